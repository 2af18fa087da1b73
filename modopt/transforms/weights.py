"""Weight-stage transforms: they act on the parameters after the optimizer wrote them."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import math
import warnings

import torch
from pydantic import Field, NonNegativeInt

from ..core.kernels import const
from ..core.reduce import acc_dtype, common_acc_dtype
from ..core.reduce import any_pnorms
from ..core.step import Step, TransformState
from ..core.roles import SeesHostSkips, ShapeDependent, WeightStage
from ..core.state import Buffer
from ..core.transform import Transform

_Targets = list[tuple[Any, list[tuple[int, int, int]], list[tuple[int, int, int]]]]

__all__ = ["ProjectNorm", "QKClip"]


def _norm_now(i: int, p: torch.Tensor) -> torch.Tensor:
    """A tensor's radius when first seen: its Frobenius norm, accumulated in at least float32."""
    return torch.linalg.vector_norm(p.detach(), dtype=acc_dtype(p.dtype))


class ProjectNorm(WeightStage, ShapeDependent):
    r"""Hold each weight tensor's Frobenius norm: after the optimizer's write, project it back onto the sphere
    of radius $R$.

    $$
    p \leftarrow p \cdot \frac{R}{\lVert p \rVert_F + \epsilon}
    $$

    for every parameter with a gradient and at least `min_ndim` dims (default 2: the matrices; biases and
    norms' gains are left alone). $R$ is `radius`, or by default each tensor's own norm when the optimizer
    first sees it, before its first update: the weights stay on the sphere they started on, as the
    Hyperball hook of NVIDIA's Emerging-Optimizers and the MuonH baseline hold them. A tensor whose norm is
    0 is left as it is. Defaults: `radius=None`, `min_ndim=2`, `eps=0`.

    It is a weight-stage transform: it comes after the optimizer transform, at the end of the pipeline, and
    runs after the parameters were written (a step the non-finite policy skips, or that `Accumulate`
    stops, leaves every bit; decided on the device, no sync). Norms accumulate in at least float32; the
    factor multiplies the parameter in its dtype. State: one 0-d radius per tensor.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))       # norm 5
    >>> opt = mo.Modular([p], mo.SGD(lr=1.0), mo.ProjectNorm())
    >>> p.grad = torch.tensor([[-3.0, -4.0]]); opt.step(); p.data  # SGD doubles it; back to norm 5
    tensor([[3., 4.]])

    ```
    """

    positional: ClassVar[str | None] = "radius"
    radius: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None  # (an infinite radius: inf weights)
    min_ndim: NonNegativeInt = 2
    eps: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0

    device_skip: ClassVar[bool] = True  # on a skipped step the factor is exactly 1
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"radius": Buffer("segment", low=0)}  # 0-d per tensor

    def shape_dependence(self) -> str | None:
        """Each chosen weight is projected alone, chosen by its number of dims."""
        return f"projects each tensor of at least {self.min_ndim} dims onto its own norm ball"

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Always raises: a weight-stage transform acts on the parameters, after the optimizer's write."""
        raise RuntimeError("ProjectNorm acts on the weights: it comes after the optimizer transform, at the end")

    def _chosen(self, ctx: Step) -> list[int]:
        """The indices of the step's parameters with at least `min_ndim` dims (worked out once per layout)."""
        key = ("ProjectNorm.chosen", self.min_ndim)
        idx = ctx.layout.cache.get(key)
        if idx is None:
            idx = ctx.layout.cache[key] = [i for i, p in enumerate(ctx.params) if p.dim() >= self.min_ndim]
        return idx

    def prepare_weights(self, ctx: Step, st: TransformState) -> None:
        """The radius of each tensor first seen: its norm now, before this step's update (or `radius`)."""
        if self.radius is None:
            st.buffers("radius", _norm_now)

    def apply_weights(self, ctx: Step, st: TransformState) -> None:
        """Multiply each chosen parameter by `R / (norm + eps)` (1 where the norm is 0, or the step is skipped)."""
        idx = self._chosen(ctx)
        if not idx:
            return
        params = [ctx.params[i] for i in idx]
        acc = common_acc_dtype(params)
        norms = any_pnorms(params, 2.0, acc)  # (of the full tensors when sharded: modopt.core.distributed)
        if self.radius is None:
            all_r = st.buffers("radius", _norm_now)
            radii = torch.stack([all_r[i] for i in idx]).to(acc)
        else:
            radii = torch.full_like(norms, self.radius)
        factors = torch.where(norms > 0, radii / (norms + self.eps), const(1.0, norms))
        if ctx.skip is not None:  # x * 1 is x, every bit
            factors = torch.where(ctx.skip, const(1.0, factors), factors)
        for p, f in zip(params, factors.unbind(0)):
            p.mul_(f.to(p.dtype))


