"""Sharded tensors (FSDP2 / DTensor): the one place modopt talks to `torch.distributed`.

Under FSDP2 (`torch.distributed.fsdp.fully_shard`) parameters, gradients and
every buffer made with `zeros_like` are `DTensor`\\ s, each rank holding a
shard of the full tensor. This module says which tensors are sharded, over
which process groups a partial statistic of a tensor is summed (`groups_of`:
the mesh dims that split it, `Shard` and FSDP2's `_StridedShard`; `Replicate`
dims hold the same values everywhere and are not summed; a `Partial` tensor
is an error) or maximised (`all_groups_of`: every mesh dim, so a NaN in one
rank's copy of a replicated tensor reaches every rank), and runs those
collectives (`all_reduce`, batched per group). The statistics themselves are
made in `modopt.core.reduce`, the same way for plain and sharded tensors.

It also holds the owner-rank computation (`owner_apply`: each full matrix
assembled on one rank, the result sent back as shards), the loss mean over
ranks (`world_mean`) and the refusal of per-slice statistics of sharded
parameters (`check_slices()`, when a transform first builds its scope's
layout). Tested on a 2x2 mesh (TP x FSDP2, tests/distributed/test_mesh_2d.py).

DDP needs nothing of this: its gradients are plain tensors, already averaged
over the ranks before `step`.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .hostdata import on_device


def _dtensor_cls() -> type | None:
    """`DTensor` if `torch.distributed.tensor` was imported (no DTensor can exist otherwise).

    Looked up in `sys.modules` so that importing modopt never imports
    torch.distributed (seconds of import time) for single-process users.
    """
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_sharded(t: Any) -> bool:
    """True for a DTensor (the only kind of tensor whose statistics need communication)."""
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def any_sharded(tensors: Sequence[torch.Tensor | None]) -> bool:
    """True if any of `tensors` is a DTensor (cheap: `False` at once when DTensor was never imported)."""
    cls = _dtensor_cls()
    if cls is None or not tensors:
        return False
    if torch.compiler.is_compiling():  # dynamo traces the generator, not set(map(...))
        return any(isinstance(t, cls) for t in tensors)
    return any(issubclass(c, cls) for c in set(map(type, tensors)))  # the distinct types only (C-level scan)


def _splits(pl: Any) -> bool:
    """True for a placement that splits the tensor over its mesh dim: `Shard`, and `_StridedShard`, which
    FSDP2 puts on the dp dim of a parameter that tensor parallelism already sharded on the same tensor dim
    (its `is_shard()` is False in torch 2.13: testing `is_shard()` alone would leave that dim unreduced)."""
    return not (pl.is_replicate() or pl.is_partial())


def groups_of(t: torch.Tensor, where: str = "") -> tuple[torch.distributed.ProcessGroup, ...]:
    """The process groups to all-reduce a partial *sum* (or count, or max) of `t` over: those of the mesh dims
    that split `t` (empty: it is whole here). `Replicate` dims are left out: each of their ranks holds the
    same values, and summing over them would count those values once per rank."""
    if not is_sharded(t):
        return ()
    mesh = t.device_mesh
    groups = []
    for mesh_dim, pl in enumerate(t.placements):
        if pl.is_partial():
            raise ValueError(
                f"modopt: {where or 'a tensor'} is a DTensor with a Partial placement (an unreduced sum); "
                "statistics need Shard or Replicate placements (redistribute it first)"
            )
        if _splits(pl):
            groups.append(mesh.get_group(mesh_dim))
    return tuple(groups)


def all_groups_of(t: torch.Tensor) -> tuple[torch.distributed.ProcessGroup, ...]:
    """The groups of every mesh dim of `t` (split or replicated): a *maximum* taken over them is the same
    on every rank that holds a piece or a copy of `t`, even where copies that should be equal are not
    (a NaN in one rank's copy of a replicated gradient: every rank sees it)."""
    if not is_sharded(t):
        return ()
    mesh = t.device_mesh
    return tuple(mesh.get_group(d) for d in range(mesh.ndim))


def whole_blocks_here(t: torch.Tensor, k: int) -> bool:
    """True for a DTensor `t` that only its first `k` dims are split of (`Shard`/`_StridedShard` of a dim below
    `k` on every splitting mesh dim, no `Partial`): each rank holds whole trailing blocks, as an expert-parallel
    stack `(E, out, in)` sharded on dim 0 holds whole experts (`k=1`), so a per-block rule needs no communication."""
    if not k or not is_sharded(t):
        return False
    dims = []
    for pl in t.placements:
        if pl.is_partial():
            return False
        if _splits(pl):
            dims.append(pl.dim % t.dim())
    return bool(dims) and all(d < k for d in dims)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds (its local shard; `t` itself when it is not a DTensor): an in-place
    op on it changes `t`."""
    return t.to_local() if is_sharded(t) else t


_local = local


def all_reduce(values: torch.Tensor, keys: list[tuple[torch.distributed.ProcessGroup, ...]], op: str) -> torch.Tensor:
    """A copy of the 1-D `values` with entry `i` all-reduced (`op`: "sum" or "max") over the groups `keys[i]`
    (`groups_of`, `all_groups_of`), batched: one collective per distinct key and group."""
    import torch.distributed as dist

    op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    out = values.clone()
    by_key: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        if k:
            by_key.setdefault(k, []).append(i)
    for key, idx in by_key.items():
        ix = on_device(idx, torch.int64, values.device)
        buf = out.index_select(0, ix).contiguous()
        for group in key:
            dist.all_reduce(buf, op=op, group=group)
        out.index_copy_(0, ix, buf)
    return out


def check_slices(params: list[torch.Tensor], dims: list[tuple[int, ...]], names: list[str | None]) -> None:
    """Refuse per-slice statistics (`scope="tensor"` with `dim`) of sharded parameters, naming the first.

    Called when a transform first builds its scope's layout (its first step).
    """
    for i, (p, ds) in enumerate(zip(params, dims)):
        if is_sharded(p):
            name = (names[i] if i < len(names) else None) or f"#{i}"
            sharded = sorted({pl.dim % max(p.dim(), 1) for pl in p.placements if _splits(pl)})
            raise ValueError(
                f"modopt: parameter {name} (shape {tuple(p.shape)}) is a DTensor sharded on dim(s) {sharded}; "
                f"per-slice statistics (scope='tensor' with dim/inverse_dims; here over dims {tuple(ds)}) of "
                "sharded parameters are not supported. Use scope='tensor' without dim, 'group' or 'global' "
                "(computed over the full tensors), or keep this parameter out of FSDP"
            )


# --- several meshes in one optimizer (expert parallelism): multi-tensor ops split per mesh -------------------
def _mesh_of(t: Any) -> Any:
    """The mesh of a DTensor, None for a plain tensor (the key a multi-tensor op is split by)."""
    return t.device_mesh if is_sharded(t) else None


def meshes_mixed(params: Sequence[torch.Tensor]) -> bool:
    """True when `params` hold DTensors of more than one mesh, or DTensors and plain tensors together (dense
    layers under FSDP2 and an expert stack on an expert-parallel mesh; replicated plain tensors beside them):
    DTensor refuses one multi-tensor (`_foreach_*`) op over them, so a step runs under `PerMesh`. Read when
    the optimizer is built and when a param group is added."""
    if _dtensor_cls() is None or not any_sharded(list(params)):
        return False
    return len({_mesh_of(p) for p in params}) > 1


def _split_foreach(func: Any, args: tuple, kwargs: dict, keys: list) -> Any:
    """`func` (a `torch._foreach_*` op) run once per mesh of the tensors of its first list (`keys`), each list (and
    1-D tensor of per-tensor scalars) of that length cut to the bucket's entries; the results in the given order."""
    n = len(keys)
    dtensor = _dtensor_cls()
    buckets: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        buckets.setdefault(k, []).append(i)

    def cut(a: Any, idx: list[int]) -> Any:
        if isinstance(a, (list, tuple)) and len(a) == n:
            return [a[i] for i in idx]
        if isinstance(a, torch.Tensor) and not isinstance(a, dtensor) and a.dim() == 1 and a.shape[0] == n:
            return a[idx]  # (per-tensor scalars given as one tensor)
        return a

    out: list[Any] = [None] * n
    returned = False
    for idx in buckets.values():
        res = func(*[cut(a, idx) for a in args], **{k: cut(v, idx) for k, v in kwargs.items()})
        if res is not None:
            returned = True
            for i, r in zip(idx, res):
                out[i] = r
    return out if returned else None


def per_mesh_mode() -> Any:
    """A torch function mode under which a `torch._foreach_*` op whose first list holds tensors of several meshes
    (or DTensors and plain tensors) runs once per mesh (`_split_foreach`); every other call runs as it is. Entered
    only around the step of an optimizer whose parameters are so mixed (`meshes_mixed`): one multi-tensor op per
    mesh, the statistics still summed per tensor over the groups of the mesh dims that split it (`groups_of`)."""
    from torch.overrides import TorchFunctionMode

    dtensor = _dtensor_cls()  # (imported: a mixed layout holds DTensors)

    class PerMesh(TorchFunctionMode):
        # (it sees every torch call of the step: the test is written out, no call per tensor; see
        # benchmarks/per_mesh_cost.py)
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if args and isinstance(args[0], (list, tuple)) and len(args[0]) > 1 \
                    and getattr(func, "__name__", "").startswith("_foreach_"):
                keys = [t.device_mesh if isinstance(t, dtensor) else None for t in args[0]]
                if len(set(map(id, keys))) > 1:  # (by identity: two equal mesh objects split, harmlessly)
                    return _split_foreach(func, args, kwargs or {}, keys)
            return func(*args, **(kwargs or {}))

    return PerMesh()


def placed_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` laid out over the ranks as `like` is: a DTensor whose placements differ from `like`'s (the
    replicated result of a sharded matrix product, say) is redistributed to them (from replicated to
    sharded: each rank keeps its slice, no communication), so that an in-place write into `like` or a
    copy into a tensor made like it needs no placement change, which DTensor refuses. Else `t` itself."""
    if not (is_sharded(t) and is_sharded(like)) or t.placements == like.placements:
        return t
    return t.redistribute(like.device_mesh, like.placements)


def copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """`dst[i].copy_(src[i])` for every i: one multi-tensor kernel, or one copy per tensor when some
    are DTensors (torch registers no sharding rule for `_foreach_copy_`)."""
    if any_sharded(dst):
        for d, s in zip(dst, src):
            d.copy_(s)
    else:
        torch._foreach_copy_(dst, src)


def sum_over_(t: torch.Tensor, groups: Sequence[Any]) -> torch.Tensor:
    """`t` (a plain local tensor) summed in place over each of the process `groups` (the mesh dims that split
    the dims a statistic sums over); `t` itself."""
    import torch.distributed as dist

    for group in groups:
        dist.all_reduce(t, group=group)
    return t


def gather_0d(x: torch.Tensor, group: Any) -> torch.Tensor:
    """1-D: the 0-d `x` of every rank of the process `group`, in rank order (one all-gather)."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


def world_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean of the 0-d `x` over every rank of the default process group (`x` itself without one).

    For a value each rank computes from its own data (a data-parallel loss): a decision taken on it
    is then the same on every rank. One all-reduce, no host read."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    out = x.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()


# --- owner-rank computation: each full tensor assembled on one rank, the result sent back as shards ------------
def _chunk_sizes(n: int, world: int) -> list[int]:
    """The sizes `torch.chunk(x, world)` gives a dim of size `n` (DTensor's `Shard` split), padded with zeros to
    `world` entries: `ceil(n / world)` each, the last ones smaller or empty."""
    c = -(-n // world) if n else 0
    return [max(0, min(n, (r + 1) * c) - r * c) for r in range(world)]


class _OwnerItem:
    """One tensor of an owner plan: its gather stages `(mesh_dim, tensor_dim)` (innermost split first), at each
    stage the chunk sizes of the group's ranks and the shape the stage reassembles, its owner coordinates."""

    __slots__ = ("index", "stages", "sizes", "shapes", "local_shape", "owner", "numel")

    def __init__(self, index: int, stages: tuple, sizes: list, shapes: list, local_shape: tuple):
        self.index, self.stages, self.sizes, self.shapes, self.local_shape = index, stages, sizes, shapes, local_shape
        self.numel = math.prod(shapes[-1]) if shapes else 0  # the full tensor's elements (the outermost stage's shape)
        self.owner: list[int] = [0] * len(stages)

    def piece_numel(self, s: int, r: int) -> int:
        """Elements of group rank `r`'s piece at stage `s`."""
        shape = self.shapes[s]
        td = self.stages[s][1]
        return self.sizes[s][r] * math.prod(shape[:td] + shape[td + 1 :])

    def piece_shape(self, s: int, r: int) -> tuple[int, ...]:
        shape, td = self.shapes[s], self.stages[s][1]
        return shape[:td] + (self.sizes[s][r],) + shape[td + 1 :]


def owner_split(t: torch.Tensor) -> tuple[tuple[int, int], ...] | None:
    """How `owner_apply` reassembles the DTensor `t`: its gather stages, `(mesh_dim, tensor_dim)` for each mesh dim
    that splits it, the innermost split first; None for a layout it does not take (a plain tensor, `Partial`,
    three splits of one tensor dim, a `_StridedShard` that is not FSDP2's over tensor parallelism, a local shard
    that is not the nested `torch.chunk` piece the placements describe).

    Taken: `Shard` over one mesh dim, replicated over the others (FSDP2, HSDP); `Shard`s of different tensor dims
    over two mesh dims (a row-parallel weight under FSDP2: `(Shard(0), Shard(1))`); two splits of one tensor dim,
    `(Shard(d), Shard(d))` (mesh dim 0 outermost) or FSDP2's `(_StridedShard(d, sf=W_tp), Shard(d))` over tensor
    parallelism (tp split first, each tp piece then chunked over dp: dp is the inner split). Each rank's shard is
    then one block of the full tensor, and the full tensor is the blocks concatenated, inner splits first."""
    if not is_sharded(t) or t.dim() == 0:
        return None
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # (not a subclass of Shard in torch 2.13)

    mesh = t.device_mesh
    by_dim: dict[int, list[int]] = {}
    for md, pl in enumerate(t.placements):
        if pl.is_replicate():
            continue
        if pl.is_partial() or not isinstance(pl, (Shard, _StridedShard)):
            return None
        by_dim.setdefault(pl.dim % t.dim(), []).append(md)
    if not by_dim:
        return None
    before: list[tuple[int, int]] = []  # (inner, outer): the inner split's stage comes first
    for mds in by_dim.values():
        if len(mds) > 2:
            return None
        if len(mds) == 2:
            a, b = mds
            pa, pb = t.placements[a], t.placements[b]
            if type(pb) is not Shard:
                return None
            if type(pa) is Shard:
                before.append((b, a))  # plain: mesh dim a splits first (outer), b each of its pieces
            elif getattr(pa, "split_factor", None) == mesh.size(b):
                before.append((a, b))  # FSDP2 over TP: b (tp) split first, a (dp) chunks each tp piece
            else:
                return None
        elif type(t.placements[mds[0]]) is not Shard:
            return None
    dims = {md: td for td, mds in by_dim.items() for md in mds}
    order: list[int] = []
    todo = sorted(dims)
    while todo:  # inner splits before their outer ones, else by mesh dim
        md = next(m for m in todo if not any(o == m and i in todo for i, o in before))
        order.append(md)
        todo.remove(md)
    stages = tuple((md, dims[md]) for md in order)
    shape = list(t.shape)
    for md, td in reversed(stages):  # the placements applied, outermost first: this rank's block
        shape[td] = _chunk_sizes(shape[td], mesh.size(md))[mesh.get_local_rank(md)]
    if tuple(t.to_local().shape) != tuple(shape):
        return None
    return stages


def _plan_item(index: int, t: torch.Tensor, stages: tuple) -> _OwnerItem:
    mesh = t.device_mesh
    shape = tuple(t.shape)
    sizes: list = [None] * len(stages)
    shapes: list = [None] * len(stages)
    for s in range(len(stages) - 1, -1, -1):  # outermost first: each stage's shape is its group's common one
        md, td = stages[s]
        shapes[s] = shape
        sizes[s] = _chunk_sizes(shape[td], mesh.size(md))
        shape = shape[:td] + (sizes[s][mesh.get_local_rank(md)],) + shape[td + 1 :]
    return _OwnerItem(index, stages, sizes, shapes, shape)


def owner_apply(tensors: list[torch.Tensor], fn: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]],
                wire_in: list[torch.dtype], wire_out: list[torch.dtype]) -> list[torch.Tensor]:
    """`fn` applied to each *full* tensor once, on one owner rank, and the result's shards sent back: for each
    DTensor `tensors[i]` (every one accepted by `owner_split`), the plain tensor this rank holds of
    `fn(full_i)` (the shard of the same placement as `tensors[i]`'s), in `wire_out[i]`.

    `fn` takes a list of full tensors (the owner's, in `wire_in[i]`) and returns one result of the same shape
    per tensor; it may batch them (same-shape tensors arrive together, in order). The tensors are bucketed by
    their gather stages (the mesh dims that split them, innermost first) and pair of wire dtypes; in a bucket
    they get owners round-robin over the ranks of those mesh dims (largest first, so the work is spread). Each
    stage is one `all_to_all_single` over the group of its mesh dim: every rank that holds a piece of a tensor
    at that stage sends it to the stage's owner, which concatenates the pieces (in rank order, along the split
    tensor dim); after the last stage the owner holds the full tensor and runs `fn`; the stages then run in
    reverse, each owner sending every rank of the group its piece. A split over one mesh dim of W ranks moves
    `(W - 1) / W * N` elements each way in all (N the tensors' elements). Over two, W1 (inner) then W2:
    `(1 - 1/W1) N` in the first stage (every group of the inner dim) and `(1 - 1/W2) N` in the second (the
    owner's group only), each way: `N` on a 2x2 mesh, where one exchange over all four ranks would move `0.75 N`
    but needs a process group of both mesh dims, and the products of DTensor's sharded path move their
    operands every iteration. Replicas over a `Replicate` mesh dim each run their own exchange, with the same
    values (the work is duplicated over that dim, not the data of the split ones).

    The shards are copied into the wire buffers as they are (a cast to `wire_in` is elementwise, as the one
    `fn` would make first), so the owner's full tensor is the single-process tensor bit for bit. No value is
    read on the host: the split sizes are the shapes'.
    """
    import torch.distributed as dist

    out: list[torch.Tensor | None] = [None] * len(tensors)
    buckets: dict[tuple, list[_OwnerItem]] = {}
    for i, t in enumerate(tensors):
        stages = owner_split(t)
        mesh = t.device_mesh
        key = tuple((mesh.get_group(md), mesh.size(md), mesh.get_local_rank(md)) for md, _ in stages)
        buckets.setdefault((key, wire_in[i], wire_out[i]), []).append(_plan_item(i, t, stages))
    for (groups, w_in, w_out), items in buckets.items():
        worlds = [w for _, w, _ in groups]
        mine = [me for _, _, me in groups]
        # owners: largest first, round robin over the ranks of the split dims (the same order on every rank)
        for k, item in enumerate(sorted(items, key=lambda it: (-it.numel, it.index))):
            lin = k % math.prod(worlds)
            for s, w in enumerate(worlds):
                item.owner[s], lin = lin % w, lin // w
        dev = tensors[items[0].index].to_local().device
        cur: dict[int, torch.Tensor] = {it.index: _local(tensors[it.index]).to(w_in) for it in items}

        def exchange(parts: list[torch.Tensor], in_splits, out_splits, dtype, group) -> torch.Tensor:
            recv = torch.empty(sum(out_splits), dtype=dtype, device=dev)
            src = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=dev)
            dist.all_to_all_single(recv, src, out_splits, in_splits, group=group)
            return recv

        def taking(s: int) -> list[_OwnerItem]:
            """The items whose pieces this rank's group of stage `s` gathers: those whose owners at the earlier
            (inner) stages are this rank's coordinates (every rank of the group shares them)."""
            return [it for it in items if all(it.owner[q] == mine[q] for q in range(s))]

        # 1. gather, innermost split first: each stage's owner concatenates its group's pieces
        for s, (group, world, me) in enumerate(groups):
            part = taking(s)
            owned = [[it for it in part if it.owner[s] == r] for r in range(world)]
            send = [cur[it.index].reshape(-1) for r in range(world) for it in owned[r]]
            in_splits = [sum(it.piece_numel(s, me) for it in owned[r]) for r in range(world)]
            out_splits = [sum(it.piece_numel(s, r) for it in owned[me]) for r in range(world)]
            recv = exchange(send, in_splits, out_splits, w_in, group)
            pieces = iter(recv.split([it.piece_numel(s, r) for r in range(world) for it in owned[me]]))
            by_rank = [[next(pieces).view(it.piece_shape(s, r)) for it in owned[me]] for r in range(world)]
            for it in part:
                del cur[it.index]
            for j, it in enumerate(owned[me]):
                cur[it.index] = torch.cat([by_rank[r][j] for r in range(world)], dim=it.stages[s][1])
        # 2. the owner's work, on the full tensors it holds
        done = [it for it in items if it.index in cur]
        results = fn([cur[it.index] for it in done]) if done else []
        res: dict[int, torch.Tensor] = {it.index: r.to(w_out) for it, r in zip(done, results)}
        # 3. scatter, outermost split first: each stage's owner sends every rank of its group its piece
        for s in range(len(groups) - 1, -1, -1):
            group, world, me = groups[s]
            part = taking(s)
            owned = [[it for it in part if it.owner[s] == r] for r in range(world)]
            back = [res[it.index].split(it.sizes[s], dim=it.stages[s][1])[r].reshape(-1)
                    for r in range(world) for it in owned[me]]
            out_splits = [sum(it.piece_numel(s, me) for it in owned[r]) for r in range(world)]
            in_splits = [sum(it.piece_numel(s, r) for it in owned[me]) for r in range(world)]
            recv = exchange(back, in_splits, out_splits, w_out, group)
            pieces = iter(recv.split([it.piece_numel(s, me) for r in range(world) for it in owned[r]]))
            for r in range(world):
                for it in owned[r]:
                    res[it.index] = next(pieces).view(it.piece_shape(s, me))
        for it in items:
            out[it.index] = res[it.index].view(it.local_shape)
    return out  # type: ignore[return-value]


def like_dtensor(local_: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The plain shard `local_` as a DTensor laid out as `like` (same mesh, placements, global shape; no
    communication)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def dtensor_of(local_: torch.Tensor, mesh: Any, placements: Sequence[Any], shape: Sequence[int]) -> torch.Tensor:
    """The DTensor of global `shape` (contiguous) laid out by `placements` over `mesh` whose shard on this rank is
    `local_` (no communication): a state tensor made for a sharded parameter, with a shape of its own."""
    from torch.distributed.tensor import DTensor

    size = torch.Size(shape)
    return DTensor.from_local(local_, mesh, placements, run_check=False, shape=size,
                              stride=torch.empty(size, device="meta").stride())


__all__ = ["owner_apply", "dtensor_of", "owner_split", "like_dtensor", "world_mean", "local", "any_sharded", "check_slices", "copy_",
           "is_sharded", "groups_of", "all_groups_of", "all_reduce", "sum_over_", "gather_0d"]
