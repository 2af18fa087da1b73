"""Clipping values at a percentile of their own magnitudes (the Lean 4 gradient-utilities spec)."""

from __future__ import annotations

import math

from typing import ClassVar

import torch
from pydantic import Field

from ..core import distributed, reduce
from ..core.step import Step, TransformState
from ..core.roles import StageLimited
from ..core.scope import Scoped, ScopeName

__all__ = ["ClipValueByPercentile"]


def order_index(pct: int, n: int) -> int:
    """0-based index of the lower order statistic: `(pct * (n - 1)) // 100` (integer arithmetic)."""
    return (pct * (n - 1)) // 100


def _kth_abs(x: torch.Tensor, k: int, dim: int = -1) -> torch.Tensor:
    """The k-th smallest (1-based) of `|x|` along `dim` (half precision upcast: kthvalue lacks it on CPU)."""
    a = x.abs()
    if a.dtype in (torch.float16, torch.bfloat16):
        a = a.float()
    return torch.kthvalue(a, k, dim=dim).values


class ClipValueByPercentile(Scoped, StageLimited):
    r"""Clamp the update to the `pct`-th percentile of its absolute values.

    $$
    b = \operatorname{sort}(|u|)\big[\lfloor \text{pct}\,(N - 1) / 100 \rfloor\big], \qquad
    u \leftarrow \operatorname{clamp}(u, -b, b)
    $$

    `pct` is an integer 0..100 and the index uses integer arithmetic (the
    "lower" order statistic): `pct=100` is the identity, `pct=0` clamps to
    the smallest magnitude, an empty tensor is unchanged. Computed with
    `torch.kthvalue` (`torch.quantile` rounds differently, rejects half
    precision and inputs over 2**24 elements); half precision is ranked in
    float32, which is exact. Sharded tensors (FSDP2, tensor parallel) are
    clamped to the percentile of the full tensors, exactly
    (`modopt.core.reduce.kth_abs`). Defaults: `scope="tensor"`. Reproduces the
    percentile clipping of a Lean 4 spec of gradient utilities; functional
    form `modopt.clip_grad_percentile_()`.

    Telemetry (stacked scopes): `threshold` `b` per segment.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(5))
    >>> opt = mo.Modular([p], mo.ClipValueByPercentile(50), mo.LR(1.0))
    >>> p.grad = torch.tensor([-5.0, 1.0, 2.0, -3.0, 4.0]); opt.step(); p.data
    tensor([ 3., -1., -2.,  3., -3.])

    ```
    """

    positional: ClassVar[str | None] = "pct"
    device_skip = True  # keeps its state on a step the device skips

    pct: int = Field(ge=0, le=100)
    scope: ScopeName = "tensor"

    def check_stages(self) -> None:
        """A global percentile cannot span pipeline stages (its bisection would need an all-reduce per round)."""
        if self.scope == "global":
            raise ValueError("a global percentile over pipeline stages (Modular(stage_group=...)) is not supported; "
                             "use scope='tensor' or 'group' (each stage's own elements)")

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Clamp each segment to the `pct`-th percentile of its magnitudes."""
        if self.pct == 100:  # the maximum magnitude: clamping changes nothing
            return updates
        seg = st.segments(self)
        if seg.kind == "slices":
            for u, dims, on in zip(updates, seg.dims, seg.active):
                if on and u.numel():
                    self._clip_slices(u, dims)
            return updates
        if distributed.any_sharded(updates):  # FSDP2 / tensor parallel: the k-th value of the full tensors
            return self._clip_sharded(st, updates, seg)
        thresholds = []
        for a, b in seg.ranges:
            ts = updates[a:b]
            n = sum(t.numel() for t in ts)
            if n == 0 or not seg.active[a]:
                continue
            flat = torch.cat([t.reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1)
            bound = _kth_abs(flat, order_index(self.pct, n) + 1)
            thresholds.append(bound)
            for t in ts:
                c = bound.to(t.dtype)
                t.clamp_(min=-c, max=c)
        if thresholds:
            st.record("threshold", torch.stack(thresholds))
        return updates

    def _clip_sharded(self, st: TransformState, updates: list[torch.Tensor], seg) -> list[torch.Tensor]:
        chosen, ks = [], []
        for a, b in seg.ranges:
            n = sum(t.numel() for t in updates[a:b])  # (a DTensor's numel is its full tensor's)
            if n and seg.active[a]:
                chosen.append((a, b))
                ks.append(order_index(self.pct, n) + 1)
        if not chosen:
            return updates
        bounds = reduce.kth_abs(updates, chosen, ks)
        for (a, b), bound in zip(chosen, bounds.unbind(0)):
            for t in updates[a:b]:
                c = bound.to(t.dtype)
                distributed.local(t).clamp_(min=-c, max=c)  # each rank its own elements
        st.record("threshold", bounds)
        return updates

    def _clip_slices(self, u: torch.Tensor, dims: tuple[int, ...]) -> None:
        if not dims:  # every element is its own slice: |u| is its own bound
            return
        keep = [d for d in range(u.dim()) if d not in dims]
        n = math.prod([u.shape[d] for d in dims])
        moved = u.permute(*keep, *dims).reshape(*[u.shape[d] for d in keep], n)
        bound = _kth_abs(moved, order_index(self.pct, n) + 1, dim=-1)
        shape = [1 if d in dims else s for d, s in enumerate(u.shape)]
        c = bound.reshape(shape).to(u.dtype)
        u.clamp_(min=-c, max=c)
