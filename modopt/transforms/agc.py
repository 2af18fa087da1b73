"""Adaptive gradient clipping, unit-wise (Brock et al. 2021, NFNets)."""

from __future__ import annotations

import torch
from typing import ClassVar, Optional

from pydantic import PositiveFloat, model_validator

from ..core.kernels import const
from ..core.reduce import acc_dtype
from ..core.step import Step, TransformState
from ..core.roles import SelectsByName, ShapeDependent
from ..core.select import Select
from ..core.transform import Transform

__all__ = ["AGC"]

#: the `Select(exclude=...)` of each `exclude` list, made when an AGC is built (a compiled step cannot
#: build a pydantic model; it looks the selector up here)
_EXCLUDES: dict[tuple[str, ...], Select] = {}


def unit_dims(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dims one unit spans: all but the first for tensors with 2+ dims, else the whole tensor (None)."""
    return tuple(range(1, t.dim())) if t.dim() >= 2 else None


class AGC(SelectsByName, ShapeDependent):
    r"""Adaptive gradient clipping: clip each unit's update relative to its weight's norm.

    For each output unit `i` (the slice along dim 0 of a tensor with 2+ dims,
    the whole tensor for biases and scalars), with `W` the parameter:

    $$
    \text{if } \|u_i\| > \lambda \max(\|W_i\|, \varepsilon):\quad
    u_i \leftarrow u_i \, \frac{\lambda \max(\|W_i\|, \varepsilon)}{\max(\|u_i\|, 10^{-6})}
    $$

    `clipping` is $\lambda$. `exclude` lists `fnmatch` patterns of
    parameter names left unclipped (the paper leaves the final classifier
    alone); names come from `Modular(model.named_parameters(), ...)`, and a
    non-empty `exclude` with unnamed parameters is an error when the `Modular`
    is built (a pattern that names no parameter excludes nothing). `exclude` is a
    shorthand of `mo.Masked(mo.AGC(...), where=mo.Select(exclude=[...]))`
    (same patterns, same matcher); use `Masked` for any other selection. Defaults:
    `clipping=0.01`, `eps=1e-3`, `exclude=None` (same as `[]`: nothing excluded). Reproduces AGC of
    "High-Performance Large-Scale Image Recognition Without Normalization"
    (Brock et al. 2021) and timm's `adaptive_clip_grad`.

    Telemetry: `clipped` (any unit clipped) and `clipped_units`.

    ```pycon
    >>> import torch, modopt as mo
    >>> lin = torch.nn.Linear(2, 1, bias=False)
    >>> lin.weight.data = torch.tensor([[3.0, 4.0]])
    >>> opt = mo.Modular(lin.named_parameters(), mo.AGC(clipping=0.1), mo.LR(1.0))
    >>> lin.weight.grad = torch.tensor([[6.0, 8.0]]); opt.step(); lin.weight.data   # |u| 10 -> 0.1 * 5
    tensor([[2.7000, 3.6000]])

    ```
    """

    positional: ClassVar[str | None] = "clipping"
    device_skip = True  # keeps its state on a step the device skips

    clipping: PositiveFloat = 0.01
    eps: PositiveFloat = 1e-3
    exclude: Optional[list[str]] = None

    @model_validator(mode="after")
    def _selector(self):
        if self.exclude:
            _EXCLUDES.setdefault(tuple(self.exclude), Select(exclude=self.exclude))
        return self

    def name_selection(self, key: str) -> tuple[Select, str] | None:
        """The `exclude` selection and the label its errors use (`modopt.core.select.check_selections`,
        when the `Modular` is built, and the step's own check); None without `exclude`."""
        if not self.exclude:
            return None
        key = tuple(self.exclude)
        select = _EXCLUDES[key] if key in _EXCLUDES else _EXCLUDES.setdefault(key, Select(exclude=self.exclude))
        return select, f"AGC(exclude={self.exclude!r})"

    def _included(self, ctx, st) -> list[bool]:
        """Per parameter of the step: not excluded. Cached per layout (the names do not change)."""
        cache = ctx.layout.cache
        key = ("AGC.included", tuple(self.exclude or ()))
        mask = cache.get(key)
        if mask is None:
            if not self.exclude:
                mask = [True] * len(ctx.params)
            else:  # the shorthand of Masked(AGC(...), where=Select(exclude=...)), by the same matcher
                select, owner = self.name_selection(st.key)
                mask = select.mask(ctx, owner=owner)
            cache[key] = mask
        return mask

    def shape_dependence(self) -> str | None:
        """Its units are the slices along dim 0 of each tensor."""
        return "clips the norm of each unit (slices along dim 0 of each tensor)"

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Scale each unit's update down to at most `clipping` times its parameter's norm (`max(norm, eps)`)."""
        mask = self._included(ctx, st)
        counts = []
        traced = torch.compiler.is_compiling()
        updates = list(updates) if traced else updates
        for i, (u, p, on) in enumerate(zip(updates, ctx.params, mask)):
            if not on or u.numel() == 0:
                continue
            dims = unit_dims(u)
            acc = acc_dtype(u.dtype)
            # a whole-tensor unit's factor is 0-d (a DTensor shard is scaled by a replicated scalar in place; a
            # replicated 1-element factor would need the shard's placement, which DTensor refuses)
            keep = dims is not None
            nu = torch.linalg.vector_norm(u, 2, dim=dims, keepdim=keep, dtype=acc)
            nw = torch.linalg.vector_norm(p.detach(), 2, dim=dims, keepdim=keep, dtype=acc_dtype(p.dtype)).to(acc)
            allowed = nw.clamp(min=self.eps) * self.clipping
            over = nu > allowed
            scale = torch.where(over, allowed / nu.clamp(min=1e-6), const(1.0, nu))
            factor = scale.to(u.dtype) if u.dtype != acc else scale
            if traced:  # out of place (an in-place write into the gradient here tripped inductor, torch 2.13)
                updates[i] = u * factor
            else:
                u.mul_(factor)
            counts.append(over.sum())
        if counts:
            total = torch.stack(counts).sum()
            st.record("clipped_units", total)
            st.record("clipped", total > 0)
        return updates
