"""Normalization and centralization of the update."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field, NonNegativeFloat, PositiveFloat

from ..core.kernels import const
from ..core.reduce import Ord
from ..core.plan import pnorm
from ..core.step import Step, TransformState
from ..core.roles import Scale, ScaleFact, ShapeDependent
from ..core.scope import Dims, Scoped, ScopeName
from ..core.transform import Transform

__all__ = ["Normalize", "Centralize", "GradientCentralization", "Sign", "ScaledSign"]


def normalize_scale(norm: torch.Tensor, norm_value: float, eps: float, signed: bool = True) -> torch.Tensor:
    """`norm_value / (|norm| + eps)` where the norm is positive, else 1 (zeros stay zero).

    `signed=False` says the norm is >= 0 already (every `ord` but "sum"). The defaults
    (`norm_value=1`, `eps=0`) take three small ops: `1 / n` is `n.reciprocal()` bit for bit.
    """
    n = norm.abs() if signed else norm
    d = n + eps if eps != 0 else n
    inv = d.reciprocal() if norm_value == 1 else norm_value / d
    return torch.where(n > const(0.0, n), inv, const(1.0, inv))  # (0-d tensors: no scalar made per call)


class Normalize(Scoped, ScaleFact):
    r"""Set the `ord` norm of the update over the scope to `norm_value`.

    $$
    u \leftarrow u \cdot \frac{\text{norm\_value}}{n(u) + \varepsilon} \quad (n(u) > 0)
    $$

    A slice whose norm is 0 is left unchanged (it stays zero). With `dim` /
    `inverse_dims`, $n$ is taken per slice over each tensor's slice dims, and a
    tensor with none (a bias under `dim=0, inverse_dims=True`) is left unchanged
    (docs/concepts.md, "Slices"). Defaults: `norm_value=1`, `ord=2`,
    `scope="tensor"`, `eps=0`; `eps=1e-8` reproduces drytorch's
    `GradParamNormalizer`. torchzero's `Normalize` (equal with the same `dim`,
    `inverse_dims`, `min_size`).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([3.0, 4.0])
    >>> opt = mo.Modular([p], mo.Normalize(), mo.LR(1.0)); opt.step(); p.data
    tensor([-0.6000, -0.8000])

    ```
    """

    positional: ClassVar[str | None] = "norm_value"
    device_skip = True  # keeps its state on a step the device skips

    norm_value: PositiveFloat = 1.0
    ord: Ord = 2.0
    scope: ScopeName = "tensor"
    eps: NonNegativeFloat = 0.0

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Multiply each segment by `norm_value / (norm + eps)` (a segment whose norm is 0 is left as it is)."""
        seg = st.segments(self)
        norm = seg.reduce(updates, self.ord)
        scale = normalize_scale(norm, self.norm_value, self.eps, signed=self.ord == "sum")
        st.scale_(seg, updates, scale)  # (deferred into a compiled step's fused optimizer op: `scale_fact`)
        st.record("norm", norm)
        st.record("scale", scale)
        return updates

    def scale_fact(self) -> Scale | None:
        """Its last touch of the updates is the multiply by its scale. With `eps=0`, `min_size=1` and a
        p-norm `ord` (p > 0) it sets the norm: each segment's norm becomes `norm_value` whatever positive
        factor multiplied it before (`modopt.core.plan.cancelled_scales`)."""
        sets = self.eps == 0 and self.min_size == 1 and pnorm(self.ord) is not None
        return Scale(self.scope, self.dim, self.inverse_dims, sets_norm=sets)


class Centralize(Scoped):
    r"""Subtract the mean of the update over the scope (or over `dim`).

    $$
    u \leftarrow u - \operatorname{mean}(u)
    $$

    With `dim` / `inverse_dims` the mean is per slice, over each tensor's slice
    dims; a tensor with none (a bias under `dim=0, inverse_dims=True`) is left
    unchanged (docs/concepts.md, "Slices"). Defaults: `scope="tensor"`,
    `min_size=2` (a one-element slice is left alone). torchzero's `Centralize`
    (equal with the same `dim`, `inverse_dims`, `min_size`); see
    `GradientCentralization`.
    """

    positional: ClassVar[str | None] = None
    device_skip = True  # keeps its state on a step the device skips

    scope: ScopeName = "tensor"
    min_size: int = Field(2, ge=1)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Subtract each segment's mean."""
        seg = st.segments(self)
        seg.sub_(updates, seg.reduce(updates, "mean"))
        return updates


class GradientCentralization(Centralize):
    r"""Gradient centralization (Yong et al. 2020): for each output unit, subtract
    the mean over all dims but the first; tensors with one dim (biases) are left alone.

    $$
    u_i \leftarrow u_i - \operatorname{mean}(u_i)
    $$

    for each slice $u_i$ along dim 0 of a tensor with two or more dims. Equal to
    `Centralize(dim=0, inverse_dims=True)`: a 1-D tensor has no slice dim left, so
    it is left alone whatever `min_size` (docs/concepts.md, "Slices").
    """

    positional: ClassVar[str | None] = None

    dim: Dims = 0
    inverse_dims: bool = True


class Sign(Transform):
    r"""Replace every element of the update by its sign: signSGD's direction.

    $$
    u_i \leftarrow \operatorname{sign}(u_i) \in \{-1, 0, 1\}
    $$

    with $\operatorname{sign}(0) = 0$, as `torch.sign`. Before an `LR` it is
    signSGD (Bernstein et al. 2018, "signSGD: Compressed Optimisation for
    Non-Convex Problems"); after `Momentum(beta, nesterov=False)` it is their
    Signum. It has no fields. Reproduces optax's `scale_by_sign` and torchzero's
    `Sign`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(3)); p.grad = torch.tensor([2.0, -0.5, 0.0])
    >>> opt = mo.Modular([p], mo.Sign(), mo.LR(0.1)); opt.step(); p.data
    tensor([-0.1000,  0.1000,  0.0000])

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip = True  # keeps its state on a step the device skips (it has none)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The sign of every element, in place."""
        torch._foreach_sign_(updates)
        return updates


class ScaledSign(ShapeDependent):
    r"""The sign of every element times the tensor's mean absolute value: EF-signSGD's scaled sign.

    For each parameter's update $u$ of $d$ elements,

    $$
    u \leftarrow \frac{\lVert u \rVert_1}{d} \operatorname{sign}(u)
    $$

    with $\operatorname{sign}(0) = 0$. The direction is `Sign`'s, the size the
    update's own: the step keeps the update's $\ell_1$ norm, so the learning
    rate of plain SGD still fits (`Sign` needs a much smaller one). This is the
    scaled sign compressor of Karimireddy, Rebjock, Stich and Jaggi 2019, "Error
    Feedback Fixes SignSGD and other Gradient Compression Schemes" (ICML,
    arXiv 1901.09847), applied to each tensor, without their error feedback
    (which keeps the compression error as state). It has no fields and no state.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(4)); p.grad = torch.tensor([2.0, -1.0, 0.0, 1.0])
    >>> opt = mo.Modular([p], mo.ScaledSign(), mo.LR(0.1)); opt.step(); p.data
    tensor([-0.1000,  0.1000,  0.0000, -0.1000])

    ```
    """

    positional: ClassVar[str | None] = None

    def shape_dependence(self) -> str | None:
        """The scale is each tensor's mean absolute value."""
        return "scales each tensor by its mean absolute value"

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Each update's mean absolute value times its sign, in place."""
        scales = torch._foreach_norm(updates, 1)
        torch._foreach_div_(scales, [max(u.numel(), 1) for u in updates])
        torch._foreach_sign_(updates)
        torch._foreach_mul_(updates, scales)
        return updates
