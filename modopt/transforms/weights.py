"""Weight-stage transforms: they act on the parameters after the optimizer wrote them."""

from __future__ import annotations

from typing import Annotated, ClassVar

import torch
from pydantic import Field, NonNegativeInt

from ..core.norms import acc_dtype, common_acc_dtype
from ..core.runner import Step, TransformState, any_pnorms
from ..core.state import Buffer
from ..core.transform import Transform

__all__ = ["ProjectNorm"]


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
        factors = torch.where(norms > 0, radii / (norms + self.eps), 1.0)
        if ctx.skip is not None:  # x * 1 is x, every bit
            factors = torch.where(ctx.skip, 1.0, factors)
        for p, f in zip(params, factors.unbind(0)):
            p.mul_(f.to(p.dtype))
