"""Scope: what a statistic is taken over, and how its value is broadcast back.

One mechanism for every reducing transform. A scope splits the step's tensors
into *segments*:

* `"global"`: one segment, every tensor of the step;
* `"group"`: one segment per param group;
* `"tensor"`: one segment per tensor, or, with `dim`, one per slice of a
  tensor (reduce over `dim`; `inverse_dims=True` reduces over all other dims).

A statistic over the segments is always one 1-D tensor with one value per
segment: global, group and tensor scopes have one segment per statistic, and
slice-wise scopes concatenate every tensor's slices in parameter order
(`Segments.offsets` says where each tensor's slices start). Transforms write
their math with plain torch ops on these vectors and apply it with
`Segments.mul_()` / `Segments.sub_()`; `Segments.expand()` gives each tensor
its values in a shape that broadcasts against it, and `Segments.slots()` says
where a saved per-segment value lives.

Dims (`slice_dims`, the one rule, documented in docs/concepts.md, "Slices"):
a tensor is reduced over its *slice dims*, the listed dims it has (negative
dims count from the end, dims it does not have are ignored) or, with
`inverse_dims=True`, the dims it has that are not listed; a 0-d tensor counts
as 1-D with one element. A tensor left with no slice dim (a bias under
`dim=0, inverse_dims=True` or under `dim=1`) is left unchanged, as torchzero
does. Slices (or segments) with fewer than `min_size` elements are left
unchanged too.
"""

from __future__ import annotations

import math
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import torch
from pydantic import Field, model_validator

from . import distributed
from .distributed import any_sharded
from .hostdata import on_device
from .keys import group_key, value_key
from .norms import combine_pnorms, common_acc_dtype, foreach_pnorm, parse_ord, slice_stat

#: `parse_ord` of a validated field's `ord` (a float or a name: hashable; typed, so True is not 1), once
_parsed_ord = lru_cache(maxsize=256, typed=True)(parse_ord)
from .runner import NormMemo, Step, TransformState, any_pnorms
from .transform import Transform

ScopeName = Literal["global", "group", "tensor"]
Dims = Union[int, tuple[int, ...], None]


class Scoped(Transform, abstract=True):
    """Mixin of the scope fields (see `modopt.core.scope`)."""

    scope: ScopeName = "global"
    dim: Dims = None
    inverse_dims: bool = False
    min_size: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _dims_need_tensor_scope(self) -> Scoped:
        if (self.dim is not None or self.inverse_dims) and self.scope != "tensor":
            raise ValueError(f"dim/inverse_dims apply only with scope='tensor' (got scope={self.scope!r})")
        return self

    def segment_shape(self, p: torch.Tensor) -> tuple[int, ...] | None:
        """The shape of this transform's per-segment values saved for `p` (None: kept transform-wide)."""
        return segment_shape(p, self.scope, self.dim, self.inverse_dims)

    def segments(self, ctx: Step, st: TransformState | None = None) -> "Segments":
        """How this transform's scope splits the step (shared by every transform with the same scope,
        cached on the step's layout)."""
        layout = ctx.layout
        k = ("segments", self.scope, self.dim, self.inverse_dims, self.min_size)
        seg = layout.cache.get(k)
        if seg is None:
            seg = layout.cache[k] = make_segments(
                ctx.params, ctx.ranges, self.scope, self.dim, self.inverse_dims, self.min_size, ctx.names
            )
        seg.memo = ctx.memo  # this step's
        return seg


def slice_dims(ndim: int, dim: Dims, inverse_dims: bool) -> tuple[int, ...] | None:
    """The dims a tensor with `ndim` dims is reduced over under `dim` / `inverse_dims`, or None when it
    has none left: the tensor is then left unchanged (every transform; docs/concepts.md, "Slices").

    The listed dims the tensor has (negative dims count from the end; the others are ignored), or with
    `inverse_dims` the dims it has that are not listed. A 0-d tensor counts as 1-D with one element
    (its slice is the tensor, `()`). torchzero's `ClipNorm`, `Normalize` and `Centralize` skip a
    tensor with no dim left the same way (its `if len(real_dim) == 0: continue`).
    """
    n = max(ndim, 1)
    listed = (dim,) if isinstance(dim, int) else tuple(dim or ())
    valid = {d % n for d in listed if -n <= d < n}
    dims = tuple([d for d in range(n) if (d in valid) != inverse_dims])
    if not dims:
        return None
    return dims if ndim else ()


