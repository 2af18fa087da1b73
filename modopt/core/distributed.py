"""Statistics of sharded tensors (FSDP2 / DTensor): the one place modopt talks to `torch.distributed`.

Under FSDP2 (`torch.distributed.fsdp.fully_shard`) parameters, gradients and
every buffer made with `zeros_like` are `DTensor`\\ s, each rank holding a
shard (`Shard(0)`) of the full tensor. A statistic must be that of the full,
unsharded tensor, so `modopt.core.scope.Segments.reduce()` hands lists that
hold DTensors to `reduce()`, which

1. computes *partial* statistics of each tensor on its local shard
   (`to_local()`): the max and the scaled sum of `|x|**p` for p-norms, the
   count of non-zeros, sums for means, sums of squared deviations for
   variances, all accumulated in at least float32;
2. all-reduces them over the process groups of the mesh dims that split the
   tensor (`Shard`, and `_StridedShard`, FSDP2's placement on a dim that
   tensor parallelism split already; `Replicate` dims hold the same values
   everywhere and are not summed; a `Partial` tensor is an error), each
   group from `device_mesh.get_group(dim)`, batched: one collective per kind
   of partial and group, per call. The NaN flags and maxima of p-norms are
   reduced with MAX over every mesh dim, `Replicate` ones too, so a NaN in one
   rank's copy of a replicated tensor reaches every rank (the non-finite
   decision is the same everywhere);
3. returns plain tensors, exactly as in a single process, so everything a
   transform computes from a statistic (scales, EMAs of norms, warm-up
   counters, histories) is a plain tensor, identical on every rank.

A plain 0-d scale multiplies a DTensor as a replicated scalar, so the scales
apply back with the transforms' ordinary (local) ops. Percentiles of elements
(`kth_abs`) are found exactly by a bisection on counts, without sending an
element. Tested on a 2x2 mesh (TP x FSDP2, tests/distributed/test_mesh_2d.py).

Per-slice statistics (`scope="tensor"` with `dim`) of sharded parameters
are refused with a `ValueError` naming the parameter and its sharded
dims (`check_slices()`, when the transform first builds its scope's
layout, on the first step).

DDP needs nothing of this: its gradients are plain tensors, already averaged
over the ranks before `step`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .hostdata import on_device
from .norms import common_acc_dtype, foreach_pnorm, slice_stat


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


def _groups_of(t: torch.Tensor, where: str = "") -> tuple:
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


def _all_groups_of(t: torch.Tensor) -> tuple:
    """The groups of every mesh dim of `t` (split or replicated): a *maximum* taken over them is the same
    on every rank that holds a piece or a copy of `t`, even where copies that should be equal are not
    (a NaN in one rank's copy of a replicated gradient: every rank sees it)."""
    if not is_sharded(t):
        return ()
    mesh = t.device_mesh
    return tuple(mesh.get_group(d) for d in range(mesh.ndim))


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds (its local shard; `t` itself when it is not a DTensor): an in-place
    op on it changes `t`."""
    return t.to_local() if is_sharded(t) else t


_local = local


def _all_reduce(values: torch.Tensor, keys: list[tuple], op) -> torch.Tensor:
    """All-reduce entry `i` of the 1-D `values` over the groups `keys[i]` (batched per key)."""
    import torch.distributed as dist

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


def tensor_pnorms(tensors: list[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
    """1-D plain tensor: the p-norm of each *full* tensor (DTensors reduced over their shards), in `acc`.

    The partials are scaled by the global per-tensor maximum before summing
    `|x|**p`, so no magnitude that a single-process norm can represent
    overflows here. inf and NaN propagate as in a single process.
    """
    import torch.distributed as dist

    if not tensors:
        return torch.zeros(0, dtype=acc)
    keys = [_groups_of(t, f"tensor #{i}") for i, t in enumerate(tensors)]
    local = torch.stack(foreach_pnorm([_local(t) for t in tensors], p)).to(acc)
    # the NaN flag and the maximum, in one MAX over every mesh dim (Replicate dims too: an inf or NaN in
    # one rank's copy reaches every rank, so every rank takes the same decision on it)
    if p == 0:  # non-zero counts add up (over the splitting dims only); a count is never NaN
        return _all_reduce(local, keys, dist.ReduceOp.SUM)
    n = len(tensors)
    flagmax = _all_reduce(torch.cat([local.isnan().to(acc), torch.nan_to_num(local, nan=0.0)]),
                          [_all_groups_of(t) for t in tensors] * 2, dist.ReduceOp.MAX)
    nan, big = flagmax[:n] > 0, flagmax[n:]
    if math.isinf(p):
        out = big
    else:
        safe = torch.where((big > 0) & torch.isfinite(big), big, torch.ones_like(big))
        q = torch.where(torch.isfinite(local), local / safe, torch.zeros_like(local)).pow(p)
        s = _all_reduce(torch.nan_to_num(q, nan=0.0), keys, dist.ReduceOp.SUM)
        out = torch.where(torch.isfinite(big) & (big > 0), safe * s.pow(1.0 / p), big)
    return torch.where(nan, torch.full_like(out, math.nan), out)


def kth_abs(tensors: list[torch.Tensor], ranges: list[tuple[int, int]], ks: list[int]) -> torch.Tensor:
    """1-D plain tensor: for each segment `tensors[a:b]` of `ranges`, the `ks[i]`-th smallest (1-based) `|x|`
    over the elements of its *full* tensors, exactly (the value `torch.kthvalue` gives one process).

    Found by bisection on the bit patterns of the magnitudes, which order non-negative floats as their
    values do: 31 rounds in float32 (63 in float64), each counting, on the local shards, the elements at or
    below the middle pattern and summing the counts over the splitting mesh dims (one all-reduce per
    round, group and kind of placement; no element is sent, nothing is read on the host). Half precision
    is ranked in float32 (exact). A segment with a NaN ranks it above every number, as `kthvalue` does,
    but returns +inf where the rank falls on a NaN (a non-finite step is skipped before this under the
    default policy).
    """
    import torch.distributed as dist

    acc = common_acc_dtype(tensors)
    ibits, rounds = (torch.int64, 63) if acc == torch.float64 else (torch.int32, 31)
    dev = _device([_local(t) for t in tensors])
    keys = [_groups_of(t, f"tensor #{i}") for i, t in enumerate(tensors)]
    bits = [_local(t).detach().abs().to(acc).reshape(-1).view(ibits) for t in tensors]
    seg_of = [s for s, (a, b) in enumerate(ranges) for _ in range(a, b)]
    pick = on_device(seg_of, torch.int64, dev)
    k = on_device(ks, torch.float64, dev)
    lo = torch.zeros(len(ranges), dtype=ibits, device=dev)
    hi = torch.full_like(lo, int(torch.tensor(math.inf, dtype=acc).view(ibits)))  # the pattern of +inf
    ranged = [i for a, b in ranges for i in range(a, b)]
    for _ in range(rounds):  # invariant: at least k elements are <= hi, fewer than k are < lo
        mid = lo + (hi - lo) // 2
        mids = mid.index_select(0, pick).unbind(0) if ranged else ()
        counts = torch.zeros(len(tensors), dtype=torch.float64, device=dev)
        if ranged:
            local = torch.stack([(bits[i] <= m).sum(dtype=torch.float64) for i, m in zip(ranged, mids)])
            counts = counts.index_copy(0, on_device(ranged, torch.int64, dev), local)
        counts = _all_reduce(counts, keys, dist.ReduceOp.SUM)
        per_seg = torch.zeros(len(ranges), dtype=torch.float64, device=dev).index_add_(0, pick, counts[ranged] if ranged else counts[:0])
        enough = per_seg >= k
        hi = torch.where(enough, mid, hi)
        lo = torch.where(enough, lo, mid + 1)
    return hi.view(acc)


def _tensor_sums(locals_: list[torch.Tensor], keys: list[tuple], acc: torch.dtype, fn) -> torch.Tensor:
    import torch.distributed as dist

    parts = torch.stack([fn(t) for t in locals_]) if locals_ else torch.zeros(0, dtype=acc)
    return _all_reduce(parts.to(acc), keys, dist.ReduceOp.SUM)


def reduce(seg: Any, tensors: list[torch.Tensor], stat: float | str) -> torch.Tensor:
    """`Segments.reduce()` (`seg`) for lists that hold DTensors (`stat` already parsed)."""
    if seg.kind == "slices":  # sharded parameters were refused when the layout was built (check_slices)
        return seg.concat([slice_stat(_local(t), stat, d) for t, d in zip(tensors, seg.dims)], tensors)
    acc = common_acc_dtype(tensors)  # (p-norms come through `Segments.tensor_pnorms`, the step's memo)
    keys = [_groups_of(t, f"tensor #{i}") for i, t in enumerate(tensors)]
    locals_ = [_local(t) for t in tensors]
    counts = seg.count_tensor(acc, _device(locals_))
    if stat == "mad":
        return seg.segment_sums(_tensor_sums(locals_, keys, acc, lambda t: t.abs().sum(dtype=acc))) / counts.clamp(min=1)
    sums = seg.segment_sums(_tensor_sums(locals_, keys, acc, lambda t: t.sum(dtype=acc)))
    if stat == "sum":
        return sums
    mean = sums / counts.clamp(min=1)
    if stat == "mean":
        return mean
    means = iter(seg.expand(mean))
    sq = _tensor_sums(locals_, keys, acc, lambda t: (t.to(acc) - next(means)).square().sum())
    var = torch.where(counts >= 2, seg.segment_sums(sq) / (counts - 1).clamp(min=1), 0.0)
    return var if stat == "var" else var.sqrt()


def _device(tensors: list[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


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


def any_nonfinite(grads: list[torch.Tensor]) -> torch.Tensor:
    """0-d plain bool: does any element of any (full) gradient hold inf or NaN; the same on every rank."""
    maxabs = tensor_pnorms(grads, math.inf, torch.float32)
    return ~torch.isfinite(maxabs).all()


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


def owner_apply(tensors: list[torch.Tensor], fn, wire_in: list[torch.dtype], wire_out: list[torch.dtype]) -> list[torch.Tensor]:
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


__all__ = ["owner_apply", "owner_split", "like_dtensor", "world_mean", "any_nonfinite", "kth_abs", "local", "any_sharded", "check_slices", "copy_", "is_sharded", "reduce", "tensor_pnorms"]
