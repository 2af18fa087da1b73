"""Spec of the weight-stage transforms (float64, one tensor at a time)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def project_norm(params: Sequence[torch.Tensor], radii: Sequence[float | None], eps: float,
                 min_ndim: int) -> list[torch.Tensor]:
    """`ProjectNorm`: each tensor with at least `min_ndim` dims times `R / (||p||_F + eps)` (`radii[i]`: its
    R), left as it is when its norm is 0; the others unchanged."""
    out = []
    for p, r in zip(params, radii):
        vals = p.detach().to(torch.float64).reshape(-1).tolist()
        if p.dim() < min_ndim:
            out.append(torch.tensor(vals, dtype=torch.float64).reshape(p.shape))
            continue
        norm = math.sqrt(sum(v * v for v in vals))
        f = r / (norm + eps) if norm > 0 else 1.0
        out.append(torch.tensor([v * f for v in vals], dtype=torch.float64).reshape(p.shape))
    return out


def frobenius(p: torch.Tensor) -> float:
    """`||p||_F` in float64."""
    return math.sqrt(sum(v * v for v in p.detach().to(torch.float64).reshape(-1).tolist()))
