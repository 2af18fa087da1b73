"""Running a chain of transforms over one step: shared by `Modular` and `attach`."""

from __future__ import annotations

import math
from typing import Literal

import torch

from .distributed import any_nonfinite, any_sharded
from .norms import common_acc_dtype, foreach_pnorm
from .scope import NormMemo
from .state import Layout, StateHost, StepContext, TransformState
from .transform import Transform, run_sequence

NonFinite = Literal["skip", "raise", "zero", "ignore"]


def collect(host: StateHost, param_groups: list[dict], stats: dict) -> StepContext:
    """The parameters with a gradient, by group (params whose `.grad` is None are skipped).

    The per-step work is one pass over the parameters; everything derived from
    which parameters have a gradient is cached in a `Layout` (checks of
    the parameters themselves run when the layout is first seen).
    """
    params: list[torch.Tensor] = []
    group_ids: list[int] = []
    ranges: list[tuple[int, int]] = []
    masks: list = []
    for gi, group in enumerate(param_groups):
        ps = group["params"]
        keep = [p.grad is not None for p in ps]
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
    key = (tuple(map(id, params)), tuple(group_ids), tuple(masks), tuple(map(id, groups)))
    layouts = host.runtime_store("__layouts__")
    layout = layouts.get(key)
    if layout is None:
        names = _names(param_groups, group_ids, masks)
        _check_params(params, names, param_groups, group_ids, ranges)
        if len(layouts) >= 16:  # many distinct grad patterns: keep the cache small
            layouts.clear()
        layout = layouts[key] = Layout(key, params, ranges)
        layout.cache["names"] = names
    for p in params:
        if p.grad.is_sparse:
            raise RuntimeError(f"modopt does not support sparse gradients (parameter {_where(layout, p)})")
    ctx = StepContext(layout.params, groups, group_ids, layout.ranges, layout.cache["names"], host, stats)
    ctx.layout = layout
    memo = layout.cache.get("norm_memo")
    if memo is None:
        memo = layout.cache["norm_memo"] = NormMemo()
    memo.clear()  # the runner owns it: nothing from an earlier step survives
    ctx.norm_memo = memo
    return ctx


def _names(param_groups, group_ids, masks) -> list:
    names: list = []
    for gi, mask in zip(group_ids, masks):
        group = param_groups[gi]
        gnames = group.get("param_names")
        n = len(group["params"])
        idx = range(n) if mask is None else [j for j in range(n) if mask[j]]
        names.extend(gnames[j] if gnames else None for j in idx)
    return names


def _check_params(params, names, param_groups, group_ids, ranges) -> None:
    for (a, b), gi in zip(ranges, group_ids):
        for i in range(a, b):
            if params[i].is_complex():
                raise RuntimeError(
                    f"modopt does not support complex parameters (parameter {names[i] or i - a} of group {gi}); "
                    "use torch.view_as_real on the parameter"
                )


def _where(layout: Layout, p: torch.Tensor) -> str:
    i = next(i for i, q in enumerate(layout.params) if q is p)
    return str(layout.cache["names"][i] or i)


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


def maybe_nonfinite(ctx: StepContext, grads: list[torch.Tensor]) -> torch.Tensor:
    """0-d bool tensor, cheap: False proves every gradient finite; True means "possibly not".

    It is the finiteness of the per-tensor 2-norms: an inf or NaN element makes
    its tensor's 2-norm inf or NaN, so finite norms prove finite gradients. The
    converse fails only when finite values' squares overflow the accumulator
    (float32 values near 1e19 and above), which `nonfinite_mask` then
    settles. The norms are the ones a global or per-tensor 2-norm of the
    chain needs anyway: they go into the step's norm memo
    (`modopt.core.scope.NormMemo.pnorms`), so a following
    `ClipNorm` reads them instead of the gradients.
    """
    memo = ctx.norm_memo
    if memo is not None:
        parts = memo.pnorms(grads, 2.0, common_acc_dtype(grads))
    else:
        parts = torch.stack(foreach_pnorm(grads, 2.0)).float()
    return ~torch.isfinite(parts).all()


def apply_nonfinite_policy(policy: str, ctx: StepContext, grads: list[torch.Tensor]) -> bool:
    """Apply the policy; return False when the step must be skipped.

    One host sync per step when the gradients are finite (the common case):
    the finiteness of the 2-norms (`maybe_nonfinite`). Only when that
    says "possibly non-finite" does the exact check (`nonfinite_mask`)
    run, with a second sync, so finite-but-huge gradients are never called
    non-finite. Under `torch.compile` that decision runs outside the graph
    (`_settle_compiled`): plain `torch.compile` breaks the graph there, and
    `fullgraph=True` fails with `FULLGRAPH_HINT` in dynamo's message.
    """
    if policy == "ignore" or not grads:
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
    if any_sharded(grads):  # FSDP2: one exact, all-reduced decision
        bad, exact = nonfinite_mask(grads), True
    else:  # cheap check first; true only for a non-finite (or overflowing) norm
        bad, exact = maybe_nonfinite(ctx, grads), False
    settle = _settle_compiled if torch.compiler.is_compiling() else _settle
    is_bad, bad, which = settle(policy, bad, exact, grads, ctx.names)
    ctx.stats["nonfinite"] = bad
    if not is_bad:
        return True
    if ctx.norm_memo is not None:  # the chain does not run: let the gradients go
        ctx.norm_memo.clear()
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
    "modopt: nonfinite='skip' and nonfinite='raise' decide on the host whether the step goes ahead "
    "(bool() of an on-device check, one sync per step), which a single graph cannot hold. "
    "For torch.compile(opt.step, fullgraph=True), build the optimizer with nonfinite='ignore' (no check) "
    "or nonfinite='zero' (non-finite gradient elements become 0, on the device); or keep the policy and "
    "compile without fullgraph=True (one graph break per step, at this decision)"
)
#: `_settle` for traced code: a graph break under plain `torch.compile`, `FULLGRAPH_HINT` under fullgraph
_settle_compiled = torch.compiler.disable(_settle, reason=FULLGRAPH_HINT)


def run_chain(host: StateHost, ctx: StepContext, transforms: tuple[Transform, ...], write: bool) -> list | None:
    """Run `transforms` on the gradients of `ctx`.

    With `write=True` the parameters move (the last transform may fuse that
    write); otherwise the final updates are returned (None if a transform
    stopped the step).
    """
    updates = [p.grad for p in ctx.params]
    states = [TransformState(host, ctx, f"{i}:{type(t).__name__}") for i, t in enumerate(transforms)]
    try:
        if write and transforms:
            run_sequence(transforms, ctx, states, updates, True)
            return None
        updates = run_sequence(transforms, ctx, states, updates, False)
        if write and updates is not None:
            ctx.write_updates(updates)
            return None
        return updates
    finally:
        if ctx.norm_memo is not None:  # holds the step's tensors: let them go
            ctx.norm_memo.clear()
