"""`Modular`: a real ``torch.optim.Optimizer`` that runs a chain of transforms."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from .pipeline import apply_nonfinite_policy, collect, run_chain
from .transform import Transform, plain_input, to_plain, walk

#: the checkpoint format ``state_dict`` writes (``sd["modopt"]["format_version"]``)
FORMAT_VERSION = 1
#: ``MIGRATIONS[n]`` upgrades a state dict of format ``n`` to format ``n + 1``.
#: When a change to ``state_dict`` bumps ``FORMAT_VERSION`` to ``n + 1``, register
#: here the function that rewrites an ``n`` checkpoint (renamed keys, new
#: buffers with their initial values, ...). It must return a new dict and never
#: modify its argument; ``load_state_dict`` runs the chain ``n -> n+1 -> ...``
#: before any check, so an old checkpoint is validated as a current one.
MIGRATIONS: dict[int, Callable[[dict], dict]] = {}
_GROUP_BASE_KEYS = {"params", "param_names"}


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two plain-data trees first differ, as ``path: a != b``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}{k}: {'missing' if k not in a else a[k]!r} != {'missing' if k not in b else b[k]!r}"
            d = _first_difference(a[k], b[k], f"{path}{k}.")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path.rstrip('.')}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}{i}.")
            if d:
                return d
        return None
    return None if a == b else f"{path.rstrip('.')}: {a!r} != {b!r}"


def migrate(sd: dict[str, Any], version: int) -> dict[str, Any]:
    """Upgrade a state dict of format ``version`` to :data:`FORMAT_VERSION` through :data:`MIGRATIONS`."""
    while version < FORMAT_VERSION:
        step = MIGRATIONS.get(version)
        if step is None:
            raise ValueError(
                f"load_state_dict: no migration from checkpoint format_version {version} to {version + 1} "
                f"(this modopt writes {FORMAT_VERSION})"
            )
        sd = step(sd)
        version += 1
        got = sd.get("modopt", {}).get("format_version") if isinstance(sd, dict) else None
        if got != version:
            raise ValueError(f"load_state_dict: the migration to format_version {version} returned format {got!r}")
    return sd


class Modular(torch.optim.Optimizer):
    """An optimizer made of transforms.

    ``Modular(params, *transforms, nonfinite="skip", **group_defaults)``

    * ``params``: tensors, param-group dicts, or ``named_parameters()`` pairs.
    * ``transforms``: run in order on the gradient; the update after the last one
      is subtracted from the parameters. Optimizer transforms (``Adam``, ``SGD``,
      ``LR``, ...) expose their hyperparameters as param-group keys (``lr``,
      ``betas``, ``momentum``, ``weight_decay``, ...), so torch's schedulers and
      per-group overrides work as with any torch optimizer.
    * ``nonfinite``: what a step with an inf/NaN gradient does: ``"skip"``
      (default; parameters and every transform's state stay as they were, and
      ``opt.stats["skipped_steps"]`` counts it), ``"raise"``, ``"zero"`` (non-finite
      elements become 0) or ``"ignore"`` (no check, no host sync).
    * ``group_defaults``: defaults for the exposed group keys (``lr=0.1``).

    For frameworks that build the optimizer from keywords (HF Trainer's
    ``optimizer_cls_and_kwargs``, Hydra's ``_partial_: true``), the pipeline may
    come by name instead: ``transforms=[...]`` (transforms or their
    ``{"type": ...}`` dicts) or ``config=`` (a :class:`~modopt.PipelineConfig`,
    its dict or ``DictConfig``, or a config file path; its ``nonfinite`` and
    ``defaults`` apply, and keyword group defaults override them).
    """

    def __init__(
        self,
        params: Iterable[Any],
        *transforms: Transform,
        nonfinite: str | None = None,
        config: Any = None,
        **group_defaults: Any,
    ):
        from ..config import PipelineConfig, load_config

        transforms, nonfinite, group_defaults = _pipeline_arguments(
            transforms, nonfinite, config, plain_input(group_defaults), load_config
        )
        for i, t in enumerate(transforms):
            if not isinstance(t, Transform):
                raise TypeError(f"Modular: transform #{i} is {type(t).__name__}, not a modopt Transform")
        self._pipeline = PipelineConfig(transforms=list(transforms), nonfinite=nonfinite, defaults=group_defaults)
        self.transforms: tuple[Transform, ...] = tuple(transforms)
        self._keys = [k for k, _ in walk(self.transforms)]
        _check_last(self.transforms)
        hyper: dict[str, Any] = {}
        owner: dict[str, str] = {}
        for key, t in walk(self.transforms):
            for k, v in t.hyperparams().items():
                if k in hyper:
                    raise ValueError(
                        f"param-group key {k!r} is exposed by both {owner[k]} and {key}; "
                        "put one of them in its own Modular or use LR for the other"
                    )
                hyper[k], owner[k] = v, key
        unknown = sorted(set(group_defaults) - set(hyper))
        if unknown:
            raise TypeError(
                f"Modular got unknown hyperparameter(s) {unknown}; the transforms expose: {sorted(hyper) or 'none'}"
            )
        self._store: dict[str, dict] = {}
        self._runtime: dict[str, dict] = {}
        self._skipped_steps = torch.zeros((), dtype=torch.int64)
        self.stats: dict[str, torch.Tensor] = {}
        super().__init__(params, {**hyper, **group_defaults})

    # --- torch.optim.Optimizer contract -------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        unknown = sorted(set(param_group) - _GROUP_BASE_KEYS - set(self.defaults))
        if unknown:
            raise ValueError(
                f"unknown param-group key(s) {unknown}; this pipeline accepts: "
                f"{sorted(set(self.defaults)) or 'no hyperparameters'}"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimisation step; returns the closure's loss like torch's optimizers."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stats: dict[str, torch.Tensor] = {}
        ctx = collect(self, self.param_groups, stats)
        if ctx.params:
            grads = [p.grad for p in ctx.params]
            if apply_nonfinite_policy(self._pipeline.nonfinite, ctx, grads):
                run_chain(self, ctx, self.transforms, write=True)
                stats["skipped"] = torch.zeros((), dtype=torch.bool)
            else:
                self._skipped_steps += 1
                stats["skipped"] = torch.ones((), dtype=torch.bool)
        stats["skipped_steps"] = self._skipped_steps.clone()
        self.stats = stats
        return loss

    # --- state host ------------------------------------------------------------
    def transform_store(self, key: str) -> dict:
        return self._store.setdefault(key, {})

    def runtime_store(self, key: str) -> dict:
        return self._runtime.setdefault(key, {})

    # --- configs ---------------------------------------------------------------
    @property
    def config(self) -> "PipelineConfig":  # noqa: F821
        """The :class:`~modopt.PipelineConfig` that rebuilds this optimizer."""
        return self._pipeline

    @classmethod
    def from_config(cls, params: Iterable[Any], config: Any, trust_imports: bool = False) -> "Modular":
        """Build from a :class:`~modopt.PipelineConfig`, its dict or OmegaConf ``DictConfig``, or a config file path."""
        from ..config import load_config

        return load_config(config, trust_imports=trust_imports).build(params)

    # --- checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["modopt"] = {
            "format_version": FORMAT_VERSION,
            "config": self._pipeline.to_dict(),
            "transforms": {k: dict(v) for k, v in self._store.items()},
            "skipped_steps": self._skipped_steps,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint of the same pipeline and parameter layout.

        Everything is checked before anything changes: on any error the
        optimizer is left exactly as it was.
        """
        new_state, new_groups, new_store, skipped = self._prepare_load(state_dict)
        self.state.clear()
        self.state.update(new_state)
        self.param_groups[:] = new_groups
        self._store = new_store
        self._skipped_steps = skipped
        self._runtime.clear()

    def _prepare_load(self, sd: Any):
        if not isinstance(sd, dict) or not {"state", "param_groups"} <= set(sd):
            raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups' (an optimizer state_dict)")
        meta = sd.get("modopt")
        if not isinstance(meta, dict):
            raise ValueError("load_state_dict: this state dict was not written by modopt.Modular (no 'modopt' entry)")
        version = meta.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION or version < 1:
            raise ValueError(f"load_state_dict: unsupported checkpoint format_version {version!r} (this modopt reads <= {FORMAT_VERSION})")
        if version < FORMAT_VERSION:
            sd = migrate(sd, version)
            meta = sd["modopt"]
        diff = _first_difference(to_plain(meta.get("config")), self._pipeline.to_dict())
        if diff is not None:
            raise ValueError(f"load_state_dict: the checkpoint's pipeline differs from this optimizer's: config.{diff}")
        saved_groups = sd["param_groups"]
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: the checkpoint has {len(saved_groups) if isinstance(saved_groups, list) else '?'} "
                f"param groups, this optimizer {len(self.param_groups)}"
            )
        index: dict[int, torch.Tensor] = {}
        new_groups = []
        for gi, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if not isinstance(sg, dict) or not isinstance(sg.get("params"), list):
                raise ValueError(f"load_state_dict: param group {gi} of the checkpoint is malformed")
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(
                    f"load_state_dict: param group {gi} has {len(sg['params'])} parameters in the checkpoint, "
                    f"{len(g['params'])} here"
                )
            unknown = sorted(set(sg) - _GROUP_BASE_KEYS - set(self.defaults) - _SCHEDULER_KEYS)
            if unknown:
                raise ValueError(f"load_state_dict: param group {gi} has unknown key(s) {unknown}")
            for idx, p in zip(sg["params"], g["params"]):
                index[idx] = p
            ng = {k: copy.deepcopy(v) for k, v in sg.items() if k != "params"}
            ng["params"] = g["params"]
            if "param_names" in g:
                ng["param_names"] = g["param_names"]
            new_groups.append(ng)
        state = sd["state"]
        if not isinstance(state, dict):
            raise ValueError("load_state_dict: 'state' must be a dict")
        prefixes = tuple(self._keys)
        new_state: dict[torch.Tensor, dict] = {}
        for idx, entry in state.items():
            if idx not in index:
                raise ValueError(f"load_state_dict: state for parameter index {idx!r}, which no param group holds")
            p = index[idx]
            if not isinstance(entry, dict):
                raise ValueError(f"load_state_dict: state of parameter {idx} is not a dict")
            for k in entry:
                if not (isinstance(k, str) and k.split(".", 1)[0] in prefixes):
                    raise ValueError(f"load_state_dict: state key {k!r} of parameter {idx} belongs to no transform of this pipeline")
            _check_buffers(entry, p, self.state.get(p), idx)
            new_state[p] = _copy_state(entry, p, f"parameter {idx}")
        store = meta.get("transforms", {})
        if not isinstance(store, dict) or any(k not in prefixes for k in store):
            bad = [k for k in store if k not in prefixes] if isinstance(store, dict) else store
            raise ValueError(f"load_state_dict: transform state for unknown key(s) {bad}")
        device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
        new_store = {k: _copy_state(v, None, f"transform {k}", device) for k, v in store.items()}
        skipped = meta.get("skipped_steps", torch.zeros((), dtype=torch.int64))
        if not isinstance(skipped, torch.Tensor):
            raise ValueError("load_state_dict: skipped_steps must be a tensor")
        return new_state, new_groups, new_store, skipped.clone()

    # --- pickling / deepcopy -------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_runtime"] = {}
        return d

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)

    def __repr__(self) -> str:
        inner = ", ".join(repr(t) for t in self.transforms)
        return f"Modular({inner}; {len(self.param_groups)} param group(s))"


