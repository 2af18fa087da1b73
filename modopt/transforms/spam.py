"""SPAM and Stable-SPAM: spike-aware clipping with periodic resets of the optimizer's moments.

Both were published fused into Adam (`pytorch_optimizer.SPAM`, `pytorch_optimizer.StableSPAM`);
here each is a gradient transform in front of `mo.Adam` / `mo.AdamW`, reaching the optimizer's
moments only through the declared contract of `modopt.core.moments` (the optimizer offers its
second moment, a reset and a learning-rate factor; `Modular` links the two when it is built).

Every schedule (reset, clip delay, warm-up, bias corrections) reads the transform's own device
step counter, which a step the device skips does not advance, so no step synchronises with the
host and a skipped step leaves every state bit for bit as it was.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import torch
from pydantic import Field

from ..core.kernels import const
from ..core.hostdata import on_device
from ..core.moments import Moments
from ..core.distributed import any_sharded
from ..core.reduce import combine_pnorms, common_acc_dtype
from ..core.step import Step, TransformState
from ..core.roles import NeedsMoments
from ..core.reduce import Segments
from ..core.scope import Scoped, ScopeName
from ..core.state import Buffer, proceed_flag
from ..core.transform import Transform
from ._util import FiniteNonNegativeFloat

__all__ = ["SPAM", "StableSPAM"]

#: the value the warm-up's cosine starts from (the reference's `CosineDecay(0.99, ...)`)
_WARMUP_TOP = 0.99


def warmup_factors(warmup_steps: int) -> list[float]:
    """SPAM's learning-rate factor on the `c`-th step after a reset (`c = 0 .. warmup_steps - 1`), then 1.

    `1 - r(c + 1)` with `r` torch's `CosineAnnealingLR` from 0.99 to 0 over `warmup_steps + 1`
    epochs, in its own recursive arithmetic (`r(k) = r(k-1) (1 + cos(pi k / T)) / (1 + cos(pi (k-1) / T))`),
    so the factors are those of `pytorch_optimizer.SPAM` to the last bit. In closed form
    `1 - 0.99 (1 + cos(pi (c + 1) / (warmup_steps + 1))) / 2`.
    """
    period = warmup_steps + 1
    r, out = _WARMUP_TOP, []
    for k in range(1, warmup_steps + 1):
        r = (1 + math.cos(math.pi * k / period)) / (1 + math.cos(math.pi * (k - 1) / period)) * (r - 0.0) + 0.0
        out.append(1.0 - r)
    return out + [1.0]


def _counter(st: TransformState, like: torch.Tensor) -> torch.Tensor:
    count = st.store.get("step")
    return torch.zeros((), dtype=torch.int64, device=like.device) if count is None else count


def _advance(ctx: Step, st: TransformState, count: torch.Tensor) -> None:
    go = proceed_flag(ctx)  # None: the host decided, the step goes ahead
    st.store["step"] = count + (1 if go is None else go)


def _max_abs(seg: Segments, updates: list[torch.Tensor]) -> torch.Tensor:
    """`seg.reduce(updates, inf)`, the largest |x| of each segment, the same bits in fewer passes on a CPU.

    torch's inf-norm kernel on a CPU (`_foreach_norm(ts, inf)`, `vector_norm`) is about 20x slower than
    a min/max pass; max |x| is max(|min x|, |max x|) exactly, and both propagate NaN. Elsewhere (a GPU,
    a compiled step, sharded or empty tensors, slices) the scope's own reduction runs."""
    if (seg.kind == "slices" or torch.compiler.is_compiling() or any_sharded(updates)
            or any(u.device.type != "cpu" or not u.is_floating_point() or u.numel() == 0 for u in updates)):
        return seg.reduce(updates, math.inf)
    acc = common_acc_dtype(updates)
    lows, highs = zip(*(torch.aminmax(u) for u in updates))
    parts = torch.maximum(torch.stack([v.to(acc) for v in lows]).abs(), torch.stack([v.to(acc) for v in highs]).abs())
    if seg.kind == "tensor":
        return parts
    if seg.kind == "global":
        return combine_pnorms(parts, math.inf).reshape(1)
    return torch.stack([combine_pnorms(parts[a:b], math.inf) for a, b in seg.ranges])


