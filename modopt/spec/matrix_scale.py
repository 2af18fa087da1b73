"""Spec of the per-matrix rescalings (float64, one tensor at a time): MuonEq, Muon+ and the shape factor.

Each tensor of 2 or more dims is read as its matrix `(shape[0], prod(shape[1:]))`, or with `batch_dims=k` as
one such matrix per index of its first `k` dims (`matrices_of`), each rescaled alone; others are returned
unchanged. The rules are the definitions of the docstrings in `modopt/transforms/matrix_scale.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

from .orthogonal import adjust_ratio, from_matrices, matrices_of


def muon_eq(updates: Sequence[torch.Tensor], eps: float = 1e-6, batch_dims: Optional[int] = None) -> list[torch.Tensor]:
    """`MuonEq`: row `i` of each matrix `X` times `(||X||_F / sqrt(rows)) / max(||X_i||, eps)`."""
    out = []
    for u in updates:
        ms = matrices_of(u, batch_dims)
        if ms is None:
            out.append(u.detach().to(torch.float64).clone())
            continue
        ys = []
        for m in ms:
            target = float(torch.linalg.matrix_norm(m)) / math.sqrt(m.shape[0])
            rows = torch.linalg.vector_norm(m, dim=1).clamp(min=eps)
            ys.append(m * (target / rows)[:, None])
        out.append(from_matrices(ys, u.shape))
    return out


def muon_plus(updates: Sequence[torch.Tensor], eps: float = 1e-6,
              batch_dims: Optional[int] = None) -> list[torch.Tensor]:
    """`MuonPlus`: each matrix `O` times `sqrt(min(rows, cols)) / max(||O||_F, eps)`."""
    out = []
    for u in updates:
        ms = matrices_of(u, batch_dims)
        if ms is None:
            out.append(u.detach().to(torch.float64).clone())
            continue
        out.append(from_matrices([m * (math.sqrt(min(m.shape)) / max(float(torch.linalg.matrix_norm(m)), eps))
                                  for m in ms], u.shape))
    return out


def shape_scale(updates: Sequence[torch.Tensor], adjust_lr: Optional[str] = "original",
                batch_dims: Optional[int] = None) -> list[torch.Tensor]:
    """`ShapeScale`: each matrix times torch.optim.Muon's factor of its own shape (`adjust_ratio`)."""
    out = []
    for u in updates:
        ms = matrices_of(u, batch_dims)
        x = u.detach().to(torch.float64).clone()
        out.append(x if ms is None else x * adjust_ratio(ms[0].shape[0], ms[0].shape[1], adjust_lr))
    return out
