"""Guards and no-ops."""

from __future__ import annotations

from ..core.transform import Transform


class Identity(Transform):
    """Pass the update through unchanged (drytorch's ``NoOp``)."""

    def apply(self, ctx, st, updates):
        return updates
