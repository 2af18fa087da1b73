"""`Transform`, the base class of every module, and `Chain`.

A transform is a frozen pydantic model: its fields are its hyperparameters and
nothing else. It never holds state; per step it receives the step
(`modopt.core.step.Step`: the parameters that have a gradient, their groups),
a `modopt.core.step.TransformState` (its slice of the optimizer's state) and the
list of updates, and returns the new list of updates (`None` stops the chain for
this step: nothing after it runs and the parameters do not move).
"""

from __future__ import annotations

import inspect
import math
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, ValidationError, ValidationInfo,
                      WithJsonSchema, field_validator)
from pydantic_core import PydanticCustomError

import torch

from . import registry
from .fieldtext import field_text, number_text
from .keys import transform_key
from .step import Step, TransformState


def to_plain(value: Any) -> Any:
    """Plain JSON-like data: tuples become lists, transforms become dicts."""
    if isinstance(value, Transform):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


def closest(name: Any, candidates: Any) -> str | None:
    """The closest of `candidates` to `name`, case ignored: the same name in another case, else difflib's
    closest (cutoff 0.6), or None. (`Adamw` is `AdamW`, not `Adam`: compared as written, dropping the `w`
    looks closer than changing its case.)"""
    import difflib

    if not isinstance(name, str):
        return None
    lowered: dict[str, str] = {}
    for c in candidates:
        if isinstance(c, str):
            lowered.setdefault(c.lower(), c)
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[close[0]] if close else None


def did_you_mean(name: Any, candidates: Any) -> str:
    """`" (did you mean 'x'?)"` for the closest of `candidates` to `name`, or `""`."""
    close = closest(name, candidates)
    return f" (did you mean {close!r}?)" if close else ""