class QKClip(WeightStage, SeesHostSkips, ShapeDependent):
    r"""QK-Clip (Kimi K2's MuonClip, arXiv 2507.20534): after the optimizer's write, shrink the query and
    key rows of each attention head whose largest pre-softmax logit over the step exceeded $\tau$.

    $$
    \eta_h = \min\Big(1, \max\Big(\eta_{\min}, \frac{\tau}{\max(S_h, \epsilon)}\Big)\Big), \qquad
    W_q^{(h)} \leftarrow \eta_h^{\alpha}\, W_q^{(h)}, \qquad W_k^{(h)} \leftarrow \eta_h^{1-\alpha}\, W_k^{(h)}
    $$

    $S_h$ is head h's maximum of $q \cdot k / \sqrt{d}$ over the forwards since the last step, recorded by an
    `mo.AttentionLogits` provider (`mo.AttentionLogits.attach(model)` hooks `nn.MultiheadAttention`; a
    user's attention records its own). The floor $\epsilon$ keeps $S_h \le 0$ from making a NaN or a
    negative factor; a NaN or $+\infty$ $S_h$ is no measurement (an overflowed forward) and leaves the head
    alone. So the next forward's logit $\eta_h S_h \le \tau$ for the same inputs, unless the floor
    $\eta_{\min}$ holds: one step shrinks a head's logits by at most that factor (1000 by default), so one
    absurd finite $S_h$ (1.5e38) cannot wipe a head out; a head really that far over $\tau$ is shrunk again
    at the next steps, which measure it again. Defaults: `tau=100`, `alpha=0.5` (Megatron's
    `qk_clip_threshold`, `qk_clip_alpha`), `eps=1e-6`, `eta_min=1e-3`, `logits="recorded"`.

    `logits="recorded"` (the default) is Kimi K2's rule: $S_h$ as the forwards recorded it, at the weights
    before the write, so the write itself can still raise the logits. `logits="rewritten"` (modopt's
    variant, not Kimi's) measures $S'_h$ after the write, on the inputs of the forwards since the last step
    (kept by a provider made with `keep_inputs=True`), and clips by it: on those inputs every head's max
    logit is then $\min(S'_h, \tau)$. Cost: the kept inputs stay in memory until the step, and the step
    computes each kept forward's $QK^\top$ once more. A user's `logits_fn` is first tried on each new kind
    of kept input (shapes, dtypes) before the write: one that raises, or returns anything but a real
    floating-point `[heads]` tensor, makes the step raise a `ValueError` or `TypeError` naming the layer
    with nothing changed.

    The transform holds no model: it finds the watched layers through the parameters its optimizer steps
    (the provider registers them; see `modopt.attention`), so its config is just its numbers. Only the
    rows of parameters stepped this step are scaled; the recorded maxima are reset after the clip. A step
    call the non-finite policy skips changes nothing and drops the maxima (and kept inputs) of its own
    forwards, those recorded since the previous call: the weights did not move, the next forward measures
    them again, and an overflowed forward's logits never reach a later clip. A call `Accumulate` stops keeps
    them running to the cycle's step, and a skipped write keeps those of the calls that went ahead. No
    sync. Telemetry: `max_logit` (every watched head, layer by layer, before the clip: $S_h$, or $S'_h$),
    `clipped` (how many heads were scaled), `floored` (how many of them by $\eta_{\min}$) and `nonfinite`
    (how many heads had a NaN or $+\infty$ $S_h$, left alone).

    ```pycon
    >>> import torch, modopt as mo
    >>> attn = torch.nn.MultiheadAttention(4, 2, batch_first=True)
    >>> stats = mo.AttentionLogits.attach(attn)
    >>> opt = mo.Modular(attn.parameters(), mo.SGD(lr=0.0), mo.QKClip(tau=1.0))
    >>> with torch.no_grad(): _ = attn.in_proj_weight.mul_(10.0)
    >>> x = torch.randn(3, 5, 4); attn(x, x, x)[0].sum().backward(); opt.step()
    >>> bool(mo.attention.mha_max_logits(attn, x, x).max() <= 1.0 + 1e-5)
    True

    ```
    """

    positional: ClassVar[str | None] = "tau"
    tau: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 100.0
    alpha: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.5
    eps: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1e-6
    eta_min: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1e-3  # (0 would let one logit zero a head)
    logits: Literal["recorded", "rewritten"] = "recorded"

    device_skip: ClassVar[bool] = True  # on a skipped step every factor is exactly 1

    def shape_dependence(self) -> str | None:
        """Its heads are blocks of each projection weight's rows."""
        return "scales each attention head's block of rows of the query and key weights"

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Always raises: a weight-stage transform acts on the parameters, after the optimizer's write."""
        raise RuntimeError("QKClip acts on the weights: it comes after the optimizer transform, at the end")

    def _targets(self, ctx: Step) -> _Targets:
        """Per watched layer among the step's parameters: `(layer, query rows, key rows)`, each rows entry
        `(param index, start, stop)` (worked out once per layout)."""
        key = "QKClip.targets"
        found = ctx.layout.cache.get(key)
        if found is None:
            found = ctx.layout.cache[key] = _resolve(ctx.params)
        return found

    def prepare_weights(self, ctx: Step, st: TransformState) -> None:
        """Before the write, on every call that is not skipped on the host: check what the clip needs (with
        `logits="rewritten"`: every watched layer keeps its inputs, its `logits_fn` takes them), then settle
        the maxima recorded since the last call (left out where the device skips this call)."""
        targets = self._targets(ctx)
        if self.logits == "rewritten":
            for layer, _, _ in targets:
                if not layer.keep:
                    how = ("make its provider with keep_inputs=True (for nn.MultiheadAttention: "
                           "mo.AttentionLogits.attach(model, keep_inputs=True))" if layer.logits_fn is not None
                           else "watch it with logits_fn=... on a provider made with keep_inputs=True, and "
                           "record(..., inputs=...)")
                    raise ValueError(f"QKClip(logits='rewritten'): the attention layer {layer.name!r} keeps no inputs "
                                     f"to measure its logits at the written weights; {how} (docs/modules/weights.md)")
            if not torch.compiler.is_compiling():  # (traced, a raising logits_fn fails the trace, before any write)
                for layer, _, _ in targets:
                    _try_logits_fn(layer)
        for layer, _, _ in targets:
            layer.settle(ctx.skip)

    def on_host_skip(self, ctx: Step, st: TransformState) -> None:
        """The host skipped this call: drop the maxima and kept inputs of its forwards (the weights did not
        move; the next forward measures them again)."""
        for layer, _, _ in self._targets(ctx):
            layer.drop_call()

    def apply_weights(self, ctx: Step, st: TransformState) -> None:
        """Scale each watched head's query rows by `eta ** alpha` and key rows by `eta ** (1 - alpha)`."""
        targets = self._targets(ctx)
        if not targets:
            return
        acc = common_acc_dtype([ctx.params[i] for _, q, k in targets for i, _, _ in q + k])
        if self.logits == "rewritten":  # the logits of the kept inputs at the weights just written
            s = torch.cat([_rewritten(layer, acc, ctx.skip) for layer, _, _ in targets])
        else:
            s = torch.cat([layer.held for layer, _, _ in targets]).to(acc)  # (a copy: telemetry before the reset)
        raw = self.tau / s.clamp_min(self.eps)
        # NaN or +inf: no measurement, no clip (-inf, no forward, gives 1 anyway); a skipped step: x * 1 is x
        ok = torch.isfinite(s)
        if ctx.skip is not None:
            ok = ok & (ctx.proceed if ctx.proceed is not None else ~ctx.skip)
        eta = torch.where(ok, raw.clamp(self.eta_min, 1.0), const(1.0, raw))
        st.record("max_logit", s)
        st.record("clipped", (eta < 1.0).sum())
        st.record("floored", ((raw < self.eta_min) & ok).sum())
        st.record("nonfinite", (torch.isnan(s) | torch.isposinf(s)).sum())
        fq, fk = eta.pow(self.alpha), eta.pow(1.0 - self.alpha)
        at = 0
        for layer, query, keys in targets:
            h = layer.heads
            for rows, f in ((query, fq[at:at + h]), (keys, fk[at:at + h])):
                for i, start, stop in rows:
                    p = ctx.params[i]
                    block = p[start:stop].unflatten(0, (h, -1))  # (a view whatever the strides: no .view failure)
                    block.mul_(f.to(p.dtype).reshape((h,) + (1,) * (block.dim() - 1)))
            at += h
            layer.consume(ctx.skip)


