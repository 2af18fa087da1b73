"""Spec of the core modules (float64, one segment at a time).

Each function takes the list of updates, the param-group index of each and
the module's fields, and returns the new updates in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .scope import Dims, map_segments
from .stats import Ord, stat


def clip_value(updates: Sequence[torch.Tensor], value: float) -> list[torch.Tensor]:
    """`ClipValue`: every element clamped to `[-value, value]`."""
    return [u.to(torch.float64).clamp(-value, value) for u in updates]


def clip_norm(updates: Sequence[torch.Tensor], group_of: Sequence[int], max_norm: float, ord: Ord = 2.0, scope: str = "global",
              dim: Dims = None, inverse_dims: bool = False, min_size: int = 1, eps: float = 1e-6) -> list[torch.Tensor]:
    """`ClipNorm`: each segment times `min(1, max_norm / (|stat| + eps))`."""
    def rule(_, x):
        n = stat(x, ord).abs()
        return x * min(1.0, float(max_norm / (n + eps))) if n + eps > 0 else x

    return map_segments(updates, group_of, scope, dim, inverse_dims, min_size, rule)


def clip_norm_by_rms(updates: Sequence[torch.Tensor], group_of: Sequence[int], threshold: float, scope: str = "tensor", dim: Dims = None,
                     inverse_dims: bool = False, min_size: int = 1) -> list[torch.Tensor]:
    """optax's `clip_by_block_rms`, per segment: `u / max(1, rms(u) / threshold)`, `rms(u) = sqrt(mean(u**2))`."""
    def rule(_, x):
        rms = float(x.square().mean().sqrt())
        return x / max(1.0, rms / threshold)

    return map_segments(updates, group_of, scope, dim, inverse_dims, min_size, rule)


def normalize(updates: Sequence[torch.Tensor], group_of: Sequence[int], norm_value: float = 1.0, ord: Ord = 2.0, scope: str = "tensor",
              dim: Dims = None, inverse_dims: bool = False, min_size: int = 1, eps: float = 0.0) -> list[torch.Tensor]:
    """`Normalize`: each segment times `norm_value / (|stat| + eps)`; a segment whose statistic is 0 is left as it is."""
    def rule(_, x):
        n = stat(x, ord).abs()
        return x * (norm_value / (n + eps)) if n > 0 else x

    return map_segments(updates, group_of, scope, dim, inverse_dims, min_size, rule)


def centralize(updates: Sequence[torch.Tensor], group_of: Sequence[int], scope: str = "tensor", dim: Dims = None, inverse_dims: bool = False,
               min_size: int = 2) -> list[torch.Tensor]:
    """`Centralize`: each segment minus its mean."""
    return map_segments(updates, group_of, scope, dim, inverse_dims, min_size, lambda _, x: x - x.mean())


def gradient_centralization(updates: Sequence[torch.Tensor], group_of: Sequence[int]) -> list[torch.Tensor]:
    """`GradientCentralization`: `centralize` over every dim but the first (per output unit)."""
    return centralize(updates, group_of, dim=0, inverse_dims=True)


def identity(updates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`Identity`: the updates unchanged (in float64)."""
    return [u.to(torch.float64) for u in updates]


def lr(updates: Sequence[torch.Tensor], lr: float) -> list[torch.Tensor]:
    """`LR`: the updates times `lr`."""
    return [lr * u.to(torch.float64) for u in updates]


def sign(updates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`Sign`: every (finite) element replaced by -1, 0 or 1 (signSGD's direction; the sign of 0 is 0)."""
    return [torch.where(u > 0, 1.0, torch.where(u < 0, -1.0, 0.0)).to(torch.float64) for u in updates]


def scaled_sign(updates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`ScaledSign`: each update's sign times its mean absolute value, ||u||_1 / d (Karimireddy et al. 2019)."""
    out = []
    for u in updates:
        x = u.to(torch.float64)
        mean_abs = x.abs().sum() / max(x.numel(), 1)
        out.append(mean_abs * torch.where(x > 0, 1.0, torch.where(x < 0, -1.0, 0.0)).to(torch.float64))
    return out