def _in_place(u: torch.Tensor, *by: torch.Tensor) -> bool:
    """Whether `u op b` keeps `u`'s dtype for every `b` of `by` (so `u.op_(b)` rounds as `u op b` does): not so
    where `b` has dimensions and a wider dtype, or where `u` is 0-d and `b` is a wider 0-d tensor."""
    if torch.compiler.is_compiling():  # a compiled step keeps the plain expressions: inductor fuses them
        return False
    return all(_keeps(u.dtype, u.dim() == 0, b.dtype, b.dim() == 0) for b in by)


@functools.cache
def _keeps(dtype: torch.dtype, scalar: bool, other: torch.dtype, other_scalar: bool) -> bool:
    """torch's type promotion of `u op b` by what it reads (dtypes, whether 0-d), asked once per combination."""
    def like(d: torch.dtype, s: bool) -> torch.Tensor:
        return torch.empty(() if s else (0,), dtype=d)

    return torch.result_type(like(dtype, scalar), like(other, other_scalar)) == dtype


def _reset_now(ctx: Step, t: torch.Tensor, every: int) -> torch.Tensor:
    """Whether step `t` resets the moments (`t % every == 0`), and false on a step the device skips."""
    due = t % every == 0
    go = proceed_flag(ctx)
    return due if go is None else due & go


