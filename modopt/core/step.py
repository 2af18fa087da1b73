"""The author's step API: what a transform sees of one step and how a chain of transforms runs over it.

A transform's hooks get the step (`Step`, named `ctx` in the transforms: the parameters of its `Layout`, the
state host, the telemetry, the step's device-side skip decision) and its own view of the state
(`TransformState`: its buffers, its stores, its scope's segments, its telemetry). A container (`Chain`,
`Masked`) runs its children with `run`; `run_step` runs a whole pipeline. `Step.over()` makes a step over a
bare list of tensors (the functional layer, the tests). How each chain runs (its state keys, its writer, its
routed branches) is the plan's `RunShape`, decided when the optimizer is built.

Each transform computes and writes its own result through its `TransformState`. The step owns one shared
mechanism, its `modopt.core.reduce.NormMemo`: the per-tensor norms of the raw gradients, valid until the
first transform that writes the updates (`Transform.update_access`).

The driver that makes a step and decides whether it goes ahead is `modopt.core.runner`. This module sits
below `modopt.Transform` in the import order (tests/test_imports.py: no cycles, a type hint included), so its
signatures name a transform `Any`.
"""

from __future__ import annotations

import math
import operator
import sys
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from . import compile_marks
from .distributed import copy_
from .kernels import const
from .keys import transform_key, value_key
from .values import is_numpy
from .hostdata import Host, refuse_device_path
from .reduce import NormMemo, Segments, make_segments

class Layout:
    """Facts about one set of parameters with gradients, cached across steps.

    `params` are ordered by param group: `groups[g]` is the param-group dict of
    `params[a:b]` with `(a, b) = ranges[g]`, `group_ids[g]` its index in
    `optimizer.param_groups`; `names[i]` names `params[i]` (or None). `collect`
    returns the same `Layout` for every step whose parameters with a gradient
    (and their groups) are the same objects, so per-layout work (segment tables,
    kernel plans) runs once. `cache` is free for transforms; keys name their owner. `on_cpu`: every
    parameter is on the CPU (where the non-finite decision may be read on the host: `Plan.host_on_cpu`).
    `positions[i]`: where `params[i]` stands among all the parameters of the param groups, in order
    (None for a step over tensors outside an optimizer's groups).
    """

    __slots__ = ("key", "params", "groups", "group_ids", "ranges", "names", "cache", "on_cpu", "positions")
    key: Hashable
    params: list[torch.Tensor]
    groups: list[dict[str, Any]]
    group_ids: list[int]
    ranges: list[tuple[int, int]]
    names: list[str | None]
    cache: dict[Hashable, Any]
    on_cpu: bool
    positions: list[int] | None

    def __init__(self, key: Hashable, params: list[torch.Tensor], groups: list[dict[str, Any]], group_ids: list[int],
                 ranges: list[tuple[int, int]], names: list[str | None], positions: list[int] | None = None) -> None:
        self.key, self.params, self.groups, self.group_ids = key, params, groups, group_ids
        self.ranges, self.names = ranges, names
        self.positions = positions
        self.cache = {}
        self.on_cpu = all(p.device.type == "cpu" for p in params)


#: the runtime store whose "rows" `compile_step` fills before each call of its graph with `state.get(p)` for
#: every parameter of the param groups in order (None where `p` has no state yet), and from which its trace
#: takes the parameters' states: dynamo reaches a dict value keyed by a parameter through the dict's keys in
#: order (`dict_keys_getitem`, a walk to the key's position), so `state[p]` for n parameters costs the
#: graph's every call O(n^2) steps (8 ms a call at 2048 parameters); `rows[i]` is one index
STATE_ROWS = "__state_rows__"

#: tensors of at most this many elements are cleaned together (`Step.clean_`): one `nan_to_num_` over their
#: concatenation, copied back, instead of one call each; a call costs more than moving a few thousand elements
SMALL_CLEAN = 2048


