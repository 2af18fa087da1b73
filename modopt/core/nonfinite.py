"""One step as `Modular` and `attach` take it (`drive`): the parameters with a gradient, the non-finite
policy's decision, then the chain and the weight stage. The one step driver of both."""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import torch

from . import compile_marks
from .distributed import any_nonfinite, any_sharded
from .norms import common_acc_dtype, foreach_pnorm, vector_pnorm
from .runner import Step, TransformState, collect, run_step

NonFinite = Literal["skip", "raise", "zero", "ignore"]


def nonfinite_mask(grads: list[torch.Tensor]) -> torch.Tensor:
    """0-d bool tensor: does any gradient hold inf or NaN (exact; no host sync).

    Uses the largest magnitude of each tensor, which is finite exactly when
    every element is (finite values never overflow a max). Slow on CPU (about
    18x a 2-norm), so the step runs it only when the cheap check fails.
    """
    if any_sharded(grads):  # FSDP2: every rank must reach the same decision
        return any_nonfinite(grads)
    maxabs = foreach_pnorm(grads, math.inf)  # empty tensors count as 0; float64 kept (1e300 is finite)
    return ~torch.stack([torch.isfinite(n) for n in maxabs]).all()


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
    (`modopt.core.runner.NormMemo`), so a following `ClipNorm` reads them instead
    of the gradients. With `on_device` (the device decides: an overflowing total
    skips the step) the total goes into the memo as well, so a global 2-norm clip
    costs no further op. The test is one op, `total < inf` (a norm is >= 0, and
    NaN compares false). `total_only`: the total itself, for the host to compare.
    """
    acc = common_acc_dtype(grads)
    total = vector_pnorm(ctx.memo.pnorms(grads, 2.0, acc))
    if on_device:
        ctx.memo.put_total(grads, 2.0, acc, total)
    return total if total_only else total < math.inf


#: A step over parameters on the CPU reads the device's non-finite decision back on the host (where that
#: only reads memory) when its plan allows it (`Plan.host_on_cpu`), and transforms read other values there
#: to skip work (`reads_on_host`). False keeps the device path on the CPU too (`device_path`).
HOST_ON_CPU = True


def reads_on_host(t: torch.Tensor) -> bool:
    """Whether the step may read `t`'s values on the host to leave out work the value makes useless (a
    moment reset that is not due, a clip that cuts nothing): `t` on the CPU, where a read only reads memory,
    outside a compiled step, unless `device_path` is in force. Either way the results are the same bits."""
    return HOST_ON_CPU and t.device.type == "cpu" and not torch.compiler.is_compiling()


@contextlib.contextmanager
def device_path() -> Iterator[None]:
    """Inside it, steps on the CPU take the device path (no host read of any decision): what a GPU runs.
    The tests and benchmarks that count syncs, ops and bytes run their steps inside it."""
    global HOST_ON_CPU
    was, HOST_ON_CPU = HOST_ON_CPU, False
    try:
        yield
    finally:
        HOST_ON_CPU = was

#: `False` as a 0-d bool tensor on the CPU, for the telemetry of steps that go ahead (`opt.stats` values are
#: read, never written: one shared tensor instead of a new one each step)
CPU_FALSE = torch.zeros((), dtype=torch.bool)


def apply_nonfinite_policy(policy: str, ctx: Step, grads: list[torch.Tensor], on_device: bool = False,
                           host_on_cpu: bool = False) -> bool:
    """Apply the policy; return False when the step must be skipped.

    With `on_device` (only for `"skip"`, when every transform of the pipeline
    `skips_on_device()`), the decision stays on the device: `ctx.skip` is set to
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
        if host_on_cpu and HOST_ON_CPU and ctx.layout.on_cpu and not torch.compiler.is_compiling():
            # the device's decision, read where reading it is free: the plain chain runs (no cleaning
            # pass, no skip-aware kernels), or none of it, as on a step the host decides; the same bits
            # (the device's test, `total < inf`, made on the host: NaN compares false there too)
            if maybe_finite(ctx, grads, on_device=True, total_only=True).item() < math.inf:
                ctx.stats["nonfinite"] = CPU_FALSE
                return True
            ctx.stats["nonfinite"] = torch.ones((), dtype=torch.bool)
            ctx.memo.close()
            return False
        proceed = maybe_finite(ctx, grads, on_device=True)
        bad = ctx.stats["nonfinite"] = ~proceed
        ctx.proceed, ctx.skip = proceed, bad
        return True
    if any_sharded(grads):  # FSDP2: one exact, all-reduced decision
        bad, exact = nonfinite_mask(grads), True
    else:  # cheap check first; true only for a non-finite (or overflowing) norm
        bad, exact = ~maybe_finite(ctx, grads), False
    settle = compile_marks.settle if torch.compiler.is_compiling() else _settle
    is_bad, bad, which = settle(policy, bad, exact, grads, ctx.names)
    ctx.stats["nonfinite"] = bad
    if not is_bad:
        return True
    ctx.memo.close()  # the chain does not run: let the gradients go
    if policy == "raise":
        raise FloatingPointError(f"non-finite gradient in parameter(s) {', '.join(which)} (nonfinite='raise')")
    return False


