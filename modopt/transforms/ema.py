"""Clipping and normalizing by an exponential moving average of past updates (torchzero's EMA family).

The EMA `m` is kept per parameter, as full vectors (`m <- beta*m + (1-beta)*u`);
the norm of `m` over the transform's scope is the yardstick the update is
measured against. Non-finite gradients never reach `m` under the optimizer's
non-finite policy (the default `"skip"` leaves every state as it was;
`"zero"` zeroes them first). A segment whose norm is not finite (finite
values whose norm overflowed) leaves `m` as it was. With
`nonfinite="ignore"` nothing is checked, and an inf or NaN element turns
its `m` into NaN, as the user asked.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal, Optional

import torch
from pydantic import Field, PositiveFloat

from ..core import compiled, distributed
from ..core.kernels import const
from ..core.keys import value_key
from ..core.reduce import Ord
from ..core.step import Step, TransformState
from ..core.roles import Scale, ScaleFact
from ..core.scope import Scoped, ScopeName
from ..core.state import STARTED, Buffer, new_flag, proceed_flag, same_flags, settle_flags, started_flags
from ..core.transform import Transform
from ._util import FiniteNonNegativeFloat, below_one

__all__ = ["ClipNormByEMA", "NormalizeByEMA", "ClipValueByEMA"]

EmaInit = Literal["zeros", "update"]


def _lerp_op(updates: list[torch.Tensor]) -> bool:
    """Whether a trace (the caller checked `torch.compiler.is_compiling()`, so the eager step makes no call
    here) is `compile_step`'s with the EMA op declared (`compiled.LERP`, aten's lerp as eager runs it) for
    these plain tensors (a custom op has no DTensor sharding rule: sharded EMAs take the traced lerp)."""
    return compiled.keeps_fused() and compiled.LERP is not None and not distributed.any_sharded(updates)


class _NormEMA(Scoped, ScaleFact, abstract=True):
    """The fields and step shared by `ClipNormByEMA` and `NormalizeByEMA`: an EMA of the updates whose norm
    each segment is scaled against."""

    beta: float = Field(0.99, ge=0.0, lt=1.0)
    ord: Ord = 2.0
    eps: FiniteNonNegativeFloat = 1e-6  # (inf would make every floor, and the update, inf)
    max_ema_growth: Optional[PositiveFloat] = 1.5
    ema_init: EmaInit = "zeros"
    # "started": ema_init="update" only, see `_ema_from_update`
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"ema": "param", "prev_ema_norm": Buffer("segment", low=0), "started": STARTED}
    normalize: ClassVar[bool] = False
    device_skip = True  # keeps its state on a step the device skips (ema_init="update": the started flags)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Update the EMA of the updates, then scale each segment against the EMA's norm."""
        seg = st.segments(self)
        signed = self.ord == "sum"  # every other ord is >= 0 already
        nu = seg.reduce(updates, self.ord)
        nu = nu.abs() if signed else nu
        # compiled by `compile_step`: aten's lerp in place inside one op (`compiled.ema_lerp_`), which cleans
        # what it reads itself (a custom op has no DTensor sharding rule: sharded EMAs take the traced lerp);
        # ema_init="update" cleans first all the same: its first EMA is the update itself
        in_op = torch.compiler.is_compiling() and _lerp_op(updates)
        # a step the device skips: zeros, weighed by 0 below (one pass, only then)
        reads = updates if in_op and self.ema_init == "zeros" else ctx.cleaned(updates)
        # a segment whose norm overflowed (or is non-finite, possible only with nonfinite="ignore")
        # leaves the EMA as it is: its lerp weight is 0, chosen on device (no host sync);
        # `nu < inf` is "finite" for a norm (NaN compares false)
        ok = ctx.finite(nu)  # None: the host knows every segment's norm is finite (the step's checked total)
        if ok is None and self.ema_init != "zeros":
            ok = nu < math.inf
        ok_t = None if ok is None else seg.expand(ok)
        flags = None
        if self.ema_init == "zeros":
            m = st.buffers("ema", lambda i, p: torch.zeros_like(updates[i]))
        else:
            m, flags, fresh = _ema_from_update(ctx, st, reads, lambda i: torch.where(ok_t[i], reads[i], 0))
        # (the weight is a tensor in m's dtype, as lerp requires: exact for float32/64, rounded for half;
        # built once per segment vector and dtype, so many small tensors cost no per-tensor ops)
        w = 1.0 - self.beta
        one_of_each = {mi.dtype: mi for mi in m}
        if ok is None:  # every segment goes ahead: the weight itself (`ok * w` is `w` there)
            by_dtype = {dt: _weight(None, w, like) for dt, like in one_of_each.items()}
            weights = [by_dtype[mi.dtype] for mi in m]
        else:
            per_dtype = {dt: seg.expand(_weight(ok, w, like)) for dt, like in one_of_each.items()}
            weights = [per_dtype[mi.dtype][i] for i, mi in enumerate(m)]
        if flags is not None and any(f is not None for f in flags):
            # an EMA that has not started (zeros) takes the update where the segment is ok: weight 1,
            # `lerp(0, u, 1) = u` exactly, as the host path's `m = u` then `lerp(u, u, w) = u`
            self._first_weights(st, seg, ok, w, m, flags, fresh, weights)
        if in_op:
            compiled.LERP(m, reads, weights, ctx.skip, ctx.cpu_kernels)
        elif torch.compiler.is_compiling():  # inductor lowers lerp (its foreach form is an opaque call)
            for mi, ui, wi in zip(m, reads, weights):
                mi.lerp_(ui, wi)
        else:
            torch._foreach_lerp_(m, reads, weights)
        if flags is not None:
            settle_flags(st, "ema", ctx.param_states(), flags, proceed_flag(ctx), fresh)
        nm = seg.reduce(m, self.ord)
        nm = nm.abs() if signed else nm
        if self.max_ema_growth is not None:
            prev = st.seg_get(seg, "prev_ema_norm", 0.0, dtype=nm.dtype)
            prev = prev if prev.dtype == nm.dtype else prev.to(nm.dtype)
            # the limit binds where a previous norm exists and the segment is ok; elsewhere it is inf
            # (cached 0-d operands: on a CPU a Python number is made into a tensor on every call)
            binds = prev > const(0.0, prev) if ok is None else (prev > const(0.0, prev)) & ok
            limit = torch.where(binds, prev * const(self.max_ema_growth, prev), const(math.inf, prev))
            factor = below_one(limit / nm)
            seg.mul_(m, factor)
            nm = nm * factor
            st.seg_set(seg, "prev_ema_norm", nm if ok is None else torch.where(ok, nm, prev), kept=True)
        floor = torch.clamp_min(nm, self.eps)
        if self.normalize:
            scale = torch.where(nu > 0, floor / nu, const(1.0, nu))
        else:
            scale = below_one(floor / nu)
        st.scale_(seg, updates, scale)
        st.record_clip(nu, scale, ema_norm=nm)
        return updates

    @staticmethod
    def _first_weights(st, seg, ok, w, m, flags, fresh, weights) -> None:
        """`weights[i] = where(started, w, ok)` for the flagged parameters: one op per dtype when the
        flags are known to be equal (the common case: created together), else one per parameter."""
        fl = [i for i, f in enumerate(flags) if f is not None]
        dts = {m[i].dtype for i in fl}
        if same_flags(st, "ema", [flags[i] for i in fl], fresh):
            first = {dt: seg.expand(torch.where(flags[fl[0]], ok.to(dt) * w, ok.to(dt))) for dt in dts}
            for i in fl:
                weights[i] = first[m[i].dtype][i]
            return
        start = {dt: seg.expand(ok.to(dt)) for dt in dts}
        for i in fl:
            weights[i] = torch.where(flags[i], weights[i], start[m[i].dtype][i])

    def scale_fact(self) -> Scale | None:
        """Positive with `eps > 0` (the factor stays > 0), else nothing stated."""
        # eps > 0 keeps the EMA's norm, and so the factor, away from 0
        return Scale(self.scope, self.dim, self.inverse_dims, positive=True) if self.eps > 0 else None


