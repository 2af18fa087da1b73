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
from collections.abc import Sequence
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


def groups_of(t: torch.Tensor, where: str = "") -> tuple:
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


def all_groups_of(t: torch.Tensor) -> tuple:
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


def all_reduce(values: torch.Tensor, keys: list[tuple], op: str) -> torch.Tensor:
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


# --- owner-rank computation: each full tensor assembled on one rank, the result sent back as shards ------------
def _chunk_sizes(n: int, world: int) -> list[int]:
    """The sizes `torch.chunk(x, world)` gives a dim of size `n` (DTensor's `Shard` split), padded with zeros to
    `world` entries: `ceil(n / world)` each, the last ones smaller or empty."""
    c = -(-n // world) if n else 0
    return [max(0, min(n, (r + 1) * c) - r * c) for r in range(world)]


class _OwnerItem:
    """One tensor of an owner plan: its split mesh dim, tensor dim, the shard sizes of every rank, its owner."""

    __slots__ = ("index", "mesh_dim", "dim", "sizes", "shape", "owner", "numels")

    def __init__(self, index: int, mesh_dim: int, dim: int, sizes: list[int], shape: tuple[int, ...]):
        self.index, self.mesh_dim, self.dim, self.sizes, self.shape = index, mesh_dim, dim, sizes, shape
        rest = math.prod(shape[:dim] + shape[dim + 1 :])
        self.numels = [s * rest for s in sizes]
        self.owner = 0

    def local_shape(self, r: int) -> tuple[int, ...]:
        return self.shape[: self.dim] + (self.sizes[r],) + self.shape[self.dim + 1 :]


def owner_split(t: torch.Tensor) -> tuple[int, int] | None:
    """`(mesh_dim, tensor_dim)` when the DTensor `t` is split over exactly one mesh dim by a plain `Shard` (every
    other mesh dim `Replicate`) and its local shard is the `torch.chunk` piece that rank holds: the layouts
    `owner_apply` reassembles (FSDP2 on a 1-D mesh; FSDP2 or TP on one dim of a 2-D mesh, replicated over the
    other). None otherwise (`_StridedShard`, two splitting dims, `Partial`, a plain tensor)."""
    if not is_sharded(t):
        return None
    from torch.distributed.tensor import Shard

    split = [(d, pl) for d, pl in enumerate(t.placements) if not pl.is_replicate()]
    if len(split) != 1 or type(split[0][1]) is not Shard:
        return None
    mesh_dim, pl = split[0]
    dim = pl.dim % t.dim()
    mesh = t.device_mesh
    sizes = _chunk_sizes(t.shape[dim], mesh.size(mesh_dim))
    if t.to_local().shape[dim] != sizes[mesh.get_local_rank(mesh_dim)]:
        return None
    return mesh_dim, dim


def owner_apply(tensors: list[torch.Tensor], fn, wire_in: list[torch.dtype], wire_out: list[torch.dtype]) -> list[torch.Tensor]:
    """`fn` applied to each *full* tensor once, on one owner rank, and the result's shards sent back: for each
    DTensor `tensors[i]` (every one accepted by `owner_split`), the plain tensor this rank holds of
    `fn(full_i)` (the shard of the same placement as `tensors[i]`'s), in `wire_out[i]`.

    `fn` takes a list of full tensors (the owner's, in `wire_in[i]`) and returns one result of the same shape
    per tensor; it may batch them (same-shape tensors arrive together, in order). Per process group of a
    split mesh dim and per pair of wire dtypes: the tensors are given owners round-robin (largest first, so
    the work is spread), one `all_to_all_single` brings every shard of a tensor to its owner, `fn` runs
    there, and a second `all_to_all_single` sends each rank its shard of the result. Each rank sends and
    receives `(W - 1) / W` of each tensor's elements once in each direction, in total: `2 (W - 1) / W * N`
    elements over the group per step (N the elements of the tensors), where the products of DTensor's
    sharded path move their operands every iteration. Replicas over a `Replicate` mesh dim each run their own
    exchange, with the same values (the work is duplicated over that dim, not the data of the split one).

    The shards are copied into the wire buffers as they are (a cast to `wire_in` is elementwise, as the one
    `fn` would make first), so the owner's full tensor is the single-process tensor bit for bit. No value is
    read on the host: the split sizes are the shapes'.
    """
    import torch.distributed as dist

    out: list[torch.Tensor | None] = [None] * len(tensors)
    buckets: dict[tuple, list[_OwnerItem]] = {}
    for i, t in enumerate(tensors):
        md, dim = owner_split(t)
        world = t.device_mesh.size(md)
        item = _OwnerItem(i, md, dim, _chunk_sizes(t.shape[dim], world), tuple(t.shape))
        buckets.setdefault((t.device_mesh.get_group(md), world, t.device_mesh.get_local_rank(md),
                            wire_in[i], wire_out[i]), []).append(item)
    for (group, world, me, w_in, w_out), items in buckets.items():
        # owners: largest first, round robin (the same order on every rank: the tensors' order and shapes)
        for k, item in enumerate(sorted(items, key=lambda it: (-math.prod(it.shape), it.index))):
            item.owner = k % world
        owned = [[it for it in items if it.owner == r] for r in range(world)]
        dev = tensors[items[0].index].to_local().device
        # 1. every shard to its owner
        send = [_local(tensors[it.index]).reshape(-1).to(w_in) for r in range(world) for it in owned[r]]
        in_splits = [sum(it.numels[me] for it in owned[r]) for r in range(world)]
        out_splits = [sum(it.numels[r] for it in owned[me]) for r in range(world)]
        recv = torch.empty(sum(out_splits), dtype=w_in, device=dev)
        src = torch.cat(send) if send else torch.empty(0, dtype=w_in, device=dev)
        dist.all_to_all_single(recv, src, out_splits, in_splits, group=group)
        # 2. the owner's work: each full tensor reassembled from the ranks' pieces, in rank order
        pieces = iter(recv.split([it.numels[r] for r in range(world) for it in owned[me]]))
        by_rank = [[next(pieces).view(it.local_shape(r)) for it in owned[me]] for r in range(world)]
        fulls = [torch.cat([by_rank[r][j] for r in range(world)], dim=it.dim) for j, it in enumerate(owned[me])]
        results = fn(fulls) if fulls else []
        # 3. each rank its shard of each result
        back = [res.to(w_out).split(it.sizes, dim=it.dim)[r].reshape(-1)
                for r in range(world) for res, it in zip(results, owned[me])]
        recv2 = torch.empty(sum(in_splits), dtype=w_out, device=dev)
        src2 = torch.cat(back) if back else torch.empty(0, dtype=w_out, device=dev)
        dist.all_to_all_single(recv2, src2, in_splits, out_splits, group=group)
        mine = iter(recv2.split([it.numels[me] for r in range(world) for it in owned[r]]))
        for r in range(world):
            for it in owned[r]:
                out[it.index] = next(mine).view(it.local_shape(me))
    return out  # type: ignore[return-value]


def like_dtensor(local_: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The plain shard `local_` as a DTensor laid out as `like` (same mesh, placements, global shape; no
    communication)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


__all__ = ["owner_apply", "owner_split", "like_dtensor", "world_mean", "local", "any_sharded", "check_slices", "copy_",
           "is_sharded", "groups_of", "all_groups_of", "all_reduce"]
