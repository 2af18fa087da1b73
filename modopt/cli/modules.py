"""`modopt modules`: every registered transform with its fields, defaults and a one-line description."""

from __future__ import annotations

import inspect
from typing import Any

from pydantic_core import PydanticUndefined

from ..core.registry import available, get_transform


def _one_line(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    first = doc.strip().split("\n\n", 1)[0]
    return " ".join(first.split())


def _type_name(ann: Any) -> str:
    """A short readable name of a field's type (Annotated metadata dropped)."""
    import types
    import typing

    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]" if args else name
    if ann is type(None):
        return "None"
    return getattr(ann, "__name__", str(ann).replace("typing.", ""))


def describe_modules() -> list[dict[str, Any]]:
    """`[{name, module, description, fields: [{name, type, default, required}]}]` for every registered transform."""
    out = []
    for name in available():
        cls = get_transform(name)
        fields = []
        for fname in cls.field_order():
            f = cls.model_fields[fname]
            if f.default is not PydanticUndefined:
                default: Any = f.default
            elif f.default_factory is not None:
                default = f.default_factory()
            else:
                default = None
            required = f.is_required()
            fields.append({
                "name": fname,
                "type": _type_name(f.annotation),
                "default": None if required else _plain(default),
                "required": required,
            })
        out.append({
            "name": name,
            "module": cls.__module__,
            "optimizer": bool(cls.is_optimizer),
            "description": _one_line(cls),
            "fields": fields,
        })
    return out


def _plain(v: Any) -> Any:
    from ..core.transform import to_plain

    v = to_plain(v)
    if isinstance(v, (str, int, float, bool, list, dict)) or v is None:
        return v
    return repr(v)


def format_modules(mods: list[dict[str, Any]]) -> str:
    lines = []
    for m in mods:
        kind = " [optimizer]" if m["optimizer"] else ""
        lines.append(f"{m['name']}{kind}: {m['description']}")
        for f in m["fields"]:
            d = "required" if f["required"] else f"default {f['default']!r}"
            lines.append(f"    {f['name']}: {f['type']} ({d})")
    return "\n".join(lines)
