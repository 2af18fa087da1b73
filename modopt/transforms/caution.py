"""Caution: masks and sign rules that compare the update with the gradient or the weights (2024-2025).

Placed after an optimizer transform, which then returns its update `u` instead of writing the
parameters: `Cautious` zeroes the elements of `u` whose sign disagrees with the gradient's
(Liang et al. 2024), `Grams` gives `u` the gradient's signs (Cao et al. 2024), `WeightDecay`
adds a decoupled weight decay to `u`, masked where the update and the weight disagree in sign
with `cautious=True` (`CautiousWeightDecay`; Chen et al. 2025). The gradient `g` is the
parameter's `.grad` as the step has it when the transform runs: the raw gradient, or what the
transforms before the optimizer made of it in place (a clip scales it and keeps its signs).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from ..core.kernels import const
from ..core.reduce import common_acc_dtype
from ..core.step import Step, TransformState
from ..core.roles import PostOptimizer, ShapeDependent
from ..core.reduce import Segments, make_segments
from ..core.transform import Transform
from ._util import FiniteNonNegativeFloat
from .optimizers import _lr_value

__all__ = ["Cautious", "Grams", "WeightDecay", "CautiousWeightDecay"]

CautionScale = Literal["timm", "c_optim", "heavyball", "none"]


def tensor_segments(ctx: Step) -> Segments:
    """One segment per parameter tensor, the table `Scoped(scope="tensor")` shares (cached on the layout):
    its `reduce` takes the statistic of each *full* tensor under FSDP2 (`modopt.core.distributed`)."""
    key = ("segments", "tensor", None, False, 1)  # (Scoped.segments' key for scope="tensor": one table)
    seg = ctx.layout.cache.get(key)
    if seg is None:
        seg = ctx.layout.cache[key] = make_segments(ctx.params, ctx.ranges, "tensor", None, False, 1, ctx.names)
    seg.memo = ctx.memo
    return seg


def agree(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`u * g > 0` in exact arithmetic, elementwise (a bool tensor): both non-zero, of one sign.

    `u * sign(g)` is `u`, `-u` or 0 exactly, so no product underflows to 0 (an fp16 update that carries
    a learning rate of 1e-3 times a gradient of 1e-4 would); a NaN in either gives False."""
    return (u * torch.sign(g)) > 0


