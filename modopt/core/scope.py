"""The scope fields of a reducing transform (`Scoped`): what its statistics are taken over.

`scope` is `"global"` (one segment: every tensor of the step), `"group"` (one per param group) or
`"tensor"` (one per tensor, or with `dim` one per slice of a tensor; `inverse_dims=True` reduces over
the other dims); segments with fewer than `min_size` elements are left unchanged. The mechanism (the
segments, the statistics, their application) is `modopt.core.reduce`; a transform gets its step's
segments from its state, `st.segments(self)` (`modopt.core.step.TransformState.segments`).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from .reduce import Dims, segment_shape
from .roles import Segmented, ShapeDependent

ScopeName = Literal["global", "group", "tensor"]


class Scoped(Segmented, ShapeDependent, abstract=True):
    """Mixin of the scope fields (see `modopt.core.scope`)."""

    scope: ScopeName = "global"
    dim: Dims = None
    inverse_dims: bool = False
    min_size: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _dims_need_tensor_scope(self) -> Scoped:
        if (self.dim is not None or self.inverse_dims) and self.scope != "tensor":
            raise ValueError(f"dim/inverse_dims apply only with scope='tensor' (got scope={self.scope!r})")
        return self

    def shape_dependence(self) -> str | None:
        """Per-tensor and per-slice statistics read each tensor's extent and shape; global and group ones
        (elementwise over every tensor of the segment) do not."""
        if self.scope != "tensor":
            return None
        if self.dim is None and not self.inverse_dims:
            return "takes its statistics per tensor (scope='tensor')"
        return f"takes its statistics per slice of each tensor (scope='tensor', dim={self.dim!r}, inverse_dims={self.inverse_dims})"

    def segment_shape(self, p: torch.Tensor) -> tuple[int, ...] | None:
        """The shape of this transform's per-segment values saved for `p` (None: kept transform-wide)."""
        return segment_shape(p, self.scope, self.dim, self.inverse_dims)


__all__ = ["Dims", "ScopeName", "Scoped"]
