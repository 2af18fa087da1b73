"""Transforms that wrap an inner chain and keep their own copy of the parameters."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field, PositiveInt

from ..core.runner import Step, TransformState, run
from ..core.state import Buffer
from ..core.transform import Transform, TransformField, variadic_transforms

__all__ = ["Lookahead"]


class Lookahead(Transform):
    r"""Lookahead: the inner chain steps the (fast) weights; every `k` calls they are pulled toward slow
    weights, which then take their value.

    $$
    \text{on every } k\text{-th call:}\quad
    p \leftarrow p + (1 - \alpha)\,(\phi - p), \qquad \phi \leftarrow p
    $$

    with $\phi$ the slow weights, equal to the parameters when first seen (before the first update).
    `alpha` is the weight kept by the fast weights (`alpha=1`: plain inner optimizer; the paper's
    $\alpha$ weighs the fast weights too: $\phi + \alpha(p - \phi)$, the same number). The inner
    transforms run as a pipeline of their own on this step, ending in the optimizer transform that
    writes the parameters; `Lookahead` comes last.

    Defaults `k=5`, `alpha=0.5`, as pytorch-optimizer's `Lookahead` (Zhang et al. 2019, "Lookahead
    Optimizer: k steps forward, 1 step back"), which it reproduces bit for bit (its `pullback_momentum`
    `'none'`): the interpolation is torch's `lerp` with weight `1 - alpha`, the parameters then copied
    into the slow weights. Every `opt.step()` call counts toward `k`, also one the non-finite policy
    skips (as pytorch-optimizer counts every call of its wrapped optimizer, counted on the host: no
    sync), and one counter serves every param group. A skipped `k`-th call changes nothing: the
    parameters and the slow weights keep every bit, and the count starts again. Parameters with no
    gradient on a `k`-th call are not pulled (as there). State: one slow copy per parameter (1P).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(1))
    >>> opt = mo.Modular([p], mo.Lookahead(mo.SGD(lr=1.0), k=2, alpha=0.5))
    >>> p.grad = torch.tensor([1.0]); opt.step(); p.data     # fast step
    tensor([-1.])
    >>> p.grad = torch.tensor([1.0]); opt.step(); p.data     # fast step to -2, then halfway back to 0
    tensor([-1.])

    ```
    """

    positional: ClassVar[str | None] = "transforms"  # variadic: mo.Lookahead(mo.Adam(), k=5)
    transforms: list[TransformField] = Field(min_length=1)
    k: PositiveInt = 5
    alpha: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5

    must_be_last: ClassVar[bool] = True  # it writes the parameters after its inner chain
    attachable: ClassVar[bool] = False
    device_skip: ClassVar[bool] = True  # a skipped k-th call keeps every bit (a where); the host counts calls
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"slow": "param", "calls": "counter"}

    def __init__(self, *transforms: Any, **kwargs: Any) -> None:
        super().__init__(**variadic_transforms(type(self).__name__, transforms, kwargs))

    def __repr__(self) -> str:
        inner = ", ".join(repr(t) for t in self.transforms)
        extra = "".join(f", {k}={v!r}" for k, v in self.__repr_args__() if k != "transforms")
        return f"Lookahead({inner}{extra})"

    def children(self) -> tuple[Transform, ...]:
        """The inner transforms, in order."""
        return tuple(self.transforms)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Always raises: Lookahead writes the parameters after its inner chain, so it must come last."""
        raise RuntimeError("Lookahead must be the last transform of a Modular")

    def apply_final(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> bool:
        """The inner chain writes the parameters; on every `k`-th call they are pulled toward the slow ones."""
        slow = st.buffers("slow", lambda i, p: p.detach().clone())  # (first seen: before any update)
        run(self.transforms, ctx, updates, parent=st.key, final=True)
        if self._counts(st):
            self._pull(ctx, slow)
        return True

    def on_host_skip(self, ctx: Step, st: TransformState) -> None:
        """A call the host skipped counts toward `k`; a skipped `k`-th call pulls nothing."""
        self._counts(st)

    def _counts(self, st: TransformState) -> bool:
        """Count this call on the host; True on the `k`-th (the count starts again)."""
        calls = int(st.store.get("calls", 0)) + 1
        st.store["calls"] = 0 if calls >= self.k else calls
        return calls >= self.k

    def _pull(self, ctx: Step, slow: list[torch.Tensor]) -> None:
        params, w = ctx.params, 1.0 - self.alpha
        if ctx.skip is None:  # pytorch-optimizer's two ops
            torch._foreach_lerp_(params, slow, w)
            torch._foreach_copy_(slow, params)
            return
        # the device decides: the pull computed aside, kept only where the step goes ahead (every bit kept)
        pulled = torch._foreach_lerp(params, slow, w)
        for p, s, q in zip(params, slow, pulled):
            p.copy_(torch.where(ctx.skip, p, q))
            s.copy_(torch.where(ctx.skip, s, p))