def _pipeline_arguments(transforms: tuple, nonfinite: Any, config: Any, group_defaults: dict, load_config) -> tuple:
    """The pipeline given positionally, by ``transforms=`` or by ``config=``, as (transforms, nonfinite, defaults)."""
    by_name = group_defaults.pop("transforms", None)
    given = [w for w, v in (("positional transforms", transforms or None), ("transforms=", by_name), ("config=", config))
             if v is not None]
    if len(given) > 1:
        raise TypeError(f"Modular: give the pipeline one way, not by {' and '.join(given)}")
    if by_name is not None:
        if isinstance(by_name, (Transform, dict)) or not isinstance(by_name, (list, tuple)):
            raise TypeError(f"Modular: transforms= takes a list of transforms, not {type(by_name).__name__}")
        transforms = tuple(t if isinstance(t, Transform) else Transform.from_dict(t) if isinstance(t, dict) else t
                           for t in by_name)
    if config is not None:
        cfg = load_config(config)
        transforms = tuple(cfg.transforms)
        nonfinite = cfg.nonfinite if nonfinite is None else nonfinite
        group_defaults = {**cfg.defaults, **group_defaults}
    if not transforms:
        raise ValueError(
            "Modular needs at least one transform, the last one making the step: for example "
            "mo.Modular(params, mo.AdamW(lr=1e-3)) or mo.Modular(params, mo.ClipNorm(1.0), mo.SGD(lr=0.1)) "
            "(or transforms=[...] / config=... by name)"
        )
    return transforms, "skip" if nonfinite is None else nonfinite, group_defaults