def _settle(policy: str, bad: torch.Tensor, exact: bool, grads: list[torch.Tensor], names: list) -> tuple:
    """The host's decision: `(is_bad, bad, which)`.

    One sync (`bool(bad)`) when the gradients are finite; when the cheap check
    says "possibly non-finite", the exact check and a second sync. `which`
    names the non-finite parameters for `"raise"` (empty otherwise).
    """
    is_bad = bool(bad)
    if is_bad and not exact:  # rare: settle it exactly
        bad = nonfinite_mask(grads)
        is_bad = bool(bad)
    which = []
    if is_bad and policy == "raise":
        which = [names[i] or f"#{i}" for i, g in enumerate(grads) if not torch.isfinite(g).all()]
    return is_bad, bad, which


#: what dynamo prints when `fullgraph=True` meets the host decision (it shows a disabled function's reason)
FULLGRAPH_HINT = (
    "modopt: this step decides on the host whether it goes ahead (bool() of an on-device check, one sync "
    "per step), which a single graph cannot hold. That happens with nonfinite='raise', and with the default "
    "nonfinite='skip' when a transform of the pipeline keeps its state only with the host's decision "
    "(Transform.skips_on_device() is False: SGD/Adam/AdamW with fused=False or foreach (torch's non-fused "
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
          weights: Sequence[tuple[str, Any]] = ()) -> tuple[Step, bool, Any]:
    """One step of `transforms` over the parameters of `groups` that have a gradient; `(ctx, go, out)`.

    `go` is False when the policy skipped the step on the host (the chain did not run: the caller tells
    its transforms, `Transform.on_host_skip`); `out` is then None, else `run_step`'s result: True when
    `write` and the parameters were written, the updates without `write`, None when a transform stopped
    the step. `taps` see the step after the decision, before the chain (telemetry); the weight stage
    (`weights`: `(key, transform)`) reads the weights before the write and acts after it. No parameter
    with a gradient: `ctx.params` is empty and nothing ran."""
    ctx = collect(host, groups, stats)
    ctx.loss = loss
    if not ctx.params:
        return ctx, True, None
    grads = [p.grad for p in ctx.params] if torch.compiler.is_compiling() else list(map(_grad_of, ctx.params))
    go = apply_nonfinite_policy(policy, ctx, grads, on_device, host_on_cpu)
    for tap in taps:
        tap(ctx)
    if not go:
        return ctx, False, None
    for key, t in weights:  # (the weight stage reads the weights before this step's write)
        t.prepare_weights(ctx, TransformState(ctx, key))
    out = run_step(transforms, ctx, write=write)
    if out and weights:
        for key, t in weights:
            t.apply_weights(ctx, TransformState(ctx, key))
    return ctx, True, out


_grad_of = operator.attrgetter("grad")
