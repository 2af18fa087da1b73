"""Config files: reading YAML / JSON / TOML, writing TOML, and errors that name the file and the field.

The layer below every config model: `modopt.core.pipeline_config.PipelineConfig` and the CLI's
experiment configs read their files and report their errors through it.

Config text is untrusted input, so reading it has bounds (`check_limits`, `_BoundedLoader`): at most
`MAX_BYTES` bytes of text (checked before parsing), at most `MAX_NODES` values once YAML aliases and
merge keys are expanded (counted without expanding them), at most `MAX_DEPTH` levels of nesting, no
alias that contains itself, and UTF-8 text. Each breach is a `ConfigError` naming the file and the
limit.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping
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

#: Most values (mappings, lists and scalars, each counted once per place it appears) a config may
#: hold once its YAML aliases are expanded (and entries a mapping may receive through merge keys). A real pipeline or experiment config has tens to a few
#: hundred; the cap stops an "alias bomb" (a few hundred bytes of `*alias` lists nested inside one
#: another) before validation builds every copy. Counted over the alias graph, never expanded.
MAX_NODES = 100_000
#: Deepest nesting of mappings and lists a config may have (the top-level mapping is level 1; each
#: `Chain` inside a pipeline adds two: its mapping and its `transforms` list). Deeper input is
#: refused before the parsers or validators can run out of Python stack.
MAX_DEPTH = 64
#: Largest config text, in bytes (2 MiB), refused before it is parsed: the pure-Python YAML reader takes
#: about 0.3 s per MiB, so without a bound a large file (a huge comment) holds `modopt validate` for
#: minutes. Real configs are a few kilobytes; `MAX_NODES` values written out one by one are about 1 MiB.
MAX_BYTES = 2 * 2**20
_WHERE = "modopt/core/configfile.py"


class ConfigError(ValueError):
    """A config file that cannot be read or does not validate; the message names the file and place."""


def _format_of(path: Path) -> str:
    try:
        return FORMATS[path.suffix.lower()]
    except KeyError:
        raise ConfigError(f"{path}: unknown config format {path.suffix!r}; use .yaml, .yml, .json or .toml") from None


class _MergeTooLarge(Exception):
    """A YAML mapping whose merge keys (`<<: *alias`) would copy more than `MAX_NODES` entries."""


class _MergeCycle(Exception):
    """A YAML mapping that merges itself (`&a {<<: *a}`, directly or through other mappings)."""


class _BoundedLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` (same tags; exponent floats as YAML 1.2 reads them) whose merge keys cannot blow up.

    PyYAML resolves `<<: [*a, *a, ...]` by copying the entry lists of the merged mappings into the
    mapping, duplicates included, so nested merges grow tenfold per level inside `safe_load` itself,
    before any check on the result can run. Here each mapping is flattened once, its merge sources
    first, and the entries it would receive are counted (a sum of lengths) before anything is copied.
    """

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        flat = self.__dict__.setdefault("_flattened", {})
        if id(node) in flat:  # already flattened: nothing left to merge
            return
        busy = self.__dict__.setdefault("_flattening", {})
        if id(node) in busy:
            raise _MergeCycle
        busy[id(node)] = node
        entries = len(node.value)
        for key_node, value_node in node.value:
            if key_node.tag != "tag:yaml.org,2002:merge":
                continue
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for src in sources:
                if isinstance(src, yaml.MappingNode):  # anything else: the base class reports it
                    self.flatten_mapping(src)
                    entries += len(src.value)
        if entries > MAX_NODES:
            raise _MergeTooLarge
        super().flatten_mapping(node)
        del busy[id(node)]
        flat[id(node)] = node  # holding the node keeps its id from being reused


def load_yaml(text: str) -> Any:
    """YAML text as plain data, read as config files are (`_BoundedLoader`)."""
    return yaml.load(text, Loader=_BoundedLoader)


# YAML 1.1 (PyYAML) reads `1e-3` and `2E+5` (no dot) as strings, YAML 1.2 and JSON as numbers: a config
# writes learning rates that way, so they are read as floats here (the 1.1 forms still read as before)
_BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def _too_long(source: str, size: int | None) -> ConfigError:
    """A config over `MAX_BYTES` (`size` in bytes, None where only "more" is known)."""
    what = f"{size} bytes" if size is not None else f"over {MAX_BYTES} bytes"
    return ConfigError(f"{source}: the config is {what}, more than a config may be ({MAX_BYTES} bytes, "
                       f"{MAX_BYTES / 2**20:g} MiB); not parsed (limit MAX_BYTES in {_WHERE})")


