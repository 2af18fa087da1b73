"""Spec of the wrappers that keep their own copy of the parameters (float64, one tensor at a time)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Lookahead:
    """`Lookahead(k, alpha)` around an inner step: `step(fast)` takes the parameters the inner step wrote
    and returns them after the pull of every `k`-th call, `p + (1 - alpha) (slow - p)`, which the slow
    weights then take (`slow` starts as the parameters before the first step)."""

    def __init__(self, params: Sequence[torch.Tensor], k: int, alpha: float) -> None:
        self.k: int = k
        self.alpha: float = alpha
        self.calls: int = 0
        self.slow: list[torch.Tensor] = [p.detach().to(torch.float64).clone() for p in params]

    def step(self, fast: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters after this call."""
        out = [p.detach().to(torch.float64).clone() for p in fast]
        self.calls += 1
        if self.calls < self.k:
            return out
        self.calls = 0
        pulled = []
        for p, s in zip(out, self.slow):
            q = torch.tensor([a + (1.0 - self.alpha) * (b - a) for a, b in zip(p.reshape(-1).tolist(), s.reshape(-1).tolist())],
                             dtype=torch.float64).reshape(p.shape)
            pulled.append(q)
        self.slow = [q.clone() for q in pulled]
        return pulled


class ScheduleFree:
    """Schedule-Free SGD (`adam=False`) or AdamW (`adam=True`) in the paper's three sequences (Defazio et al.
    2024, Algorithm 1), one param group: `step(grads)` takes the gradients at `y` and returns the new `y`;
    `x` (the average, the eval point) and `z` (the base sequence) are kept.

    `gamma_t = lr * min(1, t / warmup_steps)`, `w_t = t**r * max_i(gamma_i)**weight_lr_power`,
    `c = w_t / sum w`; SGD's direction is `g + wd * y`, AdamW's `g / (sqrt(v / (1 - beta2**t)) + eps) + wd * y`
    with `v` the EMA of `g**2`; `z -= gamma_t * direction`, `x = (1 - c) x + c z`, `y = (1 - beta) z + beta x`.
    """

    def __init__(self, params: Sequence[torch.Tensor], lr: float, beta: float, weight_decay: float = 0.0,
                 warmup_steps: int = 0, r: float = 0.0, weight_lr_power: float = 2.0, adam: bool = False,
                 beta2: float = 0.999, eps: float = 1e-8) -> None:
        self.lr: float = lr
        self.beta: float = beta
        self.wd: float = weight_decay
        self.warmup: int = warmup_steps
        self.r: float = r
        self.power: float = weight_lr_power
        self.adam: bool = adam
        self.beta2: float = beta2
        self.eps: float = eps
        self.t: int = 0
        self.weight_sum: float = 0.0
        self.lr_max: float = 0.0
        self.z: list[torch.Tensor] = [p.detach().to(torch.float64).clone() for p in params]
        self.x: list[torch.Tensor] = [z.clone() for z in self.z]
        self.v: list[torch.Tensor] = [torch.zeros_like(z) for z in self.z]

    def y(self) -> list[torch.Tensor]:
        """The training point, `(1 - beta) z + beta x`."""
        return [(1 - self.beta) * z + self.beta * x for z, x in zip(self.z, self.x)]

    def step(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One step with the gradients taken at `y()`; returns the new `y`."""
        self.t += 1
        t = self.t
        gamma = self.lr * (min(1.0, t / self.warmup) if self.warmup else 1.0)
        self.lr_max = max(self.lr_max, gamma)
        w = t ** self.r * self.lr_max ** self.power
        self.weight_sum += w
        c = w / self.weight_sum if self.weight_sum else 0.0
        ys = self.y()
        for i, (g, y) in enumerate(zip(grads, ys)):
            g = g.detach().to(torch.float64)
            if self.adam:
                self.v[i] = self.beta2 * self.v[i] + (1 - self.beta2) * g * g
                g = g / ((self.v[i] / (1 - self.beta2 ** t)).sqrt() + self.eps)
            d = g + self.wd * y
            self.z[i] = self.z[i] - gamma * d
            self.x[i] = (1 - c) * self.x[i] + c * self.z[i]
        return self.y()
