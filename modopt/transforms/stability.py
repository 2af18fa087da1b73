"""Stability methods of 2023-2026: clipping and skipping rules that follow the run's own history.

`SkipStep` (OLMo 2, arXiv 2501.00656) skips the whole step when the loss or the
gradient norm is far above its recent mean; `SkipNorm` (Megatron-LM's
`grad_norm_skip_threshold`) when the gradient norm is above a fixed threshold; `Clippy` (Tang et al. 2023, arXiv
2302.09178), placed after the optimizer, shrinks each tensor's step so that no
element moves by more than a bound relative to its weight. (ADOPT's clip needs
the optimizer's own second moment: it is the optimizer transform `mo.ADOPT`.)

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
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from ..core import distributed
from ..core.distributed import any_sharded
from ..core.reduce import acc_dtype, combine_pnorms, common_acc_dtype, foreach_pnorm
from ..core.step import check_loss
from ..core.roles import SkipDecider
from ..core.transform import Transform
from ..core.step import Step, TransformState
from ..core.scope import Scoped, ScopeName
from ..core.state import Buffer, proceed_flag
from ..core.values import F32_MAX
from ._util import FiniteNonNegativeFloat, FinitePositiveFloat, below_one

__all__ = ["AdaGC", "SkipStep", "SkipNorm", "Clippy"]


def _global_norm(parts: torch.Tensor) -> torch.Tensor:
    """The 2-norm of a concatenation from the 2-norms of its parts (1-D), as `sqrt(sum(parts**2))`.

    That plain form is pytorch_optimizer's global norm, bit for bit; where it overflows although
    every part is finite, `combine_pnorms` (which cannot overflow) stands in, chosen on the device."""
    plain = parts.square().sum().sqrt()
    return torch.where(plain < math.inf, plain, combine_pnorms(parts, 2.0))


def _scaled_norms(seg, updates: list[torch.Tensor], n: torch.Tensor, scale: torch.Tensor,
                  acc: torch.dtype, host_reads: bool) -> torch.Tensor:
    """`seg.mul_(updates, scale)`, then each segment's 2-norm measured again (1-D, in `acc`).

    On a CPU, where reading a value is free (the step's `host_reads`), per tensor (the default
    scope): a tensor whose scale is exactly 1 is neither multiplied nor measured (`u * 1` is `u`
    bit for bit, so its norm is `n`'s, taken from the same values by the same kernel), and the
    others are multiplied and measured one after the other, the norm reading what the multiply
    has just written while it is still in cache (a per-tensor norm is the multi-tensor kernel's
    on a CPU: the same bits). Elsewhere (a GPU: no host read) both run over every tensor."""
    if seg.kind == "tensor" and host_reads and not any_sharded(updates):
        values = scale.tolist()
        if all(s == 1.0 for s in values):
            return n
        out = []
        for u, on, s, c, own in zip(updates, seg.active, values, scale.unbind(0), n.unbind(0)):
            if s == 1.0:
                out.append(own)
                continue
            if on:
                u.mul_(c)
            # (`foreach_pnorm`'s kernel called directly where it takes no accumulation dtype: the same call)
            out.append(torch._foreach_norm([u], 2.0)[0] if u.dtype == own.dtype else foreach_pnorm([u], 2.0)[0])
        return torch.stack(out).to(acc)
    seg.mul_(updates, scale)
    return seg.reduce(updates, 2.0)


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

    positional: ClassVar[str | None] = None
    device_skip = True  # keeps its state on a step the device skips

    beta: float = Field(0.98, ge=0.0, lt=1.0)
    lambda_abs: FinitePositiveFloat = 1.0
    lambda_rel: FinitePositiveFloat = 1.05
    warmup_steps: int = Field(100, ge=0, lt=2**62)  # (every count field takes values below 2**62)
    eps: FiniteNonNegativeFloat = 1e-8
    scope: ScopeName = "tensor"
    state_buffers: ClassVar[dict[str, str | Buffer]] = {
        # +inf: the segment has not had a step yet (its next step warms up)
        "gamma": Buffer("segment", low=0, finite=False),
        "step": Buffer("counter"),  # steps taken (a skipped one is not)
    }

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Scale each segment against its own adaptive threshold; the thresholds move on."""
        seg = st.segments(self)
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
        # the clipped norm is measured again, not taken as `scale * n`: the reference measures it, and the
        # two differ in the last bit (one more read of the updates, the price of the thresholds' exactness)
        clipped = _scaled_norms(seg, updates, n, scale, acc, ctx.host_reads)
        new = torch.where(warm, torch.minimum(gamma, clipped), torch.lerp(gamma, clipped, 1.0 - self.beta))
        ok = torch.where(warm, total < math.inf, n < math.inf)  # (a norm is >= 0; NaN compares false)
        gamma = torch.where(ok, new, gamma)
        st.seg_set(seg, "gamma", gamma)
        go = proceed_flag(ctx)  # None: the host decided, the step goes ahead
        st.store["step"] = count + (1 if go is None else go)
        st.record_clip(n, scale, gamma=gamma, warmup=warm)
        return updates


# --- OLMo 2's skip step -----------------------------------------------------------------------------------
class SkipStep(SkipDecider):
    r"""Skip the step when the loss or the gradient norm spikes (OLMo 2, arXiv 2501.00656; OLMo-core's
    `SkipStepOptimizer`).

    For each watched value $x_t$ (the step's loss; the 2-norm of every update of the step together),
    with $\mu$ and $\sigma$ the mean and the standard deviation (ddof 1) of its last `window`
    recorded values, the current one not included, the step is skipped when

    $$ x_t - \mu > k\,\sigma \quad (\text{or } x_t \text{ is NaN or } +\infty) $$

    for either value, once it has `min_steps` values, the current one included (None:
    $\max(2, \lfloor W/2 \rfloor)$, OLMo-core's rule), and at least two before it. A skipped step
    leaves the parameters and every state after this transform as they were; its values still enter
    the windows (as in OLMo-core). A value that is not finite, or any value of a step skipped for
    non-finite gradients, never does.

    Defaults: `window=128` ($W$), `sigma=6.0` ($k$), `min_steps=None`, `watch="loss_and_norm"`.
    The loss comes from the closure (`opt.step(closure)`) or `opt.step(loss=loss)`; a step without one
    tests the norm alone. Under the default `nonfinite="skip"`, with transforms that skip on the
    device, the decision stays on the device (no host sync); otherwise the host decides (one sync).
    It comes first in the pipeline (after stateless transforms only), at its top level, and cannot
    be attached to a torch optimizer. Under `torch.distributed` the loss tested is the mean of every
    rank's loss (one all-reduce), so every rank takes the same decision (the gradient norm is already
    the same on every rank: DDP averages the gradients, FSDP2's norms are of the full tensors).

    Telemetry: `spike` (this step is skipped for a spike), `norm`, `norm_spike`, `loss`, `loss_spike`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(1))
    >>> opt = mo.Modular([p], mo.SkipStep(window=4, min_steps=3), mo.LR(1.0))
    >>> for loss in [1.0, 1.1, 0.9, 1.0, 50.0]:
    ...     p.grad = torch.ones(1); _ = opt.step(loss=loss)
    >>> p.data, bool(opt.stats["0:SkipStep.spike"]), int(opt.stats["skipped_steps"])
    (tensor([-4.]), True, 1)

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip: ClassVar[bool] = True  # keeps its state on a step the device skips (and skips the rest of it)
    update_access: ClassVar[Literal["write", "read", "none"]] = "read"

    window: int = Field(128, ge=2, le=2**20)
    sigma: FiniteNonNegativeFloat = 6.0
    min_steps: int | None = Field(None, ge=1, lt=2**62)
    watch: Literal["loss_and_norm", "loss", "norm"] = "loss_and_norm"
    state_buffers: ClassVar[dict[str, str | Buffer]] = {
        # the last `window` finite values, slot `count % window` written next (a ring), in float32
        "loss_window": Buffer("fixed", dtype="float32"),
        "norm_window": Buffer("fixed", dtype="float32"),
        "loss_count": Buffer("counter"),  # values recorded so far
        "norm_count": Buffer("counter"),
    }

    @property
    def first_test(self) -> int:
        """How many values (the current one included) a test needs: `min_steps`, or OLMo-core's rule."""
        return self.min_steps if self.min_steps is not None else max(2, self.window // 2)

    def check_loaded(self, values: dict[str, Any], where: str) -> None:
        """Refuse loaded windows whose length is not `window` (`ValueError` naming `where`)."""
        for name in ("loss_window", "norm_window"):
            v = values.get(name)
            if v is not None and tuple(v.shape) != (self.window,):
                raise ValueError(f"{where}: {name} has shape {tuple(v.shape)}; SkipStep(window={self.window}) "
                                 f"keeps ({self.window},)")

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Test the loss and the norm against their windows; skip the step on a spike (on the device, or
        None when the host decides), else the updates unchanged."""
        dev = updates[0].device
        if self.watch != "norm" and ctx.loss is not None:  # (refused before any window is written)
            check_loss(ctx.loss, "SkipStep (the closure's return value)")
        go = proceed_flag(ctx)  # before this step's own decision: a non-finite step records nothing
        spike = torch.zeros((), dtype=torch.bool, device=dev)
        if self.watch != "loss":
            norm = ctx.memo.total(updates, 2.0, common_acc_dtype(updates)).to(torch.float32)
            hit = self._test(st, "norm", norm, go)
            st.record("norm", norm)
            st.record("norm_spike", hit)
            spike = spike | hit
        if self.watch != "norm" and ctx.loss is not None:
            loss = torch.as_tensor(ctx.loss).detach().reshape(()).to(device=dev, dtype=torch.float32)
            loss = distributed.world_mean(loss)  # (each data-parallel rank's loss is its own: decide on their mean)
            hit = self._test(st, "loss", loss, go)
            st.record("loss", loss)
            st.record("loss_spike", hit)
            spike = spike | hit
        st.record("spike", spike if go is None else spike & go)
        if ctx.skip is not None:
            ctx.skip_also(spike)
        elif bool(spike):  # the host decides this step (its policy, or a transform that needs it): one sync
            return _stopped_on_host(ctx)
        return updates

    def _test(self, st: TransformState, name: str, x: torch.Tensor, go: torch.Tensor | None) -> torch.Tensor:
        """Whether `x` (0-d float32) spikes against its window; records it when finite (and `go`)."""
        w = self.window
        store = st.store
        win = store.get(f"{name}_window")
        if win is None:
            win = torch.zeros(w, dtype=torch.float32, device=x.device)
        count = store.get(f"{name}_count")
        if count is None:
            count = torch.zeros((), dtype=torch.int64, device=x.device)
        n = count.clamp(max=w)
        slots = torch.arange(w, device=x.device)
        held = slots < n
        nf = n.to(torch.float32)
        mean = torch.where(held, win, 0.0).sum() / nf
        std = (torch.where(held, (win - mean).square(), 0.0).sum() / (nf - 1)).sqrt()
        active = (count + 1 >= self.first_test) & (n >= 2)
        hit = active & ~(x - mean <= self.sigma * std)  # (NaN and +inf compare false: a spike)
        take = torch.isfinite(x) if go is None else torch.isfinite(x) & go
        store[f"{name}_window"] = torch.where((slots == count % w) & take, x, win)
        store[f"{name}_count"] = count + take.to(torch.int64)
        return hit


def _stopped_on_host(ctx: Step) -> None:
    """Stop the step the host decided to skip: `skipped` tells `Modular` to count it in `skipped_steps`
    (as a step the device skips), which a chain stopped for another reason (`Accumulate`) is not."""
    ctx.stats["skipped"] = torch.ones((), dtype=torch.bool)
    return None


# --- Megatron-LM's absolute threshold ------------------------------------------------------------------
def _at_most(x: float, dtype: torch.dtype) -> float:
    """The largest value of `dtype` (float32 or float64) that is <= `x` (> 0): a norm `n` of that dtype is
    `> x` exactly when it is `> _at_most(x)`, so the test is the real-number one whatever the dtype the
    norm is accumulated in (Megatron-LM compares a float32 norm with the threshold in float64). Plain
    `math` on a constant: a traced step folds it."""
    if dtype != torch.float32:
        return x
    if x >= F32_MAX:
        return F32_MAX
    _, e = math.frexp(x)  # x = m * 2**e with 0.5 <= m < 1
    ulp = math.ldexp(1.0, max(e - 24, -149))  # float32's spacing there: 24 bits of significand, subnormals
    return math.floor(x / ulp) * ulp  # (exact: a power of two divides, and the floor fits 24 bits)


class SkipNorm(SkipDecider):
    r"""Skip the step whose gradient 2-norm exceeds a fixed threshold (Megatron-LM's
    `grad_norm_skip_threshold`).

    With $G$ the 2-norm of every update of the step together, measured where `SkipNorm` stands (first
    in the pipeline: the raw gradient, before any clip, as Megatron-LM measures it), the step is skipped
    when

    $$ G > \tau \quad (\text{or } G \text{ is NaN}) $$

    with $\tau$ = `max_norm`, compared exactly (not after rounding $\tau$ to the norm's float32). A
    skipped step leaves the parameters and every state bit for bit as they were and is counted in
    `opt.stats["skipped_steps"]`, as a step skipped for non-finite gradients; it keeps no state of its
    own. Under `torch.distributed` the norm is of the full gradients (all-reduced under FSDP2; the same
    averaged gradients on every DDP rank), so every rank skips alike. Under the default
    `nonfinite="skip"`, with transforms that skip on the device, the decision stays on the device (no
    host sync); otherwise the host decides (one sync). It comes first in the pipeline (after stateless
    transforms only), before `SkipStep` when both are used, at its top level.

    No default for `max_norm` (Megatron-LM's is $+\infty$: off). Telemetry: `norm` ($G$) and `skip`
    (this step is skipped for its norm; a step skipped for non-finite gradients is not).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> opt = mo.Modular([p], mo.SkipNorm(10.0), mo.SGD(lr=1.0))
    >>> for g in ([3.0, 4.0], [30.0, 40.0], [6.0, 8.0]):   # norms 5, 50 (skipped), 10 (not above 10)
    ...     p.grad = torch.tensor(g); opt.step()
    >>> p.data, bool(opt.stats["0:SkipNorm.skip"]), int(opt.stats["skipped_steps"])
    (tensor([ -9., -12.]), False, 1)

    ```
    """

    positional: ClassVar[str | None] = "max_norm"
    device_skip: ClassVar[bool] = True  # keeps no state; skips the rest of the step on the device
    update_access: ClassVar[Literal["write", "read", "none"]] = "read"

    max_norm: FinitePositiveFloat

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Skip the step when the 2-norm of the updates exceeds `max_norm` (on the device, or None when the
        host decides), else the updates unchanged."""
        norm = ctx.memo.total(updates, 2.0, common_acc_dtype(updates))  # (the non-finite check's, when it ran)
        over = ~(norm <= _at_most(self.max_norm, norm.dtype))  # (NaN compares false: skipped)
        go = proceed_flag(ctx)  # before this decision: a step skipped for non-finite gradients is not ours
        st.record("norm", norm)
        st.record("skip", over if go is None else over & go)
        if ctx.skip is not None:
            ctx.skip_also(over)
        elif bool(over):  # the host decides this step: one sync
            return _stopped_on_host(ctx)
        return updates


# --- Clippy -------------------------------------------------------------------------------------------------
class Clippy(Scoped):
    r"""Clippy (Tang et al. 2023, arXiv 2302.09178): shrink each tensor's step so that no element moves by
    more than $\lambda_w |w| + \lambda_\text{abs}$.

    Placed after the optimizer transform, it acts on the step $\Delta$ (the learning rate included),
    with one scale per segment $s$ (a tensor, by default):

    $$
    c_s = \min\Big(1,\ \min_{i \in s,\ \Delta_i \neq 0} \frac{\lambda_w |w_i| + \lambda_\text{abs}}{|\Delta_i|}\Big),
    \qquad \Delta_s \leftarrow c_s\,\Delta_s
    $$

    with $w$ the parameters before the step. A segment whose step is all zeros is left alone.
    Defaults: `lambda_w=0.1`, `lambda_abs=1e-7`, `scope="tensor"` (those of TensorFlow
    Recommenders' `ClippyAdagrad`; its third term, `accumulator_relative_threshold / sqrt(accumulator)`,
    0 there by default, needs an Adagrad accumulator and is not offered). It keeps no state.

    Telemetry, one value per segment: `scale` ($c_s$) and `clipped`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    >>> opt = mo.Modular([p], mo.SGD(lr=1.0), mo.Clippy(lambda_w=0.1, lambda_abs=0.0))
    >>> p.grad = torch.tensor([0.5, 0.1]); opt.step()   # min(0.1 * 1 / 0.5, 0.1 * 2 / 0.1) = 0.2
    >>> p.data, opt.stats["1:Clippy.scale"]
    (tensor([ 0.9000, -2.0200]), tensor([0.2000]))

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip: ClassVar[bool] = True  # keeps no state

    lambda_w: FiniteNonNegativeFloat = 0.1
    lambda_abs: FiniteNonNegativeFloat = 1e-7
    scope: ScopeName = "tensor"

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Scale each segment's step so that no element moves by more than its bound."""
        seg = st.segments(self)
        ratios = [self._ratio(u, p, seg, i) for i, (u, p) in enumerate(zip(updates, ctx.params))]
        if seg.kind == "slices":
            least = seg.concat(ratios, updates)
        else:
            parts = torch.stack([r.reshape(()) for r in ratios])
            least = parts if seg.kind == "tensor" else torch.stack([parts[a:b].amin() for a, b in seg.ranges])
        scale = below_one(least)
        seg.mul_(updates, scale)
        st.record("scale", scale)
        st.record("clipped", scale < 1)
        return updates

    def _ratio(self, u: torch.Tensor, p: torch.Tensor, seg, i: int) -> torch.Tensor:
        """`min (lambda_w |w| + lambda_abs) / |u|` over the elements with `u != 0` (+inf where there are
        none): per slice for `dim` (keepdim), else over the tensor; in >= float32."""
        acc = acc_dtype(u.dtype)
        mag = u.detach().to(acc).abs()
        r = torch.where(mag == 0, math.inf, (p.detach().to(acc).abs() * self.lambda_w + self.lambda_abs) / mag)
        if seg.kind == "slices":
            if not seg.dims[i]:  # (left alone: `seg.active`)
                return torch.full(seg.shapes[i], math.inf, dtype=acc, device=u.device)
            if r.numel() == 0:
                return torch.full(seg.shapes[i], math.inf, dtype=acc, device=u.device)
            return r.amin(dim=seg.dims[i], keepdim=True)
        return r.amin() if r.numel() else torch.full((), math.inf, dtype=acc, device=u.device)
