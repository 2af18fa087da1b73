"""Spec of the stability family (float64, one segment at a time, state kept on the spec object).

`AdaGC` is built with the fields of its transform and `group_of` (the param
group of each tensor); `step(updates)` returns the new updates.
"""

from __future__ import annotations

import math

import torch

from .scope import gather, scatter, segments


class AdaGC:
    """AdaGC (arXiv 2502.11034) as written in the paper, with pytorch_optimizer's warm-up boundary and eps.

    Step `t` counts from 1. A segment warms up while `t < warmup_steps` and on its own first
    step: every segment is scaled by `h = min(1, lambda_abs / (G + eps))`, `G` the 2-norm of
    every element of the step, and its threshold becomes `min(gamma, norm of the scaled
    segment)` (the norm itself on its first step). Afterwards a segment with norm `n` is
    scaled by `min(1, lambda_rel * max(gamma, eps) / max(n, eps))` (1 when both are 0), and
    `gamma <- beta * gamma + (1 - beta) * norm of the scaled segment`. A segment with fewer
    than `min_size` elements is not scaled; its threshold follows its own norm.
    """

    def __init__(self, group_of, beta=0.98, lambda_abs=1.0, lambda_rel=1.05, warmup_steps=100, eps=1e-8,
                 scope="tensor", dim=None, inverse_dims=False, min_size=1):
        self.group_of, self.beta, self.lambda_abs, self.lambda_rel = group_of, beta, lambda_abs, lambda_rel
        self.warmup_steps, self.eps = warmup_steps, eps
        self.scope, self.dim, self.inverse_dims, self.min_size = scope, dim, inverse_dims, min_size
        self.t = 0
        self.gamma: dict[int, float] = {}  # segment number -> threshold, once the segment has had a step

    def step(self, updates):
        out = [u.detach().to(torch.float64).clone() for u in updates]
        self.t += 1
        total = math.sqrt(sum(float(x.square().sum()) for x in out))
        h_abs = 1.0 if total + self.eps == 0 else min(1.0, self.lambda_abs / (total + self.eps))
        for s, seg in enumerate(segments(out, self.group_of, self.scope, self.dim, self.inverse_dims)):
            x = gather(out, seg)
            n = float(x.norm())
            gamma = self.gamma.get(s)
            warm = gamma is None or self.t < self.warmup_steps
            if warm:
                h = h_abs
            else:
                top, bottom = self.lambda_rel * max(gamma, self.eps), max(n, self.eps)
                h = 1.0 if bottom == 0 else min(1.0, top / bottom)
            y = x * h if x.numel() >= self.min_size else x
            c = float(y.norm())
            if gamma is None:
                self.gamma[s] = c
            elif warm:
                self.gamma[s] = min(gamma, c)
            else:
                self.gamma[s] = self.beta * gamma + (1 - self.beta) * c
            scatter(out, seg, y)
        return out
