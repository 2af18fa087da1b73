"""Per-matrix rescalings of the 2026 Muon recipes: MuonEq, Muon+ and the shape factor as its own transform.

`MuonEq` equilibrates the rows of a matrix-shaped update before `Orthogonalize` (each row rescaled to the
root-mean-square row norm, so the spectrum entering Newton-Schulz is better conditioned); `MuonPlus` sets the
Frobenius norm of the orthogonalized update to that of a semi-orthogonal matrix, `sqrt(min(rows, cols))`,
after it. Both are karpathy/nanochat's (`nanochat/optim.py`, since July 2026). `ShapeScale` multiplies each
matrix-shaped update by torch.optim.Muon's per-shape learning-rate factor, where `Orthogonalize(adjust_lr=...)`
would be undone by a later transform that sets the norm (Muon+, NorMuon) or where a weight decay after the
learning rate must see the shape-adjusted lr too (nanochat's cautious weight decay).

Every rule reads a tensor of more than 2 dims as `reshape(shape[0], -1)`, as `Orthogonalize` does, or with
`batch_dims=k` as a stack of matrices over its first `k` dims (an expert stack `(E, out, in)`: `batch_dims=1`),
each rescaled by its own norms and shape; it leaves tensors with 0 or 1 dims and empty ones unchanged.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from ..core.reduce import acc_dtype
from ..core.step import Step, TransformState
from .orthogonal import AdjustLR, _Matrices, adjust_ratio, blockwise, frobenius, per_matrix_shape, per_row_shape

__all__ = ["MuonEq", "MuonPlus", "ShapeScale"]


class MuonEq(_Matrices):
    r"""MuonEq's row equilibration of a matrix-shaped update (arXiv 2603.28254), nanochat's form.

    Per matrix $X$ (`rows x cols`, more than 2 dims as `reshape(shape[0], -1)`) with rows $X_i$:

    $$
    X_i \leftarrow X_i\,\frac{\lVert X \rVert_F / \sqrt{\text{rows}}}{\max(\lVert X_i \rVert_2, \varepsilon)}
    $$

    every row gets the root-mean-square row norm, so the Frobenius norm is kept (up to rows below
    $\varepsilon$) and the singular values entering `Orthogonalize` are less spread. Place it right
    before `Orthogonalize`. It is karpathy/nanochat's step (`nanochat/optim.py`, `muon_step_fused`,
    since July 2026): the norms in float32 (at least the update's precision), the factor cast to the
    update's dtype and multiplied in it. Default `eps=1e-6` (nanochat's floor of a row's norm): a zero
    row stays zero. Tensors with 0 or 1 dims and empty tensors pass through. Stateless.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2, 2)); p.grad = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    >>> opt = mo.Modular([p], mo.MuonEq(), mo.LR(1.0)); opt.step()
    >>> (-p.data).diag()   # both rows now have norm sqrt(5), the RMS of 3 and 1
    tensor([2.2361, 2.2361])

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip = True  # stateless

    eps: float = Field(1e-6, gt=0.0, allow_inf_nan=False)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Rescale each row of each matrix-shaped update to the matrix's root-mean-square row norm."""
        return blockwise(self, updates, self._equilibrated)

    def _equilibrated(self, u: torch.Tensor) -> torch.Tensor | None:
        m = self.matrix(u)
        if m is None:
            return None
        x = m.to(acc_dtype(u.dtype))
        target = frobenius(x) / (m.shape[-2] ** 0.5)  # (each matrix's own)
        rows = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(self.eps)
        # one factor per row, broadcast over u itself: the result keeps u's memory layout
        return u * (target / rows).to(u.dtype).view(per_row_shape(u, self.batch_dims))


