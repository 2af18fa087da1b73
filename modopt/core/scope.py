"""Scope: what a statistic is taken over, and how its value is broadcast back.

One mechanism for every reducing transform. A scope splits the step's tensors
into *segments*:

* `"global"`: one segment, every tensor of the step;
* `"group"`: one segment per param group;
* `"tensor"`: one segment per tensor, or, with `dim`, one per slice of a
  tensor (reduce over `dim`; `inverse_dims=True` reduces over all other dims).

A statistic over the segments is a `Stat`: a 1-D tensor with one value per
segment (global, group, tensor), or a list holding, per tensor, a keepdim tensor
of its slice values (slice-wise). Transforms write their math with ordinary
torch ops on these values (`Segments.map()`) and apply it with
`Segments.mul_()` / `Segments.sub_()`.

Dims: negative dims count from the end; dims outside a tensor's range are
ignored; if none of `dim` applies to a tensor (and `inverse_dims` is False)
the whole tensor is one slice. Slices (or segments) with fewer than
`min_size` elements are left unchanged.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Union

import torch
from pydantic import Field, model_validator

from . import distributed
from .distributed import any_sharded
from .norms import combine_pnorms, common_acc_dtype, foreach_pnorm, parse_ord, slice_stat
from .transform import Transform

if TYPE_CHECKING:  # pragma: no cover
    from .state import StepContext, TransformState

ScopeName = Literal["global", "group", "tensor"]
Dims = Union[int, tuple[int, ...], None]
#: per-segment values: a 1-D tensor (one value per segment) or, slice-wise, one keepdim tensor per tensor
Stat = Union[torch.Tensor, list]


class Scoped(Transform, abstract=True):
    """Mixin of the scope fields (see `modopt.core.scope`)."""

    scope: ScopeName = "global"
    dim: Dims = None
    inverse_dims: bool = False
    min_size: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _dims_need_tensor_scope(self):
        if (self.dim is not None or self.inverse_dims) and self.scope != "tensor":
            raise ValueError(f"dim/inverse_dims apply only with scope='tensor' (got scope={self.scope!r})")
        return self

    def segments(self, ctx: "StepContext", st: "TransformState") -> "Segments":
        layout = ctx.layout
        if layout is not None:  # shared by every transform with the same scope, cached across steps
            k = ("segments", self.scope, self.dim, self.inverse_dims, self.min_size)
            seg = layout.cache.get(k)
            if seg is None:
                seg = layout.cache[k] = make_segments(
                    ctx.params, ctx.ranges, self.scope, self.dim, self.inverse_dims, self.min_size, ctx.names
                )
                seg.memo = layout.cache.get("norm_memo")
            return seg
        key = ctx.token
        cache = st.runtime
        if cache.get("_seg_key") != key:
            cache["_seg_key"] = key
            cache["_seg"] = make_segments(
                ctx.params, ctx.ranges, self.scope, self.dim, self.inverse_dims, self.min_size, ctx.names
            )
        return cache["_seg"]


    def scale_(self, ctx: "StepContext", seg: "Segments", updates: list[torch.Tensor], scale: "Stat") -> None:
        """`updates *= scale` per segment, or defer it to the next transform when the runner allows.

        Deferring (global and group scopes, every segment active) hands the
        multiplication to the next transform that declares `folds_scale`
        (see `modopt.core.state.DeferredScale`): a fused optimizer folds it
        into its kernel, a normalization into its factor, so the updates are
        read and written once fewer. A transform that ends with this call and
        writes the updates nowhere else declares `update_access = "scale"`.
        """
        if seg.kind in ("global", "group") and seg.all_active and updates and ctx._may_defer:
            dev = updates[0].device
            if ctx.defer_scale(seg.ranges, [v.to(dev) for v in scale.unbind(0)]):
                return
        seg.mul_(updates, scale)


def _reduce_dims(ndim: int, dim: Dims, inverse: bool) -> tuple[int, ...]:
    listed = (dim,) if isinstance(dim, int) else tuple(dim or ())
    valid = sorted({d % ndim for d in listed if -ndim <= d < ndim}) if ndim else []
    if inverse:
        return tuple(d for d in range(ndim) if d not in valid)
    return tuple(valid) if valid else tuple(range(ndim))


@dataclass
class Segments:
    kind: str  # "global" | "group" | "tensor" | "slices"
    ranges: list[tuple[int, int]]  # stacked kinds: tensor index range of each segment
    counts: list[int]  # elements per segment (stacked) or per slice (slices: one per tensor)
    active: list[bool]  # per tensor: its segment/slice has at least min_size elements
    dims: list[tuple[int, ...]] | None = None  # slices: reduce dims per tensor
    #: the step's per-tensor norm memo (set for segments cached on a layout; see `NormMemo`)
    memo: "NormMemo | None" = None

    def __post_init__(self) -> None:
        self.all_active = all(self.active)

    @property
    def n(self) -> int:
        return len(self.ranges)

    @property
    def stacked(self) -> bool:
        return self.kind != "slices"

    # --- statistics -------------------------------------------------------
    def reduce(self, tensors: list[torch.Tensor], ord: float | str) -> Stat:
        """The `ord` statistic (or `"mean"`) of each segment, accumulated in >= float32."""
        stat = ord if ord == "mean" else parse_ord(ord)
        if any_sharded(tensors):  # FSDP2 / DTensor: statistics of the full tensors (modopt.core.distributed)
            return distributed.reduce(self, tensors, stat)
        if not self.stacked:
            return [slice_stat(t, stat, d) for t, d in zip(tensors, self.dims)]
        acc = common_acc_dtype(tensors)
        if isinstance(stat, float):
            parts = self.tensor_pnorms(tensors, stat, acc)
            if self.kind == "tensor":
                return parts
            return torch.stack([combine_pnorms(parts[a:b], stat) for a, b in self.ranges])
        counts = torch.tensor(self.counts, dtype=acc, device=_device(tensors))
        if stat == "mad":
            parts = torch.stack(foreach_pnorm(tensors, 1.0)).to(acc)
            return self._segment_sums(parts) / counts.clamp(min=1)
        sums = self._segment_sums(torch.stack([t.sum(dtype=acc) for t in tensors]))
        if stat == "sum":
            return sums
        mean = sums / counts.clamp(min=1)
        if stat == "mean":
            return mean
        means = self.expand(mean)
        sq = torch.stack([(t.to(acc) - m).square().sum() for t, m in zip(tensors, means)])
        var = torch.where(counts >= 2, self._segment_sums(sq) / (counts - 1).clamp(min=1), 0.0)
        return var if stat == "var" else var.sqrt()

    def tensor_pnorms(self, tensors: list[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
        """1-D tensor of the p-norm of each tensor (in `acc`), through the step's `NormMemo`."""
        if self.memo is not None:
            return self.memo.pnorms(tensors, p, acc)
        return _pnorms(tensors, p, acc)

    def _segment_sums(self, parts: torch.Tensor) -> torch.Tensor:
        if self.kind == "tensor":
            return parts
        return torch.stack([parts[a:b].sum() for a, b in self.ranges])

    def map(self, fn: Callable[..., torch.Tensor], *stats: Stat) -> Stat:
        """Apply elementwise math to per-segment values."""
        if self.stacked:
            return fn(*stats)
        return [fn(*xs) for xs in zip(*stats)]

    def expand(self, stat: Stat) -> list[torch.Tensor]:
        """Per tensor, a value that broadcasts against it."""
        if not self.stacked:
            return list(stat)
        vals = stat.unbind(0)
        out: list[torch.Tensor] = []
        for s, (a, b) in enumerate(self.ranges):
            out.extend([vals[s]] * (b - a))
        return out

    # --- application --------------------------------------------------------
    def mul_(self, tensors: list[torch.Tensor], stat: Stat) -> None:
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

    def sub_(self, tensors: list[torch.Tensor], stat: Stat) -> None:
        """`tensors[i] -= value of its segment` for active tensors, in place."""
        if self.all_active and self.kind == "tensor":
            if tensors:
                torch._foreach_sub_(tensors, stat.unbind(0))
            return
        vals = self.expand(stat)
        idx = [i for i, on in enumerate(self.active) if on]
        if idx:
            torch._foreach_sub_([tensors[i] for i in idx], [vals[i] for i in idx])

    def per_tensor(self, stat: Stat) -> list[torch.Tensor]:
        """Alias of `expand()` for readability in transforms."""
        return self.expand(stat)


