"""The experiment config of `modopt run` / `modopt compare`: a pydantic model.


```yaml
name: transformer-zclip
task: {name: transformer, options: {seq_len: 24}}
optimizer:                      # a modopt PipelineConfig
  transforms:
    - {type: ZClip}
    - {type: Adam, lr: 0.01}
train: {steps: 600, batch_size: 32, seed: 0}
output: {dir: runs/transformer-zclip}
```

Instead of `optimizer` a file may hold `variants`, a mapping of names to
pipelines; `modopt compare` runs every variant, `modopt run --variant NAME`
one of them. Files are YAML, JSON or TOML (read by `modopt.config.read_file()`);
errors name the file and the line (syntax) or the field path (validation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..config import ConfigError, PipelineConfig, format_validation_error, read_file
from ..core.registry import trust_imports as _trust
from ..rewind import RewindConfig
from ..telemetry.history import CAPACITY_MAX
from .examples import find_config


#: the largest step count, interval or batch size (a signed 64-bit integer, torch's index type)
INT64_MAX = 2**63 - 1
#: seeds are what `torch.manual_seed` takes without wrapping: unsigned 64-bit integers
SEED_MAX = 2**64 - 1
#: the most intra-op threads a run asks torch for (OpenMP allocates per thread: two billion of them ended
#: the process from inside its runtime, with its own message)
THREADS_MAX = 1024
#: `modopt sweep`'s default `--max-runs` (`sweep.MAX_RUNS`): here, where both the parser (which shows it and
#: imports no training code) and the sweep read it without importing each other
SWEEP_MAX_RUNS = 1000


def read_config(path: str | Path) -> Any:
    """`modopt.config.read_file()` of `path` or of the example config it names (`find_config`),
    with a file that is not text a `ConfigError` too."""
    path = find_config(path)
    try:
        return read_file(path)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: cannot read config: not UTF-8 text (byte {e.start})") from None


class _Strict(BaseModel):
    """A frozen pydantic model that refuses unknown keys (the base of every experiment section)."""

    model_config: ClassVar[ConfigDict] = ConfigDict(extra="forbid", frozen=True)


class TaskConfig(_Strict):
    """Which task to train: a built-in name or `package.module:function`, and its options."""

    name: str = "transformer"
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known_name(cls, name: str) -> str:
        from .tasks import check_task

        check_task(name, {})  # a built-in name, or an import path's form
        return name

    @model_validator(mode="after")
    def _known_options(self):
        from .tasks import BUILTIN, check_options

        if self.name in BUILTIN:
            check_options(self.name, BUILTIN[self.name], self.options)
        return self


class Schedule(_Strict):
    """Learning-rate schedule over the steps, built from torch's own schedulers.

    Step `s` (1-based) of `total` trains with `lr = base * f(s)`: a linear
    warm-up `f(s) = s / warmup_steps` for `s <= warmup_steps`, then `constant`
    (`f = 1`), `cosine` or `linear` decay from 1 at the end of the warm-up to
    `min_factor` at the last step (`torch.optim.lr_scheduler.LinearLR`,
    `CosineAnnealingLR` and `SequentialLR`; see `build`).
    """

    kind: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_factor: float = Field(0.0, ge=0.0, le=1.0)

    def build(self, optimizer: Any, total: int) -> Any:
        """A torch LR scheduler over `optimizer` for `total` steps, or None for a constant lr.

        Call its `step()` after each `optimizer.step()`: before step `s` the
        groups' lr is `base * f(s)`. The groups' current `lr` is the base.
        """
        import warnings

        from torch.optim import lr_scheduler as L

        w = self.warmup_steps
        decay = self.kind != "constant"
        if w <= 1 and not decay:
            return None
        lrs = {g.get("lr") for g in optimizer.param_groups}
        if None in lrs:
            raise ConfigError("train.schedule needs every parameter group to have an 'lr'")
        if self.kind == "cosine" and self.min_factor > 0 and len(lrs) > 1:
            raise ConfigError("train.schedule: a cosine schedule with min_factor > 0 needs one lr for all parameter groups")
        span = max(1, total - w)
        parts = []
        if w > 1:  # epoch e = s - 1 of the warm-up: (e + 1) / w
            parts.append(L.LinearLR(optimizer, start_factor=1.0 / w, end_factor=1.0, total_iters=w - 1))
        if self.kind == "cosine":
            parts.append(L.CosineAnnealingLR(optimizer, T_max=span, eta_min=self.min_factor * next(iter(lrs))))
        elif self.kind == "linear":
            parts.append(L.LinearLR(optimizer, start_factor=1.0, end_factor=self.min_factor, total_iters=span))
        # the decay starts at factor 1 at step s = w (epoch w - 1)
        sched = parts[0] if len(parts) == 1 else L.SequentialLR(optimizer, parts, milestones=[w - 1])
        if w == 0:  # no warm-up: step 1 is already one step into the decay
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                sched.step()
        return sched


class TrainConfig(_Strict):
    """The training loop."""

    steps: int = Field(300, ge=1, le=INT64_MAX)
    batch_size: int = Field(32, ge=1, le=INT64_MAX)
    seed: int = Field(0, ge=0, le=SEED_MAX, description="seeds torch and the task's data (an unsigned 64-bit integer)")
    seeds: list[Annotated[int, Field(ge=0, le=SEED_MAX)]] | None = Field(
        None, min_length=1, description="the seeds `modopt compare` / `modopt sweep` run (default: [seed]); `modopt run` uses `seed`")
    eval_every: int = Field(0, ge=0, le=INT64_MAX, description="evaluate on held-out data every N steps (0: only at the end)")
    checkpoint_every: int = Field(0, ge=0, le=INT64_MAX, description="save a checkpoint every N steps (0: only at the end)")
    threads: int = Field(1, ge=1, le=THREADS_MAX, description="torch intra-op threads; 1 keeps runs bit-reproducible")
    schedule: Schedule = Field(default_factory=Schedule)
    rewind: RewindConfig | None = Field(
        None, description="rewind past loss spikes (modopt.Rewind; docs/howto/rewind.md): snapshots every `every` steps, "
        "and on a trigger the run goes back to the last one and skips the batches of the rewound window (null: off)")

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int] | None) -> list[int] | None:
        if seeds is not None and len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds must be distinct, got {seeds}")
        return seeds


class OutputConfig(_Strict):
    """Where and what to write."""

    dir: str | None = Field(None, description="run directory (default runs/<name>-<time>); --out overrides")
    plots: bool = True
    tensorboard: bool = Field(False, description="also write TensorBoard event files into <run dir>/tensorboard "
                              "(needs the tensorboard package: pip install 'torch-modopt[tensorboard]')")
    read_every: int = Field(50, ge=1, le=CAPACITY_MAX, description="read the step telemetry back from the device every N "
                            "steps (and at each checkpoint and the end): one host copy per read, none in between")


#: a run label becomes a directory name (`runs/<name>-<time>`, `<out>/<variant>/seed-N`): under the
#: usual 255-byte file-name limit with the time stamp and a variant added
NAME_MAX = 120


def check_name(name: str, what: str) -> str:
    """`name`, refused unless it is one plain directory name: no path separator, not `.` or `..`, no
    NUL, not empty, at most `NAME_MAX` characters. A name is a label; `--out` says where runs go."""
    bad = None
    if not name or not name.strip():
        bad = "is empty"
    elif "/" in name or "\\" in name:
        bad = "contains a path separator"
    elif name in (".", ".."):
        bad = "is a relative directory"
    elif "\x00" in name or any(ord(c) < 32 for c in name):
        bad = "contains a control character"
    elif len(name) > NAME_MAX:
        bad = f"is {len(name)} characters long (at most {NAME_MAX})"
    if bad:
        raise ValueError(f"{what} {name!r} {bad}: it names a run directory, so it must be one plain name "
                         "(letters, digits, '-', '_', '.'); choose where runs go with --out")
    return name


class Experiment(_Strict):
    """A whole experiment: task, optimizer pipeline(s), training loop, output."""

    name: str = "experiment"
    task: TaskConfig = Field(default_factory=TaskConfig)
    optimizer: PipelineConfig | None = None
    variants: dict[str, PipelineConfig] | None = None
    train: TrainConfig = Field(default_factory=TrainConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        return check_name(name, "the name")

    @field_validator("variants")
    @classmethod
    def _plain_variant_names(cls, variants):
        for key in variants or {}:
            check_name(key, "the variant name")
        return variants

    @model_validator(mode="after")
    def _one_optimizer_source(self):
        if self.optimizer is None and not self.variants:
            raise ValueError("an experiment needs 'optimizer' (a pipeline) or 'variants' (name -> pipeline)")
        if self.optimizer is not None and self.variants:
            raise ValueError("give either 'optimizer' or 'variants', not both")
        if self.optimizer is not None and not self.optimizer.transforms:
            raise ValueError("optimizer.transforms is empty: a pipeline needs at least an optimizer transform")
        return self

    def pipelines(self) -> dict[str, PipelineConfig]:
        """`{label: pipeline}`: the one optimizer (labelled by the experiment name) or every variant."""
        if self.optimizer is not None:
            return {self.name: self.optimizer}
        return dict(self.variants or {})

    def select(self, variant: str | None) -> "Experiment":
        """This experiment with a single `optimizer` (the named variant when it has variants)."""
        if self.optimizer is not None:
            if variant is not None:
                raise ConfigError(f"experiment {self.name!r} has no variants; drop --variant")
            return self
        assert self.variants
        if variant is None:
            if len(self.variants) > 1:
                raise ConfigError(
                    f"experiment {self.name!r} has several variants ({', '.join(self.variants)}); "
                    "choose one with --variant NAME, or run them all with `modopt compare`"
                )
            variant = next(iter(self.variants))
        if variant not in self.variants:
            from ..core.transform import did_you_mean

            raise ConfigError(
                f"unknown variant {variant!r}{did_you_mean(variant, self.variants)}; "
                f"this experiment has: {', '.join(self.variants)}"
            )
        return self.model_copy(update={"name": f"{self.name}-{variant}", "optimizer": self.variants[variant], "variants": None})

    def to_dict(self) -> dict[str, Any]:
        """The experiment as plain data (name, task, optimizer, variants, then the other fields)."""
        data = self.model_dump(mode="json", exclude={"optimizer", "variants"})
        out: dict[str, Any] = {"name": data.pop("name")}
        out["task"] = data.pop("task")
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.to_dict()
        if self.variants:
            out["variants"] = {k: v.to_dict() for k, v in self.variants.items()}
        out.update(data)
        return out

    def to_yaml(self) -> str:
        """The experiment as YAML text (`to_dict()`)."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def default_experiment() -> Experiment:
    """What `modopt run` trains without a config.

    ZClip in front of Adam on the tiny-transformer copy task at an aggressive
    learning rate (`examples/configs/transformer_zclip.yaml`): 600 steps,
    a few seconds on 2 CPU cores.
    """
    return Experiment.model_validate(
        {
            "name": "default",
            "task": {"name": "transformer", "options": {}},
            "optimizer": {"transforms": [_default_clip(), {"type": "Adam", "lr": 0.02, "betas": [0.9, 0.99]}]},
            "train": {
                "steps": 600, "batch_size": 32, "seed": 0, "eval_every": 100, "checkpoint_every": 200,
                "schedule": {"kind": "constant", "warmup_steps": 50},
            },
        }
    )


