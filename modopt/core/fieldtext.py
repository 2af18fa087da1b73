"""A transform field's type and range in words, for people: `modopt modules`, `help()` and IDEs.

`type_name(int | None)` is `"int | None"`, `format_range(bounds(...))` is `"0 <= x < 1"`;
`field_text` joins them (`"float, 0 <= x < 1"`). A large bound reads as it is written: `2**62`, not
`4611686018427387904`.
"""

from __future__ import annotations

import types
import typing
from typing import Any


def bounds(ann: Any, metadata: list[Any]) -> dict[str, float]:
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


def number_text(v: Any) -> str:
    """A bound as a user writes it: a power of two from `2**16` up as `2**k` (`2**62`, `2**64` for the float
    `1.8446744073709552e+19`), one less as `2**k - 1`; any other number as `str()` gives it."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        return str(v)
    n = abs(int(v))
    if n >= 2**16:
        if n & (n - 1) == 0:
            text = f"2**{n.bit_length() - 1}"
            return f"-{text}" if v < 0 else text
        if (n + 1) & n == 0:
            text = f"2**{n.bit_length()} - 1"
            return f"-({text})" if v < 0 else text
    return str(v)


def format_range(b: dict[str, float]) -> str:
    """`{"ge": 0, "lt": 1}` -> `"0 <= x < 1"`; `{"gt": 0}` -> `"> 0"`; `{"lt": 2**62}` -> `"< 2**62"`; `{}` -> `""`."""
    t = {k: number_text(v) for k, v in b.items()}
    lo = f"{t['gt']} < " if "gt" in t else f"{t['ge']} <= " if "ge" in t else ""
    hi = f" < {t['lt']}" if "lt" in t else f" <= {t['le']}" if "le" in t else ""
    if lo and hi:
        return f"{lo}x{hi}"
    if lo:
        return (">" if "gt" in t else ">=") + f" {t.get('gt', t.get('ge'))}"
    if hi:
        return ("<" if "lt" in t else "<=") + f" {t.get('lt', t.get('le'))}"
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