def _check_last(transforms: tuple[Transform, ...]) -> None:
    """Transforms that must end the chain (they write the parameters themselves) do."""
    tail: set[int] = set()
    t = transforms[-1] if transforms else None
    while t is not None:
        tail.add(id(t))
        kids = t.children()
        t = kids[-1] if kids else None
    for key, t in walk(transforms):
        if getattr(t, "must_be_last", False) and id(t) not in tail:
            raise ValueError(f"{key}: {type(t).__name__} must be the last transform of the pipeline")


#: keys torch's LR schedulers add to param groups
_SCHEDULER_KEYS = {"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "initial_momentum"}


def _check_buffers(entry: dict, p: torch.Tensor, current: dict | None, idx: Any) -> None:
    """Refuse per-parameter buffers that cannot belong to ``p`` (before anything changes).

    A buffer is 0-d (a counter, a per-tensor value), shaped like the parameter,
    or a per-slice value (the parameter's shape with reduced dims of size 1);
    only histories (``*.history``) are 1-D of any length. Where this optimizer
    already holds the same buffer, the loaded one must have its shape and dtype.
    """
    for k, v in entry.items():
        if not isinstance(v, torch.Tensor):
            continue
        where = f"load_state_dict: buffer {k!r} of parameter {idx} (shape {tuple(p.shape)})"
        if v.is_complex() or v.is_sparse:
            raise ValueError(f"{where} is {'complex' if v.is_complex() else 'sparse'}")
        history = k.endswith("history")
        if v.dim() and not history:
            if v.dim() != p.dim() or any(a not in (b, 1) for a, b in zip(v.shape, p.shape)):
                raise ValueError(f"{where} has shape {tuple(v.shape)}, which does not fit the parameter")
        if history and v.dim() != 1:
            raise ValueError(f"{where} must be 1-D, got shape {tuple(v.shape)}")
        old = current.get(k) if current else None
        if isinstance(old, torch.Tensor):
            if old.dtype != v.dtype:
                raise ValueError(f"{where} has dtype {v.dtype}, this optimizer's is {old.dtype}")
            if not history and old.shape != v.shape:
                raise ValueError(f"{where} has shape {tuple(v.shape)}, this optimizer's is {tuple(old.shape)}")


def _copy_state(value: Any, p: torch.Tensor | None, where: str, device: torch.device | None = None) -> Any:
    """Deep copy of saved state onto the parameter's device, dtypes kept (bit-exact resume)."""
    if isinstance(value, torch.Tensor):
        target = p.device if p is not None else device
        return value.detach().to(device=target, copy=True)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if isinstance(k, str) and k.endswith("step") and isinstance(v, torch.Tensor):
                out[k] = v.detach().clone()
            else:
                out[k] = _copy_state(v, p, where, device)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_state(v, p, where, device) for v in value)
    if value is None or isinstance(value, (int, float, bool, str)):
        return value
    raise ValueError(f"load_state_dict: unsupported value of type {type(value).__name__} in the state of {where}")
