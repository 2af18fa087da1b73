"""Spec of the stability family (float64, one segment at a time, state kept on the spec object).

`AdaGC` is built with the fields of its transform and `group_of` (the param
group of each tensor); `step(updates)` returns the new updates. `SkipStep`'s
`step` says whether a step is skipped, as `skip_norm` does for `SkipNorm`;
`clippy` is one stateless step; `ADOPT` (the optimizer transform `mo.ADOPT`)
steps parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .scope import Dims, gather, scatter, segments


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

    group_of: Sequence[int]
    beta: float
    lambda_abs: float
    lambda_rel: float
    warmup_steps: int
    eps: float
    scope: str
    dim: Dims
    inverse_dims: bool
    min_size: int

    def __init__(self, group_of: Sequence[int], beta: float = 0.98, lambda_abs: float = 1.0, lambda_rel: float = 1.05,
                 warmup_steps: int = 100, eps: float = 1e-8, scope: str = "tensor", dim: Dims = None,
                 inverse_dims: bool = False, min_size: int = 1) -> None:
        self.group_of, self.beta, self.lambda_abs, self.lambda_rel = group_of, beta, lambda_abs, lambda_rel
        self.warmup_steps, self.eps = warmup_steps, eps
        self.scope, self.dim, self.inverse_dims, self.min_size = scope, dim, inverse_dims, min_size
        self.t: int = 0
        self.gamma: dict[int, float] = {}  # segment number -> threshold, once the segment has had a step

    def step(self, updates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One step: the scaled updates (float64); `t` and the thresholds move on."""
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


class SkipStep:
    """OLMo 2's skip step (OLMo-core's `SkipStepOptimizer.get_step_factor`), in float64 Python lists.

    `step(updates, loss=None, nonfinite=False)` returns True when the step is skipped for a spike.
    Each watched value (`loss`; `norm`, the 2-norm of every element of `updates`) is tested against
    the values recorded before it, the last `window` of them: with `mean` and `std` (ddof 1) of those,
    it spikes when not `value - mean <= sigma * std` (so NaN and +inf spike), once it has at least
    `min_steps` values counting itself (None: `max(2, window // 2)`) and two before it. Then every
    finite value is recorded, whether the step is skipped for a spike or not; none is when
    `nonfinite` (a step skipped for non-finite gradients). A step without a loss tests the norm alone.
    """

    window: int
    sigma: float
    watch: str
    #: how many values (the current one included) a test needs
    first_test: int
    #: name -> the recorded values (the last `window`)
    values: dict[str, list[float]]
    #: name -> how many values were recorded in all
    counts: dict[str, int]

    def __init__(self, window: int = 128, sigma: float = 6.0, min_steps: int | None = None,
                 watch: str = "loss_and_norm") -> None:
        self.window, self.sigma, self.watch = window, sigma, watch
        self.first_test = min_steps if min_steps is not None else max(2, window // 2)
        self.values: dict[str, list[float]] = {"loss": [], "norm": []}
        self.counts = {"loss": 0, "norm": 0}

    def stats(self, name: str) -> tuple[float, float]:
        """(mean, std with ddof 1) of the recorded values of `name` (NaN where undefined)."""
        xs = self.values[name]
        if len(xs) < 2:
            return math.nan, math.nan
        mean = sum(xs) / len(xs)
        return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))

    def _spikes(self, name: str, x: float) -> bool:
        held = len(self.values[name])
        if self.counts[name] + 1 < self.first_test or held < 2:
            return False
        mean, std = self.stats(name)
        return not (x - mean <= self.sigma * std)

    def step(self, updates: Sequence[torch.Tensor], loss: float | torch.Tensor | None = None,
             nonfinite: bool = False) -> bool:
        """One step: whether it is skipped for a spike; the finite values are recorded (none when `nonfinite`)."""
        watched: dict[str, float] = {}
        if self.watch != "loss":
            watched["norm"] = math.sqrt(sum(float(u.detach().to(torch.float64).square().sum()) for u in updates))
        if self.watch != "norm" and loss is not None:
            watched["loss"] = float(loss)
        spike = any(self._spikes(name, x) for name, x in watched.items())
        for name, x in watched.items():
            if math.isfinite(x) and not nonfinite:
                self.values[name] = (self.values[name] + [x])[-self.window:]
                self.counts[name] += 1
        return spike and not nonfinite


