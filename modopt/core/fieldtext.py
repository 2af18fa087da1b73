"""A transform field's type and range in words, for people: `modopt modules`, `help()` and IDEs.

`type_name(int | None)` is `"int | None"`, `format_range(bounds(...))` is `"0 <= x < 1"`;
`field_text` joins them (`"float, 0 <= x < 1"`).
"""

from __future__ import annotations

import types
import typing
from typing import Any


def bounds(ann: Any, metadata: list) -> dict[str, float]:
    """`{gt, ge, lt, le}` from a field's constraints (its metadata and Annotated types inside its annotation)."""
    out: dict[str, float] = {}
    items = list(metadata)
    stack = [ann]
    while stack:
        a = stack.pop()
        if typing.get_origin(a) is typing.Annotated:
            args = typing.get_args(a)
            items += list(args[1:])
            stack.append(args[0])
        else:
            stack += [x for x in typing.get_args(a) if x is not Ellipsis]
    for m in items:
        for key in ("gt", "ge", "lt", "le"):
            v = getattr(m, key, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[key] = v
    return out


def format_range(b: dict[str, float]) -> str:
    """`{"ge": 0, "lt": 1}` -> `"0 <= x < 1"`; `{"gt": 0}` -> `"> 0"`; `{}` -> `""`."""
    lo = f"{b['gt']} < " if "gt" in b else f"{b['ge']} <= " if "ge" in b else ""
    hi = f" < {b['lt']}" if "lt" in b else f" <= {b['le']}" if "le" in b else ""
    if lo and hi:
        return f"{lo}x{hi}"
    if lo:
        return (">" if "gt" in b else ">=") + f" {b.get('gt', b.get('ge'))}"
    if hi:
        return ("<" if "lt" in b else "<=") + f" {b.get('lt', b.get('le'))}"
    return ""


def type_name(ann: Any) -> str:
    """A short readable name of a field's type (Annotated metadata dropped)."""
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]" if args else name
    if ann is type(None):
        return "None"
    return getattr(ann, "__name__", str(ann).replace("typing.", ""))


def field_text(field: Any) -> str:
    """A pydantic field's type and range: `"float, 0 <= x < 1"`, `"'global' | 'group' | 'tensor'"`."""
    rng = format_range(bounds(field.annotation, field.metadata))
    return type_name(field.annotation) + (f", {rng}" if rng else "")
