"""The step driver. `Stepping.step` is `Modular.step` (torch's hooks, the gate's check of changed group values,
the skipped-step count, the telemetry); `drive` is the one step of `Modular` and `attach` handles: which
parameters a step holds (`collect`), whether it goes ahead (the non-finite policy's decision, on the host or
on the device), then the pipeline over it (`modopt.core.step.run_step`, the author's step API).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from itertools import accumulate, compress, count, repeat
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks as _GLOBAL_POST_HOOKS
from torch.optim.optimizer import _global_optimizer_pre_hooks as _GLOBAL_PRE_HOOKS

from . import compile_marks, distributed
from .distributed import any_sharded
from .hostdata import Host, device_path  # noqa: F401  (the path switch, where the tests and benchmarks take it)
from .reduce import any_nonfinite, common_acc_dtype, foreach_pnorm, stage_total, vector_pnorm
from .step import Layout, Step, TransformState, check_loss, run_step


_grad_of = operator.attrgetter("grad")
_is_sparse = operator.attrgetter("is_sparse")
_is_contiguous = torch.Tensor.is_contiguous


class _LastStep:
    """Holds `Modular.stats`, the telemetry of the last step.

    The step stores its new dict here rather than on the optimizer. Under
    `torch.compile`, dynamo wraps a `torch.optim.Optimizer` in a variable type
    of its own that (torch 2.13) it does not register for side-effect
    tracking, so an attribute assigned on the optimizer inside a compiled step
    is silently not replayed: `self.stats = stats` was lost and `opt.stats`
    stayed empty. An attribute assigned on this plain object is replayed like
    any other.
    """

    def __init__(self, stats: dict[str, torch.Tensor] | None = None):
        self.stats: dict[str, torch.Tensor] = {} if stats is None else stats


def _hooked(func: Callable[..., Any]) -> Callable[..., Any]:
    """`Stepping.step` (`Modular.step`) as torch's `Optimizer.profile_hook_step` and `torch.no_grad()` make a step: torch's
    step pre- and post-hooks (global and the optimizer's, in torch's order, a pre-hook's new arguments
    taken), the profiler's `Optimizer.step#Modular.step` range, the body without autograd. Each step
    makes the range only while a profiler records and sets grad mode directly: the context managers
    cost about as much as a small model's whole step on a CPU. Traced by `torch.compile`, torch's own
    wrappers run. Marked `hooked`, so torch does not wrap it again."""
    traced = torch.optim.Optimizer.profile_hook_step(torch.no_grad()(func))

    @functools.wraps(func)
    def step(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or torch.autograd._profiler_enabled():
            return traced(*args, **kwargs)
        self = args[0]
        if _GLOBAL_PRE_HOOKS or self._optimizer_step_pre_hooks:
            for hook in itertools.chain(_GLOBAL_PRE_HOOKS.values(), self._optimizer_step_pre_hooks.values()):
                result = hook(self, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(f"{func} must return None or a tuple of (new_args, new_kwargs), "
                                           f"but got {result}.")
                    args, kwargs = result
        was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            out = func(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(was)
        self._optimizer_step_code()
        if self._optimizer_step_post_hooks or _GLOBAL_POST_HOOKS:
            for hook in itertools.chain(self._optimizer_step_post_hooks.values(), _GLOBAL_POST_HOOKS.values()):
                hook(self, args, kwargs)
        return out

    step.hooked = True  # type: ignore[attr-defined]
    return step

def collect(host: Any, param_groups: list[dict[str, Any]], stats: dict[str, torch.Tensor]) -> Step:
    """The step over the parameters with a gradient, by group (params whose `.grad` is None are skipped).

    The per-step work is one pass over the parameters; everything derived from which
    parameters have a gradient is cached in a `Layout` (checks of the parameters
    themselves run when the layout is first seen).
    """
    params: list[torch.Tensor] = []
    group_ids: list[int] = []
    ranges: list[tuple[int, int]] = []
    masks: list = []
    compiling = torch.compiler.is_compiling()
    for gi, group in enumerate(param_groups):
        ps = group["params"]
        keep = ([p.grad is not None for p in ps] if compiling  # (dynamo traces the comprehension)
                else list(map(operator.is_not, map(_grad_of, ps), repeat(None))))  # (C-level: no Python call)
        if not all(keep):
            if not any(keep):
                continue
            start = len(params)
            params.extend([p for p, k in zip(ps, keep) if k])
            masks.append(tuple(keep))
        else:
            if not ps:
                continue
            start = len(params)
            params.extend(ps)
            masks.append(None)
        group_ids.append(gi)
        ranges.append((start, len(params)))
    groups = [param_groups[gi] for gi in group_ids]
    # the groups are told apart by identity below, not by id() in the key: dynamo before 2.13 cannot trace id()
    # of a dict, and a compiled step must stay one graph on every torch it meets
    key = (tuple(map(id, params)), tuple(group_ids), tuple(masks))
    layouts = host.runtime_store("__layouts__")
    layout = layouts.get(key)
    if layout is None or not all(map(operator.is_, layout.groups, groups)):
        names = _names(param_groups, group_ids, masks)
        _check_params(params, names, group_ids, ranges)
        if len(layouts) >= 16:  # many distinct grad patterns: keep the cache small
            layouts.clear()
        starts = list(accumulate((len(g["params"]) for g in param_groups), initial=0))
        positions = [starts[gi] + j for gi, mask in zip(group_ids, masks)
                     for j in (range(len(param_groups[gi]["params"])) if mask is None else compress(count(), mask))]
        layout = layouts[key] = Layout(key, params, groups, group_ids, ranges, names, positions)
    grads = [p.grad for p in params] if compiling else list(map(_grad_of, params))  # (dynamo traces the first)
    if compiling or any(map(_is_sparse, grads)) or not all(map(_is_contiguous, grads)):  # (an expanded one is not)
        for p, g in zip(params, grads):  # (the scans above run at C level: no Python call per tensor)
            if g.is_sparse:
                raise RuntimeError(f"modopt does not support sparse gradients (parameter {_where(layout, p)})")
            # (a DTensor's gradient is FSDP2's or DTensor's own, never expanded; dynamo cannot trace its strides)
            if not distributed.is_sharded(g) and 0 in g.stride() and torch._debug_has_internal_overlap(g) == 1:
                # an expanded gradient (`t.expand(...)`): elements share memory, so no transform could write it
                # in place; the step works on a copy of its own, as torch's kernels read such a gradient whole
                p.grad = g.contiguous()
    return Step(layout, host, stats, None, None, compiling)  # a new, open memo: the check and the transforms share norms


def _names(param_groups, group_ids, masks) -> list:
    names: list = []
    for gi, mask in zip(group_ids, masks):
        group = param_groups[gi]
        gnames = group.get("param_names")
        n = len(group["params"])
        idx = range(n) if mask is None else [j for j in range(n) if mask[j]]
        names.extend(gnames[j] if gnames else None for j in idx)
    return names


def _check_params(params, names, group_ids, ranges) -> None:
    for (a, b), gi in zip(ranges, group_ids):
        for i in range(a, b):
            if params[i].is_complex():
                raise RuntimeError(
                    f"modopt does not support complex parameters (parameter {names[i] or i - a} of group {gi}); "
                    "use torch.view_as_real on the parameter"
                )


def _where(layout: Layout, p: torch.Tensor) -> str:
    i = next(i for i, q in enumerate(layout.params) if q is p)
    return str(layout.names[i] or i)


# --- the step driver and the non-finite policy ---------------------------------
NonFinite = Literal["skip", "raise", "zero", "ignore"]


def nonfinite_mask(grads: list[torch.Tensor], stages: Any = None) -> torch.Tensor:
    """0-d bool tensor: does any gradient hold inf or NaN (exact; no host sync).

    Uses the largest magnitude of each tensor, which is finite exactly when
    every element is (finite values never overflow a max). Slow on CPU (about
    18x a 2-norm), so the step runs it only when the cheap check fails.
    """
    if any_sharded(grads):  # FSDP2: every rank must reach the same decision
        bad = any_nonfinite(grads)
    else:
        maxabs = foreach_pnorm(grads, math.inf)  # empty tensors count as 0; float64 kept (1e300 is finite)
        bad = ~torch.stack([torch.isfinite(n) for n in maxabs]).all()
    if stages is not None:  # pipeline stages (`stages`, their process group): every stage decides alike
        bad = distributed.gather_0d(bad.to(torch.float32), stages).any()
    return bad


def maybe_finite(ctx: Step, grads: list[torch.Tensor], on_device: bool = False,
                 total_only: bool = False) -> torch.Tensor:
    """0-d bool tensor, cheap: True proves every gradient finite; False means "possibly not".

    It is the finiteness of the total 2-norm, combined from the per-tensor 2-norms
    as `torch.nn.utils.get_total_norm` does: an inf or NaN element makes its
    tensor's 2-norm, and so the total, inf or NaN, so a finite total proves finite
    gradients. The converse fails only when finite values' squares overflow the
    accumulator (float32 norms near 1.8e19 and above), which `nonfinite_mask` then
    settles on the host. The per-tensor norms are the ones a global or per-tensor
    2-norm of the chain needs anyway: they go into the step's norm memo
    (`modopt.core.reduce.NormMemo`), so a following `ClipNorm` reads them instead
    of the gradients. With `on_device` (the device decides: an overflowing total
    skips the step) the total goes into the memo as well, so a global 2-norm clip
    costs no further op. The test is one op, `total < inf` (a norm is >= 0, and
    NaN compares false). `total_only`: the total itself, for the host to compare.
    """
    acc = common_acc_dtype(grads)
    parts = ctx.memo.pnorms(grads, 2.0, acc)
    # (`vector_pnorm` only where `compile_step` traces: the eager step makes no call for it)
    total = vector_pnorm(parts) if compile_marks.KEEP_EAGER_KERNELS else torch.linalg.vector_norm(parts)
    if ctx.memo.stages is not None:  # pipeline stages: the total of every stage's gradients, decided alike
        total = stage_total(total, 2.0, ctx.memo.stages)
    if on_device:
        ctx.memo.put_total(grads, 2.0, acc, total)
        ctx.checked = total
    return total if total_only else total < math.inf


#: `False` as a 0-d bool tensor on the CPU, for the telemetry of steps that go ahead (`opt.stats` values are
#: read, never written: one shared tensor instead of a new one each step)
CPU_FALSE = torch.zeros((), dtype=torch.bool)


def apply_nonfinite_policy(policy: str, ctx: Step, grads: list[torch.Tensor], on_device: bool = False,
                           host_on_cpu: bool = False, values_ok: torch.Tensor | None = None) -> bool:
    """Apply the policy; return False when the step must be skipped.

    With `on_device` (only for `"skip"`, when every transform of the pipeline
    `modopt.core.roles.skips_on_device`), the decision stays on the device: `ctx.skip` is set to
    the 0-d bool "the total 2-norm is not finite" (from all-reduced norms under
    FSDP2: every rank decides alike) and the chain runs, keeping every state on
    a skipped step; no host sync at all (on a CPU, with `host_on_cpu`, the host reads that
    decision: one sync that only reads memory, and the plain chain). Gradients whose total 2-norm overflows
    the accumulator (finite float32 elements beyond about 1.8e19) then count as
    non-finite, as in the careful torch loop
    (`if clip_grad_norm_(...).isfinite(): opt.step()`).

    One host sync per step when the gradients are finite (the common case):
    the finiteness of the total 2-norm (`maybe_finite`). Only when that
    says "possibly non-finite" does the exact check (`nonfinite_mask`)
    run, with a second sync, so finite-but-huge gradients are never called
    non-finite. Under `torch.compile` that decision runs outside the graph
    (`_settle_compiled`): plain `torch.compile` breaks the graph there, and
    `fullgraph=True` fails with `FULLGRAPH_HINT` in dynamo's message.

    `values_ok` (a 0-d bool, or None): whether the tensor group values the host does not read are within
    their rules; False is decided as a non-finite gradient is (`"skip"` skips, `"raise"` raises), in the
    same decision (no sync of its own). `"zero"` and `"ignore"` never skip, so they do not read it.
    """
    if policy == "ignore" or not grads or grads[0].is_meta:  # (meta tensors hold no values: nothing to check)
        return True
    if policy == "zero":
        if any_sharded(grads):  # FSDP2: the decision all-reduced, then each rank zeroes its shards
            ctx.stats["nonfinite"] = any_nonfinite(grads)
            for g in grads:
                torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
            return True
        counts = []
        for g in grads:
            bad = ~torch.isfinite(g)
            counts.append(bad.sum())
            g.masked_fill_(bad, 0)
        zeroed = torch.stack(counts).sum()
        ctx.stats["zeroed"] = zeroed  # the number of elements set to 0 this step (no sync)
        ctx.stats["nonfinite"] = zeroed > 0
        return True
    if on_device and policy == "skip":  # under FSDP2 the norms are all-reduced: every rank decides alike
        if host_on_cpu and ctx.host_reads:
            # the device's decision, read where reading it is free: the plain chain runs (no cleaning
            # pass, no skip-aware kernels), or none of it, as on a step the host decides; the same bits
            # (the device's test, `total < inf`, made on the host: NaN compares false there too)
            total = maybe_finite(ctx, grads, on_device=True, total_only=True)
            if (total.item() < math.inf) if values_ok is None else bool((total < math.inf) & values_ok):
                ctx.stats["nonfinite"] = CPU_FALSE
                return True
            ctx.stats["nonfinite"] = torch.ones((), dtype=torch.bool)
            ctx.memo.close()
            return False
        proceed = maybe_finite(ctx, grads, on_device=True)
        if values_ok is not None:
            proceed = proceed & values_ok
        bad = ctx.stats["nonfinite"] = ~proceed
        ctx.proceed, ctx.skip = proceed, bad
        return True
    if any_sharded(grads):  # FSDP2: one exact, all-reduced decision
        bad, exact = nonfinite_mask(grads, ctx.memo.stages), True
    else:  # cheap check first; true only for a non-finite (or overflowing) norm
        bad, exact = ~maybe_finite(ctx, grads), False
    settle = compile_marks.settle if torch.compiler.is_compiling() else _settle
    is_bad, bad, which = settle(policy, bad, exact, grads, ctx.names, ctx.memo.stages, values_ok)
    ctx.stats["nonfinite"] = bad
    if not is_bad:
        return True
    ctx.memo.close()  # the chain does not run: let the gradients go
    if policy == "raise":
        if not which:  # (the gradients are finite: a group value the device checks is not)
            raise ValueError("a tensor param-group value is out of its range or not finite (filled in place since "
                             "the last step; nonfinite='raise'); nothing was changed by this step")
        raise FloatingPointError(f"non-finite gradient in parameter(s) {', '.join(which)} (nonfinite='raise')")
    return False


def _settle(policy: str, bad: torch.Tensor, exact: bool, grads: list[torch.Tensor], names: list,
            stages: Any = None, values_ok: torch.Tensor | None = None) -> tuple:
    """The host's decision: `(is_bad, bad, which)`.

    One sync (`bool(bad)`) when the gradients are finite; when the cheap check
    says "possibly non-finite", the exact check and a second sync. `which`
    names the non-finite parameters for `"raise"` (empty otherwise). A `values_ok`
    (the device's verdict on tensor group values) is read in the same sync.
    """
    values_bad = None if values_ok is None else ~values_ok
    is_bad = bool(bad if values_bad is None else bad | values_bad)
    if is_bad and not exact:  # rare: settle it exactly
        bad = nonfinite_mask(grads, stages)
        is_bad = bool(bad if values_bad is None else bad | values_bad)
    if values_bad is not None:
        bad = bad | values_bad
    which = []
    if is_bad and policy == "raise":
        which = [names[i] or f"#{i}" for i, g in enumerate(grads) if not torch.isfinite(g).all()]
    return is_bad, bad, which


#: what dynamo prints when `fullgraph=True` meets the host decision (it shows a disabled function's reason)
FULLGRAPH_HINT = (
    "modopt: this step decides on the host whether it goes ahead (bool() of an on-device check, one sync "
    "per step), which a single graph cannot hold. That happens with nonfinite='raise', and with the default "
    "nonfinite='skip' when a transform of the pipeline keeps its state only with the host's decision "
    "(modopt.core.roles.skips_on_device() is False: SGD/Adam/AdamW with fused=False or foreach (torch's non-fused "
    "kernels); a TorchOptimizer of a class its docstring does not list, or of torch's SGD with momentum and "
    "dampening; a transform of your own that does not declare it). For "
    "torch.compile(opt.step, fullgraph=True), use transforms that skip on the device, or build the optimizer with nonfinite='ignore' (no check) or nonfinite='zero' (non-finite "
    "gradient elements become 0, on the device); or keep the policy and compile without fullgraph=True "
    "(one graph break per step, at this decision)"
)
#: `_settle` for traced code (`compile_marks.settle`): a graph break under plain `torch.compile`,
#: `FULLGRAPH_HINT` under fullgraph
compile_marks.disabled("settle", _settle, FULLGRAPH_HINT)


def drive(host: Any, groups: list[dict[str, Any]], transforms: Sequence[Any], policy: str,
          stats: dict[str, torch.Tensor], *, loss: Any = None, write: bool = False, on_device: bool = False,
          host_on_cpu: bool = False, taps: Iterable[Callable[[Step], None]] = (),
          weights: Sequence[tuple[str, Any]] = (), values_ok: torch.Tensor | None = None) -> tuple[Step, bool, Any]:
    """One step of `transforms` over the parameters of `groups` that have a gradient; `(ctx, go, out)`.

    `go` is False when the policy skipped the step on the host (the chain did not run: the caller tells
    its transforms, `SeesHostSkips.on_host_skip`); `out` is then None, else `run_step`'s result: True when
    `write` and the parameters were written, the updates without `write`, None when a transform stopped
    the step. `taps` see the step after the decision, before the chain (telemetry); the weight stage
    (`weights`: `(key, transform)`) reads the weights before the write and acts after it. `values_ok`: the
    device's verdict on the tensor group values the host does not read (`GroupGate.device_ok`); it joins
    the non-finite decision. No parameter with a gradient: `ctx.params` is empty and nothing ran."""
    ctx = collect(host, groups, stats)
    ctx.loss = loss
    if not ctx.params:
        return ctx, True, None
    grads = [p.grad for p in ctx.params] if torch.compiler.is_compiling() else list(map(_grad_of, ctx.params))
    go = apply_nonfinite_policy(policy, ctx, grads, on_device, host_on_cpu, values_ok)
    for tap in taps:
        tap(ctx)
    if not go:
        return ctx, False, None
    for key, t in weights:  # (the weight stage reads the weights before this step's write)
        t.prepare_weights(ctx, TransformState(ctx, key))
    out = run_step(transforms, ctx, grads, write=write)  # (the checked list: the same tensors, in place)
    if out and weights:
        for key, t in weights:
            t.apply_weights(ctx, TransformState(ctx, key))
    return ctx, True, out


class Stepping(torch.optim.Optimizer, Host):
    """The step of an optimizer built by a plan (`Modular`'s base; `modopt.core.modular` builds it): torch's
    step hooks around it, the group values a scheduler or a hand changed checked at the gate, the drive
    (`drive`), the skipped-step count and the telemetry, and the state stores the transforms reach.

    What the builder sets: `plan` (`modopt.core.plan.Plan`), `_gate` (`modopt.core.hyper.GroupGate`),
    `skip_limit` (`modopt.core.skip_limit.SkipLimit` or None), `_skipped_steps` (a 0-d int64 tensor),
    `_last` (`_LastStep`), `_store` and `_runtime` (dicts by transform key); `_per_mesh`, the torch function
    mode the step runs under when the parameters lie on several meshes (`distributed.per_mesh_mode`), or None.
    """

    plan: Any
    _gate: Any
    skip_limit: Any
    _skipped_steps: torch.Tensor
    _last: _LastStep
    _store: dict[str, dict[str, Any]]
    _runtime: dict[str, dict[str, Any]]
    _per_mesh: Any = None

    @_hooked
    def step(self, closure: Callable[[], Any] | None = None, *, loss: Any = None) -> Any:
        """One optimisation step; returns the closure's loss like torch's optimizers.

        `loss=` gives the step's loss to the transforms that read it (`SkipStep`) when there is no
        closure (a real number or a one-element tensor); with a closure, its return value is the loss.
        Returns `loss` then."""
        if closure is not None and loss is not None:
            raise TypeError("opt.step: give the loss by the closure or by loss=, not both")
        if loss is not None:
            check_loss(loss, "opt.step(loss=...)")
        if self.skip_limit is not None:  # (a GPU's count of the last step, read now: before anything changes)
            self.skip_limit.before_step()
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        gate = self._gate
        values_ok = None  # (the tensor group values the device checks: their verdict joins the skip decision)
        if not torch.compiler.is_compiling():  # the group values a scheduler or a hand changed since the last step
            # (`GroupGate.check_step`, inline: a call fewer per step)
            now = [g.get(k) for g in self.param_groups for k in gate.live]
            if len(now) != len(gate.checked) or not all(map(operator.is_, now, gate.checked)) \
                    or gate.device_path != self.device_path:
                gate.check_live(self.param_groups, now, self.device_path)
            elif gate.host_tensors:  # (tensors filled in place keep their identity: read at every step)
                gate.read_host_tensors()
            if gate.device_tensors:
                values_ok = gate.device_ok()
        elif gate.live:
            values_ok = gate.traced_ok(self.param_groups)
        for key, t in self.plan.swaps:  # (before anything changes: the step moves the training form)
            if t.weights_mode(self, key) != "train":
                raise RuntimeError(f"opt.step(): {key} ({type(t).__name__}) holds the parameters in their eval form "
                                   "(after opt.eval()); call opt.train() before stepping")
        stats: dict[str, torch.Tensor] = {}
        plan = self.plan
        mesh_mode = self._per_mesh  # (parameters on several meshes: each multi-tensor op split per mesh)
        if mesh_mode is not None:
            mesh_mode.__enter__()
        try:
            ctx, go, out = drive(
                self, self.param_groups, plan.updates, plan.nonfinite, stats, loss=loss, write=True,
                on_device=plan.device_skip if plan.device_skip is not None else plan.skips_on_device(self.param_groups),
                host_on_cpu=plan.host_on_cpu, taps=self.__dict__.get("_step_taps", {}).values(), weights=plan.weights,
                values_ok=values_ok)
        finally:
            if mesh_mode is not None:
                mesh_mode.__exit__(None, None, None)
        if not go:  # the host skipped it: the chain did not run, each transform hears of the call
            for key, t in plan.host_skips:
                t.on_host_skip(ctx, TransformState(ctx, key))
            stats["skipped_steps"] = self._count_skipped(1)
            stats["skipped"] = torch.ones((), dtype=torch.bool)
        elif ctx.params:
            if ctx.skip is not None:  # decided on the device: count it there
                stats["skipped_steps"] = self._count_skipped(ctx.skip)
                stats["skipped"] = ctx.skip
            elif out is None and "skipped" in stats:  # a SkipDecider stopped the step on the host
                stats["skipped_steps"] = self._count_skipped(1)
            else:
                stats["skipped"] = CPU_FALSE
        if "skipped_steps" not in stats:
            stats["skipped_steps"] = self._skipped_steps  # (never written in place: see _count_skipped)
        self._last.stats = stats  # not `self.stats = stats`: see _LastStep
        if self.skip_limit is not None:  # (counted on the device; on the CPU it may raise now)
            self.skip_limit.after_step(stats, self.device_path)
        return loss

    def _count_skipped(self, by: torch.Tensor | int) -> torch.Tensor:
        """`skipped_steps += by`; returns the new count for the step's stats.

        Eagerly the count becomes a new tensor (one op), never written in place, so the
        stats of earlier steps and a state dict taken earlier keep their values. Traced,
        it is written in place (a compiled step keeps writes into an attribute's tensor,
        not a rebinding of the attribute) and the stats get a copy.
        """
        if isinstance(by, torch.Tensor) and self._skipped_steps.device != by.device:
            self._skipped_steps = self._skipped_steps.to(by.device)
        if torch.compiler.is_compiling():
            self._skipped_steps.add_(by)  # (not `+=`: that rebinds the attribute, which dynamo before 2.13 refuses)
            return self._skipped_steps.clone()
        self._skipped_steps = self._skipped_steps + by
        return self._skipped_steps

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """Telemetry of the last step: a new dict of 0-d tensors each step (no host sync); read them, never
        write them in place (a value may be shared between steps)."""
        return self._last.stats

    @stats.setter
    def stats(self, value: dict[str, torch.Tensor]) -> None:
        self._last.stats = value

    # --- state host ------------------------------------------------------------
    def transform_store(self, key: str) -> dict[str, Any]:
        """The saved values of the transform with state key `key` (created empty; in `state_dict()`)."""
        return self._store.setdefault(key, {})

    def runtime_store(self, key: str) -> dict[str, Any]:
        """The unsaved cache of the transform with state key `key` (created empty; never saved)."""
        return self._runtime.setdefault(key, {})