def _pnorms(tensors: list[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, dtype=acc)
    return torch.stack(foreach_pnorm(tensors, p)).to(acc)


class NormMemo:
    """Per-tensor p-norms of the step's update lists, shared by the transforms of one step.

    Owned by the pipeline runner, which makes it correct by construction: it
    is emptied when a step starts and ends, and after every transform that may
    have written the updates (see `Transform.update_access`); it survives
    only transforms that provably did not write them (`Identity`, or a
    clip whose scale was deferred to the next transform). So the non-finite
    check's 2-norms serve a following global `ClipNorm`, and a global clip's
    per-tensor norms a per-tensor normalization, without reading memory again;
    a write through `.data` (which no version counter sees) cannot make a
    later transform read a stale norm. Entries also check the tensors' version
    counters, as a second guard against in-place writes inside a transform.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict = {}

    def clear(self) -> None:
        if self._entries:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def pnorms(self, tensors: list[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
        """1-D tensor of the p-norm of each tensor (in `acc`), computed once per step and list."""
        if not tensors or torch.compiler.is_compiling():
            return _pnorms(tensors, p, acc)
        key = (p, acc, tuple(map(id, tensors)))
        versions = tuple(map(_version_of, tensors))
        hit = self._entries.get(key)
        if hit is not None and hit[0] == versions:
            return hit[2]
        parts = _pnorms(tensors, p, acc)
        self._entries[key] = (versions, list(tensors), parts)  # holds the tensors: ids stay theirs
        return parts


_version_of = operator.attrgetter("_version")


def _device(tensors: list[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def make_segments(
    tensors: list[torch.Tensor], ranges: list[tuple[int, int]], scope: str, dim: Dims, inverse_dims: bool, min_size: int,
    names: list | None = None,
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
    dims = [_reduce_dims(t.dim(), dim, inverse_dims) for t in tensors]
    if any_sharded(tensors):
        distributed.check_slices(tensors, dims, names or [])
    sizes = [math.prod(t.shape[d] for d in ds) for t, ds in zip(tensors, dims)]
    return Segments("slices", [], sizes, [s >= min_size for s in sizes], dims)
