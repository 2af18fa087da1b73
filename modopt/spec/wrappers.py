"""Spec of the wrappers that keep their own copy of the parameters (float64, one tensor at a time)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Lookahead:
    """`Lookahead(k, alpha)` around an inner step: `step(fast)` takes the parameters the inner step wrote
    and returns them after the pull of every `k`-th call, `p + (1 - alpha) (slow - p)`, which the slow
    weights then take (`slow` starts as the parameters before the first step)."""

    def __init__(self, params: Sequence[torch.Tensor], k: int, alpha: float) -> None:
        self.k, self.alpha, self.calls = k, alpha, 0
        self.slow = [p.detach().to(torch.float64).clone() for p in params]

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
