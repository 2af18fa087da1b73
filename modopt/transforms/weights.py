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
from ..core.runner import Step, TransformState
from ..core.state import Buffer
from ..core.transform import Transform

_Targets = list[tuple[Any, list[tuple[int, int, int]], list[tuple[int, int, int]]]]

__all__ = ["ProjectNorm", "QKClip"]


def _norm_now(i: int, p: torch.Tensor) -> torch.Tensor:
    """A tensor's radius when first seen: its Frobenius norm, accumulated in at least float32."""
    return torch.linalg.vector_norm(p.detach(), dtype=acc_dtype(p.dtype))


class ProjectNorm(Transform):
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

    stage: ClassVar[str] = "weights"
    attachable: ClassVar[bool] = False
    device_skip: ClassVar[bool] = True  # on a skipped step the factor is exactly 1
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"radius": Buffer("segment", low=0)}  # 0-d per tensor

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


class QKClip(Transform):
    r"""QK-Clip (Kimi K2's MuonClip, arXiv 2507.20534): after the optimizer's write, shrink the query and
    key rows of each attention head whose largest pre-softmax logit over the step exceeded $\tau$.

    $$
    \eta_h = \min\Big(1, \frac{\tau}{\max(S_h, \epsilon)}\Big), \qquad
    W_q^{(h)} \leftarrow \eta_h^{\alpha}\, W_q^{(h)}, \qquad W_k^{(h)} \leftarrow \eta_h^{1-\alpha}\, W_k^{(h)}
    $$

    $S_h$ is head h's maximum of $q \cdot k / \sqrt{d}$ over the forwards since the last step, recorded by an
    `mo.AttentionLogits` provider (`mo.AttentionLogits.attach(model)` hooks `nn.MultiheadAttention`; a
    user's attention records its own). The floor $\epsilon$ keeps $S_h \le 0$ from making a NaN or a
    negative factor; a NaN $S_h$ leaves the head alone. So the next forward's logit $\eta_h S_h \le \tau$
    for the same inputs. Defaults: `tau=100`, `alpha=0.5` (Megatron's `qk_clip_threshold`,
    `qk_clip_alpha`), `eps=1e-6`, `logits="recorded"`.

    `logits="recorded"` (the default) is Kimi K2's rule: $S_h$ as the forwards recorded it, at the weights
    before the write, so the write itself can still raise the logits. `logits="rewritten"` (modopt's
    variant, not Kimi's) measures $S'_h$ after the write, on the inputs of the forwards since the last step
    (kept by a provider made with `keep_inputs=True`), and clips by it: on those inputs every head's max
    logit is then $\min(S'_h, \tau)$. Cost: the kept inputs stay in memory until the step, and the step
    computes each kept forward's $QK^\top$ once more.

    The transform holds no model: it finds the watched layers through the parameters its optimizer steps
    (the provider registers them; see `modopt.attention`), so its config is just its numbers. Only the
    rows of parameters stepped this step are scaled; the recorded maxima are reset after the clip. A step
    the non-finite policy skips, or `Accumulate` stops, changes nothing (the maxima keep running). No
    sync. Telemetry: `max_logit` (every watched head, layer by layer, before the clip: $S_h$, or $S'_h$)
    and `clipped` (how many heads were scaled).

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
    logits: Literal["recorded", "rewritten"] = "recorded"

    stage: ClassVar[str] = "weights"
    attachable: ClassVar[bool] = False
    device_skip: ClassVar[bool] = True  # on a skipped step every factor is exactly 1

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
        """Before the write: with `logits="rewritten"`, check that every watched layer keeps its inputs
        (the default's maxima were recorded by the forwards: nothing to check)."""
        if self.logits == "rewritten":
            for layer, _, _ in self._targets(ctx):
                if not layer.keep:
                    how = ("make its provider with keep_inputs=True (for nn.MultiheadAttention: "
                           "mo.AttentionLogits.attach(model, keep_inputs=True))" if layer.logits_fn is not None
                           else "watch it with logits_fn=... on a provider made with keep_inputs=True, and "
                           "record(..., inputs=...)")
                    raise ValueError(f"QKClip(logits='rewritten'): the attention layer {layer.name!r} keeps no inputs "
                                     f"to measure its logits at the written weights; {how} (docs/modules/weights.md)")

    def apply_weights(self, ctx: Step, st: TransformState) -> None:
        """Scale each watched head's query rows by `eta ** alpha` and key rows by `eta ** (1 - alpha)`."""
        targets = self._targets(ctx)
        if not targets:
            return
        maxima = [layer.max_logits for layer, _, _ in targets]
        acc = common_acc_dtype([ctx.params[i] for _, q, k in targets for i, _, _ in q + k])
        if self.logits == "rewritten":  # the logits of the kept inputs at the weights just written
            s = torch.cat([_rewritten(layer, acc, ctx.skip) for layer, _, _ in targets])
        else:
            s = torch.cat(maxima).to(acc)  # (a copy: telemetry before the reset; the factors in at least float32)
        eta = (self.tau / s.clamp_min(self.eps)).clamp_max(1.0)
        eta = torch.where(torch.isnan(s), const(1.0, eta), eta)
        if ctx.skip is not None:  # x * 1 is x, every bit
            eta = torch.where(ctx.skip, const(1.0, eta), eta)
        st.record("max_logit", s)
        st.record("clipped", (eta < 1.0).sum())
        fq, fk = eta.pow(self.alpha), eta.pow(1.0 - self.alpha)
        at = 0
        for (layer, query, keys), m in zip(targets, maxima):
            h = layer.heads
            for rows, f in ((query, fq[at:at + h]), (keys, fk[at:at + h])):
                for i, start, stop in rows:
                    p = ctx.params[i]
                    p[start:stop].view(h, -1).mul_(f.to(p.dtype).unsqueeze(1))
            at += h
            if ctx.skip is None:
                m.fill_(-math.inf)
            else:  # a skipped step keeps them running
                m.copy_(torch.where(ctx.skip, m, -math.inf))
            if layer.kept:  # (consumed; in the default mode a provider that keeps inputs must not pile them up)
                layer.kept.clear()


def _rewritten(layer: Any, acc: torch.dtype, skip: torch.Tensor | None) -> torch.Tensor:
    """`[heads]` in `acc`: the layer's max logits over the inputs it kept, at its current (written) weights,
    and over the carried maxima of forwards whose step the device skipped. Then the carry: -inf after a step
    that goes ahead; on a skipped step (the weights unchanged) these maxima, for the next step's clip."""
    s = layer.carry.to(acc, copy=True)  # (a copy: the carry is rewritten below)
    for inputs in layer.kept:
        s = torch.maximum(s, layer.logits_fn(*inputs).to(acc))
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