class Cautious(ShapeDependent):
    r"""Keep only the elements of the update that agree in sign with the gradient, and rescale.

    $$
    m = \mathbb{1}[u \odot g > 0], \qquad u \leftarrow s \cdot m \odot u
    $$

    per parameter tensor, with `g` the parameter's gradient and `s` the rescaling chosen by `scale`
    ($N$ the tensor's element count, $k = \sum m$ the elements kept):

    | `scale` | $s$ | source |
    |---|---|---|
    | `"timm"` (default) | $1 / \max(k/N,\ 10^{-3})$ | timm's `caution=True`; C-Optim since 2025 |
    | `"c_optim"` | $N / (k + 1)$ | the C-Optim paper's code; pytorch_optimizer's `cautious=True` |
    | `"heavyball"` | $N / \max(k, 1)$, with $m = [\operatorname{signbit} u = \operatorname{signbit} g]$ | HeavyBall |
    | `"none"` | $1$ | the bare mask |

    HeavyBall's mask compares sign bits: where the gradient is $+0$ a positive update is kept (and
    counted), a negative one dropped; the other rules drop every element with a zero gradient. Place it after an optimizer transform
    (`mo.Adam(...), mo.Cautious()`), which then returns its update instead of writing the parameters:
    that is "Cautious Optimizers" (Liang et al. 2024, arXiv 2411.16085), C-AdamW with
    `mo.Adam(lr), mo.Cautious(), mo.WeightDecay(wd)`. Default `scale="timm"`: the most used rule, and
    the only one whose amplification is bounded (by 1000, when almost every element is masked; the two
    count rules multiply a lone kept element by up to $N$).

    $k/N$ is the full tensor's under FSDP2 (the counts are summed over the shards). The mask is exact:
    modopt compares signs, where the references multiply `u` and `g` in the parameters' dtype (a
    product that underflows to 0 drops its element there). Telemetry: `kept`, the fraction of each
    tensor's elements kept (not with `scale="none"`, which counts nothing).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(4))
    >>> opt = mo.Modular([p], mo.LR(1.0), mo.Cautious())
    >>> p.grad = torch.tensor([1.0, -2.0, 3.0, 0.0]); opt.step(); p.data   # u = g: 3 of 4 kept, s = 4/3
    tensor([-1.3333,  2.6667, -4.0000,  0.0000])

    ```
    """

    positional: ClassVar[str | None] = "scale"
    device_skip = True  # keeps its state on a step the device skips (it has none)

    scale: CautionScale = "timm"

    def shape_dependence(self) -> str | None:
        """The rescaling counts the kept elements of each tensor (`scale="none"` counts nothing)."""
        return None if self.scale == "none" else f"rescales each tensor by its count of kept elements (scale={self.scale!r})"

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Zero the elements that disagree with the gradient's sign; multiply each tensor by its `s`."""
        grads = [p.grad for p in ctx.params]
        if self.scale == "heavyball":
            keep = [torch.signbit(u) == torch.signbit(g) for u, g in zip(updates, grads)]
        else:
            keep = [agree(u, g) for u, g in zip(updates, grads)]
        traced = torch.compiler.is_compiling()
        if self.scale == "none":
            if traced:  # out of place: inductor fuses it (an in-place write into a gradient tripped it, 2.13)
                return [torch.where(k, u, const(0.0, u)) for u, k in zip(updates, keep)]
            for u, k in zip(updates, keep):
                u.masked_fill_(~k, 0.0)
            return updates
        seg = tensor_segments(ctx)
        kept = seg.reduce(keep, "sum").to(common_acc_dtype(updates))  # (exact counts up to 2**24 per tensor)
        n = seg.element_counts(kept)
        st.record("kept", kept / n.clamp(min=1))
        if self.scale == "timm":
            s = 1.0 / torch.clamp(kept / n.clamp(min=1), min=1e-3)
        elif self.scale == "c_optim":  # (N times the reciprocal: the reference's rounding, bit for bit)
            s = (kept + 1).reciprocal() * n
        else:
            s = n / kept.clamp(min=1)
        if traced:
            return [torch.where(k, u * si, const(0.0, u)) for u, k, si in zip(updates, keep, s.unbind(0))]
        for u, k in zip(updates, keep):
            u.masked_fill_(~k, 0.0)
        seg.mul_(updates, s)
        return updates


