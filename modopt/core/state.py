"""Where transform state lives: the optimizer (or an `attach` handle), never the transform.

Per-parameter buffers go in `opt.state[p]` under `"<key>.<name>"`, the key
being the transform's stable position in the chain (`"1:ClipNormByEMA"`,
`"2/0:Normalize"` inside a chain). Per-transform values that are not per
parameter (a global EMA of a norm, a step counter) go in the host's transform
store under the same key. Both are saved by `state_dict`. The runtime store is
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


class Layout:
    """Facts about one set of parameters with gradients, cached across steps.

    `collect` returns the same `Layout` for every step whose parameters
    with a gradient (and their param groups) are the same objects, so
    per-layout work (segment tables, dtype/device grouping, fused-kernel
    eligibility) runs once, not every step. `cache` is free for transforms;
    keys should name the transform or helper that owns them.
    """

    __slots__ = ("key", "params", "ranges", "cache")

    def __init__(self, key: tuple, params: list[torch.Tensor], ranges: list[tuple[int, int]]):
        self.key, self.params, self.ranges = key, params, ranges
        self.cache: dict = {}


class StepContext:
    """What every transform sees of one step.

    `params` are the parameters that have a gradient, ordered by param group;
    `groups[g]` is the param-group dict of the tensors `params[a:b]` with
    `(a, b) = ranges[g]`; `group_ids[g]` its index in `optimizer.param_groups`.
    """

    def __init__(self, params, groups, group_ids, ranges, names, host: StateHost, stats: dict):
        self.params: list[torch.Tensor] = params
        self.groups: list[dict] = groups
        self.group_ids: list[int] = group_ids
        self.ranges: list[tuple[int, int]] = ranges
        self.names: list[str | None] = names
        self.host = host
        self.stats = stats
        self._token: int | None = None
        #: cached facts about this set of parameters (set by `collect`; None for ad-hoc contexts)
        self.layout: Layout | None = None
        # the deferred scale (see DeferredScale): run by the runner (modopt.core.transform.run_sequence)
        self._pending: DeferredScale | None = None  # deferred, not yet handed to anyone
        self._incoming: DeferredScale | None = None  # handed to the running transform
        self._may_defer = False  # the running transform may defer (a later one folds)
        self._states: list[dict] | None = None
        #: the step's per-tensor norm memo (`modopt.core.scope.NormMemo`), owned by the runner; None ad hoc
        self.norm_memo = None

    @property
    def token(self) -> int:
        """A number unique to this step (drawn lazily: compiled steps that never read it do not guard on it)."""
        if self._token is None:
            self._token = next(_tokens)
        return self._token

    def param_states(self) -> list[dict]:
        """`host.state[p]` for every parameter of the step (looked up once per step)."""
        if self._states is None:
            state = self.host.state
            self._states = [state[p] for p in self.params]
        return self._states

    # --- the deferred scale ------------------------------------------------------
    # One mechanism, run by ``run_sequence``. A transform declares what it can do
    # (``Transform.folds_scale``, ``Transform.update_access``); the runner decides
    # who may defer, hands a deferred scale to the transform that folds it, and
    # multiplies it in for every other one. Transforms only ever call
    # ``Scoped.scale_`` (which defers when the runner allows it) and, when they
    # declare ``folds_scale``, read `incoming_scale` and ``take`` or ``apply`` it.
    def defer_scale(self, ranges: list[tuple[int, int]], scales: list[torch.Tensor]) -> bool:
        """Record `updates[a:b] *= scales[s]` for `(a, b) = ranges[s]` without doing it, if allowed.

        Returns False (and records nothing) unless the runner allows the running
        transform to defer: a later transform declares `folds_scale` and only
        transforms that neither read nor write the updates stand between them.
        The caller then multiplies the updates itself (`Scoped.scale_` does
        both). Never call it for a scale that does not cover every tensor of a range.
        """
        if not self._may_defer or self._pending is not None:
            return False
        self._pending = DeferredScale(list(ranges), list(scales))
        return True

    @property
    def incoming_scale(self) -> "DeferredScale | None":
        """The scale deferred to the running transform (only a transform that declares
        `folds_scale` ever sees one). It must `take()` it (and fold it into
        its arithmetic) or `apply(updates)` it; the runner checks."""
        return self._incoming

    def _apply_pending(self, updates: list[torch.Tensor]) -> None:
        """(runner) Multiply a pending scale into `updates`."""
        pend, self._pending = self._pending, None
        if pend is not None:
            pend.apply(updates)
            if self.norm_memo is not None:
                self.norm_memo.clear()

    def write_updates(self, updates: list[torch.Tensor]) -> None:
        """`p -= update` for every parameter of the step (a pending scale multiplied in first)."""
        self._apply_pending(updates)
        if self.params:
            torch._foreach_sub_(self.params, updates)

    def per_group(self):
        """`(group, a, b)` for each param group of the step."""
        for g, (a, b) in zip(self.groups, self.ranges):
            yield g, a, b


class DeferredScale:
    """`updates[a:b] *= values[s]` for `(a, b) = ranges[s]`, not yet done.

    A transform whose last act is such a multiplication (a clip, through
    `Scoped.scale_`) may leave it to the next transform that can fold it into
    its own arithmetic (a fused optimizer's `grad_scale`, a normalization's
    factor): the updates are then read and written once fewer. The transform
    that receives it (`ctx.incoming_scale`) either calls `take()`,
    promising to fold it, or `apply(updates)`.
    """

    __slots__ = ("ranges", "values", "state")

    def __init__(self, ranges: list[tuple[int, int]], values: list[torch.Tensor]):
        self.ranges, self.values = ranges, values
        #: "pending", "taken" (the receiver folds it) or "applied" (multiplied into the updates)
        self.state = "pending"

    def for_range(self, a: int, b: int) -> torch.Tensor | None:
        """The 0-d scale of `updates[a:b]` when one value covers all of them, else None."""
        for (lo, hi), s in zip(self.ranges, self.values):
            if lo <= a and b <= hi:
                return s
        return None

    def per_tensor(self, n: int) -> list[torch.Tensor] | None:
        """The scale of each of `n` tensors (None if the ranges do not cover exactly `n`)."""
        vals: list[torch.Tensor] = []
        for (a, b), v in zip(self.ranges, self.values):
            vals.extend([v] * (b - a))
        return vals if len(vals) == n else None

    def take(self) -> "DeferredScale":
        """The receiver folds the scale into its own arithmetic (it becomes its responsibility)."""
        self.state = "taken"
        return self

    def apply(self, updates: list[torch.Tensor]) -> None:
        """Multiply the scale into `updates` (in place)."""
        for (a, b), s in zip(self.ranges, self.values):
            if b > a:
                torch._foreach_mul_(updates[a:b], s.to(updates[a].device))
        self.state = "applied"


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
        """Telemetry for `opt.stats` (tensors; never synchronises)."""
        self.ctx.stats[f"{self.key}.{name}"] = value

    # --- per-parameter buffers --------------------------------------------
    def buffers(self, name: str, init: Callable[[int, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """The buffer `name` of each parameter of the step, created by `init(i, p)` when missing."""
        k = f"{self.key}.{name}"
        states = self.ctx.param_states()
        try:
            return [s[k] for s in states]
        except KeyError:
            pass
        out = []
        for i, (p, s) in enumerate(zip(self.ctx.params, states)):
            v = s.get(k)
            if v is None:
                v = s[k] = init(i, p)
            out.append(v)
        return out

    def has_buffers(self, name: str) -> list[bool]:
        k = f"{self.key}.{name}"
        return [k in s for s in self.ctx.param_states()]

    # --- per-segment values (scope-aware) ---------------------------------
    def seg_get(self, seg: "Segments", name: str, init: float, dtype=torch.float32) -> "Stat":
        """A saved per-segment value (see `modopt.core.scope`), `init` where new."""
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
        """Save per-segment values read by `seg_get()`."""
        if seg.kind == "global":
            self.store[name] = value.reshape(())
        elif seg.kind == "group":
            for gid, v in zip(self.ctx.group_ids, value.unbind(0)):
                self.store[f"{name}@group{gid}"] = v
        else:
            k = f"{self.key}.{name}"
            dst = [s[k] for s in self.ctx.param_states()]
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


# --- buffer declarations (what a transform saves, checked when a checkpoint loads) ---------------
#: what one saved value of a transform is:
#:
#: * `"param"`: per parameter, the parameter's shape (Adam's moments, an EMA of the update);
#:   its dtype is the transform's choice (e.g. float32 sums for a float16 parameter)
#: * `"segment"`: a per-segment statistic (see `TransformState.seg_get`): 0-d in the
#:   transform store (global scope; `name@groupN` for scope="group"), or per parameter
#:   0-d (scope="tensor") or the parameter's shape with the reduced dims of size 1 (slices)
#: * `"history"`: a 1-D record of any length (AutoClip's past norms), in the store or per parameter
#: * `"counter"`: a 0-d tensor or a Python number (a step count), in the store or per parameter
#: * `"fixed"`: a tensor whose shape the transform chooses, not the parameter (four summary
#:   statistics per parameter: shape (4,)); `Buffer("fixed", shape=(4,))` pins the shape
#: * `"torch"`: per parameter, the state dict a wrapped `torch.optim.Optimizer` keeps for it;
#:   loaded with torch's own device and dtype policy
BUFFER_KINDS = ("param", "segment", "history", "counter", "fixed", "torch")
#: where a loaded buffer goes: `"param"` onto its parameter's device (store values: the device
#: of the first parameter of the optimizer), `"cpu"` onto the CPU
BUFFER_DEVICES = ("param", "cpu")


class Buffer:
    """The declaration of one value a transform saves.

    A transform lists its saved values in the class variable `state_buffers`,
    a dict from the name it passes to `TransformState.buffers` /
    `TransformState.seg_get` (or uses in `TransformState.store`) to a kind or a
    `Buffer`:

    ```python
    class MyEMA(mo.Transform):
        beta: float = 0.9
        state_buffers: ClassVar[dict] = {"ema": "param", "calls": mo.Buffer("counter", device="cpu")}
    ```

    `load_state_dict` checks every saved value against its declaration (shape
    against the parameter, kind, dtype) and moves it to the declared device; a
    value that no declaration names is refused with the transform's name.
    """

    __slots__ = ("kind", "device", "shape")

    def __init__(self, kind: str, device: str = "param", shape: tuple[int, ...] | None = None) -> None:
        if kind not in BUFFER_KINDS:
            raise ValueError(f"Buffer kind must be one of {', '.join(BUFFER_KINDS)}; got {kind!r}")
        if device not in BUFFER_DEVICES:
            raise ValueError(f"Buffer device must be one of {', '.join(BUFFER_DEVICES)}; got {device!r}")
        if shape is not None and (kind != "fixed" or not all(isinstance(n, int) and n >= 0 for n in shape)):
            raise ValueError("Buffer shape is a tuple of sizes, and only for kind 'fixed'")
        self.kind, self.device = kind, device
        self.shape = tuple(shape) if shape is not None else None

    def __repr__(self) -> str:
        extra = f", shape={self.shape}" if self.shape is not None else ""
        return f"Buffer({self.kind!r}, device={self.device!r}{extra})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Buffer) and (self.kind, self.device, self.shape) == (other.kind, other.device, other.shape)

    def __hash__(self) -> int:
        return hash((self.kind, self.device, self.shape))


def declared_buffers(t: Any) -> dict[str, Buffer]:
    """The buffers a transform (or transform class) declares, as `Buffer` objects."""
    cls = t if isinstance(t, type) else type(t)
    spec = getattr(cls, "state_buffers", None) or {}
    out: dict[str, Buffer] = {}
    for name, b in spec.items():
        out[name] = b if isinstance(b, Buffer) else Buffer(b)
    return out
