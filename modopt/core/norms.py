"""The `ord` vocabulary and the statistics it names, in one place.

`ord` is any real `p >= 0` (`0` counts non-zeros, `inf` is the largest
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
"""

from __future__ import annotations

import math
import operator
from typing import Annotated, Union

import torch
from pydantic import AfterValidator, AllowInfNan, BeforeValidator

from . import compile_marks

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
    return torch.stack(foreach_pnorm(tensors, p)).to(acc)


def combine_pnorms(norms: torch.Tensor, p: float) -> torch.Tensor:
    """The p-norm of a concatenation, from the p-norms of its parts (1-D `norms`)."""
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
        # (`plain < inf`: one op where isfinite takes four; a norm is >= 0 and NaN compares false)
        wide = torch.linalg.vector_norm(norms, p, dtype=torch.float64).to(torch.float32)
        return torch.where(plain < math.inf, plain, wide)
    top = norms.amax()
    unit = torch.where(torch.isfinite(top) & (top > 0), top, torch.ones_like(top))
    scaled = unit * torch.linalg.vector_norm(norms / unit, p)
    return torch.where(torch.isfinite(plain) | ~torch.isfinite(top), plain, scaled)


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
