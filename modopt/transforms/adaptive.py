"""Statistical clipping: thresholds learned from the history of the update's norm.

`HistClip` (drytorch's `HistClipper` / `ParamHistClipper`) with its
criteria `EMACriterion` and `ZStatCriterion`; `ZClip` (the `zclip`
package); `AutoClip` (Seetharaman et al. 2020); and `ZScoreNormalize`
(drytorch's `GradZScoreNormalizer`).

All statistics live in the optimizer's state, one set per segment of the
scope (`seg_get`/`seg_set`), as tensors: warm-up counters included, so a
step never synchronises with the host. Warm-up statistics are accumulated with
Welford's running mean / sum of squares (no history buffer). A non-finite norm
never enters any statistic and does not count as a warm-up step.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from ..core.kernels import const
from ..core.reduce import Ord, _parsed_ord
from ..core.roles import Scale, ScaleFact
from ..core.step import Step, TransformState
from ..core.scope import Scoped, ScopeName
from ..core.state import Buffer
from ._util import below_one, clip_to

__all__ = ["HistClip", "EMACriterion", "ZStatCriterion", "ZClip", "AutoClip", "ZScoreNormalize"]

Rule = Literal["max", "mean", "reciprocal"]

#: the clip scale's epsilon of drytorch / zclip / torch's clip_grad_norm_
CLIP_EPS = 1e-6
#: a saved statistic that is never negative (a count, a mean of norms, a variance)
_NONNEG = Buffer("segment", low=0)
#: a sum or mean of squares: +inf after finite gradients of 1e20 (float32), never NaN or negative
_SQUARES = Buffer("segment", low=0, finite=False)


def _ones(x: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(x)


class EMACriterion(BaseModel):
    r"""Trigger when the norm exceeds `r_thresh` times its EMA (drytorch's `EMACriterion`).

    With `mu` the EMA of past norms and `g` the current norm: triggers when
    `mu > 0` and `g / mu > r_thresh`, and clips to `mu * f(g / mu, r_thresh)`
    with `f` = `max`: `r_thresh`; `reciprocal`: `r_thresh**2 / (g/mu)`;
    `mean`: 1 (clip to `mu`; drytorch clips to zero there). Statistics:
    `mu <- alpha*mu + (1-alpha)*x`. Defaults: `alpha=0.98`, `r_thresh=1.05`,
    `rule="max"`.
    """

    model_config: ClassVar[ConfigDict] = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    kind: Literal["ema"] = "ema"
    alpha: float = Field(0.98, ge=0.0, lt=1.0)
    r_thresh: PositiveFloat = 1.05
    rule: Rule = "max"

    def threshold(self, mu: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(triggered, clip value)` for the norm `g` given the statistics."""
        safe_mu = torch.where(mu > 0, mu, 1.0)
        r = g / safe_mu
        t = self.r_thresh
        if self.rule == "max":
            f = torch.full_like(r, t)
        elif self.rule == "reciprocal":
            f = t * t / r
        else:
            f = _ones(r)
        return (mu > 0) & (r > t), mu * f

    def update(self, mu: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Statistics after observing `x` (`v` is not used by this criterion)."""
        return self.alpha * mu + (1 - self.alpha) * x, v


class ZStatCriterion(BaseModel):
    r"""Trigger on the z-score of the norm (drytorch's `ZStatCriterion`; ZClip's rule).

    `z = (g - mu) / (sqrt(v) + 1e-8)`; triggers when `mu > 0` and
    `|z| > z_thresh` (`z > z_thresh` when not `two_sided`); clips to
    `mu + f(|z|, z_thresh) * sqrt(v)` with `f` = `max`: `z_thresh`;
    `reciprocal`: `z_thresh**2 / |z|`; `mean`: 0. Statistics, variance
    first (it uses the old mean): `v <- alpha*v + (1-alpha)*(x - mu)**2`,
    `mu <- alpha*mu + (1-alpha)*x`. Defaults: `alpha=0.97`, `z_thresh=2.5`,
    `rule="reciprocal"`, `two_sided=True`.
    """

    model_config: ClassVar[ConfigDict] = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    kind: Literal["zstat"] = "zstat"
    alpha: float = Field(0.97, ge=0.0, lt=1.0)
    z_thresh: PositiveFloat = 2.5
    rule: Rule = "reciprocal"
    two_sided: bool = True

    def threshold(self, mu: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(triggered, clip value)` for the norm `g` given the statistics."""
        sd = v.clamp(min=0).sqrt()
        z = (g - mu) / (sd + 1e-8)
        za = z.abs() if self.two_sided else z
        t = self.z_thresh
        if self.rule == "max":
            f = torch.full_like(z, t)
        elif self.rule == "reciprocal":
            f = t * t / torch.where(z != 0, z.abs(), 1.0)
        else:
            f = torch.zeros_like(z)
        return (mu > 0) & (za > t), mu + f * sd

    def update(self, mu: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Statistics after observing `x`: the variance moves first, around the old mean."""
        a = self.alpha
        return a * mu + (1 - a) * x, a * v + (1 - a) * (x - mu).square()


#: a HistClip criterion, chosen in configs by its `kind` (`ema` or `zstat`)
Criterion = Annotated[Union[EMACriterion, ZStatCriterion], Field(discriminator="kind")]


def _welford(n, mean, m2, g, ok):
    """One warm-up observation: count, running mean and sum of squared deviations (`g` only where `ok`)."""
    n1 = n + ok.to(n.dtype)
    delta = torch.where(ok, g - mean, 0.0)
    mean1 = mean + delta / n1.clamp(min=1)
    m21 = m2 + delta * torch.where(ok, g - mean1, 0.0)
    return n1, mean1, m21


def _finish(st, seg, updates, g, scale, saved: dict, **telemetry):
    """The end of a history clipper's step: scale, save the per-segment statistics,
    record telemetry (the statistics included)."""
    st.scale_(seg, updates, scale)  # (left out, folded or deferred only for a transform that declares it)
    for name, value in saved.items():
        st.seg_set(seg, name, value)
    st.record_clip(g, scale, **telemetry, **{k: v for k, v in saved.items() if k != "count"})
    return updates


class HistClip(Scoped):
    r"""Clip the norm when it is an outlier of its own history (drytorch's `HistClipper`).

    Warm-up: the first `warmup_steps` steps record the pre-clip norm `g` and
    clip it to `warmup_max_norm` (None: no clip); then the statistics start
    from the recorded norms (`mu` their mean, `v` their variance with
    ddof 1; 1.0 from fewer than 2 norms or a zero variance, as drytorch). After warm-up, when the
    `criterion` triggers, `u` is clipped to the criterion's value `c`
    (scale `c / (g + eps)`, never up), and the statistics are updated with
    `g` (`update_stats_with="raw"`, drytorch) or with the clipped norm
    `min(g, c)` (`"clipped"`, ZClip's choice). Initial `mu = 0`, `v = 1`.

    Defaults: `criterion=ZStatCriterion()`, `warmup_steps=20`,
    `warmup_max_norm=1.0`, `update_stats_with="raw"`, `ord=2`,
    `eps=1e-6`, `scope="global"`. `scope="tensor"` is drytorch's
    `ParamHistClipper`; `dim` gives per-slice statistics.

    Telemetry: `norm`, `scale`, `clipped`, `triggered`, `mu`, `v`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(1))
    >>> clip = mo.HistClip(mo.EMACriterion(r_thresh=2.0), warmup_steps=2, warmup_max_norm=None)
    >>> opt = mo.Modular([p], clip, mo.LR(1.0))
    >>> for g in (1.0, 1.0, 10.0):
    ...     p.grad = torch.tensor([g]); opt.step()
    >>> round(float(p.detach()), 4)   # the spike is clipped to 2 * mu = 2
    -4.0

    ```
    """

    positional: ClassVar[str | None] = "criterion"
    device_skip = True  # keeps its state on a step the device skips

    criterion: Criterion = Field(default_factory=ZStatCriterion)
    warmup_steps: NonNegativeInt = 20
    warmup_max_norm: Optional[PositiveFloat] = 1.0
    update_stats_with: Literal["raw", "clipped"] = "raw"
    ord: Ord = 2.0
    eps: NonNegativeFloat = 1e-6
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"count": _NONNEG, "mu": _NONNEG, "v": _SQUARES}

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain data (`Transform.to_dict`), the criterion as its dict."""
        data = super().to_dict()
        data["criterion"] = self.criterion.model_dump()
        return data

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Clip each segment whose norm the criterion flags (a fixed `warmup_max_norm` during the warm-up); the
        statistics move on."""
        seg = st.segments(self)
        g = seg.reduce(updates, self.ord).abs()
        dt = g.dtype
        W = self.warmup_steps
        n = st.seg_get(seg, "count", 0.0, dtype=dt)
        mu = st.seg_get(seg, "mu", 0.0, dtype=dt)
        # during warm-up ``v`` holds Welford's sum of squared deviations
        v = st.seg_get(seg, "v", 0.0 if W > 0 else 1.0, dtype=dt)
        crit, wmax, eps = self.criterion, self.warmup_max_norm, self.eps

        def rule(g, n, mu, v):
            n, mu, v = n.to(g.dtype), mu.to(g.dtype), v.to(g.dtype)
            ok = g < math.inf  # (a norm: >= 0, and NaN compares false)
            warm = n < W
            # warm-up
            n1, mean1, m21 = _welford(n, mu, v, g, ok)
            var = torch.where((n1 >= 2) & (m21 > 0), m21 / (n1 - 1).clamp(min=1), 1.0)
            v_w = torch.where(n1 >= W, var, m21)
            scale_w = clip_to(g, wmax, CLIP_EPS) if wmax is not None else _ones(g)
            # after warm-up
            trig, c = crit.threshold(mu, v, g)
            scale_p = torch.where(trig & (g > c), below_one(c / (g + eps)), 1.0)
            x = torch.where(trig, torch.minimum(g, c), g) if self.update_stats_with == "clipped" else g
            mu_p, v_p = crit.update(mu, v, x)
            mu_p, v_p = torch.where(ok, mu_p, mu), torch.where(ok, v_p, v)
            return (
                torch.where(warm, scale_w, scale_p),
                torch.where(warm, n1, n),
                torch.where(warm, mean1, mu_p),
                torch.where(warm, v_w, v_p),
                ~warm & trig,
            )

        scale, n, mu, v, trig = rule(g, n, mu, v)
        return _finish(st, seg, updates, g, scale, {"count": n, "mu": mu, "v": v}, triggered=trig)


class ZClip(Scoped, ScaleFact):
    r"""ZClip (Kumar et al. 2025, arXiv 2504.02507): z-score spike clipping, as the `zclip` package. By
    default it also caps every step's norm at 1.0, warm-up included (`max_grad_norm=1.0`, the package's
    default); `max_grad_norm=None` leaves only the spike clipping.

    Warm-up: the first `warmup_steps` norms set `mu` (mean) and
    `sigma**2` (variance, ddof 0). Then, with `z = (g - mu) / (sigma + eps)`:

    * `mode="zscore"`: a spike is `z > z_thresh`; its threshold is
      `clip_factor * (mu + z_thresh**2 * sigma / z)` (`clip_option="adaptive_scaling"`)
      or `mu` (`clip_option="mean"`);
    * `mode="percentile"`: a spike is `g > mu + z_thresh * sigma`, clipped to that.

    `max_grad_norm` (None: off) caps the norm on every step, warm-up
    included. The statistics then move with the threshold `c` on a spike,
    else with `g` (mean first, then `sigma**2 <- alpha*sigma**2 +
    (1-alpha)*(x - mu_new)**2`); `skip_update_on_spike` leaves them
    unchanged on spikes. The clip scale is `c / (g + 1e-6)` (the package's).

    Defaults: `alpha=0.97`, `z_thresh=2.5`, `max_grad_norm=1.0`,
    `eps=1e-6`, `warmup_steps=25`, `mode="zscore"`,
    `clip_option="adaptive_scaling"`, `clip_factor=1.0`,
    `skip_update_on_spike=False`, `ord=2`, `scope="global"`.

    Telemetry: `norm`, `scale`, `clipped`, `spike`, `mu`, `var`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(1))
    >>> opt = mo.Modular([p], mo.ZClip(warmup_steps=3, max_grad_norm=None), mo.LR(1.0))
    >>> for g in (1.0, 1.2, 0.8, 50.0):
    ...     p.grad = torch.tensor([g]); opt.step()
    >>> bool(opt.stats["0:ZClip.spike"][0]), round(float(opt.stats["0:ZClip.scale"][0] * 50), 4)
    (True, 1.0034)

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip = True  # keeps its state on a step the device skips

    alpha: float = Field(0.97, ge=0.0, lt=1.0)
    z_thresh: PositiveFloat = 2.5
    max_grad_norm: Optional[PositiveFloat] = Field(
        1.0, description="a fixed cap on every step's norm, warm-up included (the zclip package's default); "
                         "None: no cap, spikes only")
    eps: NonNegativeFloat = 1e-6
    warmup_steps: PositiveInt = 25
    mode: Literal["zscore", "percentile"] = "zscore"
    clip_option: Literal["adaptive_scaling", "mean"] = "adaptive_scaling"
    clip_factor: PositiveFloat = 1.0
    skip_update_on_spike: bool = False
    ord: Ord = 2.0
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"count": _NONNEG, "mu": _NONNEG, "var": _SQUARES}

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Clip each segment whose norm's z-score against the running mean and variance is a spike; the statistics
        move on."""
        seg = st.segments(self)
        g = seg.reduce(updates, self.ord)
        if not isinstance(_parsed_ord(self.ord), float):  # (a p-norm is >= 0 or NaN already)
            g = g.abs()
        dt = g.dtype
        W = self.warmup_steps
        n = st.seg_get(seg, "count", 0.0, dtype=dt)
        mu = st.seg_get(seg, "mu", 0.0, dtype=dt)
        var = st.seg_get(seg, "var", 0.0, dtype=dt)  # Welford's sum of squares during warm-up
        a, t, M = self.alpha, self.z_thresh, self.max_grad_norm
        # on a CPU, where reading a value is free (the step's `host_reads`), the host reads the counts and
        # the norms and computes only the phase every segment is in (the same expressions, so the same
        # bits; a finite norm takes its plain form): about 20 small ops in place of about 75
        phase, finite, counts = None, False, []
        if W <= 2**24 and ctx.host_reads:  # (counts below 2**24 compare with W exactly in float32)
            counts, norms = n.tolist(), g.tolist()
            if all(c < W for c in counts):
                phase = "warm"
            elif not any(c < W for c in counts):
                phase = "after"
            finite = all(x < math.inf for x in norms)  # (a norm is >= 0; NaN compares false)

        if phase is None and W <= 2**24:  # the device's step (or mixed phases on the host)
            return self._packed_step(ctx, st, seg, updates, g, n, mu, var)

        # the numbers of the rule as 0-d tensors of g's dtype (>= float32: the same values as the numbers in
        # its ops; on a CPU a number is made into a tensor on every call), looked up once a step
        key = ("ZClip host", self.eps, t, self.clip_factor, a, g.dtype, g.device)
        nums = None if torch.compiler.is_compiling() else st.step.layout.cache.get(key)
        if torch.compiler.is_compiling():  # (the graph folds the numbers in; no cache written while tracing)
            nums = {v: v for v in (1.0, self.eps, t, t * t, self.clip_factor, CLIP_EPS, a, 1 - a)}
        elif nums is None:
            nums = st.step.layout.cache[key] = {v: const(v, g) for v in (1.0, self.eps, t, t * t, self.clip_factor,
                                                                            CLIP_EPS, a, 1 - a)}
        k = nums.__getitem__

        def rule(g, n, mu, var):
            n, mu, var = (v if v.dtype == dt else v.to(dt) for v in (n, mu, var))
            if phase == "warm" and finite:
                # `_welford` with every `ok` true (a count is >= 0, so `n + 1 >= 1`: no clamp); whether a
                # count reaches W is read from the host's counts (whole numbers below 2**24: exact)
                n1 = n + k(1.0)
                delta = g - mu
                mean1 = mu + delta / n1
                m21 = var + delta * (g - mean1)
                if any(c + 1 >= W for c in counts):
                    var_w = torch.where(n1 >= W, m21 / n1, m21) if any(c + 1 < W for c in counts) else m21 / n1
                else:
                    var_w = m21
                scale_w = clip_to(g, M, CLIP_EPS) if M is not None else _ones(g)
                return scale_w, n1, mean1, var_w, torch.zeros(g.shape, dtype=torch.bool, device=g.device)
            # (a norm: >= 0, and NaN compares false; a finite norm read on the host needs no test)
            ok = g < math.inf if phase is None or not finite else None
            warm = n < W if phase is None else None
            if phase == "warm":
                n1, mean1, m21 = _welford(n, mu, var, g, ok)
                var_w = torch.where(n1 >= W, m21 / n1.clamp(min=1), m21)
                scale_w = clip_to(g, M, CLIP_EPS) if M is not None else _ones(g)
                return scale_w, n1, mean1, var_w, torch.zeros(g.shape, dtype=torch.bool, device=g.device)
            if phase != "after":
                n1, mean1, m21 = _welford(n, mu, var, g, ok)
                var_w = torch.where(n1 >= W, m21 / n1.clamp(min=1), m21)
                scale_w = clip_to(g, M, CLIP_EPS) if M is not None else _ones(g)
            sigma = torch.clamp_min(var, 0.0).sqrt()
            if self.mode == "zscore":
                z = (g - mu) / (sigma + k(self.eps))
                spike = z > k(t)
                if self.clip_option == "adaptive_scaling":
                    safe_z = torch.where(spike, z, k(1.0))
                    c = mu + k(t * t) * sigma / safe_z
                    c = c if self.clip_factor == 1.0 else k(self.clip_factor) * c  # (1 * c is c)
                else:
                    c = mu
            else:
                c = mu + k(t) * sigma
                spike = g > c
            limit = torch.where(spike, c, g)
            if M is not None:
                limit = torch.clamp_max(limit, M)
            scale_p = torch.where(g > limit, below_one(limit / (g + k(CLIP_EPS))), k(1.0))
            x = torch.where(spike, c, g)
            mu_p = k(a) * mu + k(1 - a) * x
            var_p = k(a) * var + k(1 - a) * (x - mu_p).square()
            if self.skip_update_on_spike or not finite:
                if finite:
                    keep = spike
                else:
                    keep = (~ok | spike) if self.skip_update_on_spike else ~ok
                mu_p, var_p = torch.where(keep, mu, mu_p), torch.where(keep, var, var_p)
            if phase == "after":
                return scale_p, n, mu_p, var_p, spike
            return (
                torch.where(warm, scale_w, scale_p),
                torch.where(warm, n1, n),
                torch.where(warm, mean1, mu_p),
                torch.where(warm, var_w, var_p),
                ~warm & spike,
            )

        scale, n, mu, var, spike = rule(g, n, mu, var)
        if not ctx.host_reads:  # saved as the rows of one tensor, which the device's step reads back
            n, mu, var = torch.stack((n, mu, var)).unbind(0)  # without a copy (`_packed_step`)
        return _finish(st, seg, updates, g, scale, {"count": n, "mu": mu, "var": var}, spike=spike)

    def scale_fact(self) -> Scale | None:
        """Its last touch of the updates is `st.scale_` (the statistics and the telemetry after it read no
        update). Not positive: a steady-phase threshold of 0 (every earlier norm 0) gives a factor of 0."""
        return Scale(self.scope, self.dim, self.inverse_dims)

    def _constants(self, st: TransformState, dt: torch.dtype, device: torch.device) -> torch.Tensor:
        """The constants of `_packed_step`, one column per phase (warm-up, its last step, after it), on
        `device` in `dt`: made once per step layout (a tensor made from Python numbers, no op)."""
        a, t, W, inf = self.alpha, self.z_thresh, self.warmup_steps, math.inf
        M = inf if self.max_grad_norm is None else self.max_grad_norm
        cols = (
            (1.0, 1.0, 1.0),  # n is multiplied by 1
            (1.0, 1.0, a),  # mu and var are multiplied by this
            (1.0, 1.0, a),
            (1.0, 1.0, 0.0),  # the count moves on
            (1.0, 1.0, 1 - a),  # the new observation's weight
            (1.0, float(W), 1.0),  # the warm-up's sum of squares becomes the variance on its last step
            (inf, inf, t),  # a z-score above this is a spike (none during warm-up)
            (CLIP_EPS, CLIP_EPS, CLIP_EPS),  # the norm's epsilon; the clip compares g + this ...
            (CLIP_EPS, CLIP_EPS, 0.0),  # ... with its threshold: g + eps during warm-up (`clip_to`), g after
            (M, M, -inf),  # the threshold: max_grad_norm during warm-up,
            (M, M, M),  # the clipped statistic after it, at most max_grad_norm
            (W - 1.0, float(W), float(W)),  # the first two: the phases' boundaries (`bucketize`)
        )
        key = ("ZClip", st.key, a, t, W, M, dt, device)
        cache = st.step.layout.cache
        hit = None if torch.compiler.is_compiling() else cache.get(key)
        if hit is None:
            hit = torch.tensor(cols, dtype=dt, device=device)
            if not torch.compiler.is_compiling():
                cache[key] = hit
        return hit

    def _packed_step(self, ctx: Step, st: TransformState, seg: Any, updates: list[torch.Tensor], g: torch.Tensor,
                     n: torch.Tensor, mu: torch.Tensor, var: torch.Tensor) -> list[torch.Tensor]:
        """Every segment's step without reading a value on the host: both phases' rules as one.

        The same bits as the warm-up rule (Welford's) and the z-score rule computed apart and chosen per
        segment, in about half the (0-d) ops: the phase picks a column of constants (`_constants`)
        that turn the one set of expressions into either rule (`x * 1`, `x / 1` and `x + 0` are exact),
        count, mean and variance move together as one (3, segments) tensor, and one `where` keeps
        them where the norm is not finite (and, on a step the device skips, the saved ones). Counts are whole
        numbers (as every step saves them): a count between W-1 and W, from a hand-made checkpoint, would
        end its warm-up dividing by W where the host's rule divides by the count + 1."""
        t, M = self.z_thresh, self.max_grad_norm
        K = self._constants(st, g.dtype, g.device)
        one = K[0, 0]
        k = K[:, torch.bucketize(n, K[11, :2], right=True)]  # each segment's phase's constants, a column each
        warm = n < self.warmup_steps
        base = n._base
        if (not torch.compiler.is_compiling() and base is not None and base.dim() == 2 and base.shape[0] == 3
                and mu._base is base and var._base is base and base.dtype == g.dtype and base.is_contiguous()
                and base.shape[1] == n.numel() and n.data_ptr() == base.data_ptr()
                and mu.data_ptr() == base[1].data_ptr() and var.data_ptr() == base[2].data_ptr()):
            P = base  # saved by the last step as rows of one tensor: read back as it, no copy
        else:
            P = torch.stack((n, mu, var))
        d0 = g - mu
        sigma = var.clamp(min=0).sqrt()
        if self.mode == "zscore":
            z = d0 / (sigma + self.eps)
            spike = z > k[6]  # (never during warm-up)
            if self.clip_option == "adaptive_scaling":
                c = torch.addcdiv(mu, t * t * sigma, z)  # mu + t^2 sigma / z (z > t > 0 where it is used)
                c = c if self.clip_factor == 1.0 else self.clip_factor * c
            else:
                c = mu
        else:
            c = mu + t * sigma
            spike = (g > c) > warm
        x = torch.where(spike, c, g)  # what the statistics see: g during warm-up
        # the clip: a scale below 1 where the compared norm exceeds the threshold (`clip_to` during warm-up, where
        # max_grad_norm is 1 or None: 1/y and below_one(1/y) have the same bits as 1 / y where y > 1, else 1)
        geps = g + k[7:9]
        limit = torch.clamp(x, min=k[9], max=k[10])
        scale = torch.where(geps[1] > limit, limit / geps[0], one)
        if M is not None and M != 1.0:  # (M / y is not M * (1 / y): the warm-up's own expression)
            scale = torch.where(warm, clip_to(g, M, CLIP_EPS), scale)
        # count, mean, sum of squares or variance: n + inc, A mu + B r / D, (A var + B f e) / D2
        new = P * k[0:3]
        new[0].add_(k[3])
        r = torch.where(warm, d0, x)
        new[1].addcdiv_(r * k[4], torch.where(warm, new[0], one))
        e = x - new[1]
        new[2].add_(torch.where(warm, d0, e) * e * k[4]).div_(k[5])
        ok = g < math.inf  # (a norm: >= 0, and NaN compares false): a non-finite norm changes no statistic
        if self.skip_update_on_spike:
            ok = ok > spike
        new = torch.where(ok, new, P)
        kept = new if ctx.skip is None else torch.where(ctx.proceed if ctx.proceed is not None else ~ctx.skip, new, P)
        st.scale_(seg, updates, scale)
        for i, name in enumerate(("count", "mu", "var")):
            st.seg_set(seg, name, kept[i], kept=True)
        st.record_clip(g, scale, spike=spike, mu=new[1], var=new[2])
        return updates


class AutoClip(Scoped):
    r"""AutoClip (Seetharaman et al. 2020): clip to a percentile of the history of norms.

    Each step appends the pre-clip norm `g` to the history (every step, or
    the last `window` steps), then clips the update to the history's
    `percentile`-th percentile `c` (linear interpolation, as
    `numpy.percentile`): scale `min(1, c / (g + eps))`. A non-finite norm
    on a step that goes ahead (`nonfinite="ignore"`, or a norm that
    overflows) takes its place in the history but never counts in the
    percentile; a skipped step appends nothing. Without `window` the
    history grows by one value per step (and so does the checkpoint); set
    `window` for long runs.

    A segment's history is a buffer and its `length`, a device counter:
    the first `length` entries, oldest first, are the norms, the rest is
    unused room (+inf). The host alone sizes the buffer (`window` slots
    from the first call; without a window, one more slot per call), so no
    shape depends on a value and a step the device skips leaves the
    norms and the length as they were, with no host sync (without a
    window the room still gains its slot).

    Defaults: `percentile=10`, `window=None`, `ord=2`, `eps=1e-6`,
    `scope="global"`. `dim` (slice-wise statistics) is not supported.

    Telemetry: `norm`, `scale`, `clipped`, `threshold`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(1))
    >>> opt = mo.Modular([p], mo.AutoClip(percentile=50, eps=0.0), mo.LR(1.0))
    >>> for g in (1.0, 3.0, 8.0):
    ...     p.grad = torch.tensor([g]); opt.step()
    >>> float(p.detach())   # 1 + 2 (median of 1, 3) + 3 (median of 1, 3, 8)
    -6.0

    ```
    """

    positional: ClassVar[str | None] = "percentile"
    device_skip = True  # keeps its history on a step the device skips

    percentile: float = Field(10.0, ge=0.0, le=100.0)
    window: Optional[PositiveInt] = None
    ord: Ord = 2.0
    eps: NonNegativeFloat = 1e-6
    state_buffers: ClassVar[dict[str, str | Buffer]] = {
        # per segment: the norms, oldest first, in the first `length` entries, then unused room (+inf; a
        # non-finite norm is +inf too); a checkpoint from before "length" has every entry in use
        "history": Buffer("history", low=0, finite=False),
        "length": Buffer("counter"),
    }

    @model_validator(mode="after")
    def _no_dims(self):
        if self.dim is not None or self.inverse_dims:
            raise ValueError("AutoClip keeps a history per segment; dim/inverse_dims are not supported")
        return self

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Record each segment's norm, then clip the segment to the `percentile`-th percentile of its recorded norms."""
        seg = st.segments(self)
        g = seg.reduce(updates, self.ord).abs()
        q = self.percentile / 100.0
        go = None if ctx.skip is None else (ctx.proceed if ctx.proceed is not None else ~ctx.skip)  # the step goes ahead
        thresholds = []
        for (where, key, _, _), (_, lkey, _, _), gs in zip(seg.slots(st, "history"), seg.slots(st, "length"),
                                                            g.unbind(0)):
            hist, n = self._append(where.get(key), where.get(lkey), gs, go)
            where[key], where[lkey] = hist, n
            thresholds.append(_percentile(hist, q).to(gs.dtype))  # the room is +inf: not counted
        c = torch.stack(thresholds)
        scale = clip_to(g, c, self.eps)
        seg.mul_(updates, scale)
        st.record_clip(g, scale, threshold=c)
        return updates

    def check_loaded(self, values: dict[str, Any], where: str) -> None:
        """Refuse a loaded `length` larger than its `history` (a damaged or edited checkpoint)."""
        hist, n = values.get("history"), values.get("length")
        if not (isinstance(hist, torch.Tensor) and isinstance(n, torch.Tensor)) or n.is_meta:
            return  # (a meta copy holds no values: a dry run)
        if int(n) > hist.numel():
            raise ValueError(f"{where}: 'length' is {int(n)}, more than the {hist.numel()} entries of its 'history': "
                             "the checkpoint is damaged or was edited")

    def _append(self, hist, n, g, go):
        """The history buffer and its length with the norm `g` (0-d) appended, unless `go` (0-d bool,
        or None: the step goes ahead) is false: then the norms and the length stay as they were.

        Every shape is the host's: with a `window` the buffer has its size from the first call,
        without one it gains a slot (+inf) per call. In a full window the oldest norm moves out
        (a shift by one) and the new one goes last."""
        if hist is None:
            hist, n = g.new_zeros(0), torch.zeros((), dtype=torch.int64, device=g.device)
        elif not isinstance(n, torch.Tensor):  # a checkpoint from before "length" (None), or a plain number
            n = torch.full((), hist.numel() if n is None else int(n), dtype=torch.int64, device=hist.device)
        old = hist.numel()
        size = old + 1 if self.window is None else self.window
        if size > old:
            hist = torch.nn.functional.pad(hist, (0, size - old), value=math.inf)
        else:
            if size < old:  # a smaller window than the checkpoint's: keep the newest norms
                drop = (n - size).clamp(min=0)
                hist, n = hist.index_select(0, torch.arange(size, device=hist.device) + drop), n - drop
            full = n >= size
            hist = torch.where(full if go is None else full & go, hist.roll(-1), hist)
        pos = n.clamp(max=size - 1).reshape(1)
        x = g.nan_to_num(nan=math.inf, posinf=math.inf).reshape(1).to(hist.dtype)  # a non-finite norm: +inf
        if go is not None:  # a skipped step writes back what is there
            x = torch.where(go, x, hist.index_select(0, pos))
        hist.index_copy_(0, pos, x)  # (hist is this call's own tensor)
        n = n + (1 if go is None else go)
        return hist, n if size > old else n.clamp(max=size)


def _percentile(hist: torch.Tensor, q: float) -> torch.Tensor:
    """Linear-interpolation percentile of the finite entries (invalid ones are +inf); inf if none."""
    s = hist.sort().values
    k = torch.isfinite(hist).sum()
    pos = (k - 1).clamp(min=0).to(hist.dtype) * q
    lo = pos.floor()
    hi = pos.ceil().long().clamp(max=hist.numel() - 1)
    frac = pos - lo
    a, b = s.index_select(0, lo.long().reshape(1))[0], s.index_select(0, hi.reshape(1))[0]
    val = a + (b - a) * frac
    val = torch.where(frac == 0, a, val)
    return torch.where(k > 0, val, torch.full_like(val, math.inf))


class ZScoreNormalize(Scoped):
    r"""Standardize the update over the scope: $u \leftarrow (u - \bar u) / (\operatorname{std}(u) + \varepsilon)$.

    The standard deviation has ddof 1, as drytorch's `GradZScoreNormalizer`
    (which it reproduces). Slices with fewer than `min_size` (at least 2)
    elements are left unchanged instead of becoming NaN; a constant slice
    becomes zero. Defaults: `scope="tensor"`, `eps=1e-8`, `min_size=2`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(3))
    >>> opt = mo.Modular([p], mo.ZScoreNormalize(eps=0.0), mo.LR(1.0))
    >>> p.grad = torch.tensor([1.0, 2.0, 3.0]); opt.step(); p.data
    tensor([ 1.,  0., -1.])

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip = True  # keeps its state on a step the device skips

    scope: ScopeName = "tensor"
    eps: NonNegativeFloat = 1e-8
    min_size: int = Field(2, ge=2)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Each segment becomes `(u - mean) / (std + eps)`."""
        seg = st.segments(self)
        mean = seg.reduce(updates, "mean")
        std = seg.reduce(updates, "std")
        eps = self.eps
        scale = torch.where(std + eps > 0, 1.0 / (std + eps), 1.0)
        seg.sub_(updates, mean)
        seg.mul_(updates, scale)
        return updates