class Grams(Transform):
    r"""Give the update the gradient's signs: $u \leftarrow \operatorname{sign}(g) \odot |u|$.

    Grams, "Gradient descent with adaptive momentum scaling" (Cao et al. 2024, arXiv 2412.17107):
    after an optimizer transform, the step keeps the optimizer's magnitudes and takes its direction
    from the current gradient `g` (the parameter's gradient); an element with a zero gradient does not
    move. `mo.Adam(lr, eps=1e-6), mo.Grams()` is pytorch_optimizer's `Grams` with its defaults
    (to float rounding: the reference divides by the bias corrections in another order).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(3))
    >>> opt = mo.Modular([p], mo.LR(1.0), mo.Grams())
    >>> p.grad = torch.tensor([2.0, -0.5, 0.0]); opt.step(); p.data
    tensor([-2.0000,  0.5000,  0.0000])

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip = True  # keeps its state on a step the device skips (it has none)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """`sign(g) * |u|` for every parameter (the signs read before any write: `u` may be the gradient)."""
        signs = [torch.sign(p.grad) for p in ctx.params]
        if torch.compiler.is_compiling():
            return [u.abs() * s for u, s in zip(updates, signs)]
        for u, s in zip(updates, signs):
            u.abs_().mul_(s)
        return updates


class WeightDecay(PostOptimizer):
    r"""Decoupled weight decay after the optimizer: $u \leftarrow u + \text{lr}\cdot\lambda\, x$, or with
    `cautious=True` only where the update and the weight agree in sign.

    $$
    u \leftarrow u + \text{lr}\cdot\lambda\ \mathbb{1}[u \odot x \ge 0] \odot x
    \qquad\Longrightarrow\qquad
    x \leftarrow x - u - \text{lr}\cdot\lambda\ \mathbb{1}[u \odot x \ge 0] \odot x
    $$

    with $x$ the parameter, $\lambda$ = `weight_decay` and lr the param group's learning rate, read
    from the group every step as the optimizer transform before it exposes it (`group["lr"]`, so a
    scheduler drives the decay too). Placed after an optimizer transform, it is AdamW's decoupled
    decay for any optimizer, left out of what comes before it: `mo.Adam(lr), mo.Cautious(),
    mo.WeightDecay(1e-2)` is timm's cautious AdamW (its decay is not masked). `cautious=True` is
    cautious weight decay (Chen et al. 2025, arXiv 2510.12402): where $u x < 0$ the step moves $x$ away
    from 0 and the decay, which pulls it toward 0, is left out; an element with $u = 0$ or $x = 0$
    decays (`>= 0`, the paper's rule).
    `CautiousWeightDecay` is this transform with `cautious=True`.

    The mask is exact (signs compared, no product to underflow). `weight_decay` is a field, not a param
    group key (the optimizer's `weight_decay` key is the optimizer's own). Defaults: `weight_decay=1e-2`
    (torch's AdamW), `cautious=False`. It needs an lr in the param groups: a `ValueError` at the first
    step says so when no transform exposes one.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.tensor([1.0, 1.0, -1.0]))
    >>> opt = mo.Modular([p], mo.LR(0.5), mo.WeightDecay(0.1, cautious=True))
    >>> p.grad = torch.tensor([1.0, -1.0, 0.0]); opt.step(); p.data   # u x < 0 for the second: no decay
    tensor([ 0.4500,  1.5000, -0.9500])

    ```
    """

    positional: ClassVar[str | None] = "weight_decay"
    device_skip = True  # keeps its state on a step the device skips (it has none)

    weight_decay: FiniteNonNegativeFloat = 1e-2
    cautious: bool = False

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Add `lr * weight_decay * x` (where `u * x >= 0` with `cautious`) to each update."""
        traced = torch.compiler.is_compiling()
        out = list(updates) if traced else updates
        for g, a, b in ctx.per_group():
            if b == a or self.weight_decay == 0:
                continue
            if "lr" not in g:
                raise ValueError(
                    f"{st.key}: {type(self).__name__} scales its decay by the param group's lr, and no transform "
                    "of this pipeline exposes one: put it after an optimizer transform (mo.Adam, mo.SGD, mo.LR, ...)"
                )
            coef = _lr_value(g["lr"], updates[a]) * self.weight_decay
            params = [p.detach() for p in ctx.params[a:b]]
            if self.cautious:  # u * x >= 0 exactly: not (both non-zero and of opposite signs)
                decay = [torch.where((u * torch.sign(x)) >= 0, x, 0.0) * coef for u, x in zip(updates[a:b], params)]
            elif traced or isinstance(coef, torch.Tensor):
                decay = [x * coef for x in params]
            else:
                torch._foreach_add_(updates[a:b], params, alpha=coef)
                continue
            if traced:
                out[a:b] = [u + d for u, d in zip(updates[a:b], decay)]
            else:
                torch._foreach_add_(updates[a:b], decay)
        return out


class CautiousWeightDecay(WeightDecay):
    r"""Cautious weight decay (Chen et al. 2025, arXiv 2510.12402): `WeightDecay` with `cautious=True`.

    $$
    u \leftarrow u + \text{lr}\cdot\lambda\ \mathbb{1}[u \odot x \ge 0] \odot x
    $$

    after an optimizer transform: a weight decays only where the update does not move it away from 0.
    nanochat and Dion apply it to Muon's orthogonalized update. Default: `weight_decay=1e-2`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.tensor([2.0, -2.0]))
    >>> opt = mo.Modular([p], mo.Adam(lr=0.1), mo.CautiousWeightDecay(0.5))
    >>> p.grad = torch.tensor([1.0, 1.0]); opt.step(); p.data   # the second moves away from 0: not decayed
    tensor([ 1.8000, -2.1000])

    ```
    """

    positional: ClassVar[str | None] = "weight_decay"

    cautious: bool = True
