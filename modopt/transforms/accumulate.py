"""Gradient accumulation as a transform."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import PositiveInt

from ..core.keys import value_key
from ..core.norms import acc_dtype
from ..core.state import Buffer
from ..core.transform import Transform

__all__ = ["Accumulate"]


class Accumulate(Transform):
    r"""Average the updates of `steps` calls; only every `steps`-th call goes on.

    $$
    s \leftarrow s + u; \quad \text{on call } k\,\text{steps}:\; u \leftarrow s / \text{steps},\; s \leftarrow 0
    $$

    On the other calls it returns None: the transforms after it do not run and
    the parameters do not move. Put it first to accumulate gradients, then call
    `opt.step()` after every micro-batch. Sums are kept in at least float32;
    a parameter without a gradient on some call contributes zero for that call.
    A parameter without a gradient on the final call of a cycle does not move
    (as with torch, which skips parameters whose `.grad` is None), and what it
    accumulated earlier in the cycle is dropped: every cycle's sums are cleared
    at its end, so nothing leaks into the next cycle.
    A step skipped by the non-finite policy is not a call. Count LR-scheduler
    steps accordingly (they see every micro-step). `Accumulate` cannot be
    used with `modopt.attach()` (a pre-hook cannot stop the optimizer).

    Reproduces shrew's `GradAccumulator` and optax's `MultiSteps`.

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(1))
    >>> opt = mo.Modular([p], mo.Accumulate(2), mo.SGD(lr=1.0))
    >>> p.grad = torch.tensor([1.0]); opt.step(); p.data       # waits
    tensor([0.])
    >>> p.grad = torch.tensor([3.0]); opt.step(); p.data       # the mean, 2
    tensor([-2.])

    ```
    """

    positional = "steps"

    steps: PositiveInt
    state_buffers: ClassVar[dict] = {"sum": Buffer("param", dtype="acc"), "calls": "counter"}
    attachable: ClassVar[bool] = False

    def apply(self, ctx, st, updates):
        sums = st.buffers("sum", lambda i, p: torch.zeros_like(updates[i], dtype=acc_dtype(updates[i].dtype)))
        same = [i for i, (u, s) in enumerate(zip(updates, sums)) if u.dtype == s.dtype]
        if len(same) == len(updates):
            torch._foreach_add_(sums, updates)
        else:  # half-precision updates accumulate in float32
            torch._foreach_add_(sums, [u.to(s.dtype) for u, s in zip(updates, sums)])
        calls = int(st.store.get("calls", 0)) + 1
        if calls < self.steps:
            st.store["calls"] = calls
            return None
        st.store["calls"] = 0
        # the mean goes into the update buffers themselves: no full-size copy
        torch._foreach_div_(sums, float(self.steps))
        torch._foreach_copy_(updates, sums)
        self._end_cycle(ctx, st)
        return updates

    def _end_cycle(self, ctx, st) -> None:
        """Clear every sum of the cycle, also of parameters without a gradient on this final call."""
        k = value_key(st.key, "sum")
        stale = [s[k] for s in ctx.host.state.values() if k in s]
        if stale:
            torch._foreach_zero_(stale)