def _same(a: Any, b: Any) -> bool:
    """`a` is the default `b` (1 and 1.0 are the same number; True is not 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # pragma: no cover - exotic values compare as different
        return False


class TransformValidationError(ValidationError):
    """A transform's fields refused: a `pydantic.ValidationError` whose text states each error once, as
    `Class.field: message (got value)` (pydantic's own text repeats every message under its location)."""

    def __str__(self) -> str:
        lines = []
        for err in self.errors(include_url=False):
            loc = ".".join(str(x) for x in err["loc"])
            where = f"{self.title}.{loc}" if loc else self.title
            lines.append(f"{where}: {err['msg']}{_got(err) if loc else ''}")
        if len(lines) == 1:
            return lines[0]
        return f"{len(lines)} errors in {self.title}:\n" + "\n".join(f"  {line}" for line in lines)

    def __reduce__(self) -> tuple[Any, tuple[str, list[Any]]]:  # (pydantic's rebuilds its errors as built-in types, which need their context)
        return _rebuild_error, (self.title, [(err["type"], err["msg"], err["loc"], err.get("input"))
                                              for err in self.errors(include_url=False)])


def _rebuild_error(title: str, errors: list) -> TransformValidationError:
    return TransformValidationError.from_exception_data(
        title, [{"type": PydanticCustomError(t, msg), "loc": loc, "input": v} for t, msg, loc, v in errors])


def _got(err: dict) -> str:
    """` (got <value>)`, unless the message already says what it got or the value is a mapping."""
    if "input" not in err or isinstance(err["input"], dict) or re.search(r"\bgot\b", err["msg"]):
        return ""
    return f" (got {err['input']!r})"


#: pydantic's bound errors: the context key of the bound and the words before it
_BOUND_WORDS = {"greater_than": ("gt", "greater than"), "greater_than_equal": ("ge", "greater than or equal to"),
                "less_than": ("lt", "less than"), "less_than_equal": ("le", "less than or equal to")}


def _message(err: dict) -> str:
    """An error's message in the words a reader needs: a validator's own text (no "Value error, "), a large
    bound as it is written (`2**62`)."""
    ctx = err.get("ctx") or {}
    if err["type"] == "value_error" and isinstance(ctx.get("error"), Exception):
        return str(ctx["error"])
    if err["type"] in _BOUND_WORDS:
        key, words = _BOUND_WORDS[err["type"]]
        if key in ctx and number_text(ctx[key]) != str(ctx[key]):
            return f"Input should be {words} {number_text(ctx[key])}"
    return err["msg"]


def _named_error(cls_name: str, e: ValidationError, fields: Any = ()) -> ValidationError:
    """`e` as a `TransformValidationError` titled with the transform's name, each error stated once as
    `modopt validate` states it; an unknown field gets the closest of `fields` as a suggestion, and the
    "required" error of the field it suggests is left out (one mistake, one message).

    Still a `pydantic.ValidationError` with the errors it names (type, location, message, input).
    """
    errors = []
    for err in e.errors(include_url=False):
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            hint = did_you_mean(str(err["loc"][0]), fields)
            err = {**err, "msg": f"unknown field{hint}; the fields: {', '.join(fields)}"}
        else:
            err = {**err, "msg": _message(err)}
        errors.append(err)
    meant = {closest(str(err["loc"][0]), fields) for err in errors if err["type"] == "extra_forbidden"}
    errors = [err for err in errors if not (err["type"] == "missing" and err["loc"] and err["loc"][0] in meant)]
    try:
        return _rebuild_error(cls_name, [(err["type"], err["msg"], err["loc"], err.get("input")) for err in errors])
    except Exception:  # pragma: no cover - keep the original if pydantic refuses
        return e


def _example_kwargs(cls: type) -> str:
    fields = list(getattr(cls, "model_fields", {}))
    return ", ".join(f"{n}=..." for n in fields[:2])


def _check_positional(cls: type) -> None:
    """A concrete transform states its positional field (`positional = "x"` or `None`)."""
    declared = next(
        (k for k in cls.__mro__ if k is not Transform and issubclass(k, Transform) and "positional" in k.__dict__), None
    )
    if declared is None:
        fields = list(cls.model_fields)
        raise TypeError(
            f"transform {cls.__name__} does not say which field may be given positionally: add "
            f"`positional = {fields[0]!r}` (any of its fields: {fields}) or `positional = None` to the class body"
            if fields else
            f"transform {cls.__name__} does not say which field may be given positionally: add "
            "`positional = None` to the class body (it has no fields)"
        )
    name = declared.__dict__["positional"]
    if name is not None and name not in cls.model_fields:
        raise TypeError(
            f"transform {cls.__name__}: positional = {name!r} is not one of its fields "
            f"({', '.join(cls.model_fields)}){did_you_mean(name, cls.model_fields)}"
        )
def _kinds(annotation: Any) -> set:
    """The plain types a field's annotation is made of (through `Annotated`, `Union`, `Optional`)."""
    import typing

    seen: set = set()

    def walk(a: Any) -> None:
        origin = typing.get_origin(a)
        if origin is typing.Annotated:
            walk(typing.get_args(a)[0])
        elif origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            for x in typing.get_args(a):
                walk(x)
        else:
            seen.add(a)

    walk(annotation)
    return seen


def _numeric(annotation: Any) -> bool:
    """Whether a field's type takes numbers and not bools (`float`, `PositiveInt`, `Optional[float]`, `Ord`...)."""
    seen = _kinds(annotation)
    return bool(seen & {float, int}) and bool not in seen


def _is_flag(annotation: Any) -> bool:
    """Whether a field's type is a flag (`bool`, `bool | None`)."""
    return _kinds(annotation) - {type(None)} == {bool}


def _integral(annotation: Any) -> bool:
    """Whether a field's type takes integers and not floats (a count: `PositiveInt`, `int | None`)."""
    seen = _kinds(annotation)
    return int in seen and float not in seen


def _takes_strings(annotation: Any) -> bool:
    """Whether a field's type also takes some strings (`Ord`'s names, a `Literal` of words)."""
    import typing

    def any_str(a: Any) -> bool:
        origin = typing.get_origin(a)
        if origin is typing.Literal:
            return any(isinstance(x, str) for x in typing.get_args(a))
        if origin is not None:
            return any(any_str(x) for x in typing.get_args(a) if not isinstance(x, (int, float)))
        return a is str

    return any_str(annotation)


def readable_signature(cls: type) -> inspect.Signature:
    """The class's call signature with its fields' types in words and their defaults: the positional
    field first (it may be given without its name), the others by name."""
    params = []
    pos = cls._positional_field()
    for name, f in sorted(cls.model_fields.items(), key=lambda kv: kv[0] != pos):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if name == pos else inspect.Parameter.KEYWORD_ONLY
        text = field_text(f)
        default = inspect.Parameter.empty if f.is_required() else (
            f.default if f.default_factory is None else f.default_factory())
        params.append(inspect.Parameter(name, kind, default=default, annotation=text))
    return inspect.Signature(params)


def plain_input(value: Any) -> Any:
    """Config containers as plain data: OmegaConf's `DictConfig`/`ListConfig` (interpolations
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



def _stateless(cls: type) -> bool:
    """Whether `cls` keeps nothing a skipped step could change, so the device may decide its skips: it
    declares no saved values and has no field that holds transforms (`Chain`, `Masked`: they ask their
    children). A role that keeps order or state (`modopt.core.roles`) declares `device_skip = False`."""
    if cls.state_buffers:
        return False
    return not any("Transform" in str(f.annotation) for f in cls.model_fields.values())


#: a role's hook -> the role that declares it (`modopt.core.roles` fills it as it defines the roles), and the
#: names of the flags and methods the roles replaced -> the role to take instead
ROLE_HOOKS: dict[str, str] = {}
RETIRED = {"is_optimizer": "Optimizer", "group_keys": "Optimizer", "must_be_last": "LastWriter",
           "attachable": "PostOptimizer (or another role that is not attachable)", "may_stop": "StepStopper",
           "decides_skip": "SkipDecider", "stage": "WeightStage", "swaps_weights": "WeightSwap",
           "positive_scale": "ScaleFact", "ends_with_scale": "ScaleFact", "sets_norm": "ScaleFact"}


def _check_roles(cls: type) -> None:
    """A class that defines a role's hook takes the role: a hook the plan would never call (it asks
    `isinstance(t, Role)`) is a mistake named when the class is defined, as is a flag the roles replaced."""
    if cls.__module__ == __name__.rsplit(".", 1)[0] + ".roles":
        return
    taken = {k.__name__ for k in cls.__mro__ if k.__module__ == __name__.rsplit(".", 1)[0] + ".roles"}
    for name in cls.__dict__:
        if name in cls.model_fields:
            continue
        role = ROLE_HOOKS.get(name) or RETIRED.get(name)
        if role is not None and role not in taken:
            raise TypeError(f"transform {cls.__name__} defines {name!r}, which the {role.split(' ')[0]} role declares: "
                            f"take the role by inheriting it (class {cls.__name__}(modopt.roles.{role.split(' ')[0]}, "
                            f"...)); see docs/contributing.md, \"Roles\"")


#: whether the transform classes defer their validators to first use (pydantic 2.12 on: see `Transform`)
_DEFER_BUILD = hasattr(BaseModel, "__pydantic_on_complete__")


class _TransformMeta(type(BaseModel)):  # type: ignore[misc]
    """The transforms' metaclass: `dir(cls)`, which `help()` and completion read, lists the public names modopt's
    classes define (the fields, the role and step methods, `to_dict`, `from_dict`...), not the sixty members
    every pydantic model inherits (`model_validate_json`, `parse_raw`, ...) nor pydantic's class attributes,
    which all stay there to use."""

    def __dir__(cls) -> list[str]:
        own = {n for c in cls.__mro__ if c.__module__.startswith("modopt") for n in c.__dict__
               if not n.startswith("_") or n == "__init__"}
        return sorted(own | set(cls.model_fields) | {"model_fields"})


class Transform(BaseModel, metaclass=_TransformMeta):
    """Base class of every modopt module.

    Subclasses declare their hyperparameters as pydantic fields and implement `apply()`; every concrete
    subclass is registered under its class name. Its hooks are the eight below (`positional`,
    `state_buffers`, `update_access`, `device_skip`, `apply`, `children`, `check_params`,
    `check_loaded`); a rarer part (the optimizer that writes, a weight stage, a router, a scale fact...)
    is a role it inherits from `modopt.core.roles`.
    """

    # (inf and NaN are not numbers a field takes: `Normalize(norm_value=inf)` made every loss NaN; a
    # field where inf means something (`ord`) says so itself)
    # (defer_build: each class's validator is made when it is first used, not at `import modopt`; only where
    # pydantic calls `__pydantic_on_complete__` (2.12 on), which sets the readable signature again after that)
    model_config: ClassVar[ConfigDict] = ConfigDict(frozen=True, extra="forbid", validate_default=True,
                                                    allow_inf_nan=False, defer_build=_DEFER_BUILD)

    #: the one field that may be given positionally (`mo.ClipNorm(1.0)`), or None for none.
    #: Every concrete transform states it (in its own body or a base class's other than
    #: `Transform`): forgetting it is an error when the class is defined.
    positional: ClassVar[str | None]
    #: what `apply` does to the updates: `"write"` (default: anything), `"read"` (reads them,
    #: never writes them) or `"none"` (neither: `Identity`). The runner keeps the raw gradients'
    #: norms (its norm memo) only until the first transform that writes them.
    update_access: ClassVar[Literal["write", "read", "none"]] = "write"
    #: the values this transform saves (name -> kind or `modopt.Buffer`); checked on load,
    #: see `modopt.core.state.Buffer`. A saved value not declared here cannot be loaded.
    state_buffers: ClassVar[dict[str, Any]] = {}
    _abstract: ClassVar[bool] = True

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """`True`/`False` or a string where a number is needed is a mistake (pydantic would read them as
        1/0 and as the number written: a quoted `"1e-3"` in a config is a string, not a number)."""
        if info.field_name and not isinstance(v, bool) and v is not None \
                and _is_flag(cls.model_fields[info.field_name].annotation):
            # (pydantic would read "yes", "off", 1 and 0 as flags: a typo or a misplaced value switching a kernel)
            raise ValueError(f"true or false is needed, not {type(v).__name__}")
        if isinstance(v, (bool, str)) and info.field_name:
            annotation = cls.model_fields[info.field_name].annotation
            if isinstance(v, bool) and _numeric(annotation):
                raise ValueError(f"a number is needed, got {v!r} (a bool)")
            if isinstance(v, str) and _numeric(annotation) and not _takes_strings(annotation):
                raise ValueError(f"a number is needed, got the string {v!r} (write it without quotes)")
        elif isinstance(v, (int, float)) and info.field_name and abs(v) >= 2**62 and math.isfinite(v) \
                and _integral(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"a count below 2**62 is needed, got {v!r}")  # (int64 steps and counters)
        return v

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        cls._abstract = abstract
        super().__init_subclass__(**kwargs)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        _check_roles(cls)
        if not any(c.__dict__.get("device_skip") is not None and "_device_skip_inferred" not in c.__dict__
                   for c in cls.__mro__[:cls.__mro__.index(Transform)]):
            # not declared: inferred (a forgotten declaration must not cost a sync a step), per class
            cls.device_skip, cls._device_skip_inferred = _stateless(cls), True
        if not cls._abstract:
            _check_positional(cls)
            registry.register_transform(cls)
            setattr(cls, "__signature__", readable_signature(cls))  # (what help() shows; set, not declared)

    @classmethod
    def __pydantic_on_complete__(cls) -> None:
        """When pydantic completes the class (its first use, under `defer_build`), it sets its own signature:
        the readable one again."""
        super().__pydantic_on_complete__()
        if not cls._abstract:
            setattr(cls, "__signature__", readable_signature(cls))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "omegaconf" in sys.modules:  # built by hydra.utils.instantiate: fields may be DictConfig/ListConfig
            args, kwargs = plain_input(args), plain_input(kwargs)
        if args:
            cls = type(self)
            name = cls._positional_field()
            if name is None or len(args) > 1:
                what = f"1 positional argument ({name})" if name else "no positional arguments"
                raise TypeError(
                    f"{cls.__name__} takes {what}; got {len(args)}. Pass the "
                    f"{'others' if name else 'fields'} by name, e.g. {cls.__name__}({_example_kwargs(cls)})."
                )
            if name in kwargs:
                raise TypeError(f"{cls.__name__} got {name!r} both positionally and by name")
            kwargs[name] = args[0]
        for k, v in kwargs.items():
            if k in type(self).model_fields and isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v):
                raise TypeError(  # (betas=(0.9, torch.tensor(0.99)) became a float silently)
                    f"{type(self).__name__}.{k}: got a tensor in {k}; a transform's fields are plain numbers, saved in "
                    f"its config (give {k}={type(v)(x.item() if isinstance(x, torch.Tensor) and x.numel() == 1 else x for x in v)!r})."
                    f" A tensor hyperparameter belongs in the param group once the optimizer is built: "
                    f"opt.param_groups[i][{k!r}] = ... (torch's kernels read it there)"
                )
            if isinstance(v, torch.Tensor) and k in type(self).model_fields:
                raise TypeError(
                    f"{type(self).__name__}.{k}: got a tensor; a transform's fields are plain numbers, saved in its "
                    f"config (give {k}={v.detach().reshape(-1)[0].item() if v.numel() else '...'!r}). A tensor "
                    f"hyperparameter belongs in the param group once the optimizer is built: "
                    f"opt.param_groups[i][{k!r}] = tensor (torch's kernels read it there)"
                )
        try:
            super().__init__(**kwargs)
        except ValidationError as e:
            raise _named_error(type(self).__name__, e, list(type(self).field_order())) from None

    @classmethod
    def _positional_field(cls) -> str | None:
        """The field given positionally (`positional`), or None."""
        return cls.positional

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_"):
            cls = type(self).__name__
            example = f"{{{name!r}: {value!r}}}"
            raise ValidationError.from_exception_data(
                f"{cls} (frozen)",
                [{
                    "type": PydanticCustomError(
                        "frozen_instance",
                        f"{cls} is frozen: its fields cannot be assigned. Make a changed copy with "
                        f"t.model_copy(update={example}) or build a new {cls}(...)",
                    ),
                    "loc": (name,),
                    "input": value,
                }],
            )
        super().__setattr__(name, value)

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> "Transform":
        """A copy; with `update`, a new transform whose changed fields are validated like a constructor's."""
        if not update:
            return super().model_copy(deep=deep)
        unknown = sorted(set(update) - set(type(self).model_fields))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.model_copy: unknown field(s) {unknown}{did_you_mean(unknown[0], type(self).model_fields)}"
            )
        data = {name: getattr(self, name) for name in type(self).model_fields}
        data.update(update)
        with self._copy_context():
            new = type(self)(**data)
        return new.model_copy(deep=True) if deep else new

    def _copy_context(self):
        """Context in which `model_copy()` rebuilds this transform (`TorchOptimizer` keeps its class)."""
        import contextlib

        return contextlib.nullcontext()

    @classmethod
    def field_order(cls) -> list[str]:
        """Fields in reading order: the most derived class's own first, mixins' (scope) last."""
        order: list[str] = []
        for klass in cls.__mro__:
            for name in klass.__dict__.get("__annotations__", {}):
                if name in cls.model_fields and name not in order:
                    order.append(name)
        return order + [n for n in cls.model_fields if n not in order]

    def __repr_args__(self) -> Iterator[tuple[str, Any]]:
        """Only the fields that differ from their defaults: `ClipNorm(max_norm=1.0)`, `Adam()`."""
        for name in self.field_order():
            value = getattr(self, name)
            info = type(self).model_fields[name]
            if not info.is_required():
                try:
                    default = info.get_default(call_default_factory=True, validated_data={})
                except TypeError:  # pragma: no cover - older pydantic signature
                    default = info.get_default(call_default_factory=True)
                if _same(value, default):
                    continue
            yield name, value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__repr_args__())})"

    def __str__(self) -> str:
        return repr(self)

    # --- the step -------------------------------------------------------
    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Return the new updates (may modify `updates` in place), or None to stop this step."""
        raise NotImplementedError(f"{type(self).__name__}.apply")

    def check_loaded(self, values: dict[str, Any], where: str) -> None:
        """Refuse (`ValueError` starting with `where`) loaded values whose relation this transform's
        steps rely on: `values` holds one segment's values by declared name (each already checked
        against its `Buffer`). A host read is fine here (a load, never a step). Default: nothing."""

    # --- what the runner and the linter may rely on ----------------------------------
    #: True when the transform leaves its state bit-identical on a step the device decided to skip
    #: (`ctx.skip`, a 0-d bool tensor), without a host sync (`modopt.core.roles.skips_on_device`). Inferred
    #: True for a class that declares nothing it keeps (no `state_buffers`) and holds no other transform,
    #: unless a role it takes says False: it has nothing to keep. Declare it on any other class
    device_skip: ClassVar[bool] = False

    def check_params(self, named: list[tuple[str | None, torch.Tensor]]) -> None:
        """Refuse parameters this transform cannot step (`ValueError` naming one) before any state exists:
        when `Modular` is built, for a group added after (`add_param_group`) and in `mo.attach`; `named`
        holds `(name or None, parameter)` in the optimizer's order. The default asks the sub-transforms."""
        for c in self.children():
            c.check_params(named)

    # --- structure --------------------------------------------------------
    def children(self) -> tuple["Transform", ...]:
        """Sub-transforms run by this one (for keys, group keys and checks)."""
        return ()

    # --- serialisation ----------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """`{"type": name, field: value, ...}` as plain data (every field, defaults included)."""
        data = {"type": type(self).__name__}
        for name in self.field_order():
            data[name] = to_plain(getattr(self, name))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Transform":
        """The registered transform that `data` (`{"type": name, field: value, ...}`) describes."""
        return _coerce_transform(data)