def _default_clip() -> dict[str, Any]:
    from ..core.registry import available

    return {"type": "ZClip", "max_grad_norm": None} if "ZClip" in available() else {"type": "ClipNorm", "max_norm": 1.0}


def experiment_from_data(data: Any, source: str, trust_imports: bool = False) -> Experiment:
    """Validate plain data as an `Experiment`; errors name `source` and the field path."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: an experiment config must be a mapping, got {type(data).__name__}")
    try:
        with _trust(trust_imports):
            return Experiment.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, data, Experiment)) from None


def load_experiment(path: str | Path, trust_imports: bool = False) -> Experiment:
    """Read an experiment from YAML / JSON / TOML.

    A bare pipeline file (`transforms: [...]`) is accepted too: it becomes the
    optimizer of the default experiment. `path` may name a shipped example
    config instead (`transformer_zclip`, see `modopt examples`); a path that
    exists wins.
    """
    path = find_config(path)
    data = read_config(path)
    if isinstance(data, dict) and "transforms" in data and "optimizer" not in data and "variants" not in data:
        try:  # errors name the pipeline's own fields (transforms.0.max_norm), as in the file
            PipelineConfig.from_dict(data, trust_imports=trust_imports)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, str(path), data, PipelineConfig)) from None
        base = default_experiment().to_dict()
        base["optimizer"] = data
        base["name"] = Path(path).stem
        data = base
    elif isinstance(data, dict) and "name" not in data:
        data = {**data, "name": Path(path).stem}
    return experiment_from_data(data, str(path), trust_imports)


def experiment_schema() -> dict[str, Any]:
    """JSON schema of an experiment file, with the pipeline schema of every registered transform."""
    from ..config import config_schema

    pipe = config_schema()
    defs = dict(pipe.pop("$defs", {}))
    pipe.pop("title", None)
    defs["PipelineConfig"] = pipe
    props: dict[str, Any] = {"name": {"type": "string", "default": "experiment", "description": "run label"}}
    for field, model in (("task", TaskConfig), ("train", TrainConfig), ("output", OutputConfig)):
        sub = model.model_json_schema(ref_template="#/$defs/{model}")
        defs.update(sub.pop("$defs", {}))
        defs[model.__name__] = sub
        props[field] = {"$ref": f"#/$defs/{model.__name__}"}
    props["optimizer"] = {"$ref": "#/$defs/PipelineConfig", "description": "the optimizer pipeline"}
    props["variants"] = {
        "type": "object",
        "additionalProperties": {"$ref": "#/$defs/PipelineConfig"},
        "description": "several named pipelines instead of 'optimizer' (for modopt compare)",
    }
    return {
        "title": "modopt experiment config",
        "description": (Experiment.__doc__ or "").strip(),
        "type": "object",
        "properties": props,
        "additionalProperties": False,
        "oneOf": [{"required": ["optimizer"]}, {"required": ["variants"]}],
        "$defs": defs,
    }


def apply_overrides(exp: Experiment, args: Any) -> Experiment:
    """`exp` with the command line's `--steps` / `--seed` (attributes of `args`, None when not given)."""
    train = {}
    if getattr(args, "steps", None) is not None:
        train["steps"] = args.steps
    if getattr(args, "seed", None) is not None:
        train["seed"] = args.seed
    if not train:
        return exp
    data = exp.to_dict()
    data["train"] = {**data["train"], **train}
    return experiment_from_data(data, "command line")
