"""Stability methods of 2024-2026: clipping rules that follow each tensor's own history.

`AdaGC` (Wang et al. 2025, arXiv 2502.11034): per-tensor adaptive clipping,
with a global absolute clip while its thresholds warm up. Published fused into
Adam (`pytorch_optimizer.AdaGC`); here it is a gradient transform that goes in
front of any optimizer transform.

The thresholds live in the optimizer's state, one per segment of the scope
(`seg_get`/`seg_set`), and the step count is a device counter, so a step never
synchronises with the host and a step the device skips leaves every value as
it was. A non-finite norm never enters a threshold.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from pydantic import Field

from ..core.norms import combine_pnorms, common_acc_dtype
from ..core.scope import Scoped, ScopeName
from ..core.state import Buffer, proceed_flag
from ._util import FiniteNonNegativeFloat, FinitePositiveFloat, below_one, record_clip

__all__ = ["AdaGC"]


def _global_norm(parts: torch.Tensor) -> torch.Tensor:
    """The 2-norm of a concatenation from the 2-norms of its parts (1-D), as `sqrt(sum(parts**2))`.

    That plain form is pytorch_optimizer's global norm, bit for bit; where it overflows although
    every part is finite, `combine_pnorms` (which cannot overflow) stands in, chosen on the device."""
    plain = parts.square().sum().sqrt()
    return torch.where(plain < math.inf, plain, combine_pnorms(parts, 2.0))


class AdaGC(Scoped):
    r"""AdaGC (Wang et al. 2025, arXiv 2502.11034): clip each tensor to a multiple of its own EMA norm.

    Each segment `s` (a tensor, by default) keeps a threshold $\gamma_s$. With
    $t$ the step number (from 1), $g$ the update, $n_s = \|g_s\|_2$ and
    $G = \|g\|_2$ the norm of every tensor of the step together:

    * warm-up, $t < T_w$ (and a segment's first step, whatever $t$):
      $h = \min\big(1,\ \lambda_\text{abs} / (G + \varepsilon)\big)$ for every segment, then
      $\gamma_s \leftarrow \min(\gamma_s,\ \|h\,g_s\|)$ ($\gamma_s$ starts at $+\infty$);
    * after: $h_s = \min\big(1,\ \lambda_\text{rel} \max(\gamma_s, \varepsilon) / \max(n_s, \varepsilon)\big)$,
      then $\gamma_s \leftarrow \beta \gamma_s + (1-\beta)\,\|h_s g_s\|$;

    and $g_s \leftarrow h\,g_s$ (resp. $h_s g_s$). The warm-up clip is over every
    tensor of the step, whatever `scope`. A step's norm that is not finite
    leaves $\gamma$ as it was (the update is then scaled by 0, or by 1 for NaN).

    Defaults: `beta=0.98`, `lambda_abs=1.0`, `lambda_rel=1.05`,
    `warmup_steps=100` ($T_w$: steps 1 to 99 warm up), `eps=1e-8`,
    `scope="tensor"`. Reproduces `pytorch_optimizer.AdaGC`:
    `mo.Modular(params, mo.AdaGC(), mo.AdamW(weight_decay=0.1, fused=False))`
    steps exactly as `pytorch_optimizer.AdaGC(params)` (float32, bit for bit).

    Telemetry: `norm` (pre-clip $n_s$), `scale`, `clipped`, `gamma`, `warmup`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> opt = mo.Modular([p], mo.AdaGC(warmup_steps=2, lambda_abs=5.0, beta=0.5), mo.LR(1.0))
    >>> p.grad = torch.tensor([3.0, 4.0]); opt.step()      # warm-up: norm 5, gamma = 5
    >>> p.grad = torch.tensor([30.0, 40.0]); opt.step()    # cut to 1.05 * 5; gamma = (5 + 5.25) / 2
    >>> p.data, opt.stats["0:AdaGC.gamma"]
    (tensor([-6.1500, -8.2000]), tensor([5.1250]))

    ```
    """

    positional = None
    device_skip = True  # keeps its state on a step the device skips

    beta: float = Field(0.98, ge=0.0, lt=1.0)
    lambda_abs: FinitePositiveFloat = 1.0
    lambda_rel: FinitePositiveFloat = 1.05
    warmup_steps: int = Field(100, ge=0, lt=2**63)  # (compared with an int64 step count)
    eps: FiniteNonNegativeFloat = 1e-8
    scope: ScopeName = "tensor"
    state_buffers: ClassVar[dict] = {
        # +inf: the segment has not had a step yet (its next step warms up)
        "gamma": Buffer("segment", low=0, finite=False),
        "step": Buffer("counter"),  # steps taken (a skipped one is not)
    }

    def apply(self, ctx, st, updates):
        seg = self.segments(ctx, st)
        acc = common_acc_dtype(updates)
        parts = seg.tensor_pnorms(updates, 2.0, acc)  # per tensor, for the global warm-up norm
        n = parts if seg.kind == "tensor" else seg.reduce(updates, 2.0)
        gamma = st.seg_get(seg, "gamma", math.inf, dtype=n.dtype).to(n.dtype)
        count = st.store.get("step")
        if count is None:
            count = torch.zeros((), dtype=torch.int64, device=n.device)
        warm = (count + 1 < self.warmup_steps) | (gamma == math.inf)
        total = _global_norm(parts)
        eps = self.eps
        # (`lambda / x` on a tensor is `x.reciprocal() * lambda` in torch: the reference's rounding)
        h_abs = below_one((total + eps).reciprocal() * self.lambda_abs)
        h_rel = below_one(self.lambda_rel * gamma.clamp(min=eps) / n.clamp(min=eps))
        scale = torch.where(warm, h_abs, h_rel)
        ctx.memo.close()  # the updates change here: no norm of the gradients may be reused below
        seg.mul_(updates, scale)
        # the clipped norm is measured again, not taken as `scale * n`: the reference measures it, and the
        # two differ in the last bit (one more read of the updates, the price of the thresholds' exactness)
        clipped = seg.reduce(updates, 2.0)
        new = torch.where(warm, torch.minimum(gamma, clipped), torch.lerp(gamma, clipped, 1.0 - self.beta))
        ok = torch.where(warm, total < math.inf, n < math.inf)  # (a norm is >= 0; NaN compares false)
        gamma = torch.where(ok, new, gamma)
        st.seg_set(seg, "gamma", gamma)
        go = proceed_flag(ctx)  # None: the host decided, the step goes ahead
        st.store["step"] = count + (1 if go is None else go)
        record_clip(st, n, scale, gamma=gamma, warmup=warm)
        return updates