def parse_text(text: str, fmt: str, source: str = "<config>") -> Any:
    """Parse config text to plain data; syntax errors name the line.

    Text longer than `MAX_BYTES` bytes (UTF-8) is refused before parsing; the data is checked by
    `check_limits` (size after alias expansion, depth, cycles)."""
    if len(text) > MAX_BYTES // 4:  # (a character is 1 to 4 bytes: only text that may be too long is counted)
        size = len(text.encode("utf-8", "surrogatepass")) if len(text) <= MAX_BYTES else None
        if size is None or size > MAX_BYTES:
            raise _too_long(source, size)
    try:
        if fmt == "yaml":
            data = load_yaml(text)
        elif fmt == "json":
            data = json.loads(text)
        else:
            data = tomllib.loads(text)
    except RecursionError:  # the parsers recurse once per nesting level
        raise ConfigError(
            f"{source}: the config nests too deeply to parse (more than {MAX_DEPTH} levels are refused; "
            f"limit MAX_DEPTH in {_WHERE})"
        ) from None
    except _MergeCycle:
        raise ConfigError(f"{source}: a YAML merge key (<<) merges a mapping into itself (a cycle)") from None
    except _MergeTooLarge:
        raise ConfigError(
            f"{source}: the config expands to more than {MAX_NODES} values through YAML merge keys (<<) "
            f"(limit MAX_NODES in {_WHERE})"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{source}{where}: invalid YAML: {problem}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}, line {e.lineno}, column {e.colno}: invalid JSON: {e.msg}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    check_limits(data, source, aliases=fmt == "yaml")
    return _toml_nulls(data) if fmt == "toml" else data


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _is_omegaconf(value: Any) -> bool:
    om = sys.modules.get("omegaconf")
    return om is not None and isinstance(value, (om.DictConfig, om.ListConfig))


def _entries(value: Any) -> Any:
    """An iterator of `(key, child)` over a config container, or None for a leaf."""
    if isinstance(value, dict):
        return iter(value.items())
    if isinstance(value, (list, tuple)):
        return enumerate(value)
    if isinstance(value, Mapping) and not isinstance(value, BaseModel) and not _is_omegaconf(value):
        return iter(value.items())
    return None


def check_limits(data: Any, source: str = "<config>", aliases: bool = True) -> Any:
    """Refuse config data that is too large once shared references (YAML aliases) are expanded,
    nested deeper than `MAX_DEPTH`, or that contains itself; returns `data` unchanged.

    Walks the reference graph once without recursion, remembering each container's expanded size
    and height by `id`, so an alias repeated a million times costs one visit. `aliases` says whether
    the text format has aliases (it only picks the wording of the message). OmegaConf containers
    and pydantic models are leaves (they are not the output of a parser).
    """
    top = _entries(data)
    if top is None:
        return data
    done: dict[int, tuple] = {}  # id -> (expanded values, height in levels, the container: keeps its id unique)
    open_at: dict[int, int] = {id(data): 0}  # containers on the current path -> their index in `stack`
    # a frame: [container, its entries, key it sits under, values so far, height of its tallest child]
    stack: list[list] = [[data, top, None, 1, 0]]
    shared = False

    def too_big() -> ConfigError:
        through = " through YAML aliases" if aliases else " through shared references"
        how = ("expands to", through) if shared else ("holds", "")
        return ConfigError(
            f"{source}: the config {how[0]} more than {MAX_NODES} values{how[1]} (limit MAX_NODES in {_WHERE})"
        )

    def too_deep() -> ConfigError:
        return ConfigError(f"{source}: the config nests deeper than {MAX_DEPTH} levels (limit MAX_DEPTH in {_WHERE})")

    while stack:
        frame = stack[-1]
        for key, child in frame[1]:
            if type(child) in _SCALARS:  # the common case, without the container checks
                frame[3] += 1
                continue
            entries = _entries(child)
            if entries is None:
                frame[3] += 1
                continue
            seen = done.get(id(child))
            if seen is not None:
                shared = True
                frame[3] += seen[0]
                frame[4] = max(frame[4], seen[1])
                if len(stack) + seen[1] > MAX_DEPTH:
                    raise too_deep()
            elif id(child) in open_at:
                path = _path(stack) + [key]
                inner = ".".join(str(k) for k in path) or "<root>"
                outer = ".".join(str(k) for k in path[: open_at[id(child)]]) or "<root>"
                what = ("a YAML alias", "; an alias may repeat a value, not contain it") \
                    if aliases else ("a reference", "")
                raise ConfigError(
                    f"{source}: the config contains itself: {inner} is {what[0]} to {outer}, which encloses it "
                    f"(a cycle{what[1]})"
                )
            else:
                if len(stack) >= MAX_DEPTH:
                    raise too_deep()
                open_at[id(child)] = len(stack)
                stack.append([child, entries, key, 1, 0])
                break
            if frame[3] > MAX_NODES:
                raise too_big()
        else:  # every entry of `frame` counted: it is done
            stack.pop()
            del open_at[id(frame[0])]
            size, height = frame[3], frame[4] + 1
            done[id(frame[0])] = (size, height, frame[0])
            if stack:
                parent = stack[-1]
                parent[3] += size
                parent[4] = max(parent[4], height)
                if parent[3] > MAX_NODES:
                    raise too_big()
            elif size > MAX_NODES:
                raise too_big()
    return data


def _path(stack: list[list]) -> list:
    """The keys from the root to the container on top of `stack`."""
    return [frame[2] for frame in stack[1:]]


def read_file(path: str | Path) -> Any:
    """Plain data of a YAML / JSON / TOML file; a file over `MAX_BYTES` is refused unread."""
    path = Path(path)
    fmt = _format_of(path)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_BYTES:
                raise _too_long(str(path), size)
            raw = f.read(MAX_BYTES + 1)  # (a pipe or a device has no size: read one byte past the bound)
        if len(raw) > MAX_BYTES:
            raise _too_long(str(path), None)
        # universal newlines, as a file opened in text mode reads them
        text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: the config is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            "save it as UTF-8"
        ) from None
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