def _try_logits_fn(layer: Any) -> None:
    """Call a user's `logits_fn` on each new kind of kept input (at the weights before the write): raise, naming
    the layer, when it raises or returns anything but a real floating-point `[heads]` tensor, so that the step
    fails before it writes rather than after."""
    if layer.fn_trusted:
        return
    if layer.fn_checked_for is not layer.logits_fn:  # (the kinds it answered for were another function's)
        layer.fn_checked.clear()
        layer.fn_checked_for = layer.logits_fn
    for inputs in layer.kept:
        kind = tuple((tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t) for t in inputs)
        if kind in layer.fn_checked:
            continue
        door = f"QKClip(logits='rewritten'): the logits_fn of the attention layer {layer.name!r}"
        try:
            with torch.no_grad():
                out = layer.logits_fn(*inputs)
        except Exception as e:
            raise ValueError(f"{door} raised {type(e).__name__}: {e}, on inputs kept for this step (tried before "
                             f"the optimizer's write: nothing was changed)") from e
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or tuple(out.shape) != (layer.heads,):
            got = (f"a tensor of dtype {out.dtype} and shape {list(out.shape)}" if isinstance(out, torch.Tensor)
                   else f"{type(out).__name__} {out!r}")
            raise TypeError(f"{door} must return a real floating-point tensor of shape [{layer.heads}], returned "
                            f"{got} (tried before the optimizer's write: nothing was changed)")
        layer.fn_checked.add(kind)


