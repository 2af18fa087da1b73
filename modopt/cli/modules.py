"""`modopt modules`: every registered transform with its fields, defaults and a one-line description."""

from __future__ import annotations

import difflib
import inspect
import re
from typing import Any

from pydantic_core import PydanticUndefined

from ..config import ConfigError
from ..core.fieldtext import bounds, format_range, type_name
from ..core.registry import available, get_transform
from ..core.roles import Optimizer


def _one_line(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    first = doc.strip().split("\n\n", 1)[0]
    return " ".join(first.split())


def plain_text(md: str) -> str:
    """Markdown inline markup removed for a terminal: code backticks, `$` math delimiters, `**`."""
    md = re.sub(r"`([^`]*)`", r"\1", md)
    md = re.sub(r"\$([^$]+)\$", r"\1", md)
    return md.replace("**", "")


def select_names(names: list[str] | None) -> list[str]:
    """The registered transforms named in `names` (case-insensitive; all when empty).

    An unknown name raises `ConfigError` with the closest registered names.
    """
    known = available()
    if not names:
        return known
    lower = {k.lower(): k for k in known}
    chosen = []
    for n in names:
        if n.lower() not in lower:
            close = difflib.get_close_matches(n.lower(), list(lower), n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(lower[c] for c in close)}?" if close else ""
            raise ConfigError(f"no transform named {n!r}{hint} (`modopt modules` lists them all)")
        if lower[n.lower()] not in chosen:
            chosen.append(lower[n.lower()])
    return chosen


def describe_modules(names: list[str] | None = None) -> list[dict[str, Any]]:
    """`[{name, module, description, fields: [{name, type, default, required, range}]}]` of the
    registered transforms (those in `names` when given, see `select_names`)."""
    out = []
    for name in select_names(names):
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
                "type": type_name(f.annotation),
                "default": None if required else _plain(default),
                "required": required,
                "range": format_range(bounds(f.annotation, f.metadata)),
                "description": f.description or "",
            })
        out.append({
            "name": name,
            "module": cls.__module__,
            "optimizer": issubclass(cls, Optimizer),
            "description": plain_text(_one_line(cls)),
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
    """The text `modopt modules` prints for `mods` (one entry per transform, as listed for `--json`)."""
    lines = []
    for m in mods:
        kind = " [optimizer]" if m["optimizer"] else ""
        lines.append(f"{m['name']}{kind}: {m['description']}")
        for f in m["fields"]:
            d = "required" if f["required"] else f"default {f['default']!r}"
            if f.get("range"):
                d += f"; {f['range']}"
            line = f"    {f['name']}: {f['type']} ({d})"
            if f.get("description"):
                line += f"  {plain_text(f['description'])}"
            lines.append(line)
    return "\n".join(lines)
