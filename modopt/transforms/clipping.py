"""Clipping by value, by norm and by RMS (torchzero's family; torch's `clip_grad_norm_`; optax's `clip_by_block_rms`)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import NonNegativeFloat, PositiveFloat

from ..core.reduce import Ord
from ..core.step import Step, TransformState
from ..core.roles import Scale, ScaleFact
from ..core.scope import Scoped, ScopeName
from ..core.transform import Transform

__all__ = ["ClipNorm", "ClipValue", "ClipNormByRMS"]


def clip_scale(norm: torch.Tensor, max_norm: float, eps: float, signed: bool = True) -> torch.Tensor:
    """`min(1, max_norm / (|norm| + eps))`: never scales up; a zero norm gives 1. `signed=False`
    says the norm is >= 0 already (every `ord` but "sum"): no `abs`, the ops of `clip_grad_norm_`."""
    return torch.clamp(max_norm / ((norm.abs() if signed else norm) + eps), max=1.0)


class ClipValue(Transform):
    r"""Clamp every element of the update to `[-value, value]`.

    $$
    u \leftarrow \operatorname{clamp}(u, -v, v)
    $$

    Reproduces `torch.nn.utils.clip_grad_value_` and torchzero's `ClipValue`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(3)); p.grad = torch.tensor([-3.0, 0.5, 2.0])
    >>> opt = mo.Modular([p], mo.ClipValue(1.0), mo.LR(1.0)); opt.step(); p.data
    tensor([ 1.0000, -0.5000, -1.0000])

    ```
    """

    positional: ClassVar[str | None] = "value"
    device_skip = True  # keeps its state on a step the device skips

    value: PositiveFloat

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Clamp every element to `[-value, value]`."""
        big, small = _split_by_size(ctx, updates)
        for u in big:  # one sweep per large tensor (the foreach pair below takes two)
            u.clamp_(-self.value, self.value)
        if small:
            torch._foreach_clamp_min_(small, -self.value)
            torch._foreach_clamp_max_(small, self.value)
        return updates


#: tensors at least this large are worth one op each (per-op overhead is small next to a memory sweep): on a
#: CPU a call costs a few microseconds, a sweep of 64K float32 elements about as much; on a GPU a kernel
#: launch costs about what a sweep of 4M elements does at its bandwidth
_BIG = {"cpu": 1 << 16, "gpu": 1 << 22}


def _split_by_size(ctx, updates: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`updates` split into large tensors and the rest (the split is cached per layout and kind of device;
    `device_path()` runs a GPU's split on the CPU)."""
    cache = ctx.layout.cache
    kind = "cpu" if ctx.cpu_kernels else "gpu"
    idx = cache.get(("big_tensors", kind))
    if idx is None:
        idx = cache[("big_tensors", kind)] = [i for i, u in enumerate(updates) if u.numel() >= _BIG[kind]]
    if not idx:
        return [], updates
    if len(idx) == len(updates):
        return updates, []
    big = set(idx)
    return [updates[i] for i in idx], [u for i, u in enumerate(updates) if i not in big]


class ClipNorm(Scoped, ScaleFact):
    r"""Scale the update down so that its `ord` norm over the scope is at most `max_norm`.

    $$
    u \leftarrow u \cdot \min\Big(1, \frac{\text{max\_norm}}{n(u) + \varepsilon}\Big)
    $$

    Defaults: `ord=2`, `scope="global"`, `eps=1e-6`. With these it equals
    `torch.nn.utils.clip_grad_norm_(params, max_norm)` when `params` is the
    optimizer's parameters in its order (param group by param group: the
    global norm adds the per-tensor norms in that order; over
    `model.parameters()` in another order torch's total can differ in the last
    bit, see docs/migration.md); with `eps=0` it is
    declearn's `L2GlobalClipping` (and, with `scope="tensor"`, its
    `L2Clipping`). torchzero's `ClipNorm` (equal with `eps=0`,
    `scope="tensor"` and the same `dim`, `inverse_dims`, `min_size`). With
    `dim` / `inverse_dims`, $n$ is taken per slice over each tensor's slice
    dims, and a tensor with none (a bias under `dim=0, inverse_dims=True`) is
    left unchanged, not clipped element by element (docs/concepts.md, "Slices").

    Telemetry: `norm` (pre-clip), `scale` and `clipped` per segment.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([3.0, 4.0])
    >>> opt = mo.Modular([p], mo.ClipNorm(1.0, eps=0.0), mo.LR(1.0)); opt.step(); p.data
    tensor([-0.6000, -0.8000])

    ```
    """

    positional: ClassVar[str | None] = "max_norm"
    device_skip = True  # keeps its state on a step the device skips

    max_norm: PositiveFloat
    ord: Ord = 2.0
    eps: NonNegativeFloat = 1e-6

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Scale each segment by `min(1, max_norm / (norm + eps))`."""
        seg = st.segments(self)
        norm = seg.reduce(updates, self.ord)
        scale = clip_scale(norm, self.max_norm, self.eps, signed=self.ord == "sum")
        st.scale_(seg, updates, scale)
        st.record_clip(norm, scale)
        return updates

    def scale_fact(self) -> Scale | None:
        """Positive: it only multiplies each segment by a factor in (0, 1]."""
        return Scale(self.scope, self.dim, self.inverse_dims, positive=True)  # max_norm > 0: the scale is in (0, 1]


