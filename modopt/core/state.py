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