def _weight(ok: torch.Tensor | None, w: float, like: torch.Tensor) -> torch.Tensor:
    """`ok.to(dtype) * w` in `like`'s dtype: one op in float32/64 (`w` a cached tensor; 1 * w and 0 * w
    are exact); two otherwise and when traced. `ok` None (known true, on the host): no op in float32/64."""
    if like.dtype in (torch.float32, torch.float64) and not torch.compiler.is_compiling():
        return const(w, like) if ok is None else ok * const(w, like)
    return (const(1.0, like) if ok is None else ok.to(like.dtype)) * w


def _ema_from_update(ctx, st, updates, first) -> tuple[list[torch.Tensor], list, bool]:
    """The EMAs `m` of an `ema_init="update"` transform, their `started` flags and whether every flag
    was created now.

    The host path (the step goes ahead) creates a missing EMA as `first(i)`, the update (as before).
    The device path cannot know whether this step goes ahead: it creates zeros and a False flag (a
    per-parameter 0-d bool, `STARTED`), and the step's weights start the EMA from the update on the
    first step that goes ahead (`settle_flags` then sets the flag). An EMA without a flag has started.
    """
    k = value_key(st.key, "ema")
    states = ctx.param_states()
    flags = started_flags(st, states)
    fresh = True
    m = []
    for i, s in enumerate(states):
        mi = s.get(k)
        if mi is None:
            if ctx.skip is None:
                mi = first(i).to(updates[i].dtype)
            else:
                mi = torch.zeros_like(updates[i])
                if flags[i] is None:
                    flags[i] = s[value_key(st.key, "started")] = new_flag(updates[i])
                else:
                    fresh = False
            s[k] = mi
        elif flags[i] is not None:
            fresh = False
        m.append(mi)
    return m, flags, fresh


