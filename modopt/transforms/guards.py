"""Guards and no-ops."""

from __future__ import annotations

from typing import ClassVar

import torch

from ..core.step import Step, TransformState
from ..core.transform import Transform

__all__ = ["Identity", "ZeroNonFinite"]


class Identity(Transform):
    """Pass the update through unchanged (drytorch's `NoOp`).

    It neither reads nor writes the updates, so the step's norm memo passes by it:
    inserting it anywhere changes nothing, bit for bit.
    """

    update_access: ClassVar[str] = "none"

    positional: ClassVar[str | None] = None
    device_skip = True  # keeps its state on a step the device skips

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The updates, unchanged."""
        return updates


class ZeroNonFinite(Transform):
    r"""Replace non-finite elements of the update (inf, -inf, NaN) by 0.

    $$
    \begin{aligned}
    u_i \leftarrow \begin{cases} u_i & u_i \text{ finite} \\ 0 & \text{otherwise} \end{cases}
    \end{aligned}
    $$

    Useful with `Modular(..., nonfinite="ignore")` (the default policy,
    `"skip"`, drops such steps before any transform runs) or after a transform
    that may overflow. `nonfinite="zero"` does the same to the raw gradients.

    Telemetry: `zeroed`, the number of elements replaced.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(3))
    >>> opt = mo.Modular([p], mo.ZeroNonFinite(), mo.LR(1.0), nonfinite="ignore")
    >>> p.grad = torch.tensor([1.0, float("inf"), float("nan")]); opt.step(); p.data
    tensor([-1.,  0.,  0.])

    ```
    """

    positional: ClassVar[str | None] = None
    device_skip = True  # keeps its state on a step the device skips

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Replace every inf/NaN element by 0 (their count goes to `opt.stats`)."""
        counts = []
        for u in updates:
            bad = ~torch.isfinite(u)
            counts.append(bad.sum())
            u.masked_fill_(bad, 0)
        if counts:
            st.record("zeroed", torch.stack(counts).sum())
        return updates
