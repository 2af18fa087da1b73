"""What a transform saves, declared: `Buffer` and the kinds a load checks.

State lives in the optimizer (or an `attach` handle), never the transform.

Per-parameter buffers go in `opt.state[p]` under `keys.value_key(key, name)`, the key
being the transform's stable position in the chain (`"1:ClipNormByEMA"`,
`"2/0:Normalize"` inside a chain). Per-transform values that are not per
parameter (a global EMA of a norm, a step counter) go in the host's transform
store under the same key. Both are saved by `state_dict`. The runtime store is
a cache that is never saved (segment layouts, wrapped torch optimizers).
`modopt.core.keys` writes and reads every one of these names, and a transform
reaches its state through `modopt.core.runner.TransformState`.
"""

from __future__ import annotations

from typing import Any


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
#: accumulate in (`modopt.core.norms.acc_dtype`: float32 for half precision), a dtype name
#: (`"float32"`: Adam's step counters, as torch keeps them), or None to keep the saved dtype
BUFFER_DTYPES = ("param", "acc", "float32", "float64")
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
        self.kind, self.device, self.dtype, self.low = kind, device, dtype, low
        self.finite = bool(finite) or kind == "counter"
        self.shape = tuple(shape) if shape is not None else None

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


def declared_buffers(t: Any) -> dict[str, Buffer]:
    """The buffers a transform (or transform class) declares, as `Buffer` objects."""
    cls = t if isinstance(t, type) else type(t)
    spec = getattr(cls, "state_buffers", None) or {}
    out: dict[str, Buffer] = {}
    for name, b in spec.items():
        out[name] = b if isinstance(b, Buffer) else Buffer(b)
    return out
