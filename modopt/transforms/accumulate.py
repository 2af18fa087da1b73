"""Gradient accumulation as a transform."""

from __future__ import annotations

import operator
from typing import ClassVar

import torch
from pydantic import PositiveInt

from ..core import distributed
from ..core.keys import value_key
from ..core.reduce import acc_dtype
from ..core.step import SMALL_CLEAN, Step, TransformState
from ..core.roles import SeesHostSkips, StepStopper
from ..core.state import Buffer
from ..core.transform import Transform

__all__ = ["Accumulate"]

_dtype_of = operator.attrgetter("dtype")


class Accumulate(StepStopper, SeesHostSkips):
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
    (`on_host_skip`). The price, only when the device decides: the update is
    filled with 0 on a skipped call before it is added (`masked_fill_` on the
    step's decision: `0 * u` would keep a NaN). Tensors of at most 2048
    elements are concatenated with a 1 for the device's count, filled and
    added in one multi-tensor add with the larger ones (each filled in place):
    three ops a call for the small tensors, count included, and one more for
    each larger tensor; fused into the sum when compiled.
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

    positional: ClassVar[str | None] = "steps"

    steps: PositiveInt
    # "calls": the host's count of calls in this cycle (every call); "count": the device's count of the
    # calls that added to the sums (a checkpoint written before it existed has only finite calls: see _count)
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"sum": Buffer("param", dtype="acc"), "calls": "counter", "count": "counter"}
    device_skip: ClassVar[bool] = True  # a skipped call adds zeros and does not count; the host counts calls

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Add the updates to the cycle's sum; the cycle's mean on its last call, else None (the step stops)."""
        compiling = torch.compiler.is_compiling()
        sums = None if compiling else _existing_sums(ctx, st.key)
        if sums is None:
            sums = st.buffers("sum", lambda i, p: torch.zeros_like(updates[i], dtype=acc_dtype(updates[i].dtype)))
        store = st.store
        if compiling:
            count = self._count(st, updates[0].device)
            if ctx.skip is None:
                count = count + 1
            else:  # a where fuses into the sum; a skipped call is not counted
                count = count + (ctx.proceed if ctx.proceed is not None else ~ctx.skip)
                updates = [torch.where(ctx.skip, 0.0, u) for u in updates]
            same = [u.dtype for u in updates] == [s.dtype for s in sums]  # (dynamo)
            torch._foreach_add_(sums, updates if same else [u.to(s.dtype) for u, s in zip(updates, sums)])
        elif ctx.skip is None:  # the host decided: this call goes ahead and counts (a number, when it is one)
            count, calls = store.get("count"), int(store.get("calls", 0))
            count = calls + 1 if count is None else count + 1
            if (calls + 1 >= self.steps and isinstance(count, int) and type(sums[0]) is torch.Tensor
                    and list(map(_dtype_of, updates)) == list(map(_dtype_of, sums))):
                return self._last_on_host(ctx, st, store, updates, sums, count)
            # (half-precision updates add into float32 sums in the same op: the same bits as converting first)
            plain = type(sums[0]) is torch.Tensor or list(map(_dtype_of, updates)) == list(map(_dtype_of, sums))
            torch._foreach_add_(sums, updates if plain else [u.to(s.dtype) for u, s in zip(updates, sums)])
        else:  # the device decides: a skipped call adds zeros and is not counted
            count = self._add_on_device(ctx, st, updates, sums)
        if not self._ends_cycle(store, count):
            return None
        # the mean over the calls that added; the same bits as dividing by float(steps) when all did
        # (a correctly rounded division either way). It goes into the update buffers themselves.
        if isinstance(count, int) and sums[0].device.type == "cpu":  # (the host counted; a CPU divides by a number
            torch._foreach_div_(sums, float(max(count, 1)))  # exactly as by a tensor, where a GPU multiplies)
        else:
            n = count.clamp(min=1) if isinstance(count, torch.Tensor) else torch.full(
                (), max(count, 1), dtype=sums[0].dtype, device=sums[0].device)
            dtypes = {s.dtype for s in sums} if compiling else set(map(_dtype_of, sums))
            if len(dtypes) == 1:  # (a divisor of the sums' own dtype: torch's fast foreach path)
                dtype = dtypes.pop()
                torch._foreach_div_(sums, n if n.dtype == dtype else n.to(dtype))
            else:
                for dtype in dtypes:
                    torch._foreach_div_([s for s in sums if s.dtype == dtype], n.to(dtype))
        distributed.copy_(updates, sums)
        self._end_cycle(ctx, st, count, sums)
        return updates

    def _last_on_host(self, ctx: Step, st: TransformState, store: dict, updates: list[torch.Tensor],
                      sums: list[torch.Tensor], count: int) -> list[torch.Tensor]:
        """The cycle's last call, counted on the host, with updates of the sums' dtypes: the sum goes into
        the updates (`u + s`, the same bits as `s + u`) and is divided there, one pass fewer than adding
        into the sums and copying their mean out."""
        self._ends_cycle(store, count)
        torch._foreach_add_(updates, sums)
        if sums[0].device.type == "cpu":  # (a CPU divides by a number exactly as by a tensor; a GPU multiplies)
            torch._foreach_div_(updates, float(count))
        else:
            torch._foreach_div_(updates, torch.full((), count, dtype=sums[0].dtype, device=sums[0].device))
        self._end_cycle(ctx, st, count, sums)
        return updates

    def _plan(self, ctx: Step, st: TransformState, updates: list[torch.Tensor], sums: list[torch.Tensor]) -> _Plan:
        """How this layout's updates go into its sums on the device path (made once per layout and dtypes)."""
        key = ("accumulate", st.key, tuple(map(_dtype_of, updates)), tuple(map(_dtype_of, sums)))
        plan = ctx.layout.cache.get(key)
        if plan is None:
            plan = ctx.layout.cache[key] = _Plan(updates, sums)
        return plan

    def _add_on_device(self, ctx: Step, st: TransformState, updates: list[torch.Tensor],
                       sums: list[torch.Tensor]) -> torch.Tensor:
        """`sum += u` on a call that goes ahead, nothing on one the device skips; the device's count of
        the calls that added, returned. The small tensors are concatenated with a 1 for the count, that
        concatenation filled with 0 on a skipped call (`masked_fill_` on the step's 0-d decision: every
        element, inf and NaN included, where `0 * u` would keep a NaN), and added with the larger tensors,
        each filled alike in place, in one `_foreach_add_`: on a call that goes ahead `sum + u` exactly."""
        plan = self._plan(ctx, st, updates, sums)
        skip = ctx.skip
        count = self._count(st, updates[0].device, plan.count_dtype)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for group in plan.groups:
            pieces = [u if u.dim() == 1 else u.reshape(-1) for u in map(updates.__getitem__, group.index)]
            if group.count:
                pieces.append(plan.one)
            flat = torch.cat(pieces)
            if flat.dtype != group.dtype:
                flat = flat.to(group.dtype)
            flat.masked_fill_(skip, 0)
            parts = flat.split(group.sizes)
            if group.reshaped:  # (a view only where the sum is not 1-D: about 2 us each on a CPU)
                parts = list(parts)
                for j in group.reshaped:
                    parts[j] = parts[j].view(group.shapes[j])
            src += parts
            dst += [sums[i] for i in group.index]
            if group.count:
                dst.append(count)
        for i in plan.alone:
            u = updates[i].masked_fill_(skip, 0)
            src.append(u if u.dtype == sums[i].dtype else u.to(sums[i].dtype))
            dst.append(sums[i])
        if plan.sharded:  # (DTensor shards: cleaned, then weighed by 1, or by 0 on a skipped call)
            shards = [updates[i] for i in plan.sharded]
            ctx.clean_(shards)
            adding = [u if u.dtype == sums[i].dtype else u.to(sums[i].dtype) for i, u in zip(plan.sharded, shards)]
            theirs = [sums[i] for i in plan.sharded]
            torch._foreach_addcmul_(theirs, adding, ctx.weights(theirs))
        if not plan.count_in_group:
            count.add_(ctx.proceed if ctx.proceed is not None else ~skip)
        torch._foreach_add_(dst, src)
        return count

    def on_host_skip(self, ctx: Step, st: TransformState) -> None:
        """A call the host skipped: it adds nothing, but counts towards the cycle (and may end it)."""
        count = st.store.get("count")
        if count is None:
            count = int(st.store.get("calls", 0))
        if self._ends_cycle(st.store, count):
            self._end_cycle(ctx, st, count, None)

    def _ends_cycle(self, store: dict, count: torch.Tensor | int) -> bool:
        """Count this call on the host (`store`: the transform's); True when it is the cycle's last (the
        caller ends the cycle), else the call's `count` is saved for the next."""
        calls = int(store.get("calls", 0)) + 1
        if calls < self.steps:
            store["calls"], store["count"] = calls, count
            return False
        store["calls"] = 0
        return True

    @staticmethod
    def _count(st, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """The device's count of the calls of this cycle that added to the sums (a 0-d tensor of `dtype`).

        A number where the host counted (a CPU step that read its decision on the host). Missing in a new
        optimizer and in a checkpoint written before it existed: there every call counted so far was
        finite (a skipped one was not a call), so it starts at `calls`.
        """
        count = st.store.get("count")
        if count is None:
            count = int(st.store.get("calls", 0))
        if isinstance(count, int):
            return torch.full((), count, dtype=dtype, device=device)
        return count if count.dtype == dtype else count.to(dtype)

    def _end_cycle(self, ctx, st, count: torch.Tensor | int, sums: list[torch.Tensor] | None) -> None:
        """Clear the count and every sum of the cycle, also of parameters without a gradient on this final call."""
        store = st.store
        stale = sums if sums is not None and len(sums) == len(ctx.host.state) else None  # (every state is in sums)
        if stale is None:
            k = value_key(st.key, "sum")
            stale = [s[k] for s in ctx.host.state.values() if k in s]
        if isinstance(count, int) or torch.compiler.is_compiling():
            store["count"] = 0 if isinstance(count, int) else torch.zeros_like(count)
        elif stale and count.dtype == stale[0].dtype and count.device == stale[0].device:
            store["count"] = count
            stale = [*stale, count]  # (cleared with the sums, in place)
        else:
            store["count"] = torch.zeros_like(count)
        if stale:
            torch._foreach_zero_(stale)


#: `operator.itemgetter` of a transform's "sum" key, by its state key (`_existing_sums`)
_SUM_GETTERS: dict[str, operator.itemgetter] = {}


def _existing_sums(ctx: Step, key: str) -> list[torch.Tensor] | None:
    """The step's sums when every parameter has one (`TransformState.buffers` without a call to make one:
    the common case after the first call), else None."""
    get = _SUM_GETTERS.get(key)
    if get is None:
        get = _SUM_GETTERS[key] = operator.itemgetter(value_key(key, "sum"))
    try:
        return list(map(get, ctx.param_states()))  # (C-level loop)
    except KeyError:
        return None


class _Group:
    """Small plain tensors of one sum dtype and device, concatenated to be filled and added together."""

    __slots__ = ("index", "dtype", "sizes", "shapes", "count", "reshaped")

    def __init__(self, index: list[int], dtype: torch.dtype, sizes: list[int], shapes: list[tuple], count: bool):
        self.index, self.dtype, self.sizes, self.shapes, self.count = index, dtype, sizes, shapes, count
        #: the pieces (by position) whose sum is not 1-D: the concatenation's piece is viewed in its shape
        self.reshaped = [j for j, shape in enumerate(shapes) if len(shape) != 1]


class _Plan:
    """What is true of a layout's updates and sums for every call: whether their dtypes agree (the host
    adds directly), and, for the device, which small tensors go together (with the count: the first
    group, whose sum dtype the count takes) and which are filled one by one."""

    __slots__ = ("same", "groups", "alone", "sharded", "count_dtype", "count_in_group", "one")

    def __init__(self, updates: list[torch.Tensor], sums: list[torch.Tensor]) -> None:
        self.same = list(map(_dtype_of, updates)) == list(map(_dtype_of, sums))
        by: dict[tuple, list[int]] = {}
        self.alone: list[int] = []  # plain tensors too large to concatenate: filled one by one
        self.sharded: list[int] = []  # DTensor shards and other subclasses: cleaned and weighed
        for i, (u, s) in enumerate(zip(updates, sums)):
            if type(u) is not torch.Tensor or type(s) is not torch.Tensor:
                self.sharded.append(i)
            elif u.numel() <= SMALL_CLEAN:
                by.setdefault((s.dtype, s.device), []).append(i)
            else:
                self.alone.append(i)
        self.groups: list[_Group] = []
        for n, ((dtype, _), index) in enumerate(by.items()):
            sizes = [updates[i].numel() for i in index]
            shapes = [tuple(sums[i].shape) for i in index]
            if n == 0:
                sizes.append(1)
                shapes.append(())
            self.groups.append(_Group(index, dtype, sizes, shapes, n == 0))
        self.count_in_group = bool(self.groups)
        self.count_dtype = self.groups[0].dtype if self.groups else torch.int64
        # the count's share of the first concatenation (made with the plan, on the layout's first call)
        self.one = torch.ones(1, dtype=self.count_dtype, device=sums[self.groups[0].index[0]].device) if self.groups else None
