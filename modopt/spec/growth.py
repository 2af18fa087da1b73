"""Spec of the growth family (float64, one segment / element at a time).

`r` is the remembered size of the previous output update. Step 1 passes
through with `r = max(size, min_value)`; later steps allow
`A = min(r + add, r * mul)` and remember `max(size_out, r / max_decay, min_value)`.
Non-finite sizes are never remembered.
"""

from __future__ import annotations

import math

import torch

from .scope import gather, scatter, segments
from .stats import stat


def _allowed(r, add, mul):
    a = math.inf
    if add is not None:
        a = min(a, r + add)
    if mul is not None:
        a = min(a, r * mul)
    return a


def _remember(size_out, r, min_value, max_decay):
    new = max(size_out, min_value)
    if max_decay is not None:
        new = max(new, r / max_decay)
    return new


class ClipNormGrowth:
    def __init__(self, group_of, add=None, mul=1.5, min_value=1e-4, max_decay=2.0, ord=2.0, scope="global", dim=None,
                 inverse_dims=False, min_size=1):
        self.group_of, self.add, self.mul, self.min_value, self.max_decay = group_of, add, mul, min_value, max_decay
        self.ord, self.scope, self.dim, self.inverse_dims, self.min_size = ord, scope, dim, inverse_dims, min_size
        self.r = {}  # segment number -> remembered norm (absent before the first finite step)

    def step(self, updates):
        out = [u.detach().to(torch.float64).clone() for u in updates]
        for s, seg in enumerate(segments(out, self.group_of, self.scope, self.dim, self.inverse_dims)):
            x = gather(out, seg)
            n = abs(float(stat(x, self.ord)))
            if s not in self.r:
                if math.isfinite(n):
                    self.r[s] = max(n, self.min_value)
                continue
            r = self.r[s]
            allowed = _allowed(r, self.add, self.mul)
            scale = min(1.0, allowed / n) if n > 0 and n > allowed else 1.0
            if x.numel() >= self.min_size:
                scatter(out, seg, x * scale)
            if math.isfinite(n):
                self.r[s] = _remember(n * scale, r, self.min_value, self.max_decay)
        return out


class ClipValueGrowth:
    def __init__(self, add=None, mul=1.5, min_value=1e-4, max_decay=2.0):
        self.add, self.mul, self.min_value, self.max_decay = add, mul, min_value, max_decay
        self.r = None  # per tensor: remembered magnitude of every element

    def step(self, updates):
        out = [u.detach().to(torch.float64).clone() for u in updates]
        if self.r is None:
            self.r = []
            for u in out:
                r = torch.full_like(u, self.min_value)
                for j, a in enumerate(u.reshape(-1).tolist()):
                    if math.isfinite(a):
                        r.reshape(-1)[j] = max(abs(a), self.min_value)
                self.r.append(r)
            return out
        for u, r in zip(out, self.r):
            flat_u, flat_r = u.reshape(-1), r.reshape(-1)
            for j in range(flat_u.numel()):
                a, rj = float(flat_u[j]), float(flat_r[j])
                allowed = _allowed(rj, self.add, self.mul)
                if abs(a) > allowed:
                    flat_u[j] = math.copysign(allowed, a)
                if math.isfinite(a):
                    flat_r[j] = _remember(abs(float(flat_u[j])), rj, self.min_value, self.max_decay)
        return out