def _coerce_transform(value: Any) -> Any:
    """Turn `{"type": ..., ...}` into the registered transform (nested errors keep their location)."""
    if isinstance(value, Transform) or not isinstance(value, dict):
        return value
    if "type" not in value:
        raise ValueError(f"a transform needs a 'type' (one of: {', '.join(registry.available())})")
    data = dict(value)
    name = data.pop("type")
    if not isinstance(name, str) or name not in registry._TRANSFORMS:
        raise ValueError(
            f"unknown transform type {name!r}{did_you_mean(name, registry.available())}; "
            f"known types: {', '.join(registry.available())}"
        )
    return registry._TRANSFORMS[name].model_validate(data)


#: a field holding a transform: accepts an instance or its dict, serialises to its dict
TransformField = Annotated[
    Transform,
    BeforeValidator(_coerce_transform),
    PlainSerializer(lambda t: t.to_dict(), return_type=dict),
    WithJsonSchema({"x-modopt-transform": True}),  # replaced by a reference in modopt.config_schema
]


def variadic_transforms(owner: str, transforms: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with `transforms` set from positional ones (`mo.Chain(a, b)` or `mo.Chain([a, b])`)."""
    if transforms:
        if "transforms" in kwargs:
            raise TypeError(f"{owner} got transforms both positionally and by name")
        if len(transforms) == 1 and isinstance(transforms[0], (list, tuple)):
            transforms = tuple(transforms[0])
        kwargs = {**kwargs, "transforms": list(transforms)}
    return kwargs



def walk(transforms: list[Transform] | tuple[Transform, ...], prefix: str = "") -> list[tuple[str, Transform]]:
    """Every transform (nested ones included) with its stable key, in chain order (`prefix`: the parent's key)."""
    out: list[tuple[str, Transform]] = []
    for i, t in enumerate(transforms):
        key = transform_key(i, type(t).__name__, prefix)
        out.append((key, t))
        out.extend(walk(t.children(), key))
    return out

