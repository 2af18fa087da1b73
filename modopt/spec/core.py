"""Spec of the core modules (float64, one segment at a time).

Each function takes the list of updates, the param-group index of each and
the module's fields, and returns the new updates in float64.
"""

from __future__ import annotations

import torch

from .scope import map_segments
from .stats import stat


def clip_value(updates, value):
    return [u.to(torch.float64).clamp(-value, value) for u in updates]


def clip_norm(updates, group_of, max_norm, ord=2.0, scope="global", dim=None, inverse_dims=False, min_size=1, eps=1e-6):
    def rule(_, x):
        n = stat(x, ord).abs()
        return x * min(1.0, float(max_norm / (n + eps))) if n + eps > 0 else x

    return map_segments(updates, group_of, scope, dim, inverse_dims, min_size, rule)


def clip_norm_by_rms(updates, group_of, threshold, scope="tensor", dim=None, inverse_dims=False, min_size=1):
    """optax's `clip_by_block_rms`, per segment: `u / max(1, rms(u) / threshold)`, `rms(u) = sqrt(mean(u**2))`."""
    def rule(_, x):
        rms = float(x.square().mean().sqrt())
        return x / max(1.0, rms / threshold)

    return map_segments(updates, group_of, scope, dim, inverse_dims, min_size, rule)


def normalize(updates, group_of, norm_value=1.0, ord=2.0, scope="tensor", dim=None, inverse_dims=False, min_size=1, eps=0.0):
    def rule(_, x):
        n = stat(x, ord).abs()
        return x * (norm_value / (n + eps)) if n > 0 else x

    return map_segments(updates, group_of, scope, dim, inverse_dims, min_size, rule)


def centralize(updates, group_of, scope="tensor", dim=None, inverse_dims=False, min_size=2):
    return map_segments(updates, group_of, scope, dim, inverse_dims, min_size, lambda _, x: x - x.mean())


def gradient_centralization(updates, group_of):
    return centralize(updates, group_of, dim=0, inverse_dims=True)


def identity(updates):
    return [u.to(torch.float64) for u in updates]


def lr(updates, lr):
    return [lr * u.to(torch.float64) for u in updates]
