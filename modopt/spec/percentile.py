"""Spec of value clipping by percentile (the lower order statistic, integer index arithmetic)."""

from __future__ import annotations

import torch

from .scope import map_segments


def clip_value_by_percentile(updates, group_of, pct, scope="tensor", dim=None, inverse_dims=False, min_size=1):
    def rule(_, x):
        n = x.numel()
        if n == 0:
            return x
        b = torch.sort(x.abs()).values[(pct * (n - 1)) // 100]
        return torch.maximum(torch.minimum(x, b), -b)

    return map_segments(updates, group_of, scope, dim, inverse_dims, min_size, rule)