class ClipNormByEMA(_NormEMA):
    r"""Clip the update's norm to the norm of an EMA of past updates.

    $$
    \begin{aligned}
    m &\leftarrow \beta m + (1-\beta) u \\
    u &\leftarrow u \,/\, \max\big(1,\; n(u) / \max(n(m), \varepsilon)\big)
    \end{aligned}
    $$

    `m` is kept per parameter (vectors, not norms). `ema_init="update"`
    starts `m` at the first update instead of zeros. With `max_ema_growth=g`
    the EMA's norm may grow at most by the factor `g` per step: when
    `n(m) > g * n_prev` the EMA is rescaled to the norm `g * n_prev` (a
    previous norm of 0, e.g. on the first step, sets no limit).

    Defaults: `beta=0.99`, `ord=2`, `eps=1e-6`, `scope="global"`,
    `max_ema_growth=1.5`, `ema_init="zeros"`. Reproduces torchzero's
    `ClipNormByEMA` (whose `tensorwise=True` default is `scope="tensor"` here).

    Telemetry: `norm`, `scale`, `clipped`, `ema_norm`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> opt = mo.Modular([p], mo.ClipNormByEMA(beta=0.5, ema_init="update"), mo.LR(1.0))
    >>> p.grad = torch.tensor([3.0, 4.0]); opt.step()            # m = u: no clip
    >>> p.grad = torch.tensor([30.0, 40.0]); opt.step(); p.data   # m grows 1.5x at most: norm 7.5
    tensor([ -7.5000, -10.0000])

    ```
    """

    positional: ClassVar[str | None] = "beta"


class NormalizeByEMA(_NormEMA):
    r"""Set the update's norm to the norm of an EMA of past updates.

    $$
    \begin{aligned}
    m &\leftarrow \beta m + (1-\beta) u \\
    u &\leftarrow u \cdot \max(n(m), \varepsilon) / n(u) \qquad (n(u) > 0)
    \end{aligned}
    $$

    The EMA, `ema_init` and `max_ema_growth` behave as in `ClipNormByEMA`;
    a zero update stays zero. Defaults: `beta=0.99`, `ord=2`, `eps=1e-6`,
    `scope="tensor"` (the normalization family's default), `max_ema_growth=1.5`,
    `ema_init="zeros"`. Reproduces torchzero's `NormalizeByEMA`.

    Telemetry: `norm`, `scale`, `clipped` (scale < 1), `ema_norm`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> opt = mo.Modular([p], mo.NormalizeByEMA(beta=0.5, ema_init="update"), mo.LR(1.0))
    >>> p.grad = torch.tensor([3.0, 4.0]); opt.step()
    >>> p.grad = torch.tensor([0.3, 0.4]); opt.step(); p.data   # m = (1.65, 2.2): norm 2.75
    tensor([-4.6500, -6.2000])

    ```
    """

    positional: ClassVar[str | None] = "beta"

    scope: ScopeName = "tensor"
    normalize: ClassVar[bool] = True


