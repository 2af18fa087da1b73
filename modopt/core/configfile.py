"""Config files: reading YAML / JSON / TOML, writing TOML, and errors that name the file and the field.

The layer below every config model: `modopt.core.modular.PipelineConfig` and the CLI's
experiment configs read their files and report their errors through it.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .transform import Transform, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FORMATS = {".yaml": "yaml", ".yml": "yaml", ".json": "json", ".toml": "toml"}


class ConfigError(ValueError):
    """A config file that cannot be read or does not validate; the message names the file and place."""


def _format_of(path: Path) -> str:
    try:
        return FORMATS[path.suffix.lower()]
    except KeyError:
        raise ConfigError(f"{path}: unknown config format {path.suffix!r}; use .yaml, .yml, .json or .toml") from None


def parse_text(text: str, fmt: str, source: str = "<config>") -> Any:
    """Parse config text to plain data; syntax errors name the line."""
    try:
        if fmt == "yaml":
            return yaml.safe_load(text)
        if fmt == "json":
            return json.loads(text)
        return _toml_nulls(tomllib.loads(text))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{source}{where}: invalid YAML: {problem}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}, line {e.lineno}, column {e.colno}: invalid JSON: {e.msg}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None


def read_file(path: str | Path) -> Any:
    """Plain data of a YAML / JSON / TOML file."""
    path = Path(path)
    fmt = _format_of(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror or e}") from None
    return parse_text(text, fmt, str(path))


def format_validation_error(
    e: ValidationError, source: str, data: Any = None, root: type[BaseModel] | None = None
) -> str:
    """One line per error, `field.path: message`; with `data` and `root` (the model the data was
    validated as), an unknown field gets a "did you mean" and the fields its place accepts."""
    lines = [f"{source}: invalid config ({e.error_count()} error{'s' if e.error_count() > 1 else ''})"]
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "value_error" and isinstance(err.get("ctx", {}).get("error"), Exception):
            msg = str(err["ctx"]["error"])  # the validator's own words, without pydantic's "Value error, "
        if err["type"] == "extra_forbidden" and root is not None and err["loc"]:
            model = _model_at(root, data, err["loc"][:-1])
            if model is not None:
                fields = model.field_order() if issubclass(model, Transform) else list(model.model_fields)
                msg = f"unknown field {err['loc'][-1]!r}{did_you_mean(err['loc'][-1], fields)}; {model.__name__} takes: {', '.join(fields)}"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def _model_at(root: type[BaseModel], data: Any, loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that validates the mapping at `loc` of `data` (None if unknown)."""
    model: Any = root
    node = data
    for part in loc:
        model = _pick_model(model, node)
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(model, list) and isinstance(part, str):  # the tag of a union member in the location
            model = next((m for m in model if any(f.default == part for f in m.model_fields.values())), None)
            continue
        else:
            node = None
        if isinstance(model, type) and isinstance(part, str) and part in model.model_fields:
            model = _models_in(model.model_fields[part].annotation)
        # an index into a list or a key of a mapping keeps the element model
    model = _pick_model(model, node)
    return model if isinstance(model, type) and issubclass(model, BaseModel) and model is not Transform else None


def _pick_model(model: Any, node: Any) -> Any:
    """The member of `model` (a class or a list of union members) that validates `node`."""
    models = model if isinstance(model, list) else [model]
    models = [m for m in models if isinstance(m, type) and issubclass(m, BaseModel)]
    if not models:
        return None
    if isinstance(node, dict) and isinstance(node.get("type"), str) and any(issubclass(m, Transform) for m in models):
        from .registry import _TRANSFORMS

        return _TRANSFORMS.get(node["type"])
    if len(models) > 1 and isinstance(node, dict):  # a tagged union: the member whose tag has the node's value
        for m in models:
            if any(name in node and f.default == node[name] for name, f in m.model_fields.items()):
                return m
    return models[0] if len(models) == 1 else models


def _models_in(annotation: Any) -> Any:
    """The model class(es) inside an annotation (through Optional, list, dict, Annotated, unions)."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    found: list = []
    for arg in typing.get_args(annotation):
        inner = _models_in(arg)
        found.extend(inner if isinstance(inner, list) else [inner] if inner is not None else [])
    if not found:
        return None
    return found[0] if len(found) == 1 else found


# --- TOML (tomllib reads; this small writer covers config data) --------------
_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    if v is None:
        return '"null"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _toml_dumps(data: dict[str, Any]) -> str:
    lines = []
    for k, v in data.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            lines.append(f"{_toml_key(k)} = [")
            lines.extend(f"  {_toml_value(x)}," for x in v)
            lines.append("]")
        else:
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_nulls(v: Any) -> Any:
    if v == "null":
        return None
    if isinstance(v, dict):
        return {k: _toml_nulls(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_toml_nulls(x) for x in v]
    return v