class SPAM(NeedsMoments):
    r"""SPAM (Huang et al. 2025, arXiv 2501.06842): clip gradient spikes against Adam's second moment,
    reset the moments every `reset_every` steps and warm the learning rate up after each reset.

    With $t$ the step number (from 1), $v$ the second moment of the optimizer transform after
    it (as it was after the previous step) and $\Delta T$ = `reset_every`:

    * reset: on steps $t \equiv 0 \pmod{\Delta T}$ the optimizer's moments become 0 (its step
      count, and so its bias correction, goes on);
    * clip, once $t \ge$ `clip_delay` and $(t \bmod \Delta T) \ge$ `clip_delay`: each element
      with $g^2 > \theta v$ becomes $\operatorname{sign}(g)\sqrt{\theta v}$;
    * warm-up: from the first reset on, the optimizer's learning rate is multiplied by
      $1 - 0.99\,\tfrac{1 + \cos(\pi (c+1)/(N+1))}{2}$ on the $c$-th step after a reset
      ($c = t \bmod \Delta T < N$ = `warmup_steps`), by 1 otherwise.

    Defaults are `pytorch_optimizer.SPAM`'s: `theta=5000`, `reset_every=500`,
    `warmup_steps=50`, `clip_delay=20` (its `threshold`, `update_proj_gap`, `warmup_epoch`,
    `grad_accu_steps`). `theta=0` turns clipping off, `reset_every=None` the resets and
    warm-up. It needs `mo.Adam` or `mo.AdamW` after it (`mo.AdamW(eps=1e-6, weight_decay=0.0)`
    has the reference's hyperparameters; docs/migration.md lists what differs).

    Telemetry: `clipped` (elements clipped, per tensor), `clipping` (clipping is on this
    step), `reset`, `lr_scale` (the warm-up factor).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> opt = mo.Modular([p], mo.SPAM(theta=4.0, clip_delay=2), mo.Adam(lr=0.1))
    >>> p.grad = torch.tensor([1.0, 1.0]); opt.step()   # step 1 < clip_delay: v becomes 0.001
    >>> p.grad = torch.tensor([1.0, 0.01]); opt.step()  # 1 > 4 * 0.001: cut to sqrt(0.004)
    >>> opt.stats["0:SPAM.clipped"]
    tensor([1])

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip: ClassVar[bool] = True  # keeps its state on a step the device skips (the reset waits too)

    theta: FiniteNonNegativeFloat = 5000.0
    reset_every: int | None = Field(500, ge=1, lt=2**62)
    warmup_steps: int = Field(50, ge=0, lt=2**20)
    clip_delay: int = Field(20, ge=0, lt=2**62)
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"step": Buffer("counter")}  # steps taken (a skipped one is not)

    def needs(self) -> tuple[str, ...]:
        """What it needs from the optimizer transform after it (`modopt.core.moments`), by its fields."""
        out = ["second_moment"] if self.theta > 0 else []
        if self.reset_every is not None:
            out += ["reset", "lr_scale"] if self.warmup_steps > 0 else ["reset"]
        return tuple(out)

    def _factor(self, st: TransformState, t: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """The warm-up's learning-rate factor on step `t` (0-d float64, on the device)."""
        key = ("warmup", t.device)
        found = st.runtime.get(key)
        if found is None:
            table = on_device(warmup_factors(self.warmup_steps), torch.float64, t.device)
            found = st.runtime[key] = (table, torch.arange(len(table), device=t.device))
        table, index = found
        after = t >= self.reset_every  # before the first reset: no warm-up
        at = torch.where(after, phase.clamp(max=self.warmup_steps), self.warmup_steps)
        # the entry at `at`, as a sum with one term (exact): an index from the device would need a host
        # read eagerly, and a data-dependent shape when compiled
        return torch.where(index == at, table, 0.0).sum()

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Reset the optimizer's moments when due and ask for the warm-up factor; clip the spikes."""
        if not updates:
            return updates
        moments = Moments(ctx, st)
        count = _counter(st, updates[0])
        t = count + 1
        phase = t if self.reset_every is None else t % self.reset_every
        if self.reset_every is not None:
            when = _reset_now(ctx, t, self.reset_every)
            moments.reset(when)  # before the clip reads v, as the reference
            st.record("reset", when)
            if self.warmup_steps > 0:
                factor = self._factor(st, t, phase)
                moments.scale_lr(factor)
                st.record("lr_scale", factor)
        if self.theta > 0:
            clipping = (t >= self.clip_delay) & (phase >= self.clip_delay)
            counts = []
            # theta v, and inf v while clipping waits: no g^2 exceeds inf or NaN (0 inf), so nothing is hit there (no
            # full-size `& clipping`). theta is a float64 0-d tensor: `v * theta` has the bits of `v * self.theta`
            # where it keeps v's dtype (`_in_place`); elsewhere (a 0-d v below float64), the plain expressions
            vs = moments.get("second_moment")
            key = ("theta", t.device)
            theta = st.runtime.get(key)
            if theta is None:
                theta = st.runtime[key] = on_device(self.theta, torch.float64, t.device)
            gated = torch.where(clipping, theta, const(math.inf, theta))
            flat = [i for i, (u, v) in enumerate(zip(updates, vs)) if u.dtype == v.dtype and _in_place(v, gated)]
            limits = dict(zip(flat, torch._foreach_mul([vs[i] for i in flat], gated))) if flat else {}
            for i, (u, v) in enumerate(zip(updates, vs)):
                lim = limits.get(i)
                if lim is None:  # the plain expressions
                    lim = v * self.theta
                    hit = (u.square() > lim) & clipping
                    u.copy_(torch.where(hit, u.sign() * lim.sqrt(), u))
                else:
                    work = u.square()
                    hit = work > lim
                    # sign(g) sqrt(theta v) where hit, in the two scratch tensors (read only where hit)
                    torch.where(hit, lim.sqrt_().mul_(torch.sign(u, out=work)), u, out=u)
                counts.append(hit.count_nonzero())
            st.record("clipped", torch.stack(counts))
            st.record("clipping", clipping)
        _advance(ctx, st, count)
        return updates


