"""`PipelineConfig`, the pipeline as data that rebuilds a `Modular`, and `load_config`, which reads one.

A config lists the transforms by `type` with their fields:

```yaml
nonfinite: skip
defaults: {lr: 0.001}          # optional param-group defaults (override the transforms')
transforms:
  - {type: ClipNorm, max_norm: 1.0}
  - {type: Adam, lr: 0.001}
```

YAML is read with a safe loader; a config can never run code. `TorchOptimizer`
resolves import paths only for `torch.optim.*` and classes registered with
`modopt.register_optimizer()`, unless the caller passes `trust_imports=True`.
TOML has no null: in TOML files the string `"null"` stands for None.

`modopt.config` is the public face of this module (with `config_schema`); files are read and
their errors reported by `modopt.core.configfile`, below it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .configfile import ConfigError, _format_of, _toml_dumps, check_limits, format_validation_error, read_file
from .plan import Finding, lint_findings
from .runner import NonFinite
from .registry import trust_imports as _trust
from .transform import TransformField, _named_error, plain_input, to_plain

__all__ = ["PipelineConfig", "load_config"]


class PipelineConfig(BaseModel):
    """A whole pipeline: its transforms, the non-finite policy and param-group defaults."""

    model_config: ClassVar[ConfigDict] = ConfigDict(extra="forbid", frozen=True)

    transforms: list[TransformField] = Field(default_factory=list)
    nonfinite: NonFinite = "skip"
    defaults: dict[str, Any] = Field(default_factory=dict)
    #: stop the run (`SkipLimitError`) after this many skipped steps in a row; None: no limit
    #: (`modopt.core.skip_limit`)
    max_consecutive_skips: int | None = Field(None, ge=1, lt=2**62)

    @field_validator("max_consecutive_skips", mode="before")
    @classmethod
    def _a_count(cls, v: Any) -> Any:
        """A whole number: `true` or a quoted `"5"` is a mistake pydantic would read as a count."""
        if isinstance(v, (bool, str)):
            raise ValueError(f"a whole number of steps >= 1 (or null) is needed, got {v!r}")
        return v

    @classmethod
    def of(cls, door: str, **fields: Any) -> "PipelineConfig":
        """The pipeline of keyword arguments given at `door` (`Modular`, `mo.attach`); a refused value is a
        `TransformValidationError` naming the door and the keyword once (`Modular.max_consecutive_skips: ...`),
        as a transform's field is named, not pydantic's text of the whole model."""
        try:
            return cls(**fields)
        except ValidationError as e:
            raise _named_error(door, e, list(cls.model_fields)) from None

    def __repr__(self) -> str:
        """`PipelineConfig(ClipNorm(max_norm=1.0), Adam())`: the transforms, then non-default options."""
        parts = [repr(t) for t in self.transforms]
        if self.nonfinite != "skip":
            parts.append(f"nonfinite={self.nonfinite!r}")
        if self.defaults:
            parts.append(f"defaults={self.defaults!r}")
        if self.max_consecutive_skips is not None:
            parts.append(f"max_consecutive_skips={self.max_consecutive_skips}")
        return f"PipelineConfig({', '.join(parts)})"

    def __str__(self) -> str:
        return repr(self)

    # --- serialisation ----------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """`{"transforms": [...], "nonfinite": ..., "defaults": {...}}` as plain data (and
        `max_consecutive_skips` when set)."""
        out = {
            "transforms": [t.to_dict() for t in self.transforms],
            "nonfinite": self.nonfinite,
            "defaults": to_plain(self.defaults),
        }
        if self.max_consecutive_skips is not None:
            out["max_consecutive_skips"] = self.max_consecutive_skips
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """The config as JSON text (`to_dict()`)."""
        return json.dumps(self.to_dict(), indent=indent)

    def to_yaml(self) -> str:
        """The config as YAML text (`to_dict()`, fields in reading order)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_toml(self) -> str:
        """The config as TOML text (`to_dict()`)."""
        return _toml_dumps(self.to_dict())

    def save(self, path: str | Path) -> Path:
        """Write the config to `path` in the format its suffix names (.yaml/.yml, .json, .toml); returns the path."""
        path = Path(path)
        fmt = _format_of(path)
        text = {"yaml": self.to_yaml, "json": self.to_json, "toml": self.to_toml}[fmt]()
        path.write_text(text)
        return path

    @classmethod
    def from_dict(cls, data: Any, trust_imports: bool = False) -> "PipelineConfig":
        """Validate plain data (`to_dict()`'s shape) into a config (`trust_imports`: see `mo.trust_imports`)."""
        with _trust(trust_imports):
            return cls.model_validate(data)

    def lint(self) -> list[Finding]:
        """Transforms whose effect is provably cancelled or overridden by a later one (`modopt.lint`).

        ```pycon
        >>> import modopt as mo
        >>> [f.key for f in mo.PipelineConfig(transforms=[mo.ClipNormByEMA(), mo.Normalize(), mo.Adam()]).lint()]
        ['0:ClipNormByEMA']

        ```
        """
        return lint_findings(self.transforms, self.nonfinite)

    # --- building -----------------------------------------------------------
    #: the optimizer class `build` makes: `Modular`, which sets it when its module loads (`import modopt`
    #: loads it). The optimizer holds its config, so the config sits below it and never imports it
    _optimizer_class: ClassVar[Any] = None

    def build(self, params: Any) -> Any:
        """A fresh `Modular` over `params` running this pipeline (`Modular.from_config(params, self)`)."""
        return self._optimizer_class.from_config(params, self)


def load_config(path: Any, trust_imports: bool = False) -> PipelineConfig:
    """Read a pipeline config: a YAML, JSON or TOML file, or the same data in memory.

    `path` may be a file path, a dict (or any mapping), an OmegaConf `DictConfig`
    (interpolations such as `${train.lr}` are resolved) or a `PipelineConfig`
    (returned as is). An experiment config with an `optimizer` entry and no
    `transforms` gives its `optimizer` pipeline.

    Errors raise `ConfigError` naming the file (or `<dict>`) and the line
    (syntax) or the field path (validation, e.g. `transforms.0.max_norm`).
    """
    if isinstance(path, PipelineConfig):
        return path
    if isinstance(path, (str, Path)):
        data, source = read_file(path), str(path)
    else:
        check_limits(path, f"<{type(path).__name__}>", aliases=False)  # before plain_input expands shared parts
        data, source = plain_input(path), f"<{type(path).__name__}>"
        if not isinstance(data, dict):
            raise ConfigError(
                f"load_config: expected a file path, a mapping (dict, DictConfig) or a PipelineConfig; "
                f"got {type(path).__name__}"
            )
    if isinstance(data, dict) and "optimizer" in data and "transforms" not in data:
        data = plain_input(data["optimizer"])  # an experiment config: take its pipeline
    try:
        return PipelineConfig.from_dict(data, trust_imports=trust_imports)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, data, PipelineConfig)) from e
    except ValueError as e:  # a transform's own check (pydantic wraps most; this catches the rest)
        raise ConfigError(f"{source}: invalid config: {e}") from e
