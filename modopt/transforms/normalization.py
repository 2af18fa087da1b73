"""Normalization and centralization of the update."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field, NonNegativeFloat, PositiveFloat

from ..core.norms import Ord, parse_ord
from ..core.scope import Dims, Scoped, ScopeName
from ..core.transform import Transform


def normalize_scale(norm: torch.Tensor, norm_value: float, eps: float) -> torch.Tensor:
    """`norm_value / (|norm| + eps)` where the norm is positive, else 1 (zeros stay zero)."""
    n = norm.abs()
    return torch.where(n > 0, norm_value / (n + eps), torch.ones_like(n))


class Normalize(Scoped):
    r"""Set the `ord` norm of the update over the scope to `norm_value`.

    $$
    u \leftarrow u \cdot \frac{\text{norm\_value}}{n(u) + \varepsilon} \quad (n(u) > 0)
    $$

    A slice whose norm is 0 is left unchanged (it stays zero). Defaults:
    `norm_value=1`, `ord=2`, `scope="tensor"`, `eps=0`; `eps=1e-8`
    reproduces drytorch's `GradParamNormalizer`. torchzero's `Normalize`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([3.0, 4.0])
    >>> opt = mo.Modular([p], mo.Normalize(), mo.LR(1.0)); opt.step(); p.data
    tensor([-0.6000, -0.8000])

    ```
    """

    positional = "norm_value"

    norm_value: PositiveFloat = 1.0
    ord: Ord = 2.0
    scope: ScopeName = "tensor"
    eps: NonNegativeFloat = 0.0

    folds_scale: ClassVar[bool] = True  # a scale deferred to it rides along in its own factor
    update_access: ClassVar[str] = "scale"

    def apply(self, ctx, st, updates):
        seg = self.segments(ctx, st)
        prior = self._prior_scale(ctx, seg, updates)
        norm = seg.reduce(updates, self.ord)
        if prior is None:
            scale = seg.map(lambda n: normalize_scale(n, self.norm_value, self.eps), norm)
        else:  # u = prior * raw: n(u) = |prior| n(raw); one multiplication applies both factors
            norm = seg.map(lambda n, s: n * s.abs(), norm, prior)
            scale = seg.map(lambda n, s: s * normalize_scale(n, self.norm_value, self.eps), norm, prior)
        self.scale_(ctx, seg, updates, scale)
        if seg.stacked:
            st.record("norm", norm)
            st.record("scale", scale)
        return updates


    def _prior_scale(self, ctx, seg, updates):
        """A scale deferred to this transform, per segment of `seg` (None: nothing incoming, or applied now)."""
        incoming = ctx.incoming_scale
        if incoming is None:
            return None
        ord = parse_ord(self.ord)
        # an inactive segment (min_size) is not multiplied here, so the prior scale could not ride along
        homogeneous = seg.all_active and ((isinstance(ord, float) and ord > 0) or ord in ("mad", "std"))
        if homogeneous and seg.kind == "tensor":
            vals = incoming.per_tensor(len(updates))
            if vals is not None:
                incoming.take()
                return torch.stack(vals)
        elif homogeneous and seg.kind in ("global", "group"):
            vals = [incoming.for_range(a, b) for a, b in seg.ranges]
            if all(v is not None for v in vals):
                incoming.take()
                return torch.stack(vals)
        incoming.apply(updates)
        return None


class Centralize(Scoped):
    r"""Subtract the mean of the update over the scope (or over `dim`).

    $$
    u \leftarrow u - \operatorname{mean}(u)
    $$

    Defaults: `scope="tensor"`, `min_size=2` (a one-element slice is left
    alone). torchzero's `Centralize`; see `GradientCentralization`.
    """

    positional = None

    scope: ScopeName = "tensor"
    min_size: int = Field(2, ge=1)

    def apply(self, ctx, st, updates):
        seg = self.segments(ctx, st)
        seg.sub_(updates, seg.reduce(updates, "mean"))
        return updates


class GradientCentralization(Centralize):
    r"""Gradient centralization (Yong et al. 2020): for each output unit, subtract
    the mean over all dims but the first; tensors with one dim (biases) are left alone.

    Equal to `Centralize(dim=0, inverse_dims=True)`.
    """

    positional = None

    dim: Dims = 0
    inverse_dims: bool = True