def _clean_small_together(updates: list[torch.Tensor]) -> list[torch.Tensor]:
    """Clean (`nan_to_num_` to 0) the small plain tensors of `updates` together, per dtype and device, when
    there are at least three of them; returns the tensors left to clean one by one. The same values as one
    `nan_to_num_` each (elementwise), in three ops (a concatenation, the cleaning, a copy into the pieces).
    Each tensor takes part through a 1-D alias (itself when it is 1-D), which the concatenation reads and
    the copy writes: no view of the cleaned pieces in the tensors' shapes (about 2 us each on a CPU, more
    than cleaning 2048 elements). A tensor of more dimensions that is not contiguous has no such alias and
    is left to clean alone."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    rest = []
    for u in updates:
        # (a plain tensor: not a DTensor shard or a subclass)
        if type(u) is torch.Tensor and u.numel() <= SMALL_CLEAN and (u.dim() == 1 or u.is_contiguous()):
            groups[(u.dtype, u.device)].append(u)
        else:
            rest.append(u)
    for small in groups.values():
        if len(small) < 3:
            rest += small
            continue
        flats = [u if u.dim() == 1 else u.view(-1) for u in small]
        flat = torch.nan_to_num_(torch.cat(flats), nan=0.0, posinf=0.0, neginf=0.0)
        torch.split_with_sizes_copy(flat, list(map(torch.Tensor.numel, flats)), out=flats)
    return rest


class Step:
    """What every transform sees of one step: the layout's parameters, the state host and the telemetry.

    `params`, `groups`, `group_ids`, `ranges`, `names` are the layout's (see `Layout`);
    `host` holds the state (`host.state[p]`, `host.transform_store(key)`,
    `host.runtime_store(key)`); `stats` is the step's telemetry dict.
    """

    __slots__ = ("layout", "params", "groups", "group_ids", "ranges", "names", "host", "stats", "skip", "proceed",
                 "memo", "cancelled", "folded", "deferred", "pending", "loss", "moment_requests", "checked",
                 "shapes", "host_reads", "cpu_kernels", "_states")
    layout: Layout
    params: list[torch.Tensor]
    groups: list[dict[str, Any]]
    group_ids: list[int]
    ranges: list[tuple[int, int]]
    names: list[str | None]
    #: the state host: `Modular`, an `attach` handle or a `ScratchHost` (each has `state`, `plan`,
    #: `transform_store(key)`, `runtime_store(key)` and, as a `hostdata.Host`, `device_path`)
    host: Any
    stats: dict[str, torch.Tensor]
    skip: torch.Tensor | None
    proceed: torch.Tensor | None
    checked: torch.Tensor | None
    memo: NormMemo
    cancelled: frozenset[str]
    folded: str | None
    deferred: str | None
    shapes: dict[tuple[str, bool], Any] | None
    pending: tuple[Any, torch.Tensor] | None
    loss: Any
    moment_requests: dict[str, dict[str, Any]]
    #: whether the host may read this step's values to leave out work a value makes useless (a moment reset
    #: that is not due, a clip that cuts nothing, the skip decision itself): every parameter on the CPU,
    #: where a read only reads memory, outside a traced step, unless the host takes the device path
    #: (`hostdata.Host.device_path`, what a GPU runs). Decided when the step is made; the same bits either way
    host_reads: bool
    #: whether work is planned for a CPU (a call costs about a memory sweep of a few thousand elements)
    #: rather than a GPU (a launch costs about a sweep of millions): every parameter on the CPU, unless the
    #: host takes the device path. Only the speed differs, never the values
    cpu_kernels: bool

    def __init__(self, layout: Layout, host: Any, stats: dict[str, torch.Tensor], skip: torch.Tensor | None = None,
                 memo: NormMemo | None = None, compiling: bool | None = None) -> None:
        self.layout, self.host, self.stats = layout, host, stats
        plan = host.plan  # (None for a host with no pipeline: a functional call, a test)
        dp = getattr(host, "device_path", False)  # (`hostdata.Host`)
        if dp is not False and dp is not True:
            refuse_device_path(dp)
        self.cpu_kernels = cpu = layout.on_cpu and not dp
        self.host_reads = cpu and not (torch.compiler.is_compiling() if compiling is None else compiling)
        #: the step's norm memo: a new one, open, for a step (its sub-steps share it). It lives on the
        #: step, not on the cached layout, so a compiled step keeps it local to the graph (no guards).
        #: Its global statistics span the pipeline stages of the plan's `stage_group`
        self.memo = (NormMemo(opened=True, stages=plan.stage_group if plan is not None else None,
                              host_reads=self.host_reads)
                     if memo is None else memo)
        #: a 0-d bool tensor when the device decides whether this step is skipped (`nonfinite="skip"`):
        #: true means the parameters and every state must stay as they are; None: no such decision
        self.skip = skip
        #: `~skip`, when the decision made it first (one op less for a kernel that counts steps taken)
        self.proceed = None
        #: the total norm whose `< inf` made `proceed` (the non-finite check's), while that still holds
        self.checked = None
        #: the step's loss as the caller gave it (the closure's return value or `opt.step(loss=...)`),
        #: unchecked: None when not given; `check_loss` says what a transform that reads it accepts
        self.loss = None
        #: what transforms asked of an optimizer transform on this step, by its key (`modopt.core.moments`:
        #: a learning-rate factor); shared with the sub-steps
        self.moment_requests = {}
        #: keys of the transforms whose multiply a later normalization cancels (`TransformState.scale_`):
        #: the host's plan's (`modopt.core.plan.cancelled_scales` of its pipeline)
        self.cancelled = plan.cancelled if plan is not None else frozenset()
        #: the key of the transform whose global scale the final optimizer's fused kernel takes as its
        #: `grad_scale` (the host's plan's, `modopt.core.plan.folded_scale`; `Adam(fold_clip=True)`)
        self.folded = plan.folded if plan is not None else None
        #: the key of the global scale a traced `compile_step` leaves to the fused optimizer op (the plan's
        #: `deferred`): kept as `pending` there only, and multiplied in place by the op
        self.deferred = plan.deferred if plan is not None else None
        #: how each chain of the pipeline runs, by `(parent key, final)` (the plan's `RunShape`s), or None
        self.shapes = plan.shapes if plan is not None else None
        #: that transform's `(segments, scale)` on this step, not yet applied (`TransformState.scale_`);
        #: whatever runs next applies it (`flush_`) unless it is the optimizer kernel that folds it
        self.pending = None
        self.params, self.groups, self.group_ids = layout.params, layout.groups, layout.group_ids
        self.ranges, self.names = layout.ranges, layout.names
        self._states: list[dict[str, Any]] | None = None

    @classmethod
    def over(cls, params: list[torch.Tensor], host: Any = None, stats: dict[str, torch.Tensor] | None = None,
             groups: list[dict[str, Any]] | None = None, ranges: list[tuple[int, int]] | None = None,
             group_ids: list[int] | None = None, names: list[str | None] | None = None,
             layout: Layout | None = None) -> "Step":
        """A step over `params` outside an optimizer (the functional layer, tests): one group by default,
        a scratch state host unless `host` is given, and a new layout unless `layout` (from an earlier
        `Step.over`) is passed to keep per-layout caches across calls."""
        if layout is None:
            ranges = ranges if ranges is not None else [(0, len(params))]
            groups = groups if groups is not None else [{} for _ in ranges]
            group_ids = group_ids if group_ids is not None else list(range(len(ranges)))
            names = names if names is not None else [None] * len(params)
            layout = Layout(("over", id(params)), list(params), groups, group_ids, ranges, names)
        return cls(layout, host if host is not None else ScratchHost(), stats if stats is not None else {})

    def param_states(self) -> list[dict[str, Any]]:
        """`host.state[p]` for every parameter of the step (looked up once per step)."""
        if self._states is None:
            rows = (self.host.runtime_store(STATE_ROWS).get("rows")
                    if compile_marks.KEEP_EAGER_KERNELS and torch.compiler.is_compiling() else None)
            if rows and self.layout.positions is not None:  # (`compile_step`'s trace: see STATE_ROWS)
                state = self.host.state
                self._states = [s if s is not None else state[p]
                                for s, p in zip(map(rows.__getitem__, self.layout.positions), self.params)]
            else:
                self._states = list(map(self.host.state.__getitem__, self.params))  # (C-level loop)
        return self._states

    def per_group(self) -> Iterator[tuple[dict[str, Any], int, int]]:
        """`(group, a, b)` for each param group of the step."""
        for g, (a, b) in zip(self.groups, self.ranges):
            yield g, a, b

    def flush_(self, updates: list[torch.Tensor]) -> None:
        """Apply a pending folded scale (`pending`) to `updates` as its transform would have: the same
        multiply, so a fold that does not happen changes nothing."""
        if self.pending is not None:
            seg, scale = self.pending
            self.pending = None
            seg.mul_(updates, scale)

    def write_updates(self, updates: list[torch.Tensor], params: list[torch.Tensor] | None = None) -> None:
        """`p -= update` for every parameter of the step, or for `params` (nothing moves on a skipped step)."""
        self.flush_(updates)
        params = self.params if params is None else params
        if not params:
            return
        if self.skip is None:
            torch._foreach_sub_(params, updates)
        elif torch.compiler.is_compiling():  # a where fuses into the write
            torch._foreach_sub_(params, [torch.where(self.skip, 0.0, u) for u in updates])
        else:  # p - 1*u exactly as p - u; p - 0*u' = p (u' finite: a non-finite update never reaches p)
            self.clean_(updates)
            torch._foreach_addcmul_(params, updates, self.weights(updates), value=-1)

    def clean_(self, updates: list[torch.Tensor]) -> None:
        """On a step the device decides, replace every inf/NaN element of `updates` by 0, in place, so
        that a state update can weigh them by `ctx.weights()` (0 on a skipped step): `m + 0 * (u - m)`
        is `m` only for finite `u`. The other elements are left as they are (a skipped step's finite
        elements are weighed by 0 like the rest). One pass over the updates, `nan_to_num_` (about five
        times faster than a masked fill on a CPU); only transforms that keep full-size buffers call it,
        and only when the device decides the skip. Traced by `torch.compile`, a skipped step's updates
        all become 0 instead (a select on the step's decision that fuses into the following read: no
        pass of its own)."""
        if self.skip is not None and torch.compiler.is_compiling():
            # traced: a select on the step's decision, a vectorised blend that fuses into the next
            # read (inductor lowers `isnan` element by element); a skipped step's updates are all 0
            for u in updates:
                u.copy_(torch.where(self.skip, 0.0, u))
        elif self.skip is not None:
            keep_memo = self.memo.cleaning(updates)
            for u in _clean_small_together(updates):
                torch.nan_to_num_(u, nan=0.0, posinf=0.0, neginf=0.0)
            keep_memo()

    def cleaned(self, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """The updates for a state update to read, weighed by `weights()`: `updates` themselves, cleaned in
        place (`clean_`). Traced by `torch.compile`, on a step the device decides, a select per tensor
        instead (all 0 on a skipped step) that fuses into the read, and `updates` stay as they are: a write
        into the gradients would be a mutation of the graph's inputs, made on a copy and written back."""
        if self.skip is None:  # (the host decided: nothing to clean)
            return updates
        if torch.compiler.is_compiling():
            return [torch.where(self.skip, 0.0, u) for u in updates]
        self.clean_(updates)
        return updates

    def weights(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """`~skip` as a 0-d number per tensor of `like` (in its dtype): 1 where the step goes ahead,
        0 where the device skips it; weigh cleaned updates by it (`_foreach_addcmul_`: `x * 1` is
        `x` exactly). Only on a step the device decides."""
        go = self.proceed if self.proceed is not None else ~self.skip
        by_dtype = {dt: go.to(dt) for dt in {t.dtype for t in like}}
        return [by_dtype[t.dtype] for t in like]

    def keep(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """`new`, or `old` on a skipped step (no host sync)."""
        return new if self.skip is None else torch.where(self.skip, old, new)

    def skip_also(self, cond: torch.Tensor) -> None:
        """Skip the rest of this step where the 0-d bool `cond` is true, decided on the device: `skip |= cond`.

        Only on a step whose skip the device decides (`skip` is set). Every transform that runs
        after the caller then keeps its state, and the parameters stay as they are, exactly as on
        a step skipped for non-finite gradients; `Modular` counts it in `skipped_steps`. The
        transforms that ran before the caller have already taken the step in (`SkipStep` is
        refused after a transform that keeps state: `modopt.core.modular`)."""
        self.skip = self.skip | cond
        self.proceed = ~self.skip
        self.checked = None

    def finite(self, norm: torch.Tensor) -> torch.Tensor | None:
        """`norm < inf` (a norm is >= 0 and NaN compares false), and, where the device decides, the step
        goes ahead: a bool tensor like `norm`. For the non-finite check's own total (or a view of it) the
        answer is known: `proceed` where the device decides, and None where the host did (the step goes
        ahead, so the total is finite: the caller needs no test)."""
        checked = self.checked
        if checked is not None and (norm is checked or norm._base is checked):
            if self.skip is None:
                return None
            return self.proceed if norm is checked else self.proceed.view(norm.shape)  # type: ignore[union-attr]
        ok = norm < math.inf
        if self.skip is not None:
            ok = ok & (self.proceed if self.proceed is not None else ~self.skip)
        return ok

    def sub(self, idx: list[int], cache_key: Any) -> "Step":
        """The step over `params[i] for i in idx` (a `Masked` selection), its layout cached under `cache_key`."""
        layout = self.layout.cache.get(cache_key)
        if layout is None:
            groups, group_ids, ranges = [], [], []
            for g, gid, (a, b) in zip(self.groups, self.group_ids, self.ranges):
                start = sum(1 for i in idx if i < a)
                n = sum(1 for i in idx if a <= i < b)
                if n:
                    groups.append(g)
                    group_ids.append(gid)
                    ranges.append((start, start + n))
            at = self.layout.positions
            layout = Layout((self.layout.key, cache_key), [self.params[i] for i in idx], groups, group_ids, ranges,
                            [self.names[i] for i in idx], None if at is None else [at[i] for i in idx])
            self.layout.cache[cache_key] = layout
        sub = Step(layout, self.host, self.stats, self.skip, self.memo, False)  # the parent step's memo
        sub.host_reads, sub.cpu_kernels = self.host_reads, self.cpu_kernels  # (the whole step's, as its memo)
        sub.proceed, sub.checked, sub.cancelled = self.proceed, self.checked, frozenset()  # (the linter does not look inside Masked)
        sub.folded, sub.deferred, sub.loss = None, None, self.loss
        sub.moment_requests = self.moment_requests
        return sub


def check_loss(value: Any, door: str, what: str = "the loss") -> None:
    """Refuse a step's loss that SkipStep and Rewind cannot read as one real number, naming `door`:
    a `TypeError` for a complex or bool value, a tensor or NumPy array of more than one element, or
    another type; a `ValueError` for a finite number beyond float64 (`10**400`) or an int beyond 64
    bits. A real NumPy scalar or one-element array passes, and so do NaN and inf (a non-finite loss
    is what SkipStep and Rewind act on). None passes: no loss was given. A tensor's value is never
    read (its dtype and element count only: no host sync)."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
            return
        got = f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    elif isinstance(value, bool):
        got = "a bool"
    elif isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            far = abs(value) > 1.7976931348623157e308  # (int-float comparison: exact, never overflows)
            raise ValueError(f"{door}: {what} is an int of {len(str(abs(value)))} digits, which "
                             + ("cannot be represented as a finite float64" if far else "is beyond 64 bits (give it as a float)"))
        return
    elif isinstance(value, float):
        return
    elif is_numpy(value):
        kind, size = value.dtype.kind, value.dtype.itemsize
        if value.size == 1 and kind in "fiu":
            if kind == "f" and size > 8:  # longdouble: the one NumPy real that float64 may not hold
                np = sys.modules["numpy"]  # (imported: `value` is one of its objects)
                x = value.reshape(())
                if np.isfinite(x) and not math.isfinite(float(x)):
                    raise ValueError(f"{door}: {what} {x!r} cannot be represented as a finite float64")
            if (kind == "f" and size > 8) or (kind == "u" and size > 4):  # (torch has no such dtype)
                raise TypeError(f"{door}: {what} has NumPy dtype {value.dtype}, which torch does not hold; "
                                "give float(loss)")
            return
        got = (f"a NumPy array of shape {tuple(value.shape)} and dtype {value.dtype}" if value.ndim
               else f"a NumPy {type(value).__name__}")
    else:
        got = type(value).__name__
    raise TypeError(f"{door}: {what} must be a real number or a one-element real tensor or NumPy array, got {got}")


class ScratchHost(Host):
    """A throwaway state host (one functional call, a test)."""

    def __init__(self) -> None:
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        self._store: dict[str, dict[str, Any]] = {}
        self._runtime: dict[str, dict[str, Any]] = {}

    def transform_store(self, key: str) -> dict[str, Any]:
        """The saved values of the transform with state key `key` (created empty)."""
        return self._store.setdefault(key, {})

    def runtime_store(self, key: str) -> dict[str, Any]:
        """The unsaved cache of the transform with state key `key` (created empty)."""
        return self._runtime.setdefault(key, {})

    #: no pipeline, no plan: nothing is left out, folded or linked (`modopt.core.plan`)
    plan: Any = None


class TransformState:
    """One transform's view of the host's state for one step (`step`: the `modopt.core.step.Step`)."""

    __slots__ = ("step", "host", "key")
    step: Step
    host: Any
    key: str

    def __init__(self, step: Step, key: str) -> None:
        self.step, self.host, self.key = step, step.host, key

    @property
    def store(self) -> dict[str, Any]:
        """Saved per-transform values (tensors, numbers)."""
        return self.host.transform_store(self.key)

    @property
    def runtime(self) -> dict[str, Any]:
        """Unsaved per-transform cache."""
        return self.host.runtime_store(self.key)

    def segments(self, t: Any) -> Segments:
        """The segments of this step under the scope fields of `t` (a `modopt.core.scope.Scoped`), made once
        per layout and shared by every transform with the same scope, with this step's norm memo."""
        layout = self.step.layout
        k = ("segments", t.scope, t.dim, t.inverse_dims, t.min_size)
        seg = layout.cache.get(k)
        if seg is None:
            step = self.step
            seg = layout.cache[k] = make_segments(step.params, step.ranges, t.scope, t.dim, t.inverse_dims, t.min_size,
                                                  step.names)
        seg.memo = self.step.memo  # this step's
        return seg

    def record(self, name: str, value: torch.Tensor) -> None:
        """Telemetry for `opt.stats`: a tensor (never a list, never synchronised)."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{self.key}: telemetry {name!r} must be a tensor (got {type(value).__name__}); "
                "a per-segment statistic is one 1-D tensor (see modopt.core.reduce.Segments)"
            )
        self.step.stats[value_key(self.key, name)] = value

    def record_clip(self, norm: torch.Tensor, scale: torch.Tensor, **extra: torch.Tensor) -> None:
        """Telemetry of a clipper, one value per segment: the pre-clip `norm`, the `scale`, `clipped` and `extra`."""
        stats, key = self.step.stats, self.key
        stats[value_key(key, "norm")] = norm
        stats[value_key(key, "scale")] = scale
        stats[value_key(key, "clipped")] = scale < const(1.0, scale)
        for k, v in extra.items():
            self.record(k, v)

    def scale_(self, seg: Any, updates: list[torch.Tensor], scale: torch.Tensor) -> None:
        """`seg.mul_(updates, scale)`: a transform's per-segment scale (`modopt.core.roles.ScaleFact`).

        Left out when the normalization right after this transform cancels it (the step's
        `cancelled`, from `modopt.core.plan.cancelled_scales`): the result is the same up to
        rounding, one pass over the updates less, and the norm memo stays valid for the
        normalization (the runner does not close it after this transform). Telemetry gets
        `"<key>.cancelled"` (true): the transform's other entries say what it would have done.

        Deferred when the final optimizer folds it into its fused kernel (the step's `folded`,
        `modopt.core.plan.folded_scale`, a global scale only): the step keeps it as `pending`, and
        the kernel divides by its reciprocal (`grad_scale`) instead of a multiply here; any
        other transform that runs first applies it (`Step.flush_`). Under `compile_step`, the scale the plan
        defers (the step's `deferred`, `modopt.core.plan.deferrable_scale`: global or one per whole tensor)
        is kept `pending` the same way, for the fused optimizer op to multiply in place.
        """
        if self.key in self.step.cancelled:  # telemetry says so (its `clipped` etc. are what it would have done)
            cache = self.step.layout.cache
            true = cache.get(("cancelled", scale.device))
            if true is None:
                true = cache[("cancelled", scale.device)] = torch.ones((), dtype=torch.bool, device=scale.device)
            self.step.stats[value_key(self.key, "cancelled")] = true
            return
        if self.key == self.step.folded and seg.kind == "global":
            self.step.pending = (seg, scale)  # the optimizer's kernel takes it (or the next transform applies it)
            return
        if (self.key == self.step.deferred and (seg.kind == "global" or (seg.kind == "tensor" and seg.all_active))
                and compile_marks.KEEP_EAGER_KERNELS and torch.compiler.is_compiling()):
            self.step.pending = (seg, scale)  # the fused op multiplies in place (or the next transform applies it)
            return
        seg.mul_(updates, scale)

    # --- per-parameter buffers --------------------------------------------
    def buffers(self, name: str, init: Callable[[int, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """The buffer `name` of each parameter of the step, created by `init(i, p)` when missing."""
        k = value_key(self.key, name)
        states = self.step.param_states()
        try:
            return list(map(operator.itemgetter(k), states))  # (C-level loop)
        except KeyError:
            pass
        out = []
        for i, (p, s) in enumerate(zip(self.step.params, states)):
            v = s.get(k)
            if v is None:
                v = s[k] = init(i, p)
            out.append(v)
        return out

    def has_buffers(self, name: str) -> list[bool]:
        """Whether each parameter of the step already has the buffer `name`."""
        k = value_key(self.key, name)
        return [k in s for s in self.step.param_states()]

    # --- per-segment values (scope-aware) ---------------------------------
    def seg_get(self, seg: Any, name: str, init: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A saved per-segment value as a 1-D tensor, one entry per segment of `seg` (`init` where new).

        Where each segment's value lives is `seg.slots(self, name)`.
        """
        if seg.kind == "global":  # (the one slot, without building the slot list: a step reads several values)
            store = self.host.transform_store(self.key)
            v = store.get(name)
            if v is None:
                dev = self.step.params[0].device if self.step.params else torch.device("cpu")
                v = store[name] = torch.full((), init, dtype=dtype, device=dev)
            return v.reshape(1)  # (the store's tensor is replaced by seg_set, never written)
        vals = []
        for where, k, shape, device in seg.slots(self, name):
            v = where.get(k)
            if v is None:
                v = where[k] = torch.full(shape, init, dtype=dtype, device=device)
            vals.append(v)
        if seg.kind == "slices":  # per-parameter buffers are copied into: return a new tensor
            return torch.cat([v.reshape(-1) for v in vals])
        if len(vals) == 1 and seg.kind == "global":  # the store's tensor is replaced by seg_set, never written
            return vals[0].reshape(1)
        return torch.stack(vals)

    def seg_set(self, seg: Any, name: str, value: torch.Tensor, kept: bool = False) -> None:
        """Save per-segment values read by `seg_get()` (a 1-D tensor, one entry per segment).

        On a step the device skips the saved values stay as they were, unless `kept` says
        that `value` already holds them there (no second `where`).
        """
        if self.step.skip is not None and not kept:  # a skipped step keeps every saved value
            value = self.step.keep(value, self.seg_get(seg, name, 0.0, value.dtype).to(value.dtype))
        if seg.kind == "global":
            self.host.transform_store(self.key)[name] = value[0]
            return
        slots = seg.slots(self, name)
        if seg.kind in ("global", "group"):  # transform-wide values: the store holds the new tensors
            for (where, k, _, _), v in zip(slots, value.unbind(0)):
                where[k] = v
            return
        dst = [where[k] for where, k, _, _ in slots]
        if dst:
            copy_(dst, seg.split(value))


class RunShape(NamedTuple):
    """How one chain runs, decided by the plan when the optimizer is built (`modopt.core.plan.run_shapes`)."""

    #: each transform's state key (`keys.transform_key(i, type, parent)`)
    keys: tuple[str, ...]
    #: with `final`, the index of the writer: the last transform that touches the updates (a trailing
    #: `Identity` runs after it)
    end: int
    #: the start of the routed `Masked` branches that end the chain at `end` (`end` when none or one)
    first: int
    #: whether the writer writes the parameters itself (`modopt.core.roles.Writer.apply_final`)
    writes: bool


def plain_shape(transforms: Sequence[Any], parent: str, final: bool) -> RunShape:
    """The shape of a chain the plan did not see (a step outside an optimizer): its keys, no routing, and a
    writer that leaves the write to the runner."""
    keys = tuple(transform_key(i, type(t).__name__, parent) for i, t in enumerate(transforms))
    end = len(transforms) - 1
    if final:
        while end > 0 and transforms[end].update_access == "none":
            end -= 1
    return RunShape(keys, end, end, False)


def run(transforms: Sequence[Any], step: Step, updates: list[torch.Tensor], parent: str = "",
        final: bool = False) -> list[torch.Tensor] | bool | None:
    """Run `transforms` in order on `updates`; with `final` the last one writes the parameters.

    Returns the updates (not `final`) or True (`final`: the parameters were written),
    or None when a transform stopped the step (returned None). `parent` is the key of the chain
    holding the transforms (`""` at the top): each transform's state key is
    `keys.transform_key(i, type, parent)`. How the chain runs (its keys, its writer, its routed
    branches) is the plan's `RunShape`. The step's norm memo closes after the first transform that
    writes the updates.
    """
    n = len(transforms)
    shapes = step.shapes  # (the plan's, by the chain's parent key: no work here)
    shape = shapes.get((parent, final)) if shapes is not None else None
    if shape is None or len(shape[0]) != n:
        shape = plain_shape(transforms, parent, final)
    keys, end, first, writes = shape
    written: list[int] = []
    for i, t in enumerate(transforms):
        st = TransformState(step, keys[i])  # (made as it runs: a transform that stops the step spares the rest)
        if final and first <= i < end:  # a routed branch before the last: its optimizer writes its parameters
            step.flush_(updates)
            idx = t.write_branch(step, st, updates)
            if idx is None:  # it stopped the step before anything moved (only the first may stop)
                return None
            written += idx
            if st.key not in step.cancelled:
                step.memo.close()
            continue
        if final and i == end and written:  # the last routed branch, then the parameters no branch owns
            step.flush_(updates)
            chosen = set(written).union(t.write_branch(step, st, updates))
            rest = [j for j in range(len(step.params)) if j not in chosen]
            if rest:
                step.write_updates([updates[j] for j in rest], [step.params[j] for j in rest])
            for j in range(i + 1, n):
                transforms[j].apply(step, TransformState(step, keys[j]), updates)
            return True
        if final and i == end:
            if not (writes and t.apply_final(step, st, updates)):  # (a fused kernel may take a pending scale)
                step.flush_(updates)
                out = t.apply(step, st, updates)
                if out is not None:
                    step.write_updates(out)
            for j in range(i + 1, n):  # they touch no update: run them for their own sake
                transforms[j].apply(step, TransformState(step, keys[j]), updates)
            return True
        if t.update_access != "none" and step.pending is not None:
            step.flush_(updates)
        updates = t.apply(step, st, updates)
        if updates is None:
            return None
        if t.update_access == "write" and st.key not in step.cancelled:
            step.memo.close()
    return updates


def run_step(transforms: Sequence[Any], step: Step, updates: list[torch.Tensor] | None = None,
             write: bool = False) -> list[torch.Tensor] | bool | None:
    """A whole step of `transforms` over `step`, starting from the gradients (or `updates`).

    The step's norm memo was opened when the step was made (`collect`, `Step.over`) and
    is closed when this returns. With `write=True` the parameters move (the last transform may fuse that write)
    and it returns True, or None when a transform stopped the step; otherwise the final updates are returned
    (None if a transform stopped the step).
    """
    if updates is None:
        updates = [p.grad for p in step.params]
    try:
        if write and transforms:
            return run(transforms, step, updates, final=True)  # True: written; None: a transform stopped the step
        out = run(transforms, step, updates)
        if out is not None:
            step.flush_(out)
        if write and out is not None:
            step.write_updates(out)
            return True
        return out
    finally:
        step.memo.close()  # it holds the step's tensors: let them go
