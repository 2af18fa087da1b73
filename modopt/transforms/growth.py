"""Limiting how fast the update may grow from one step to the next (torchzero's growth family).

The rule, with `r` the remembered size of the previous (output) update:

* step 1 passes through and remembers `r = max(n(u), min_value)`;
* later steps allow `A = min(r + add, r * mul)` (a `None` term drops out),
  scale `u` down so that its size is at most `A`, then remember
  `r <- max(size(u_out), r / max_decay, min_value)`.

A non-finite size is never remembered (`r` and the first-step flag stay as they were).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Optional

import torch
from pydantic import Field, NonNegativeFloat, PositiveFloat

from ..core.kernels import const
from ..core.reduce import Ord, acc_dtype
from ..core.step import Step, TransformState
from ..core.roles import Scale, ScaleFact
from ..core.scope import Scoped
from ..core.state import Buffer
from ..core.transform import Transform
from ._util import below_one

__all__ = ["ClipNormGrowth", "ClipValueGrowth"]


class _Growth(Transform, abstract=True):
    """The shared rule; subclasses declare the fields (add, mul, min_value, max_decay)."""

    def _allowed(self, r: torch.Tensor) -> torch.Tensor:
        allowed = torch.full_like(r, math.inf)
        if self.add is not None:
            allowed = torch.minimum(allowed, r + self.add)
        if self.mul is not None:
            allowed = torch.minimum(allowed, r * self.mul)
        return allowed

    def _remember(self, out_size: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        new = out_size.clamp(min=self.min_value)
        if self.max_decay is not None:
            new = torch.maximum(new, r / self.max_decay)
        return new


class ClipNormGrowth(Scoped, ScaleFact, _Growth):
    r"""Limit the growth of the update's norm from one step to the next.

    $$
    \begin{aligned}
    A &= \min(r + \text{add},\; r \cdot \text{mul}) \\
    u &\leftarrow u \cdot \min\big(1, A / n(u)\big) \\
    r &\leftarrow \max\big(n(u_\text{out}),\; r / \text{max\_decay},\; \text{min\_value}\big)
    \end{aligned}
    $$

    The first step passes through and sets `r = max(n(u), min_value)`. Terms
    whose field is None drop out (`add=None, mul=None` is the identity).
    Defaults: `add=None`, `mul=1.5`, `min_value=1e-4`, `max_decay=2`,
    `ord=2`, `scope="global"`. Reproduces torchzero's `ClipNormGrowth`
    (which defaults to per-parameter norms, `scope="tensor"` here, and puts no
    `min_value` floor on the first step's remembered norm).

    Telemetry: `norm`, `scale`, `clipped`, `allowed`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> opt = mo.Modular([p], mo.ClipNormGrowth(mul=2.0), mo.LR(1.0))
    >>> p.grad = torch.tensor([3.0, 4.0]); opt.step()
    >>> p.grad = torch.tensor([30.0, 40.0]); opt.step(); p.data   # at most 2 * 5
    tensor([ -9., -12.])

    ```
    """

    positional: ClassVar[str | None] = "mul"
    device_skip = True  # keeps its state on a step the device skips

    add: Optional[PositiveFloat] = None
    mul: Optional[PositiveFloat] = 1.5
    min_value: NonNegativeFloat = 1e-4
    max_decay: Optional[float] = Field(2.0, ge=1.0)
    ord: Ord = 2.0
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"prev_norm": Buffer("segment", low=0), "started": Buffer("segment", low=0)}

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Scale each segment down so that its norm grows at most by `add` / a factor `mul` since the last step."""
        seg = st.segments(self)
        n = seg.reduce(updates, self.ord).abs()
        r = st.seg_get(seg, "prev_norm", 0.0, dtype=n.dtype).to(n.dtype)
        started = st.seg_get(seg, "started", 0.0, dtype=n.dtype)
        on = started > 0
        allowed = self._allowed(r)
        scale = torch.where(on, below_one(allowed / n), const(1.0, n))
        new_r = torch.where(on, self._remember(n * scale, r), n.clamp(min=self.min_value))
        ok = n < math.inf  # (a norm: >= 0, and NaN compares false)
        st.scale_(seg, updates, scale)
        st.seg_set(seg, "prev_norm", torch.where(ok, new_r, r))
        st.seg_set(seg, "started", torch.where(ok, const(1.0, started), started))
        st.record_clip(n, scale, allowed=allowed)
        return updates

    def scale_fact(self) -> Scale | None:
        """Positive with `min_value > 0` (the factor stays > 0), else nothing stated."""
        # the remembered norm never falls below min_value > 0, so the allowed norm and the scale stay > 0
        return Scale(self.scope, self.dim, self.inverse_dims, positive=True) if self.min_value > 0 else None


class ClipValueGrowth(_Growth):
    r"""Limit the growth of every element's magnitude from one step to the next.

    The `ClipNormGrowth` rule elementwise, on `|u|`: with `r` the
    remembered magnitude of each element, `A = min(r + add, r * mul)`,
    `u <- clamp(u, -A, A)`, then `r <- max(|u_out|, r / max_decay, min_value)`.
    The first step of a parameter that goes ahead passes through and sets
    `r = max(|u|, min_value)`, so an element that was 0 is allowed
    `min_value * mul`; a non-finite element keeps its `r`, and a skipped
    step changes nothing (decided on the device: a per-parameter `started`
    flag, no host sync). Defaults: `add=None`, `mul=1.5`, `min_value=1e-4`,
    `max_decay=2`. Reproduces torchzero's `ClipValueGrowth` (whose first step
    remembers the update with no `min_value` floor).

    Telemetry: `clipped` (any element clipped).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> opt = mo.Modular([p], mo.ClipValueGrowth(mul=2.0), mo.LR(1.0))
    >>> p.grad = torch.tensor([1.0, -1.0]); opt.step()
    >>> p.grad = torch.tensor([5.0, -1.5]); opt.step(); p.data
    tensor([-3.0000,  2.5000])

    ```
    """

    positional: ClassVar[str | None] = "mul"
    device_skip = True  # keeps its state on a step the device skips

    add: Optional[PositiveFloat] = None
    mul: Optional[PositiveFloat] = 1.5
    min_value: NonNegativeFloat = 1e-4
    max_decay: Optional[float] = Field(2.0, ge=1.0)
    state_buffers: ClassVar[dict[str, str | Buffer]] = {
        "prev": Buffer("param", dtype="acc", low=0),
        "started": Buffer("segment", low=0),  # per parameter, 0-d: 1 once a step went ahead
    }

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Clamp each element so that its magnitude grows at most by `add` / a factor `mul` since the last step."""
        # a checkpoint from before "started" holds "prev" alone: that parameter has had its first step
        had = st.has_buffers("prev")
        rs = st.buffers("prev", lambda i, p: torch.full_like(updates[i], self.min_value, dtype=acc_dtype(updates[i].dtype)))
        ss = st.buffers("started", lambda i, p: torch.full((), float(had[i]), dtype=rs[i].dtype, device=p.device))
        go = None if ctx.skip is None else (ctx.proceed if ctx.proceed is not None else ~ctx.skip)  # the step goes ahead
        clipped = []
        for u, r, s in zip(updates, rs, ss):
            # the first step passes through (nothing is allowed less than inf) and remembers
            # max(|u|, min_value): with r = min_value there, that is what `_remember` gives
            allowed = self._allowed(r).masked_fill_(s == 0, math.inf)  # (_allowed makes a new tensor)
            c = u.to(r.dtype)
            ok = torch.isfinite(c)  # a non-finite element keeps its r, and a skipped step all of them
            ok = ok if go is None else ok & go
            clipped.append((c.abs() > allowed).any())
            c = c.clamp(min=-allowed, max=allowed)
            u.copy_(c)
            r.copy_(torch.where(ok, self._remember(c.abs(), r), r))
            if go is None:
                s.fill_(1.0)
            else:
                s.masked_fill_(go, 1.0)
        if clipped:
            st.record("clipped", torch.stack(clipped).any())
        return updates
