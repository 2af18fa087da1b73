"""Pipeline configs as plain data (YAML, JSON, TOML): the public face of `modopt.core.pipeline_config`'s
`PipelineConfig` and `load_config` (where the format is described), `modopt.core.configfile`'s
readers and errors, and the JSON schema of a pipeline (`config_schema`).
"""

from __future__ import annotations

from typing import Any

from .core.configfile import ConfigError, format_validation_error, parse_text, read_file
from .core.pipeline_config import PipelineConfig, load_config
from .core.registry import available, get_transform

__all__ = ["ConfigError", "PipelineConfig", "config_schema", "format_validation_error", "load_config", "parse_text",
           "read_file"]


def config_schema() -> dict[str, Any]:
    """JSON schema of a pipeline config (every registered transform, discriminated by `type`)."""
    defs: dict[str, Any] = {}
    refs = []
    for name in available():
        s = get_transform(name).model_json_schema(ref_template="#/$defs/{model}")
        defs.update(s.pop("$defs", {}))
        s["properties"] = {"type": {"const": name}, **s.get("properties", {})}
        s["required"] = ["type", *s.get("required", [])]
        defs[name] = s
        refs.append({"$ref": f"#/$defs/{name}"})
    top = PipelineConfig.model_json_schema(ref_template="#/$defs/{model}")
    defs.update(top.pop("$defs", {}))
    defs["Transform"] = {"oneOf": refs}
    top["$defs"] = defs
    top["title"] = "modopt pipeline config"
    return _link_transforms(top)


def _link_transforms(node: Any) -> Any:
    """Replace the marker of a transform-valued field by a reference to the union of transforms."""
    if isinstance(node, dict):
        if node.get("x-modopt-transform"):
            return {"$ref": "#/$defs/Transform"}
        return {k: _link_transforms(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_link_transforms(v) for v in node]
    return node
