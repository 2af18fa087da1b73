"""Where transform state lives: the optimizer (or an ``attach`` handle), never the transform.

Per-parameter buffers go in ``opt.state[p]`` under ``"<key>.<name>"``, the key
being the transform's stable position in the chain (``"1:ClipNormByEMA"``,
``"2/0:Normalize"`` inside a chain). Per-transform values that are not per
parameter (a global EMA of a norm, a step counter) go in the host's transform
store under the same key. Both are saved by ``state_dict``. The runtime store is
a cache that is never saved (segment layouts, wrapped torch optimizers).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .scope import Segments, Stat
    from .transform import Transform

_tokens = itertools.count()


class StateHost(Protocol):
    state: Any  # mapping param -> dict

    def transform_store(self, key: str) -> dict: ...

    def runtime_store(self, key: str) -> dict: ...


class StepContext:
    """What every transform sees of one step.

    ``params`` are the parameters that have a gradient, ordered by param group;
    ``groups[g]`` is the param-group dict of the tensors ``params[a:b]`` with
    ``(a, b) = ranges[g]``; ``group_ids[g]`` its index in ``optimizer.param_groups``.
    """

    def __init__(self, params, groups, group_ids, ranges, names, host: StateHost, stats: dict):
        self.params: list[torch.Tensor] = params
        self.groups: list[dict] = groups
        self.group_ids: list[int] = group_ids
        self.ranges: list[tuple[int, int]] = ranges
        self.names: list[str | None] = names
        self.host = host
        self.stats = stats
        self.token = next(_tokens)

    def write_updates(self, updates: list[torch.Tensor]) -> None:
        """``p -= update`` for every parameter of the step."""
        if self.params:
            torch._foreach_sub_(self.params, updates)

    def per_group(self):
        """``(group, a, b)`` for each param group of the step."""
        for g, (a, b) in zip(self.groups, self.ranges):
            yield g, a, b


class TransformState:
    """One transform's view of the host's state for one step."""

    def __init__(self, host: StateHost, ctx: StepContext, key: str):
        self.host, self.ctx, self.key = host, ctx, key

    def child(self, i: int, t: "Transform") -> "TransformState":
        return TransformState(self.host, self.ctx, f"{self.key}/{i}:{type(t).__name__}")

    @property
    def store(self) -> dict:
        """Saved per-transform values (tensors, numbers)."""
        return self.host.transform_store(self.key)

    @property
    def runtime(self) -> dict:
        """Unsaved per-transform cache."""
        return self.host.runtime_store(self.key)

    def record(self, name: str, value: torch.Tensor) -> None:
        """Telemetry for ``opt.stats`` (tensors; never synchronises)."""
        self.ctx.stats[f"{self.key}.{name}"] = value

    # --- per-parameter buffers --------------------------------------------
    def buffers(self, name: str, init: Callable[[int, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """The buffer ``name`` of each parameter of the step, created by ``init(i, p)`` when missing."""
        k = f"{self.key}.{name}"
        out = []
        for i, p in enumerate(self.ctx.params):
            s = self.host.state[p]
            v = s.get(k)
            if v is None:
                v = s[k] = init(i, p)
            out.append(v)
        return out

    def has_buffers(self, name: str) -> list[bool]:
        k = f"{self.key}.{name}"
        return [k in self.host.state[p] for p in self.ctx.params]

    # --- per-segment values (scope-aware) ---------------------------------
    def seg_get(self, seg: "Segments", name: str, init: float, dtype=torch.float32) -> "Stat":
        """A saved per-segment value (see :mod:`modopt.core.scope`), ``init`` where new."""
        device = self.ctx.params[0].device if self.ctx.params else torch.device("cpu")
        if seg.kind == "global":
            v = self.store.get(name)
            if v is None:
                v = self.store[name] = torch.full((), init, dtype=dtype, device=device)
            return v.reshape(1)
        if seg.kind == "group":
            vals = []
            for gid in self.ctx.group_ids:
                k = f"{name}@group{gid}"
                v = self.store.get(k)
                if v is None:
                    v = self.store[k] = torch.full((), init, dtype=dtype, device=device)
                vals.append(v)
            return torch.stack(vals)
        if seg.kind == "tensor":
            return torch.stack(self.buffers(name, lambda i, p: torch.full((), init, dtype=dtype, device=p.device)))
        shapes = _slice_shapes(self.ctx.params, seg)
        return self.buffers(name, lambda i, p: torch.full(shapes[i], init, dtype=dtype, device=p.device))

    def seg_set(self, seg: "Segments", name: str, value: "Stat") -> None:
        """Save per-segment values read by :meth:`seg_get`."""
        if seg.kind == "global":
            self.store[name] = value.reshape(())
        elif seg.kind == "group":
            for gid, v in zip(self.ctx.group_ids, value.unbind(0)):
                self.store[f"{name}@group{gid}"] = v
        else:
            dst = [self.host.state[p][f"{self.key}.{name}"] for p in self.ctx.params]
            src = list(value.unbind(0)) if seg.kind == "tensor" else list(value)
            if dst:
                torch._foreach_copy_(dst, src)


def _slice_shapes(params: list[torch.Tensor], seg: "Segments") -> list[tuple[int, ...]]:
    out = []
    for p, dims in zip(params, seg.dims or []):
        if not dims:
            out.append(tuple(p.shape))
        else:
            out.append(tuple(1 if d in dims else s for d, s in enumerate(p.shape)))
    return out
