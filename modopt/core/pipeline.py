"""Running a chain of transforms over one step: shared by `Modular` and `attach`."""

from __future__ import annotations

import math
from typing import Literal

import torch

from .state import StateHost, StepContext, TransformState
from .transform import Transform, _final

NonFinite = Literal["skip", "raise", "zero", "ignore"]


def collect(host: StateHost, param_groups: list[dict], stats: dict) -> StepContext:
    """The parameters with a gradient, by group (params whose ``.grad`` is None are skipped)."""
    params: list[torch.Tensor] = []
    groups, group_ids, ranges, names = [], [], [], []
    for gi, group in enumerate(param_groups):
        start = len(params)
        gnames = group.get("param_names")
        for j, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            name = gnames[j] if gnames else None
            if g.is_sparse:
                raise RuntimeError(f"modopt does not support sparse gradients (parameter {name or j} of group {gi})")
            if p.is_complex():
                raise RuntimeError(
                    f"modopt does not support complex parameters (parameter {name or j} of group {gi}); "
                    "use torch.view_as_real on the parameter"
                )
            params.append(p)
            names.append(name)
        if len(params) > start:
            groups.append(group)
            group_ids.append(gi)
            ranges.append((start, len(params)))
    return StepContext(params, groups, group_ids, ranges, names, host, stats)


def nonfinite_mask(grads: list[torch.Tensor]) -> torch.Tensor:
    """0-d bool tensor: does any gradient hold inf or NaN (no host sync)."""
    maxabs = [n.float() for n in torch._foreach_norm(grads, math.inf)]
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
    """Run ``transforms`` on the gradients of ``ctx``.

    With ``write=True`` the parameters move (the last transform may fuse that
    write); otherwise the final updates are returned (None if a transform
    stopped the step).
    """
    updates = [p.grad for p in ctx.params]
    last = len(transforms) - 1
    for i, t in enumerate(transforms):
        st = TransformState(host, ctx, f"{i}:{type(t).__name__}")
        if write and i == last:
            _final(t, ctx, st, updates)
            return None
        updates = t.apply(ctx, st, updates)
        if updates is None:
            return None
    if write:
        ctx.write_updates(updates)
        return None
    return updates
