"""Gradient accumulation as a transform."""

from __future__ import annotations

import operator
from typing import ClassVar

import torch
from pydantic import PositiveInt

from ..core import distributed
from ..core.keys import value_key
from ..core.reduce import acc_dtype
from ..core.runner import Step, TransformState
from ..core.state import Buffer
from ..core.transform import Transform

__all__ = ["Accumulate"]

_dtype_of = operator.attrgetter("dtype")


class Accumulate(Transform):
    r"""Average the updates of `steps` calls; only every `steps`-th call goes on.

    $$
    s \leftarrow s + [u \text{ finite}]\,u,\; n \leftarrow n + [u \text{ finite}]; \quad
    \text{on call } k\,\text{steps}:\; u \leftarrow s / \max(n, 1),\; s, n \leftarrow 0
    $$

    On the other calls it returns None: the transforms after it do not run and
    the parameters do not move. Put it first to accumulate gradients, then call
    `opt.step()` after every micro-batch. Sums are kept in at least float32;
    a parameter without a gradient on some call contributes zero for that call.
    A parameter without a gradient on the final call of a cycle does not move
    (as with torch, which skips parameters whose `.grad` is None), and what it
    accumulated earlier in the cycle is dropped: every cycle's sums are cleared
    at its end, so nothing leaks into the next cycle.

    Every `opt.step()` call is a call of the cycle, also one the non-finite
    policy skips: the cycle ends on every `steps`-th call, counted on the host
    (a Python number: no sync). A skipped call adds nothing to the sums; a
    counter on the device counts the calls that did, and the update is the
    mean over them (with every micro-batch finite: exactly the sum divided by
    `steps`). A skipped final call skips the cycle's step (the parameters and
    the later transforms' state stay as they were) and drops its sums.
    Why: the skip is then decided on the device, so a micro-batch loop on a
    GPU never waits for the device (and `torch.compile(fullgraph=True)` holds
    it), and the cycle stays aligned with the loop's micro-batches and with an
    LR scheduler stepped on every call. When the host decides (another
    transform needs it), a call it skips is counted the same way
    (`on_host_skip`). The price, only when the device decides: one more pass
    over the updates on every call (`nan_to_num_`, which clears inf and NaN
    elements, and the sum weighs the update by 0 on a skipped call; fused into
    the sum when compiled).
    `Accumulate` cannot be used with `modopt.attach()` (a
    pre-hook cannot stop the optimizer).

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

    may_stop = True  # every call but the last of a cycle stops the step
    positional: ClassVar[str | None] = "steps"

    steps: PositiveInt
    # "calls": the host's count of calls in this cycle (every call); "count": the device's count of the
    # calls that added to the sums (a checkpoint written before it existed has only finite calls: see _count)
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"sum": Buffer("param", dtype="acc"), "calls": "counter", "count": "counter"}
    attachable: ClassVar[bool] = False
    device_skip: ClassVar[bool] = True  # a skipped call adds zeros and does not count; the host counts calls

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Add the updates to the cycle's sum; the cycle's mean on its last call, else None (the step stops)."""
        sums = st.buffers("sum", lambda i, p: torch.zeros_like(updates[i], dtype=acc_dtype(updates[i].dtype)))
        count = self._count(st, updates[0].device)
        if ctx.skip is None:  # the host decided: this call goes ahead
            count = count + 1
        else:  # the device decides: a skipped call adds zeros and is not counted
            count = count + (ctx.proceed if ctx.proceed is not None else ~ctx.skip)
            if torch.compiler.is_compiling():  # a where fuses into the sum
                updates = [torch.where(ctx.skip, 0.0, u) for u in updates]
        same = ([u.dtype for u in updates] == [s.dtype for s in sums] if torch.compiler.is_compiling()  # (dynamo)
                else list(map(_dtype_of, updates)) == list(map(_dtype_of, sums)))  # (C-level: no call per tensor)
        adding = updates if same else [u.to(s.dtype) for u, s in zip(updates, sums)]
        if ctx.skip is None or torch.compiler.is_compiling():
            torch._foreach_add_(sums, adding)  # (half-precision updates accumulate in float32)
        else:  # non-finite elements to 0, then the update weighed by 1, or by 0 on a skipped call
            ctx.clean_(adding)
            torch._foreach_addcmul_(sums, adding, ctx.weights(sums))
        if not self._ends_cycle(st, count):
            return None
        # the mean over the calls that added; the same bits as dividing by float(steps) when all did
        # (a correctly rounded division either way). It goes into the update buffers themselves.
        n = count.clamp(min=1)
        dtypes = {s.dtype for s in sums} if torch.compiler.is_compiling() else set(map(_dtype_of, sums))
        if len(dtypes) == 1:  # (a divisor of the sums' own dtype: torch's fast foreach path)
            torch._foreach_div_(sums, n.to(dtypes.pop()))
        else:
            for dtype in dtypes:
                torch._foreach_div_([s for s in sums if s.dtype == dtype], n.to(dtype))
        distributed.copy_(updates, sums)
        self._end_cycle(ctx, st, count)
        return updates

    def on_host_skip(self, ctx: Step, st: TransformState) -> None:
        """A call the host skipped: it adds nothing, but counts towards the cycle (and may end it)."""
        count = self._count(st, ctx.params[0].device)
        if self._ends_cycle(st, count):
            self._end_cycle(ctx, st, count)

    def _ends_cycle(self, st, count: torch.Tensor) -> bool:
        """Count this call on the host; True when it is the cycle's last (the caller ends the cycle),
        else the call's `count` is saved for the next."""
        calls = int(st.store.get("calls", 0)) + 1
        if calls < self.steps:
            st.store["calls"], st.store["count"] = calls, count
            return False
        st.store["calls"] = 0
        return True

    @staticmethod
    def _count(st, device) -> torch.Tensor:
        """The device's count of the calls of this cycle that added to the sums (0-d int64).

        Missing in a new optimizer and in a checkpoint written before it existed: there every
        call counted so far was finite (a skipped one was not a call), so it starts at `calls`.
        """
        count = st.store.get("count")
        if count is None:
            count = torch.full((), int(st.store.get("calls", 0)), dtype=torch.int64, device=device)
        return count

    def _end_cycle(self, ctx, st, count: torch.Tensor) -> None:
        """Clear the count and every sum of the cycle, also of parameters without a gradient on this final call."""
        st.store["count"] = torch.zeros_like(count)
        k = value_key(st.key, "sum")
        stale = [s[k] for s in ctx.host.state.values() if k in s]
        if stale:
            torch._foreach_zero_(stale)
