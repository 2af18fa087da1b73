"""What a transform saves, declared: `Buffer` and the kinds a load checks.

State lives in the optimizer (or an `attach` handle), never the transform.

Per-parameter buffers go in `opt.state[p]` under `keys.value_key(key, name)`, the key
being the transform's stable position in the chain (`"1:ClipNormByEMA"`,
`"2/0:Normalize"` inside a chain). Per-transform values that are not per
parameter (a global EMA of a norm, a step counter) go in the host's transform
store under the same key. Both are saved by `state_dict`. The runtime store is
a cache that is never saved (segment layouts, wrapped torch optimizers).
`modopt.core.keys` writes and reads every one of these names, and a transform
reaches its state through `modopt.core.step.TransformState`.

Also here, the one mechanism for a buffer whose first step is special when the
device decides the skip (`SGD`'s momentum with dampening, the EMAs with
`ema_init="update"`): a saved per-parameter `started` flag (`STARTED`,
`started_flags`, `settle_flags`), so that a skipped first step leaves the
buffer unstarted without a host sync.
"""

from __future__ import annotations

from typing import Any

import torch

from .keys import value_key
from .step import Step, TransformState
from .transform import Transform


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


#: the dtype a loaded floating-point value is cast to (torch's rule for optimizer state, made
#: explicit per buffer): `"param"` the parameter's dtype, `"acc"` the dtype statistics of it
#: accumulate in (`modopt.core.reduce.acc_dtype`: float32 for half precision), a dtype name
#: (`"float32"`: Adam's step counters, as torch keeps them; `"bfloat16"`), `FIELD_DTYPE` (the one the
#: transform's `state_dtype` field names: `"param"` or a dtype name, resolved per instance by
#: `declared_buffers`), or None to keep the saved dtype
FIELD_DTYPE = "state_dtype"
BUFFER_DTYPES = ("param", "acc", "float32", "float64", "bfloat16", FIELD_DTYPE)
#: the cast each kind gets unless its declaration says otherwise
_KIND_DTYPE = {"param": "param", "segment": "acc", "history": "acc", "counter": None, "fixed": None, "torch": None}


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

    `load_state_dict` checks every saved value against its declaration before
    anything changes: its kind and shape (against the parameter), that it is
    finite (with `finite=False`: free of NaN, for a statistic of squares that
    finite gradients of 1e20 overflow to +inf) and at least `low` (counters:
    `low=0` unless declared); it casts
    floating-point values per parameter to `dtype` (`"param"` for the `param`
    kind, `"acc"` for `segment` and `history`: what the transform creates) and
    moves them to the declared device. A value that no declaration names is
    refused with the transform's name.
    """

    __slots__ = ("kind", "device", "shape", "dtype", "low", "finite")

    def __init__(
        self,
        kind: str,
        device: str = "param",
        shape: tuple[int, ...] | None = None,
        dtype: str | None = "kind",
        low: float | None = None,
        finite: bool = True,
    ) -> None:
        if kind not in BUFFER_KINDS:
            raise ValueError(f"Buffer kind must be one of {', '.join(BUFFER_KINDS)}; got {kind!r}")
        if device not in BUFFER_DEVICES:
            raise ValueError(f"Buffer device must be one of {', '.join(BUFFER_DEVICES)}; got {device!r}")
        if shape is not None and (kind != "fixed" or not all(isinstance(n, int) and n >= 0 for n in shape)):
            raise ValueError("Buffer shape is a tuple of sizes, and only for kind 'fixed'")
        if dtype == "kind":
            dtype = _KIND_DTYPE[kind]
        if dtype is not None and (dtype not in BUFFER_DTYPES or kind == "torch"):
            raise ValueError(f"Buffer dtype must be one of {', '.join(BUFFER_DTYPES)} or None (not for 'torch'); got {dtype!r}")
        if low is None and kind == "counter":
            low = 0.0
        if low is not None and (kind == "torch" or not isinstance(low, (int, float)) or isinstance(low, bool)):
            raise ValueError("Buffer low is a number (the least valid value), and not for kind 'torch'")
        self.kind, self.device, self.dtype = kind, device, dtype
        self.low: float | None = low
        self.finite: bool = bool(finite) or kind == "counter"
        self.shape: tuple[int, ...] | None = tuple(shape) if shape is not None else None

    def __repr__(self) -> str:
        extra = f", shape={self.shape}" if self.shape is not None else ""
        if self.dtype != _KIND_DTYPE[self.kind]:
            extra += f", dtype={self.dtype!r}"
        if self.low is not None and not (self.kind == "counter" and self.low == 0):
            extra += f", low={self.low!r}"
        if not self.finite:
            extra += ", finite=False"
        return f"Buffer({self.kind!r}, device={self.device!r}{extra})"

    def _key(self) -> tuple:
        return (self.kind, self.device, self.shape, self.dtype, self.low, self.finite)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Buffer) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def declared_buffers(t: Transform | type[Transform]) -> dict[str, Buffer]:
    """The buffers a transform (or transform class) declares, as `Buffer` objects. For an instance a
    `Buffer(dtype="state_dtype")` takes the dtype its `state_dtype` field names (Adam's moments)."""
    cls = t if isinstance(t, type) else type(t)
    spec = cls.state_buffers or {}
    out: dict[str, Buffer] = {}
    for name, b in spec.items():
        b = b if isinstance(b, Buffer) else Buffer(b)
        if b.dtype == FIELD_DTYPE and not isinstance(t, type):
            b = Buffer(b.kind, b.device, b.shape, t.state_dtype, b.low, b.finite)
        out[name] = b
    return out


# --- "started" flags: state that a skipped first step must leave unstarted, decided on the device ------
#: a per-parameter 0-d bool saved next to a buffer whose first step is special (SGD's momentum with
#: dampening: torch starts it as the gradient; an EMA with ema_init="update": it starts as the update).
#: The device path creates the buffer (zeros) with the flag False and sets the flag on the first step
#: that goes ahead; a buffer without a flag (made by the host path, or in a checkpoint from before the
#: flags) has started.
STARTED = Buffer("fixed", shape=())


def started_flags(st: TransformState, states: list[dict[str, Any]]) -> list[torch.Tensor | None]:
    """The `started` flag of each of `states` (per-parameter state dicts), None where it has none.

    A flag of another dtype (a hand-edited checkpoint) becomes a bool here (host-side, no sync)."""
    k = value_key(st.key, "started")
    out = []
    for s in states:
        f = s.get(k)
        if f is not None and f.dtype != torch.bool:
            f = s[k] = f != 0
        out.append(f)
    return out


def new_flag(like: torch.Tensor) -> torch.Tensor:
    """A `started` flag for a buffer the device path creates: not started."""
    return torch.zeros((), dtype=torch.bool, device=like.device)


def settle_flags(st: TransformState, tag: Any, states: list[dict[str, Any]], flags: list[torch.Tensor | None],
                 proceed: torch.Tensor | None, fresh: bool = False) -> None:
    """After a step that used `flags` (one per state of `states`, None: no flag): on the device path
    (`proceed`, a 0-d bool tensor) `flag |= proceed`; on the host path (`proceed` None: the step went
    ahead) the flags are dropped, since every buffer has started.

    The device path packs the flags of one call site (`tag`) into one tensor the first time it sees them
    (the state holds views of it, as `kernels._packed` does with step counts): one op per step, not one per
    parameter. Compiled, one op per flag (which inductor fuses). With `fresh` (every flag was created
    by this step) the packed flags are known to be equal, and stay so while every step updates all of
    them together (`same_flags`)."""
    k = value_key(st.key, "started")
    pairs = [(s, f) for s, f in zip(states, flags) if f is not None]
    if not pairs:
        return
    if proceed is None:
        for s, _ in pairs:
            s.pop(k, None)
        return
    fs = [f for _, f in pairs]
    if torch.compiler.is_compiling():
        for f in fs:
            f.logical_or_(proceed)
        return
    key = ("packed_started", tag)
    ent = st.runtime.get(key)
    if ent is None or len(ent[1]) != len(fs) or not all(x is y for x, y in zip(ent[1], fs)):
        flat = torch.stack(fs)
        views = list(flat.unbind(0))
        for (s, _), view in zip(pairs, views):
            s[k] = view
        ent = st.runtime[key] = (flat, views, fresh or len(fs) == 1)
    ent[0].logical_or_(proceed)


def same_flags(st: TransformState, tag: Any, fs: list[torch.Tensor], fresh: bool) -> bool:
    """Whether the flags `fs` are known on the host to hold one value: all created by this step
    (`fresh`), or all in a packed set of `settle_flags(tag)` made of such flags and updated as one."""
    if fresh or len(fs) == 1:
        return True
    ent = st.runtime.get(("packed_started", tag))
    if ent is None or not ent[2]:
        return False
    ids = {id(v) for v in ent[1]}
    return all(id(f) in ids for f in fs)


def proceed_flag(ctx: Step) -> torch.Tensor | None:
    """`~ctx.skip` (the step goes ahead), or None when the host decided."""
    if ctx.skip is None:
        return None
    return ctx.proceed if ctx.proceed is not None else ~ctx.skip