def _layout_dims(ndim: int, dim: Dims, inverse_dims: bool) -> tuple[tuple[int, ...], bool]:
    """`(dims, applies)`: the slice dims of a tensor and whether the transform changes it.

    A tensor with no slice dim (`slice_dims` is None) is left unchanged, but still has slices in the
    layout: the ones earlier versions gave it (one per element under `inverse_dims`, the whole tensor
    otherwise), so that the per-slice values of checkpoints saved then keep their shapes and load.
    Their statistics are computed and their values kept, as for slices under `min_size`; nothing is
    applied to the tensor.
    """
    dims = slice_dims(ndim, dim, inverse_dims)
    if dims is not None:
        return dims, True
    return (() if inverse_dims else tuple(range(ndim))), False


@dataclass
class Segments:
    """How a scope splits the step's tensors, and the operations on per-segment vectors."""

    kind: str  # "global" | "group" | "tensor" | "slices"
    ranges: list[tuple[int, int]]  # global/group/tensor: the tensor index range of each segment
    counts: list[int]  # elements per segment (slices: per slice, one entry per tensor)
    #: per tensor: the transform changes it (its segment/slices have at least min_size elements and,
    #: slices, it has a slice dim: `slice_dims`)
    active: list[bool]
    dims: list[tuple[int, ...]] | None = None  # slices: the reduced dims of each tensor (left alone: `_layout_dims`)
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # slices: each tensor's keepdim stat shape
    #: the norm memo of the step that asked for these segments last (`Scoped.segments` sets it; see
    #: `modopt.core.runner.NormMemo`); None for segments made outside a step
    memo: NormMemo | None = None

    def __post_init__(self) -> None:
        self.all_active: bool = all(self.active)
        self._count_vectors: dict[Any, torch.Tensor] = {}
        #: slices: how many slices each tensor has, and where they start in a statistic
        self.sizes: list[int] = [math.prod(s) for s in self.shapes]
        self.offsets: list[int] = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)

    @property
    def n(self) -> int:
        """The length of a statistic: the number of segments."""
        return self.offsets[-1] if self.kind == "slices" else len(self.ranges)

    # --- statistics -------------------------------------------------------
    def reduce(self, tensors: list[torch.Tensor], ord: float | str) -> torch.Tensor:
        """The `ord` statistic (or `"mean"`) of each segment, a 1-D tensor accumulated in >= float32."""
        stat = ord if ord == "mean" else _parsed_ord(ord)
        if self.kind != "slices" and isinstance(stat, float):
            # p-norms go through the step's memo (the non-finite check may have them); of the full
            # tensors under FSDP2 (`tensor_pnorms`)
            acc = common_acc_dtype(tensors)
            if self.kind == "global":
                if self.memo is not None:
                    return self.memo.total(tensors, stat, acc).reshape(1)
                return combine_pnorms(self.tensor_pnorms(tensors, stat, acc), stat).reshape(1)
            parts = self.tensor_pnorms(tensors, stat, acc)
            if self.kind == "tensor":
                return parts
            return torch.stack([combine_pnorms(parts[a:b], stat) for a, b in self.ranges])
        if any_sharded(tensors):  # FSDP2 / DTensor: statistics of the full tensors (modopt.core.distributed)
            return distributed.reduce(self, tensors, stat)
        if self.kind == "slices":
            return self.concat([slice_stat(t, stat, d) for t, d in zip(tensors, self.dims)], tensors)
        acc = common_acc_dtype(tensors)
        counts = self.count_tensor(acc, _device(tensors))
        if stat == "mad":
            parts = torch.stack(foreach_pnorm(tensors, 1.0)).to(acc)
            return self.segment_sums(parts) / counts.clamp(min=1)
        sums = self.segment_sums(torch.stack([t.sum(dtype=acc) for t in tensors]))
        if stat == "sum":
            return sums
        mean = sums / counts.clamp(min=1)
        if stat == "mean":
            return mean
        means = self.expand(mean)
        sq = torch.stack([(t.to(acc) - m).square().sum() for t, m in zip(tensors, means)])
        var = torch.where(counts >= 2, self.segment_sums(sq) / (counts - 1).clamp(min=1), 0.0)
        return var if stat == "var" else var.sqrt()

    def element_counts(self, like: torch.Tensor) -> torch.Tensor:
        """The number of elements of each segment (slices: of each slice), a 1-D tensor in `like`'s dtype
        and device, made once per layout (e.g. to turn a 2-norm into a root mean square)."""
        key = (like.dtype, like.device)
        out = self._count_vectors.get(key)
        if out is None:
            counts = self.counts if self.kind != "slices" else [c for c, k in zip(self.counts, self.sizes) for _ in range(k)]
            out = self._count_vectors[key] = on_device(counts, torch.float64, like.device).to(like.dtype)
        return out

    def count_tensor(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The number of elements of each segment as a 1-D tensor of `dtype` on `device`, made once per layout."""
        key = ("segments", dtype, device)
        out = self._count_vectors.get(key)
        if out is None:
            out = self._count_vectors[key] = on_device(list(self.counts), dtype, device)
        return out

    def tensor_pnorms(self, tensors: list[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
        """1-D tensor of the p-norm of each tensor (in `acc`), through the step's `NormMemo`."""
        if self.memo is not None:
            return self.memo.pnorms(tensors, p, acc)
        return any_pnorms(tensors, p, acc)

    def segment_sums(self, parts: torch.Tensor) -> torch.Tensor:
        """Per-tensor values summed over each segment (global, group, tensor scopes)."""
        if self.kind == "tensor":
            return parts
        return torch.stack([parts[a:b].sum() for a, b in self.ranges])

    def concat(self, per_tensor: list[torch.Tensor], like: list[torch.Tensor]) -> torch.Tensor:
        """Slices: one statistic from each tensor's keepdim values (in parameter order)."""
        if not per_tensor:
            return torch.zeros(0, dtype=torch.float32, device=_device(like))
        return torch.cat([v.reshape(-1) for v in per_tensor])

    def split(self, stat: torch.Tensor) -> list[torch.Tensor]:
        """Per tensor (tensor scope: 0-d; slices: the keepdim shape) or per segment, views of `stat`."""
        if self.kind != "slices":
            return list(stat.unbind(0))
        return [v.view(s) for v, s in zip(stat.split(self.sizes), self.shapes)]

    def expand(self, stat: torch.Tensor) -> list[torch.Tensor]:
        """Per tensor, its value(s) of `stat` in a shape that broadcasts against it."""
        if self.kind == "slices":
            return self.split(stat)
        vals = stat.unbind(0)
        out: list[torch.Tensor] = []
        for s, (a, b) in enumerate(self.ranges):
            out.extend([vals[s]] * (b - a))
        return out

    # --- saved per-segment values ----------------------------------------------
    def slots(self, st: TransformState, name: str) -> list[tuple[dict[str, Any], str, tuple[int, ...], torch.device]]:
        """Where the saved value `name` of each segment lives: `(mapping, key, shape, device)`.

        Global: the transform's store under `name`; group: the store under
        `keys.group_key(name, i)`; tensor and slices: `opt.state[p]` under
        `keys.value_key(transform key, name)`, 0-d or the keepdim slice shape.
        """
        step = st.step
        if self.kind in ("global", "group"):
            store = st.store
            dev = step.params[0].device if step.params else torch.device("cpu")
            if self.kind == "global":
                return [(store, name, (), dev)]
            return [(store, group_key(name, gid), (), dev) for gid in step.group_ids]
        k = value_key(st.key, name)
        shapes = self.shapes or [()] * len(step.params)
        return [(s, k, shape, p.device) for s, p, shape in zip(step.param_states(), step.params, shapes)]

    # --- application --------------------------------------------------------
    def mul_(self, tensors: list[torch.Tensor], stat: torch.Tensor) -> None:
        """`tensors[i] *= value of its segment` for active tensors, in place."""
        if self.kind in ("global", "group"):
            vals = stat.unbind(0)
            for s, (a, b) in enumerate(self.ranges):
                if self.active[a]:
                    torch._foreach_mul_(tensors[a:b], vals[s].to(tensors[a].device))
            return
        if self.all_active and self.kind == "tensor":
            if tensors:
                torch._foreach_mul_(tensors, stat.unbind(0))
            return
        idx = [i for i, on in enumerate(self.active) if on]
        if idx:
            vals = self.expand(stat)
            torch._foreach_mul_([tensors[i] for i in idx], [vals[i] for i in idx])

    def sub_(self, tensors: list[torch.Tensor], stat: torch.Tensor) -> None:
        """`tensors[i] -= value of its segment` for active tensors, in place."""
        if self.all_active and self.kind == "tensor":
            if tensors:
                torch._foreach_sub_(tensors, stat.unbind(0))
            return
        vals = self.expand(stat)
        idx = [i for i, on in enumerate(self.active) if on]
        if idx:
            torch._foreach_sub_([tensors[i] for i in idx], [vals[i] for i in idx])


def _device(tensors: list[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def segment_shape(p: torch.Tensor, scope: str, dim: Dims, inverse_dims: bool) -> tuple[int, ...] | None:
    """The shape of a per-segment value saved for parameter `p` (`TransformState.seg_get`): 0-d for
    scope="tensor", the keepdim slice shape with `dim`; None for global/group (kept in the store)."""
    if scope in ("global", "group"):
        return None
    if dim is None and not inverse_dims:
        return ()
    ds, _ = _layout_dims(p.dim(), dim, inverse_dims)
    return tuple([1 if d in ds else n for d, n in enumerate(p.shape)]) if ds else tuple(p.shape)


def make_segments(
    tensors: list[torch.Tensor], ranges: list[tuple[int, int]], scope: str, dim: Dims, inverse_dims: bool, min_size: int,
    names: list[str | None] | None = None,
) -> Segments:
    """How `scope` splits `tensors` (`ranges`: the tensor index range of each param group).

    `names` (optional) name the tensors in errors (per-slice scopes refuse sharded tensors).
    """
    numels = [t.numel() for t in tensors]
    if scope == "global":
        count = sum(numels)
        return Segments("global", [(0, len(tensors))], [count], [count >= min_size] * len(tensors))
    if scope == "group":
        counts = [sum(numels[a:b]) for a, b in ranges]
        active = [c >= min_size for (a, b), c in zip(ranges, counts) for _ in range(a, b)]
        return Segments("group", list(ranges), counts, active)
    if dim is None and not inverse_dims:
        return Segments("tensor", [(i, i + 1) for i in range(len(tensors))], numels, [n >= min_size for n in numels])
    layout = [_layout_dims(t.dim(), dim, inverse_dims) for t in tensors]
    dims = [ds for ds, _ in layout]
    if any_sharded(tensors):
        distributed.check_slices(tensors, dims, names or [])
    # (list comprehensions, not generators: dynamo traces this when a compiled step builds its layout)
    sizes = [math.prod([t.shape[d] for d in ds]) for t, ds in zip(tensors, dims)]
    shapes = [tuple([1 if d in ds else n for d, n in enumerate(t.shape)]) if ds else tuple(t.shape)
              for t, ds in zip(tensors, dims)]
    active = [applies and s >= min_size for (_, applies), s in zip(layout, sizes)]
    return Segments("slices", [], sizes, active, dims, shapes)