#: dtypes whose 0-d weight tensor is the same weight as the float (lerp computes half types in float32)
_EXACT_WEIGHT = (torch.float32, torch.float64)


class ClipValueByEMA(Transform):
    r"""Clamp every element to the EMA of past magnitudes.

    $$
    \begin{aligned}
    m &\leftarrow \beta m + (1-\beta) |u| \\
    u &\leftarrow \operatorname{clamp}(u, -m, m)
    \end{aligned}
    $$

    `ema_init="update"` starts `m` at `|u|`. Defaults: `beta=0.99`, `ema_init="zeros"`. Reproduces
    torchzero's `ClipValueByEMA`.

    Telemetry: `clipped` (any element clipped).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> opt = mo.Modular([p], mo.ClipValueByEMA(beta=0.5, ema_init="update"), mo.LR(1.0))
    >>> p.grad = torch.tensor([1.0, -2.0]); opt.step()
    >>> p.grad = torch.tensor([5.0, -2.0]); opt.step(); p.data   # m = (3, 2)
    tensor([-4.,  4.])

    ```
    """

    positional: ClassVar[str | None] = "beta"

    beta: float = Field(0.99, ge=0.0, lt=1.0)
    ema_init: EmaInit = "zeros"
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"ema": Buffer("param", low=0), "started": STARTED}  # an EMA of |u|
    device_skip = True  # keeps its state on a step the device skips (ema_init="update": the started flags)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Update the EMA of each element's magnitude, then clamp the element to it."""
        if self.ema_init == "zeros":
            m = st.buffers("ema", lambda i, p: torch.zeros_like(updates[i]))
        else:
            m, flags, fresh = _ema_from_update(ctx, st, updates, lambda i: updates[i].detach().abs())
            if any(f is not None for f in flags):
                self._from_update(ctx, st, updates, m, flags, fresh)
                return self._clamp(st, updates, m)
        if torch.compiler.is_compiling() and _lerp_op(updates) and all(mi.dtype in _EXACT_WEIGHT for mi in m):
            # compiled by `compile_step`: aten's lerp in place inside one op, as eager rounds it (`ema_lerp_`);
            # a 0-d weight of m's dtype is the eager scalar's (exact in float32/64), 0 on a skipped step
            w = 1.0 - self.beta
            by = {mi.dtype: torch.full((), w, dtype=mi.dtype, device=mi.device) for mi in m}
            if ctx.skip is not None:
                by = {dt: torch.where(ctx.skip, 0.0, t) for dt, t in by.items()}
            compiled.LERP(m, torch._foreach_abs(updates), [by[mi.dtype] for mi in m], ctx.skip, ctx.cpu_kernels)
            return self._clamp(st, updates, m)
        if ctx.skip is None:
            torch._foreach_lerp_(m, torch._foreach_abs(updates), 1.0 - self.beta)
        else:  # the same lerp on copies (the same rounding in every dtype), then the old m on a skipped step
            new = [mi.clone() for mi in m]
            torch._foreach_lerp_(new, torch._foreach_abs(updates), 1.0 - self.beta)
            distributed.copy_(m, [ctx.keep(n, old) for old, n in zip(m, new)])
        return self._clamp(st, updates, m)

    def _from_update(self, ctx, st, updates, m, flags, fresh) -> None:
        """The EMA step where some EMAs have a `started` flag (see `_ema_from_update`): the same lerp on
        copies, then `|u|` where an EMA has not started (the host path's `m = |u|`, which the lerp keeps),
        and the old `m` on a skipped step. One pass over the flagged EMAs more than without flags."""
        absu = torch._foreach_abs(updates)
        new = [mi.clone() for mi in m]
        torch._foreach_lerp_(new, absu, 1.0 - self.beta)
        new = [n if f is None else torch.where(f, n, a) for n, a, f in zip(new, absu, flags)]
        distributed.copy_(m, [ctx.keep(n, old) for old, n in zip(m, new)])
        settle_flags(st, "ema", ctx.param_states(), flags, proceed_flag(ctx), fresh)

    @staticmethod
    def _clamp(st, updates, m):
        clipped = []
        for mi, ui in zip(m, updates):
            clipped.append((ui.abs() > mi).any())
            ui.clamp_(min=-mi, max=mi)
        if clipped:
            st.record("clipped", torch.stack(clipped).any())
        return updates
