"""Composing by parameter: run transforms on a selection of the parameters only."""

from __future__ import annotations

import warnings

import torch
from typing import Any, ClassVar

from pydantic import Field, model_validator

from ..core.step import Step, TransformState
from ..core.roles import LastWriter, Optimizer, Router, SelectsByName, ShapeDependent
from ..core.step import run
from ..core.select import Select, selected_named
from ..core.transform import Transform, TransformField, variadic_transforms, walk

__all__ = ["Masked"]


class Masked(Router, SelectsByName, ShapeDependent):
    r"""Run `transforms` on the parameters that `where` selects; the others pass through untouched.

    `mo.Masked(*transforms, where=mo.Select(...))` (a glob string is shorthand
    for `mo.Select(names=[glob])`). Inside, the step is the selection: a
    `scope="global"` statistic is taken over the selected tensors only,
    `scope="group"` over the selected tensors of each param group. For the
    selected updates $u_S$ and the others $u_{\bar S}$:

    $$
    u_S \leftarrow T_n(\cdots T_1(u_S)), \qquad u_{\bar S} \leftarrow u_{\bar S}
    $$

    State and telemetry keys nest as in `Chain` (`"0:Masked/0:ClipNorm"`);
    `Masked` may be nested and may hold a `Chain`. The names `where` asks for
    are checked when the `Modular` is built: a `names` pattern that matches no
    parameter name of the optimizer (a typo), or a selection by name over
    unnamed parameters, is a `ValueError` then. A selection that matches
    none of the parameters with a gradient is reported once per parameter
    layout (a `UserWarning` naming the selector) and the updates pass through.
    If an inner transform stops the step (`Accumulate` between cycles, a
    `ZClip` spike skip), the whole step stops, as in a `Chain`.

    **Routing.** A branch may end in its own optimizer transform (`SGD` for
    the embeddings, `Adam` for the rest): then every parameter must reach
    exactly one optimizer transform (checked when the `Modular` is built,
    the error names the parameters). Each branch optimizer reads its
    hyperparameters from the param groups of the parameters it owns, so
    schedulers drive them as with several torch optimizers; see the page
    "Composing by parameter". `TorchOptimizer` writes every parameter itself
    and cannot be masked.

    Default: none; `where` is required. Reproduces optax's `masked` (and,
    with routing, `partition`).

    ```pycon
    >>> import torch, modopt as mo
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = mo.Modular(model.named_parameters(), mo.Masked(mo.ClipValue(0.1), where="weight"), mo.LR(1.0))
    >>> torch.nn.init.zeros_(model.weight); torch.nn.init.zeros_(model.bias)
    Parameter...
    >>> model.weight.grad = torch.tensor([[1.0, -1.0]]); model.bias.grad = torch.tensor([1.0])
    >>> opt.step()
    >>> model.weight.data, model.bias.data   # the weight's update clipped to 0.1, the bias's not
    (tensor([[-0.1000,  0.1000]]), tensor([-1.]))

    ```
    """

    positional: ClassVar[str | None] = "transforms"  # variadic: mo.Masked(a, b, where=...)
    device_skip = True  # when every transform inside does (skips_on_device checks the children)

    transforms: list[TransformField] = Field(default_factory=list)
    where: Select

    def __init__(self, *transforms: Any, **kwargs: Any) -> None:
        super().__init__(**variadic_transforms("Masked", transforms, kwargs))

    @model_validator(mode="after")
    def _maskable(self) -> "Masked":
        for key, t in walk(self.transforms):
            if isinstance(t, LastWriter):
                raise ValueError(
                    f"transforms.{key}: {type(t).__name__} steps every parameter of the optimizer itself and "
                    "cannot run inside Masked; use SGD, Adam, AdamW or LR in a masked branch"
                )
        return self

    def children(self) -> tuple[Transform, ...]:
        """The masked transforms, in order."""
        return tuple(self.transforms)

    def to_dict(self) -> dict[str, Any]:
        """`{"type": "Masked", "transforms": [...], "where": {...}}` as plain data."""
        return {"type": "Masked", "transforms": [t.to_dict() for t in self.transforms], "where": self.where.to_dict()}

    def __repr__(self) -> str:
        inner = [repr(t) for t in self.transforms]
        return f"Masked({', '.join(inner + [f'where={self.where!r}'])})"

    def check_params(self, named: list[tuple[str | None, torch.Tensor]]) -> None:
        """The inner transforms check the parameters `where` selects. A selection by param group cannot be told
        here (`named` holds no groups): they check every parameter then."""
        super().check_params(selected_named(self.where, named))

    def shape_dependence(self) -> str | None:
        """A selection by number of dims (`min_ndim`, `max_ndim`) reads each parameter's shape."""
        w = self.where
        return None if w.min_ndim is None and w.max_ndim is None else "selects parameters by their number of dims"

    def name_selection(self, key: str) -> tuple[Select, str]:
        """`where` and the label its errors use (`modopt.core.select.check_selections`, when the
        `Modular` is built, and the step's own check)."""
        return self.where, f"{key} (where={self.where.describe()})"

    # --- the step -------------------------------------------------------------
    def selection(self, ctx: Step, st: TransformState) -> tuple[list[int], Step | None]:
        """The indices of the step's parameters that `where` selects and the sub-step over them (None
        when nothing is selected). Computed once per layout; an empty selection is reported then, with
        a `UserWarning` naming the selector."""
        key = ("modopt.Masked", self.where.cache_key())
        idx = ctx.layout.cache.get(key)
        if idx is None:
            mask = self.where.mask(ctx, owner=self.name_selection(st.key)[1])
            idx = ctx.layout.cache[key] = [i for i, m in enumerate(mask) if m]
            if not idx:
                warnings.warn(
                    f"{st.key}: Masked(where={self.where.describe()}) selects none of the {len(ctx.params)} "
                    "parameter(s) with a gradient; its transforms do not run",
                    UserWarning, stacklevel=2,
                )
        return idx, (ctx.sub(idx, ("modopt.Masked.step", self.where.cache_key())) if idx else None)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Run the transforms on the selected parameters' updates only; the others pass through."""
        idx, sub = self.selection(ctx, st)
        if sub is None or not self.transforms:
            return updates
        out = run(self.transforms, sub, [updates[i] for i in idx], parent=st.key)
        if out is None:
            return None
        updates = list(updates)
        for i, u in zip(idx, out):
            updates[i] = u
        return updates

    def routes(self) -> bool:
        """Whether the branch ends in an optimizer transform (which then writes its parameters itself)."""
        return bool(self.transforms) and isinstance(self.transforms[-1], Optimizer)

    def write_branch(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[int] | None:
        """Run the branch on the selection with its optimizer writing the selected parameters (torch's
        kernels); return the indices written, or None when an inner transform stopped the step."""
        idx, sub = self.selection(ctx, st)
        if sub is not None and run(self.transforms, sub, [updates[i] for i in idx], parent=st.key, final=True) is None:
            return None
        return idx

    def apply_final(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> bool:
        """As the last transform, when the branch ends in an optimizer transform: that optimizer writes the
        selected parameters itself (torch's fused kernels), and `p -= update` writes the others."""
        if not self.routes():
            return False
        idx = self.write_branch(ctx, st, updates)
        if idx is None:
            return True  # an inner transform stopped the step: nothing moves
        key = ("modopt.Masked.rest", self.where.cache_key())  # (the parameters outside it, once per layout)
        rest = ctx.layout.cache.get(key)
        if rest is None:
            chosen = set(idx)
            rest = ctx.layout.cache[key] = [i for i in range(len(ctx.params)) if i not in chosen]
        if rest:
            ctx.write_updates([updates[i] for i in rest], [ctx.params[i] for i in rest])
        return True