class ClipNormByRMS(Scoped, ScaleFact):
    r"""Scale the update down so that its root mean square over each segment is at most `threshold`.

    $$
    \operatorname{rms}(u) = \sqrt{\tfrac{1}{n} \textstyle\sum_i u_i^2} = \frac{\lVert u \rVert_2}{\sqrt{n}},
    \qquad
    u \leftarrow \frac{u}{\max\big(1,\ \operatorname{rms}(u) / \text{threshold}\big)}
    $$

    with `n` the number of elements of the segment. Unlike a norm, the RMS does
    not grow with the size of the tensor, so one threshold suits large and small
    parameters alike. Defaults: `scope="tensor"` (one segment per parameter
    tensor); every scope works (the RMS of a segment is its 2-norm over the square
    root of its element count). There is no `eps`: a zero update has RMS 0 and
    stays zero. Reproduces optax's `clip_by_block_rms(threshold)`, whose blocks
    are the leaves of the parameter tree (`scope="tensor"` here).

    Telemetry: `norm` (the pre-clip RMS), `scale` and `clipped` per segment.

    ```pycon
    >>> import torch, modopt as mo
    >>> a = torch.nn.Parameter(torch.zeros(4)); a.grad = torch.tensor([2.0, -2.0, 2.0, -2.0])  # rms 2
    >>> b = torch.nn.Parameter(torch.zeros(2)); b.grad = torch.tensor([0.5, -0.5])  # rms 0.5
    >>> opt = mo.Modular([a, b], mo.ClipNormByRMS(1.0), mo.LR(1.0)); opt.step(); a.data, b.data
    (tensor([-1.,  1., -1.,  1.]), tensor([-0.5000,  0.5000]))

    ```
    """

    positional: ClassVar[str | None] = "threshold"
    device_skip = True  # keeps its state on a step the device skips

    threshold: PositiveFloat
    scope: ScopeName = "tensor"

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Divide each segment by `max(1, rms / threshold)`."""
        seg = st.segments(self)
        norm = seg.reduce(updates, 2.0)
        rms = norm / seg.element_counts(norm).clamp(min=1).sqrt()
        scale = 1 / torch.clamp(rms / self.threshold, min=1.0)
        st.scale_(seg, updates, scale)
        st.record_clip(rms, scale)
        return updates

    def scale_fact(self) -> Scale | None:
        """Positive: it only multiplies each segment by a factor in (0, 1]."""
        return Scale(self.scope, self.dim, self.inverse_dims, positive=True)  # threshold > 0: the scale is in (0, 1]