def _rewritten(layer: Any, acc: torch.dtype, skip: torch.Tensor | None) -> torch.Tensor:
    """`[heads]` in `acc`: the layer's max logits over the inputs it kept (but those of calls the device
    skipped), at its current (written) weights, and over the carried maxima. Then the carry: -inf after a step
    that goes ahead; on a skipped step (the weights unchanged) these maxima, for the next step's clip."""
    s = layer.carry.to(acc, copy=True)  # (a copy: the carry is rewritten below)
    for inputs, dropped in zip(layer.kept, layer.kept_skip):
        v = layer.logits_fn(*inputs).to(acc)
        s = torch.maximum(s, v if dropped is None else torch.where(dropped, -math.inf, v))
    if skip is None:
        layer.carry.fill_(-math.inf)
    else:
        layer.carry.copy_(torch.where(skip, s, -math.inf))
    return s


def _resolve(params: list[torch.Tensor]) -> _Targets:
    from ..attention import layers_of

    index = {id(p): i for i, p in enumerate(params)}
    out: _Targets = []
    for layer in layers_of(params):
        query = [(index[id(t)], a, b) for t, a, b in layer.query if id(t) in index]
        keys = [(index[id(t)], a, b) for t, a, b in layer.key if id(t) in index]
        if query or keys:
            out.append((layer, query, keys))
    if not out and params and not torch.compiler.is_compiling():  # (dynamo cannot trace a warning: eager says it)
        warnings.warn("QKClip: no parameter of this optimizer holds the query or key rows of a watched attention "
                      "layer, so it does nothing; call mo.AttentionLogits.attach(model) (or stats.watch(...) for "
                      "your own attention) before the first step", UserWarning, stacklevel=4)
    return out
