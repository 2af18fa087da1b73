"""Running a chain of transforms over one step: shared by `Modular` and `attach`."""

from __future__ import annotations

import math
from typing import Literal

import torch

from .distributed import any_nonfinite, any_sharded
from .norms import foreach_pnorm
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
    """0-d bool tensor: does any gradient hold inf or NaN (no host sync)."""
    if any_sharded(grads):  # FSDP2: every rank must reach the same decision
        return any_nonfinite(grads)
    maxabs = [n.float() for n in foreach_pnorm(grads, math.inf)]  # empty tensors count as 0
    return ~torch.isfinite(torch.stack(maxabs)).all()


def apply_nonfinite_policy(policy: str, ctx: StepContext, grads: list[torch.Tensor]) -> bool:
    """Apply the policy; return False when the step must be skipped. At most one host sync."""
    if policy == "ignore" or not grads:
        return True
    if policy == "zero":
        for g in grads:
            torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
        return True
    bad = nonfinite_mask(grads)
    ctx.stats["nonfinite"] = bad
    if not bool(bad):  # the one sync of the step
        return True
    if policy == "raise":
        which = [ctx.names[i] or f"#{i}" for i, g in enumerate(grads) if not torch.isfinite(g).all()]
        raise FloatingPointError(f"non-finite gradient in parameter(s) {', '.join(which)} (nonfinite='raise')")
    return False


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
        memo = ctx.layout.cache.get("pnorm_memo") if ctx.layout is not None else None
        if memo:
            memo.clear()
