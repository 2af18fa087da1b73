"""`Transform`, the base class of every module, and `Chain`.

A transform is a frozen pydantic model: its fields are its hyperparameters and
nothing else. It never holds state; per-step it receives the list of updates of
the parameters that have a gradient, a :class:`~modopt.core.state.StepContext`
and a :class:`~modopt.core.state.TransformState` (its slice of the optimizer's
state), and returns the new list of updates (``None`` stops the chain for this
step: nothing after it runs and the parameters do not move).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema

from . import registry

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .state import StepContext, TransformState


def to_plain(value: Any) -> Any:
    """Plain JSON-like data: tuples become lists, transforms become dicts."""
    if isinstance(value, Transform):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


def plain_input(value: Any) -> Any:
    """Config containers as plain data: OmegaConf's ``DictConfig``/``ListConfig`` (interpolations
    resolved) and other mappings become dicts and lists, recursively; anything else is returned as is.

    OmegaConf is never imported here: its containers can only exist once the caller imported it.
    """
    om = sys.modules.get("omegaconf")
    if om is not None and isinstance(value, (om.DictConfig, om.ListConfig)):
        return om.OmegaConf.to_container(value, resolve=True)
    if isinstance(value, (list, tuple)):
        out = [plain_input(v) for v in value]
        return out if isinstance(value, list) else tuple(out)
    if isinstance(value, Mapping) and not isinstance(value, BaseModel):
        return {k: plain_input(v) for k, v in value.items()}
    return value


class Transform(BaseModel):
    """Base class of every modopt module.

    Subclasses declare their hyperparameters as pydantic fields and implement
    :meth:`apply`. Every concrete subclass is registered under its class name.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    #: the field that may be given positionally (default: the first field)
    positional: ClassVar[str | None] = None
    #: fields exposed as param-group keys (so torch schedulers can drive them)
    group_keys: ClassVar[tuple[str, ...]] = ()
    #: True for transforms that produce the step itself (they carry the learning rate)
    is_optimizer: ClassVar[bool] = False
    #: False for transforms that cannot run in front of another optimizer (``mo.attach``)
    attachable: ClassVar[bool] = True
    _abstract: ClassVar[bool] = True

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        cls._abstract = abstract
        super().__init_subclass__(**kwargs)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if not cls._abstract:
            registry.register_transform(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "omegaconf" in sys.modules:  # built by hydra.utils.instantiate: fields may be DictConfig/ListConfig
            args, kwargs = plain_input(args), plain_input(kwargs)
        if args:
            cls = type(self)
            name = cls._positional_field()
            if name is None or len(args) > 1:
                raise TypeError(
                    f"{cls.__name__} takes at most 1 positional argument ({name or 'none'}); "
                    f"got {len(args)}. Pass the others by name."
                )
            if name in kwargs:
                raise TypeError(f"{cls.__name__} got {name!r} both positionally and by name")
            kwargs[name] = args[0]
        super().__init__(**kwargs)

    @classmethod
    def _positional_field(cls) -> str | None:
        """``positional`` if set, else the first field the most derived class declares."""
        if cls.positional:
            return cls.positional
        for klass in cls.__mro__:
            for name in klass.__dict__.get("__annotations__", {}):
                if name in cls.model_fields:
                    return name
        return None

    @classmethod
    def field_order(cls) -> list[str]:
        """Fields in reading order: the most derived class's own first, mixins' (scope) last."""
        order: list[str] = []
        for klass in cls.__mro__:
            for name in klass.__dict__.get("__annotations__", {}):
                if name in cls.model_fields and name not in order:
                    order.append(name)
        return order + [n for n in cls.model_fields if n not in order]

    def __repr_args__(self):
        for name in self.field_order():
            yield name, getattr(self, name)

    # --- the step -------------------------------------------------------
    def apply(
        self, ctx: "StepContext", st: "TransformState", updates: list["torch.Tensor"]
    ) -> list["torch.Tensor"] | None:
        """Return the new updates (may modify ``updates`` in place), or None to stop this step."""
        raise NotImplementedError(f"{type(self).__name__}.apply")

    def apply_final(self, ctx: "StepContext", st: "TransformState", updates: list["torch.Tensor"]) -> bool:
        """As the last transform, write the parameters itself (fused); return False if not supported."""
        return False

    def takes_scale(self, final: bool) -> bool:
        """True if this transform consumes a deferred scale (``ctx.pending``) itself.

        ``final``: it runs as the last transform through :meth:`apply_final`.
        The transform before it may then call ``ctx.defer_scale`` instead of
        multiplying the updates, and this one must fold the scale into its
        arithmetic or call ``ctx.flush_scale``. Saves a pass over memory.
        """
        return False

    # --- structure --------------------------------------------------------
    def children(self) -> tuple["Transform", ...]:
        """Sub-transforms run by this one (for keys, group keys and checks)."""
        return ()

    def hyperparams(self) -> dict[str, Any]:
        """Default param-group values this transform exposes."""
        return {k: getattr(self, k) for k in self.group_keys}

    # --- serialisation ----------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """``{"type": name, field: value, ...}`` as plain data (every field, defaults included)."""
        data = {"type": type(self).__name__}
        for name in self.field_order():
            data[name] = to_plain(getattr(self, name))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Transform":
        return _coerce_transform(data)


def _coerce_transform(value: Any) -> Any:
    """Turn ``{"type": ..., ...}`` into the registered transform (nested errors keep their location)."""
    if isinstance(value, Transform) or not isinstance(value, dict):
        return value
    if "type" not in value:
        raise ValueError(f"a transform needs a 'type' (one of: {', '.join(registry.available())})")
    data = dict(value)
    name = data.pop("type")
    if not isinstance(name, str) or name not in registry._TRANSFORMS:
        raise ValueError(f"unknown transform type {name!r}; known types: {', '.join(registry.available())}")
    return registry._TRANSFORMS[name].model_validate(data)


#: a field holding a transform: accepts an instance or its dict, serialises to its dict
TransformField = Annotated[
    Transform,
    BeforeValidator(_coerce_transform),
    PlainSerializer(lambda t: t.to_dict(), return_type=dict),
    WithJsonSchema({"x-modopt-transform": True}),  # replaced by a reference in modopt.config_schema
]


class Chain(Transform):
    """Run transforms in order; a chain is itself a transform and may be nested.

    ``mo.Chain(mo.ClipNorm(1.0), mo.Normalize())``
    """

    transforms: list[TransformField] = Field(default_factory=list)

    def __init__(self, *transforms: Any, **kwargs: Any) -> None:
        if transforms:
            if "transforms" in kwargs:
                raise TypeError("Chain got transforms both positionally and by name")
            if len(transforms) == 1 and isinstance(transforms[0], (list, tuple)):
                transforms = tuple(transforms[0])
            kwargs["transforms"] = list(transforms)
        super().__init__(**kwargs)

    def children(self) -> tuple[Transform, ...]:
        return tuple(self.transforms)

    def apply(self, ctx, st, updates):
        return run_sequence(self.transforms, ctx, [st.child(i, t) for i, t in enumerate(self.transforms)], updates, False)

    def apply_final(self, ctx, st, updates):
        if not self.transforms:
            return False
        run_sequence(self.transforms, ctx, [st.child(i, t) for i, t in enumerate(self.transforms)], updates, True)
        return True


def run_sequence(transforms, ctx: "StepContext", states: list, updates: list, final: bool) -> list | None:
    """Run ``transforms`` in order; with ``final`` the last one writes the parameters.

    Returns the updates (not ``final``), or None when a transform stopped the
    step or the parameters were written. A transform may defer a per-segment
    scale to the next one when that one :meth:`~Transform.takes_scale`; the
    runner applies a pending scale before any transform that does not.
    """
    n = len(transforms)
    for i, t in enumerate(transforms):
        last = i == n - 1
        if ctx.pending is not None and not t.takes_scale(final and last):
            ctx.flush_scale(updates)
        ctx.defer_ok = not last and transforms[i + 1].takes_scale(final and i + 1 == n - 1)
        try:
            if final and last:
                _final(t, ctx, states[i], updates)
                return None
            updates = t.apply(ctx, states[i], updates)
        finally:
            ctx.defer_ok = False
        if updates is None:
            ctx.pending = None
            return None
    if ctx.pending is not None:  # pragma: no cover - defer_ok is never set for the last transform
        ctx.flush_scale(updates)
    return updates


def _final(t: Transform, ctx: "StepContext", st: "TransformState", updates: list) -> bool:
    """Run ``t`` as the last transform; write ``p -= update`` unless it fused the write."""
    if t.apply_final(ctx, st, updates):
        return True
    if ctx.pending is not None and not t.takes_scale(False):
        ctx.flush_scale(updates)
    out = t.apply(ctx, st, updates)
    if out is not None:
        ctx.write_updates(out)
    else:
        ctx.pending = None
    return True


def walk(transforms: list[Transform] | tuple[Transform, ...], prefix: str = "") -> list[tuple[str, Transform]]:
    """Every transform (nested ones included) with its stable key, in chain order."""
    out: list[tuple[str, Transform]] = []
    for i, t in enumerate(transforms):
        key = f"{prefix}{i}:{type(t).__name__}"
        out.append((key, t))
        out.extend(walk(t.children(), key + "/"))
    return out