def skip_norm(updates: Sequence[torch.Tensor], max_norm: float) -> bool:
    """Megatron-LM's `grad_norm_skip_threshold`: whether the step is skipped, that is `G > max_norm` or
    `G` is NaN, with `G` the 2-norm of every element of `updates` (in float64; an inf element makes it inf)."""
    total = math.fsum(float(u.detach().to(torch.float64).square().sum()) for u in updates)
    return not (math.sqrt(total) <= max_norm)


def clippy(updates: Sequence[torch.Tensor], params: Sequence[torch.Tensor], group_of: Sequence[int],
           lambda_w: float = 0.1, lambda_abs: float = 1e-7, scope: str = "tensor", dim: Dims = None,
           inverse_dims: bool = False, min_size: int = 1) -> list[torch.Tensor]:
    """Clippy (arXiv 2302.09178) on the step `updates`, with `params` the parameters before the step: each
    segment is multiplied by `min(1, min over its elements with u != 0 of (lambda_w * |w| + lambda_abs) / |u|)`
    (1 when every element is 0); a segment with fewer than `min_size` elements is left alone."""
    out = [u.detach().to(torch.float64).clone() for u in updates]
    ws = [p.detach().to(torch.float64) for p in params]
    for seg in segments(out, group_of, scope, dim, inverse_dims):
        u, w = gather(out, seg), gather(ws, seg)
        if u.numel() < min_size:
            continue
        scale = 1.0
        for ui, wi in zip(u.tolist(), w.tolist()):
            if ui != 0:
                scale = min(scale, (lambda_w * abs(wi) + lambda_abs) / abs(ui))
        scatter(out, seg, u * scale)
    return out


class ADOPT:
    """ADOPT (arXiv 2411.02853) as the paper writes it, per parameter in float64, with
    pytorch_optimizer's options: step `t` of a parameter counts from 1; on `t = 1`, `v = g**2` and the
    parameter does not move (a decoupled decay still applies); afterwards
    `m <- beta1 m + (1 - beta1) clamp(g / max(sqrt(v), eps), -t**clip_power, t**clip_power)`,
    `p <- p - lr m`, then `v <- beta2 v + (1 - beta2) g**2`. `weight_decay` adds `weight_decay * p` to
    `g` (L2), or with `decoupled_weight_decay` multiplies `p` by `1 - lr * weight_decay`
    (`fixed_decay`: `1 - weight_decay`) first. `step(params, grads)` returns the new parameters."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    #: `weight_decay`
    wd: float
    #: `decoupled_weight_decay`
    decoupled: bool
    #: `fixed_decay`
    fixed: bool
    clip_power: float | None
    maximize: bool
    #: parameter number -> its step count `t` and its moments `m`, `v`
    state: dict[int, dict[str, Any]]

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.9999), eps: float = 1e-6,
                 weight_decay: float = 0.0, decoupled_weight_decay: bool = False, fixed_decay: bool = False,
                 clip_power: float | None = 0.25, maximize: bool = False) -> None:
        self.lr, (self.beta1, self.beta2), self.eps = lr, betas, eps
        self.wd, self.decoupled, self.fixed, self.clip_power = weight_decay, decoupled_weight_decay, fixed_decay, clip_power
        self.maximize = maximize
        self.state = {}

    def step(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One step of every parameter: the new parameters (float64); the state moves on."""
        out: list[torch.Tensor] = []
        for i, (p, g) in enumerate(zip(params, grads)):
            p, g = p.detach().to(torch.float64).clone(), g.detach().to(torch.float64).clone()
            s = self.state.setdefault(i, {"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
            s["t"] += 1
            if self.maximize:
                g = -g
            if self.wd and not self.decoupled:
                g = g + self.wd * p
            if self.wd and self.decoupled:
                p = p * (1 - (self.wd if self.fixed else self.lr * self.wd))
            if s["t"] > 1:
                x = g / s["v"].sqrt().clamp(min=self.eps)
                if self.clip_power is not None:
                    c = s["t"] ** self.clip_power
                    x = x.clamp(-c, c)
                s["m"] = self.beta1 * s["m"] + (1 - self.beta1) * x
                p = p - self.lr * s["m"]
                s["v"] = self.beta2 * s["v"] + (1 - self.beta2) * g * g
            else:
                s["v"] = g * g
            out.append(p)
        return out