class MuonPlus(_Matrices):
    r"""Muon+'s renormalization of an orthogonalized update (arXiv 2602.21545), nanochat's form.

    Per matrix $O$ (`rows x cols`, more than 2 dims as `reshape(shape[0], -1)`):

    $$
    O \leftarrow O\,\frac{\sqrt{\min(\text{rows}, \text{cols})}}{\max(\lVert O \rVert_F, \varepsilon)}
    $$

    the Frobenius norm of an exactly semi-orthogonal matrix, which a few Newton-Schulz steps do not
    reach. Place it right after `Orthogonalize` (and before `NorMuon`, which keeps the norm it is
    given). It is karpathy/nanochat's step (`nanochat/optim.py`, `muon_step_fused`, since July 2026):
    the norm in float32 (at least the update's precision), the factor cast to the update's dtype.
    It sets the norm, so a shape factor of `Orthogonalize(adjust_lr=...)` before it is undone: put
    `ShapeScale` after it instead. Default `eps=1e-6` (nanochat's): a zero update stays zero. Tensors
    with 0 or 1 dims and empty tensors pass through. Stateless.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2, 3)); p.grad = torch.tensor([[3.0, 0.0, 0.0], [0.0, 4.0, 0.0]])
    >>> opt = mo.Modular([p], mo.MuonPlus(), mo.LR(1.0)); opt.step()
    >>> round(float(p.data.norm()), 6)   # sqrt(min(2, 3))
    1.414214

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip = True  # stateless

    eps: float = Field(1e-6, gt=0.0, allow_inf_nan=False)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Scale each matrix-shaped update to the Frobenius norm `sqrt(min(rows, cols))`."""
        return blockwise(self, updates, self._renormalized)

    def _renormalized(self, u: torch.Tensor) -> torch.Tensor | None:
        m = self.matrix(u)
        if m is None:
            return None
        if m.dim() == 3:  # each matrix by its own norm
            norm = frobenius(m.to(acc_dtype(u.dtype))).clamp_min(self.eps)
            norm = norm.view(per_matrix_shape(u, self.batch_dims, m))
        else:
            norm = torch.linalg.vector_norm(u.to(acc_dtype(u.dtype))).clamp_min(self.eps)
        return u * (min(m.shape[-2:]) ** 0.5 / norm).to(u.dtype)


class ShapeScale(_Matrices):
    r"""Multiply each matrix-shaped update by torch.optim.Muon's learning-rate factor of its shape.

    $u \leftarrow r(\text{rows}, \text{cols})\, u$ with `adjust_lr` (default `"original"`):
    `"original"` $\sqrt{\max(1, \text{rows}/\text{cols})}$ (Keller Jordan's, nanochat's),
    `"spectral_unclamped"` $\sqrt{\text{rows}/\text{cols}}$ (torch 2.14, Bernstein's),
    `"match_rms_adamw"` $0.2\sqrt{\max(\text{rows}, \text{cols})}$ (Moonlight's), `"none"` 1; a tensor of
    more than 2 dims as `reshape(shape[0], -1)`; tensors with 0 or 1 dims and empty tensors pass through.

    `Orthogonalize(adjust_lr=...)` applies the same factor inside the orthogonalization; this transform
    applies it anywhere in a chain: after `MuonPlus` (which would undo an earlier factor), or last, after
    `LR` and a weight decay, so that the decay uses the shape-adjusted lr as nanochat's does
    (`p <- p - lr r (O + wd mask p)`). Stateless.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(4, 1)); p.grad = torch.ones(4, 1)
    >>> opt = mo.Modular([p], mo.LR(1.0), mo.ShapeScale()); opt.step(); p.data.flatten()   # sqrt(4 / 1)
    tensor([-2., -2., -2., -2.])

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip = True  # stateless

    adjust_lr: AdjustLR = "original"

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Multiply each matrix-shaped update by its shape's factor (others pass through)."""
        out = list(updates)
        for i, u in enumerate(updates):
            m = self.matrix(u)
            if m is None:
                continue
            r = adjust_ratio(m.shape[-2], m.shape[-1], self.adjust_lr)  # (each matrix's own shape)
            if r != 1.0:
                out[i] = u * r
        return out
