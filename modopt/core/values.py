"""The rule table of hyperparameter values: what a number a transform reads may be, stated once.

A value reaches a step through many doors (a field, a param group, a scheduler, a load, a tensor a
scheduler fills in place, a compiled step). Each door asks the same questions here:

* `host_number`: the Python number the host checks for a value (a NumPy scalar, a one-element tensor of
  any shape, as torch.optim takes), or a `TypeError` naming the key for a tensor that cannot be one;
* `Rule`: the range a group key's fields declare (`ge`/`gt`/`le`/`lt`), checked on the host for a
  number and on the device, without a sync, for a tensor the host does not read;
* `bound`: the largest magnitude a value may have for the parameters' compute dtype (at least
  float32): a finite value beyond it becomes inf where the kernels use it, so the parameters would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

F32_MAX = float(torch.finfo(torch.float32).max)
F64_MAX = float(torch.finfo(torch.float64).max)


def is_numpy(v: Any) -> bool:
    """A NumPy scalar or array (without importing NumPy)."""
    return type(v).__module__ == "numpy" and hasattr(v, "dtype")


def host_number(v: Any, key: str = "value") -> Any:
    """`v` as the host checks it: a NumPy scalar, or a one-element tensor (any shape),
    as its Python number (a host read: never in a step on a device); anything else as it is. A tensor
    that is not one real floating-point number is refused (`TypeError` naming `key`): the kernels read it
    as the group's value."""
    if isinstance(v, torch.Tensor):
        check_tensor(v, key)
        return v.item()
    if is_numpy(v):
        # (an array, even of one element, is not a number the kernels take: torch's fused ones refuse it)
        if type(v).__name__ == "ndarray" or v.dtype.kind not in "fiu":
            raise TypeError(f"{key!r}: a NumPy value must be one real number (a NumPy scalar such as "
                            f"np.float32(0.1)), got {v!r}")
        return v.item()
    return v


def check_tensor(v: torch.Tensor, key: str = "value") -> None:
    """Refuse (`TypeError` naming `key`) a tensor value that is not one real floating-point number with a
    value (metadata only: no read)."""
    if v.is_meta:
        raise TypeError(f"{key!r}: a meta tensor holds no value")
    if v.numel() != 1 or not v.is_floating_point():
        what = f"{v.numel()} elements" if v.numel() != 1 else f"dtype {v.dtype}"
        raise TypeError(f"{key!r}: a tensor value must hold one real floating-point number, got one with {what}")


def bound_of(params: Any) -> float:
    """The largest finite magnitude of a value for these parameters: float64's when every parameter is
    float64, else float32's (half and bfloat16 parameters compute in float32)."""
    return F64_MAX if all(p.dtype == torch.float64 for p in params) else F32_MAX


def dtype_name(bound: float) -> str:
    """The dtype whose largest finite value `bound` is, for messages."""
    return "float64" if bound == F64_MAX else "float32"


@dataclass(frozen=True)
class Rule:
    """A group key's range, from its fields' declarations (the intersection over the transforms that read it)."""

    lo: float = -math.inf
    lo_open: bool = False
    hi: float = math.inf
    hi_open: bool = False

    @classmethod
    def of_field(cls, info: Any) -> "Rule":
        """The range a pydantic field declares (`Field(ge=0)`, `PositiveFloat`...); none: any finite number."""
        rule = cls()
        for m in getattr(info, "metadata", ()):
            for name, x in (("ge", getattr(m, "ge", None)), ("gt", getattr(m, "gt", None)),
                            ("le", getattr(m, "le", None)), ("lt", getattr(m, "lt", None))):
                if isinstance(x, (int, float)) and not isinstance(x, bool):
                    rule = rule.meet(cls(lo=float(x), lo_open=name == "gt") if name in ("ge", "gt")
                                     else cls(hi=float(x), hi_open=name == "lt"))
        return rule

    def meet(self, other: "Rule") -> "Rule":
        """Both ranges at once (the stricter end of each side)."""
        if other.lo > self.lo or (other.lo == self.lo and other.lo_open):
            lo, lo_open = other.lo, other.lo_open
        else:
            lo, lo_open = self.lo, self.lo_open
        if other.hi < self.hi or (other.hi == self.hi and other.hi_open):
            hi, hi_open = other.hi, other.hi_open
        else:
            hi, hi_open = self.hi, self.hi_open
        return Rule(lo, lo_open, hi, hi_open)

    def holds(self, x: float, bound: float) -> bool:
        """Whether the number `x` is in range and within `bound` (NaN is not)."""
        return (x > self.lo if self.lo_open else x >= self.lo) and (x < self.hi if self.hi_open else x <= self.hi) \
            and -bound <= x <= bound

    def ok(self, t: torch.Tensor, bound: float) -> torch.Tensor:
        """`holds` for a one-element tensor, as a 0-d bool tensor on its device (no sync; NaN compares false)."""
        x = t.reshape(())
        ok = x.abs() <= bound
        if self.lo > -math.inf:
            ok = ok & (x > self.lo if self.lo_open else x >= self.lo)
        if self.hi < math.inf:
            ok = ok & (x < self.hi if self.hi_open else x <= self.hi)
        return ok

    def says(self) -> str:
        """The range in words for messages (`>= 0 and < 1`)."""
        parts = []
        if self.lo > -math.inf:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo:g}")
        if self.hi < math.inf:
            parts.append(f"{'<' if self.hi_open else '<='} {self.hi:g}")
        return " and ".join(parts) or "finite"
