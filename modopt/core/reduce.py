"""Reductions: every statistic a transform takes of the step's tensors, in one place.

What is reduced (`ord`): any real `p >= 0` (`0` counts non-zeros, `inf` is the largest
magnitude) or one of the names:

=========  =====================================================
name       statistic of the elements `x` of a slice
=========  =====================================================
`l0`     number of non-zero elements (`p = 0`)
`l1`..   `l1 l2 l3 l4`: the p-norm `(sum |x|**p) ** (1/p)`
`linf`   `max |x|`
`mad`    mean absolute value, `mean |x|`
`std`    standard deviation, `ddof = 1` (0 for fewer than 2 elements)
`var`    variance, `ddof = 1` (0 for fewer than 2 elements)
`sum`    the signed sum (scaling transforms use its magnitude)
=========  =====================================================

Every statistic accumulates in at least float32, whatever the tensor's dtype.

Over what (`Segments`, from a transform's scope fields, `modopt.core.scope.Scoped`): a scope
splits the step's tensors into *segments*:

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

Once per step (`NormMemo`): the per-tensor p-norms of the raw gradients are
computed once and shared by the non-finite check and the transforms that read
them, until the first transform that writes the updates.

Of the full tensors when sharded (FSDP2 / DTensor): each statistic is made of
partial statistics of the local shards (the max and the scaled sum of `|x|**p`
for p-norms, non-zero counts, sums, sums of squared deviations), all-reduced
over the mesh dims that split the tensor (`modopt.core.distributed`, the one
place that talks to `torch.distributed`), so every rank gets the plain-tensor
result one process would. Percentiles of elements (`kth_abs`) are found
exactly by a bisection on counts, without sending an element.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Annotated, Any, Union

import torch
from pydantic import AfterValidator, AllowInfNan, BeforeValidator

from . import compile_marks, distributed
from .distributed import any_sharded
from .hostdata import on_device
from .keys import group_key, value_key

NAMED_P = {"l0": 0.0, "l1": 1.0, "l2": 2.0, "l3": 3.0, "l4": 4.0, "linf": math.inf}
NAMED_STATS = ("mad", "std", "var", "sum")
ORD_NAMES = tuple(NAMED_P) + NAMED_STATS


#: the strings that mean `p = inf` besides `"linf"`: torch's (`float(norm_type)`: `"inf"`) and
#: its other spellings, any case. A field stores them (and a float `inf`, YAML's `.inf`) as `"linf"`.
INF_SPELLINGS = frozenset({"inf", "+inf", "infinity", "+infinity"})
#: the same for `p = -inf` (torch's min-abs "norm"): refused, there is no min-norm `ord`
_MINUS_INF_SPELLINGS = frozenset({"-inf", "-infinity"})


def parse_ord(ord: float | str) -> float | str:
    """Canonical form of an `ord`: a float `p` or one of `mad std var sum`.

    `"inf"` (any case, `"infinity"`, `"+inf"`) is `p = inf`, the same as `"linf"`.
    """
    if isinstance(ord, bool):
        raise ValueError("ord must be a number or one of " + ", ".join(ORD_NAMES))
    if isinstance(ord, str):
        if ord in NAMED_P:
            return NAMED_P[ord]
        if ord in NAMED_STATS:
            return ord
        if ord.lower() in INF_SPELLINGS:
            return math.inf
        if ord.lower() in _MINUS_INF_SPELLINGS:
            raise ValueError(
                f"ord must be a real p >= 0 (or one of {', '.join(ORD_NAMES)}), got {ord!r}: "
                "there is no min-norm ord (-inf)"
            )
        raise ValueError(f"unknown ord {ord!r}; use a real p >= 0, 'inf', or one of {', '.join(ORD_NAMES)}")
    p = float(ord)
    if math.isnan(p) or p < 0:
        extra = ": there is no min-norm ord (-inf)" if p == -math.inf else ""
        raise ValueError(f"ord must be a real p >= 0 (or one of {', '.join(ORD_NAMES)}), got {ord!r}{extra}")
    return p


def canonical_ord(v: float | str) -> float | str:
    """The form an `ord` field stores (and configs write): every spelling of `p = inf` (`"inf"`,
    `float("inf")`, YAML's `.inf`) is `"linf"`; anything else is kept as written (`"l2"` stays `"l2"`,
    `2` stays `2`). Values that are not an `ord` pass through, for `parse_ord` to refuse."""
    if isinstance(v, bool):  # before pydantic's float would take True as 1.0
        parse_ord(v)
    if isinstance(v, str) and v.lower() in INF_SPELLINGS:
        return "linf"
    if isinstance(v, float) and v == math.inf:
        return "linf"
    return v


def _check_ord(v: float | str) -> float | str:
    parse_ord(v)
    return v


#: pydantic field type for `ord`: keeps the value as written (`"l2"` stays `"l2"`), except that
#: every spelling of `p = inf` becomes `"linf"` (`canonical_ord`), so a dumped config is stable
# (the float admits inf and NaN here, unlike other transform fields: `_check_ord` says what is wrong with them)
Ord = Annotated[Union[Annotated[float, AllowInfNan(True)], str], BeforeValidator(canonical_ord), AfterValidator(_check_ord)]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a statistic of `dtype` values accumulates in (at least float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_dtype_of = operator.attrgetter("dtype")


def dtypes_of(tensors: list[torch.Tensor]) -> set[torch.dtype]:
    """The distinct dtypes of `tensors` (a C-level scan in eager mode; dynamo traces the comprehension)."""
    if torch.compiler.is_compiling():
        return {t.dtype for t in tensors}
    return set(map(_dtype_of, tensors))


def common_acc_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """The dtype to accumulate a statistic of `tensors` in: float64 when one of them is float64, else float32."""
    if torch.compiler.is_compiling():
        return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return torch.float64 if torch.float64 in set(map(_dtype_of, tensors)) else torch.float32


def foreach_pnorm(tensors: list[torch.Tensor], p: float) -> list[torch.Tensor]:
    """Per-tensor p-norms (0-d, accumulated in >= float32), multi-tensor kernels per dtype."""
    compiling = torch.compiler.is_compiling()
    if compiling and all(t.numel() for t in tensors) and not compile_marks.KEEP_EAGER_KERNELS:
        # inductor has no lowering for `_foreach_norm` (an opaque call, one more pass over memory);
        # per-tensor norms are reductions it fuses with the ops that produce or read the tensors
        return [torch.linalg.vector_norm(t, p, dtype=acc_dtype(t.dtype)) for t in tensors]
    dtypes = dtypes_of(tensors) if compiling else set(map(_dtype_of, tensors))  # (C-level)
    if len(dtypes) == 1 and not math.isinf(p):  # the common case: one kernel call, no bookkeeping
        (dtype,) = dtypes
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        return list(torch._foreach_norm(tensors, p, dtype=acc) if dtype != acc else torch._foreach_norm(tensors, p))
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        acc = acc_dtype(dtype)
        if math.isinf(p):  # max |x| of an empty tensor has no identity in torch: it is 0 here (as in spec)
            for i in [i for i in idx if tensors[i].numel() == 0]:
                out[i] = tensors[i].new_zeros((), dtype=acc)
            idx = [i for i in idx if tensors[i].numel() > 0]
            if not idx:
                continue
        ts = [tensors[i] for i in idx]
        norms = torch._foreach_norm(ts, p, dtype=acc) if dtype != acc else torch._foreach_norm(ts, p)
        for i, n in zip(idx, norms):
            out[i] = n
    return out  # type: ignore[return-value]


def vector_pnorm(x: torch.Tensor, p: float = 2.0) -> torch.Tensor:
    """`torch.linalg.vector_norm(x, p)`; traced by `modopt.compile_step`, aten's kernel kept as one op
    (`_foreach_norm` of the one tensor, the same kernel on the CPU, which inductor does not lower), so
    the compiled step rounds the total as the eager step does."""
    if compile_marks.KEEP_EAGER_KERNELS and torch.compiler.is_compiling():
        return torch._foreach_norm([x], p)[0]
    return torch.linalg.vector_norm(x, p)


def pnorms(tensors: list[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
    """1-D tensor of the p-norm of each tensor, in `acc`."""
    if not tensors:
        return torch.zeros(0, dtype=acc)
    if compile_marks.NORMS is not None and compile_marks.KEEP_EAGER_KERNELS and torch.compiler.is_compiling():
        dtypes = dtypes_of(tensors)
        if len(dtypes) == 1 and acc in dtypes and not math.isinf(p) and all(t.numel() for t in tensors):
            return compile_marks.NORMS(tensors, float(p))  # (`foreach_pnorm`'s one call, stacked in the op)
    out = torch.stack(foreach_pnorm(tensors, p))
    return out if out.dtype == acc else out.to(acc)


def combine_pnorms(norms: torch.Tensor, p: float, host_reads: bool = False) -> torch.Tensor:
    """The p-norm of a concatenation, from the p-norms of its parts (1-D `norms`). `host_reads`: the step's
    (`Step.host_reads`): the host may read the plain total to leave out the overflow guard."""
    if p == 0:
        return norms.sum()
    if not norms.numel():
        return norms.new_zeros(())
    if math.isinf(p):
        return norms.amax()
    # the plain combination, as torch.nn.utils.get_total_norm computes it (bit for bit in the
    # common case); where it overflows although every part is finite (e.g. 3e19 ** 3 in float32)
    # a form that cannot overflow is used instead, chosen on device (no host sync)
    plain = vector_pnorm(norms, p)
    if norms.dtype == torch.float32 and p <= 4:
        # float64 holds sums of 4th powers of any float32 values: the whole guard is 4 small ops,
        # and inf/NaN parts give inf/NaN in both forms
        # (`plain < inf`: one op where isfinite takes four; a norm is >= 0 and NaN compares false);
        # where reading is free the host looks first: the guard is needed only where `plain` overflowed
        if host_reads and plain.item() < math.inf:
            return plain
        wide = torch.linalg.vector_norm(norms, p, dtype=torch.float64).to(torch.float32)
        return torch.where(plain < math.inf, plain, wide)
    top = norms.amax()
    unit = torch.where(torch.isfinite(top) & (top > 0), top, torch.ones_like(top))
    scaled = unit * torch.linalg.vector_norm(norms / unit, p)
    return torch.where(torch.isfinite(plain) | ~torch.isfinite(top), plain, scaled)


def stage_total(local_total: torch.Tensor, p: float, stages: Any) -> torch.Tensor:
    """The p-norm over the parameters of every pipeline stage of the process group `stages`, from each
    stage's own total (gathered, then combined as a single process combines per-tensor norms): the same
    value on every stage."""
    return combine_pnorms(distributed.gather_0d(local_total, stages), p)


def slice_stat(t: torch.Tensor, stat: float | str, dims: tuple[int, ...]) -> torch.Tensor:
    """Statistic of `t` over `dims` (keepdim). `dims == ()` means every element is its own slice."""
    acc = acc_dtype(t.dtype)
    if not dims:  # one-element slices
        x = t.to(acc)
        if stat == 0.0:
            return (x != 0).to(acc)
        if isinstance(stat, float) or stat == "mad":
            return x.abs()
        if stat in ("sum", "mean"):
            return x
        return torch.zeros_like(x)  # var / std of one element
    size = math.prod([t.shape[d] for d in dims])  # a list: dynamo cannot pass a generator to math.prod
    if size == 0 and stat == math.inf:  # max over no elements: 0 (torch has no identity for it)
        return t.new_zeros([1 if d in dims else s for d, s in enumerate(t.shape)], dtype=acc)
    if isinstance(stat, float):
        return torch.linalg.vector_norm(t, stat, dim=dims, keepdim=True, dtype=acc)
    if stat == "mad":
        return t.abs().to(acc).sum(dims, keepdim=True) / max(size, 1)
    if stat == "sum":
        return t.sum(dims, keepdim=True, dtype=acc)
    if stat == "mean":
        return t.sum(dims, keepdim=True, dtype=acc) / max(size, 1)
    if size < 2:
        return torch.zeros_like(t.sum(dims, keepdim=True, dtype=acc))
    var = torch.var(t.to(acc), dim=dims, correction=1, keepdim=True)
    return var if stat == "var" else var.sqrt()


#: `parse_ord` of a validated field's `ord` (a float or a name: hashable; typed, so True is not 1), once
_parsed_ord = lru_cache(maxsize=256, typed=True)(parse_ord)


#: the tensor types that are never sharded (a C-level test of a list's types, every step)
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})

def any_pnorms(tensors: list[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
    """1-D tensor of the p-norm of each tensor, in `acc`; of each *full* tensor when some are sharded
    (DTensors: all-reduced, the same on every rank; `tensor_pnorms`)."""
    if not torch.compiler.is_compiling() and _PLAIN.issuperset(map(type, tensors)):
        return pnorms(tensors, p, acc)
    return tensor_pnorms(tensors, p, acc) if any_sharded(tensors) else pnorms(tensors, p, acc)

class NormMemo:
    """Per-tensor p-norms of the raw gradients, shared by the transforms of one step.

    The runner opens it when a step starts (`open`) and closes it for the rest of
    the step after the first transform that may write the updates (`close`), so a
    transform never reads a stale norm, whatever it wrote through (a `.data` write
    included). While it is open, the non-finite check's 2-norms serve a following
    global `ClipNorm` and a global clip's per-tensor norms a per-tensor statistic
    over the same list, without reading the gradients again. Entries also check the
    tensors' version counters, a second guard against in-place writes.
    """

    __slots__ = ("_entries", "_open", "stages", "host_reads")
    stages: Any
    host_reads: bool

    def __init__(self, opened: bool = False, stages: Any = None, host_reads: bool = False) -> None:
        self._entries: dict[Any, Any] = {}
        self._open = opened
        #: the step's `Step.host_reads`: its totals may be read on the host (`combine_pnorms`)
        self.host_reads = host_reads
        #: the process group of the pipeline stages whose parameters a global statistic spans (`Modular`'s
        #: `stage_group`), or None: the step's parameters are the whole model
        self.stages = stages

    def open(self) -> None:
        """Start a step: forget every norm and keep the ones computed from now on (until `close`)."""
        self._entries.clear()
        self._open = True

    def close(self) -> None:
        """Forget every norm and compute from now on (until `open`): the updates are no longer the gradients."""
        if self._entries:
            self._entries.clear()
        self._open = False

    def __len__(self) -> int:
        return len(self._entries)

    def pnorms(self, tensors: list[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
        """1-D tensor of the p-norm of each tensor (in `acc`), computed once per list while open."""
        if not self._open or not tensors:
            return any_pnorms(tensors, p, acc)
        hit = self._get(("parts", p, acc), tensors)
        if hit is None:
            hit = any_pnorms(tensors, p, acc)
            self._put(("parts", p, acc), tensors, hit)
        return hit

    def total(self, tensors: list[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
        """0-d p-norm of all `tensors` together (`combine_pnorms` of their parts), once per list while open."""
        hit = self._get(("total", p, acc), tensors) if self._open and tensors else None
        if hit is None:
            hit = combine_pnorms(self.pnorms(tensors, p, acc), p, self.host_reads)
            if self.stages is not None:  # of every stage's parameters
                hit = stage_total(hit, p, self.stages)
            if self._open and tensors:
                self._put(("total", p, acc), tensors, hit)
        return hit

    def put_total(self, tensors: list[torch.Tensor], p: float, acc: torch.dtype, value: torch.Tensor) -> None:
        """Remember `value` as `total(tensors, p, acc)` (the non-finite check's plain combination; over every
        stage's parameters when `stages` is set)."""
        if self._open and tensors:
            self._put(("total", p, acc), tensors, value)

    def cleaning(self, tensors: list[torch.Tensor]) -> Callable[[], None]:
        """Before `Step.clean_` cleans `tensors` in place: returns the call that, after it, keeps the
        entries that were valid. The cleaning changes no value on a step that goes ahead, and on a
        skipped step nothing computed from a norm is kept; a compiled step never checks versions."""
        if torch.compiler.is_compiling() or not self._entries:
            return _nothing
        valid = [k for k, (versions, ts, _) in self._entries.items()
                 if k != "traced" and versions == tuple(map(_version_of, ts))]

        def after() -> None:
            for k in valid:
                versions, ts, value = self._entries[k]
                self._entries[k] = (tuple(map(_version_of, ts)), ts, value)

        return after

    def _get(self, what: tuple, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        if torch.compiler.is_compiling():
            # traced: no id() (dynamo would guard on each tensor object, and recompile every step) and
            # no version counters; the same tensor objects, while the memo is open, are the same values
            for w, ts, value in self._entries.get("traced", ()):
                if w == what and len(ts) == len(tensors) and all(x is y for x, y in zip(ts, tensors)):
                    return value
            return None
        hit = self._entries.get((what, tuple(map(id, tensors))))
        if hit is not None and hit[0] == tuple(map(_version_of, tensors)):
            return hit[2]
        return None

    def _put(self, what: tuple, tensors: list[torch.Tensor], value: torch.Tensor) -> None:
        if torch.compiler.is_compiling():
            self._entries.setdefault("traced", []).append((what, list(tensors), value))
            return
        # (the entry holds the tensors, so their ids stay theirs while it lives)
        self._entries[(what, tuple(map(id, tensors)))] = (tuple(map(_version_of, tensors)), list(tensors), value)

_version_of = operator.attrgetter("_version")

def _nothing() -> None:
    return None


# --- scopes: segments -----------------------------------------------------------
Dims = Union[int, tuple[int, ...], None]

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
    #: `modopt.core.reduce.NormMemo`); None for segments made outside a step
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
            reads = self.memo is not None and self.memo.host_reads
            return torch.stack([combine_pnorms(parts[a:b], stat, reads) for a, b in self.ranges])
        if any_sharded(tensors):  # FSDP2 / DTensor: statistics of the full tensors (`sharded_stat`)
            return sharded_stat(self, tensors, stat)
        if self.kind == "slices":
            return self.concat([slice_stat(t, stat, d) for t, d in zip(tensors, self.dims)], tensors)
        acc = common_acc_dtype(tensors)
        counts = self.count_tensor(acc, _device(tensors))
        # a global statistic over pipeline stages: the sums (and counts) of every stage's parameters
        memo = self.memo
        stages = [memo.stages] if self.kind == "global" and memo is not None and memo.stages is not None else []
        if stages:
            counts = distributed.sum_over_(counts.clone(), stages)
        if stat == "mad":
            parts = torch.stack(foreach_pnorm(tensors, 1.0)).to(acc)
            sums = self.segment_sums(parts)
            return (distributed.sum_over_(sums, stages) if stages else sums) / counts.clamp(min=1)
        sums = self.segment_sums(torch.stack([t.sum(dtype=acc) for t in tensors]))
        if stages:
            distributed.sum_over_(sums, stages)
        if stat == "sum":
            return sums
        mean = sums / counts.clamp(min=1)
        if stat == "mean":
            return mean
        means = self.expand(mean)
        sq = self.segment_sums(torch.stack([(t.to(acc) - m).square().sum() for t, m in zip(tensors, means)]))
        if stages:
            distributed.sum_over_(sq, stages)
        var = torch.where(counts >= 2, sq / (counts - 1).clamp(min=1), 0.0)
        return var if stat == "var" else var.sqrt()

    def element_counts(self, like: torch.Tensor) -> torch.Tensor:
        """The number of elements of each segment (slices: of each slice), a 1-D tensor in `like`'s dtype
        and device, made once per layout (e.g. to turn a 2-norm into a root mean square)."""
        stages = self.memo.stages if self.kind == "global" and self.memo is not None else None
        key = (like.dtype, like.device, stages)
        out = self._count_vectors.get(key)
        if out is None:
            counts = self.counts if self.kind != "slices" else [c for c, k in zip(self.counts, self.sizes) for _ in range(k)]
            out = on_device(counts, torch.float64, like.device)
            if stages is not None:  # every pipeline stage's elements
                out = distributed.sum_over_(out, [stages])
            out = self._count_vectors[key] = out.to(like.dtype)
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
    def slots(self, st: Any, name: str) -> list[tuple[dict[str, Any], str, tuple[int, ...], torch.device]]:
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


# --- sharded tensors: statistics of the full tensors ------------------------------
def tensor_pnorms(tensors: list[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
    """1-D plain tensor: the p-norm of each *full* tensor (DTensors reduced over their shards), in `acc`.

    The partials are scaled by the global per-tensor maximum before summing
    `|x|**p`, so no magnitude that a single-process norm can represent
    overflows here. inf and NaN propagate as in a single process.
    """
    if not tensors:
        return torch.zeros(0, dtype=acc)
    keys = [distributed.groups_of(t, f"tensor #{i}") for i, t in enumerate(tensors)]
    local = torch.stack(foreach_pnorm([distributed.local(t) for t in tensors], p)).to(acc)
    # the NaN flag and the maximum, in one MAX over every mesh dim (Replicate dims too: an inf or NaN in
    # one rank's copy reaches every rank, so every rank takes the same decision on it)
    if p == 0:  # non-zero counts add up (over the splitting dims only); a count is never NaN
        return distributed.all_reduce(local, keys, "sum")
    n = len(tensors)
    flagmax = distributed.all_reduce(torch.cat([local.isnan().to(acc), torch.nan_to_num(local, nan=0.0)]),
                          [distributed.all_groups_of(t) for t in tensors] * 2, "max")
    nan, big = flagmax[:n] > 0, flagmax[n:]
    if math.isinf(p):
        out = big
    else:
        safe = torch.where((big > 0) & torch.isfinite(big), big, torch.ones_like(big))
        q = torch.where(torch.isfinite(local), local / safe, torch.zeros_like(local)).pow(p)
        s = distributed.all_reduce(torch.nan_to_num(q, nan=0.0), keys, "sum")
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
    acc = common_acc_dtype(tensors)
    ibits, rounds = (torch.int64, 63) if acc == torch.float64 else (torch.int32, 31)
    dev = _device([distributed.local(t) for t in tensors])
    keys = [distributed.groups_of(t, f"tensor #{i}") for i, t in enumerate(tensors)]
    bits = [distributed.local(t).detach().abs().to(acc).reshape(-1).view(ibits) for t in tensors]
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
        counts = distributed.all_reduce(counts, keys, "sum")
        per_seg = torch.zeros(len(ranges), dtype=torch.float64, device=dev).index_add_(0, pick, counts[ranged] if ranged else counts[:0])
        enough = per_seg >= k
        hi = torch.where(enough, mid, hi)
        lo = torch.where(enough, lo, mid + 1)
    return hi.view(acc)

def _tensor_sums(locals_: list[torch.Tensor], keys: list[tuple], acc: torch.dtype, fn) -> torch.Tensor:
    parts = torch.stack([fn(t) for t in locals_]) if locals_ else torch.zeros(0, dtype=acc)
    return distributed.all_reduce(parts.to(acc), keys, "sum")

def sharded_stat(seg: Any, tensors: list[torch.Tensor], stat: float | str) -> torch.Tensor:
    """`Segments.reduce()` (`seg`) for lists that hold DTensors (`stat` already parsed)."""
    if seg.kind == "slices":  # sharded parameters were refused when the layout was built (check_slices)
        return seg.concat([slice_stat(distributed.local(t), stat, d) for t, d in zip(tensors, seg.dims)], tensors)
    acc = common_acc_dtype(tensors)  # (p-norms come through `Segments.tensor_pnorms`, the step's memo)
    keys = [distributed.groups_of(t, f"tensor #{i}") for i, t in enumerate(tensors)]
    locals_ = [distributed.local(t) for t in tensors]
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

def any_nonfinite(grads: list[torch.Tensor]) -> torch.Tensor:
    """0-d plain bool: does any element of any (full) gradient hold inf or NaN; the same on every rank."""
    maxabs = tensor_pnorms(grads, math.inf, torch.float32)
    return ~torch.isfinite(maxabs).all()
