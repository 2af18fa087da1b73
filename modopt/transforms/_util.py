"""Small helpers shared by the clipping families (tensor math only, no host syncs)."""

from __future__ import annotations

import math
from typing import Annotated

import torch
from pydantic import Field

from ..core.kernels import const


def below_one(ratio: torch.Tensor) -> torch.Tensor:
    """`ratio` where it is < 1, else 1. A NaN ratio (0/0) gives 1: never scales up, never NaN.

    `fmin(ratio, 1)` (fmin takes the number over a NaN): the same values as `where(ratio < 1, ratio, 1)`
    (signed zeros and -inf included) in one op; traced, `min(ratio, 1)` then NaN -> 1 (inductor fuses both)."""
    if torch.compiler.is_compiling():
        return torch.clamp(ratio, max=1.0).nan_to_num_(nan=1.0, posinf=math.inf, neginf=-math.inf)
    return torch.fmin(ratio, const(1.0, ratio))


def clip_to(norm: torch.Tensor, limit: torch.Tensor | float, eps: float) -> torch.Tensor:
    """The scale `min(1, limit / (norm + eps))` that clips `norm` to `limit` (1 for 0/0).

    A number `limit` divides as Python's `limit / t` does (`t.reciprocal() * limit`, the same bits); the
    numbers are cached 0-d tensors (on a CPU a number in an op is made into a tensor on every call)."""
    if isinstance(limit, torch.Tensor):
        return below_one(limit / (norm + const(eps, norm)))
    return below_one((norm + const(eps, norm)).reciprocal() * const(limit, norm))


# field types for hyperparameters that must be finite (pydantic's own `NonNegativeFloat` and `PositiveFloat`
# take inf: an infinite lr, eps, momentum or floor can only produce inf or NaN parameters)
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
FiniteNonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
FinitePositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