class StableSPAM(Scoped, NeedsMoments):
    r"""Stable-SPAM (Huang et al. 2025, arXiv 2502.17055): AdaClip, AdaGN and a periodic reset of the
    optimizer's moments.

    Per segment (a tensor, by default), with $t$ the step number (from 1) and $g$ the update:

    * AdaClip: $M \leftarrow \gamma_3 M + (1-\gamma_3)\max|g|$, $\hat M = M / (1-\gamma_3^t)$;
      each element with $|g_i| > \hat M$ becomes $g_i \hat M / \max|g|$;
    * AdaGN: with $n = \|g\|_2$ of the clipped update, $m \leftarrow \gamma_1 m + (1-\gamma_1) n$,
      $s \leftarrow \gamma_2 s + (1-\gamma_2) n^2$ and
      $g \leftarrow \frac{g}{n}\,\frac{m / (1-\gamma_1^t)}{\sqrt{s / (1-\gamma_2^t)} + \varepsilon}$;
    * reset: on steps $t \equiv 0 \pmod{\Delta T}$ the optimizer's moments become 0 and its
      step count restarts (its next step is its first: the bias corrections start again).

    $M$, $m$, $s$ start at 0. A segment whose norm is 0 is left as it is and its $m$, $s$ do
    not move; a non-finite $\max|g|$ or $n^2$ is not taken into $M$ or $m$, $s$ (an infinite
    norm of finite values then scales the segment to 0); with `eps=0` and no norm taken in yet
    ($0/0$) AdaGN leaves the segment as it is.

    Defaults are `pytorch_optimizer.StableSPAM`'s: `gamma1=0.7`, `gamma2=0.9`,
    `gamma3=0.999` (its `theta`), `eps=1e-8`, `reset_every=1000` ($\Delta T$, its
    `update_proj_gap`), `scope="tensor"`. `reset_every=None` keeps AdaClip and AdaGN alone,
    which go in front of any optimizer; with resets it needs `mo.Adam` or `mo.AdamW` after it.
    `mo.Modular(params, mo.StableSPAM(), mo.AdamW(weight_decay=0.0, fused=False))` steps
    exactly as `pytorch_optimizer.StableSPAM(params)` (float32, bit for bit).

    Telemetry: `clipped` (elements AdaClip cut, per tensor), `norm` (the clipped norm $n$),
    `scale` (AdaGN's factor), `reset`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(3))
    >>> opt = mo.Modular([p], mo.StableSPAM(reset_every=None), mo.LR(1.0))
    >>> p.grad = torch.tensor([3.0, -4.0, 0.0]); opt.step()   # first step: AdaGN gives norm 1
    >>> p.data
    tensor([-0.6000,  0.8000,  0.0000])

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip: ClassVar[bool] = True  # keeps its state on a step the device skips (the reset waits too)

    gamma1: float = Field(0.7, ge=0.0, lt=1.0)
    gamma2: float = Field(0.9, ge=0.0, lt=1.0)
    gamma3: float = Field(0.999, ge=0.0, lt=1.0)
    eps: FiniteNonNegativeFloat = 1e-8
    reset_every: int | None = Field(1000, ge=1, lt=2**62)
    scope: ScopeName = "tensor"
    state_buffers: ClassVar[dict[str, str | Buffer]] = {
        "m_max": Buffer("segment", low=0),  # EMA of max|g|
        "m_norm": Buffer("segment", low=0),  # EMA of the clipped norm
        "v_norm": Buffer("segment", low=0),  # EMA of its square
        "step": Buffer("counter"),  # steps taken (a skipped one is not)
    }

    def needs(self) -> tuple[str, ...]:
        """What it needs from the optimizer transform after it (`modopt.core.moments`), by its fields."""
        return () if self.reset_every is None else ("reset", "restart_count")

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Reset the optimizer's moments when due; AdaClip, then AdaGN, on each segment."""
        if not updates:
            return updates
        seg = st.segments(self)
        acc = common_acc_dtype(updates)
        count = _counter(st, updates[0])
        t = count + 1
        if self.reset_every is not None:
            when = _reset_now(ctx, t, self.reset_every)
            Moments(ctx, st).reset(when, restart_count=True)
            st.record("reset", when)
        tf = t.to(torch.float64)
        # AdaClip (the reference's rounding: debiased by a division, the bias correction in float64 first)
        top = _max_abs(seg, updates)
        m_max = st.seg_get(seg, "m_max", 0.0, dtype=acc).to(acc)
        m_max = torch.where(top < math.inf, torch.lerp(m_max, top, 1 - self.gamma3), m_max)
        st.seg_set(seg, "m_max", m_max)
        hat = m_max / (1 - torch.pow(self.gamma3, tf)).to(acc)
        ctx.memo.close()  # the updates change here: no norm of the gradients may be reused below
        counts = []
        # on a CPU, where reading is free (the step's `host_reads`), a tensor whose segment's
        # max |u| is at most hat has nothing to cut: no pass over it (the same bits; NaN compares false)
        quiet = ((top <= hat).tolist() if seg.kind == "tensor" and ctx.host_reads else [False] * len(updates))
        for u, on, h, x, q in zip(updates, seg.active, seg.expand(hat), seg.expand(top), quiet):
            if not on or q:
                counts.append(torch.zeros((), dtype=torch.int64, device=u.device))
                continue
            work = u.abs()
            hit = work > h
            # where |u| > hat, (u / max|u|) * hat, the reference's rounding, into one scratch tensor and then u
            # (where that would round in a wider dtype than u's, the plain expressions)
            if _in_place(u, x, h):
                torch.where(hit, torch.div(u, x, out=work).mul_(h), u, out=u)
            else:
                u.copy_(torch.where(hit, u / x * h, u))
            counts.append(hit.count_nonzero())
        st.record("clipped", torch.stack(counts))
        # AdaGN
        n = seg.reduce(updates, 2.0)
        sq = n.square()
        moves = (n > 0) & (sq < math.inf)
        m_norm = st.seg_get(seg, "m_norm", 0.0, dtype=acc).to(acc)
        v_norm = st.seg_get(seg, "v_norm", 0.0, dtype=acc).to(acc)
        m_norm = torch.where(moves, torch.lerp(m_norm, n, 1 - self.gamma1), m_norm)
        v_norm = torch.where(moves, torch.lerp(v_norm, sq, 1 - self.gamma2), v_norm)
        st.seg_set(seg, "m_norm", m_norm)
        st.seg_set(seg, "v_norm", v_norm)
        m_hat = m_norm / (1 - torch.pow(self.gamma1, tf)).to(acc)
        v_hat = v_norm / (1 - torch.pow(self.gamma2, tf)).to(acc)
        c = m_hat / (v_hat.sqrt() + self.eps)
        rescale = (n > 0) & ~c.isnan()  # (c is 0/0 only with eps = 0 and no norm taken in yet)
        # (g / n) * c, the reference's rounding, in place (where that would round in a wider dtype than u's, the
        # plain expression); a zero or NaN norm leaves the segment as it is: there it is divided and multiplied by
        # 1, which is exact for every value (no full-size select)
        by, times = seg.expand(torch.where(rescale, n, const(1.0, n))), seg.expand(torch.where(rescale, c, const(1.0, c)))
        fast = [on and _in_place(u, k, cc) for u, on, k, cc in zip(updates, seg.active, by, times)]
        idx = [i for i, f in enumerate(fast) if f]
        if idx:
            ins = [updates[i] for i in idx]
            torch._foreach_div_(ins, [by[i] for i in idx])
            torch._foreach_mul_(ins, [times[i] for i in idx])
        for u, on, f, k, cc in zip(updates, seg.active, fast, by, times):
            if on and not f:
                u.copy_(u / k * cc)
        st.record("norm", n)
        st.record("scale", torch.where(rescale, c / n, const(1.0, n)))
        _advance(ctx, st, count)
        return updates
