"""`Modular`, a real `torch.optim.Optimizer` that runs a chain of transforms.

Its pipeline as data is a `PipelineConfig` (`modopt.core.pipeline_config`); the format of its
checkpoints and their upgrades live in `modopt.core.checkpoint`.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch

from .checkpoint import (FORMAT_VERSION, GROUP_ENTRY, StateLoader, encode_history, history_keys, missing_message,
                         missing_state, param_inventory, structure_difference, upgrade, value_differences)
from .runner import Stepping, _LastStep
from .skip_limit import SkipLimit, consecutive_skips_ok
from . import distributed
from .hyper import GroupGate
from .keys import inventory_key, split_group_key
from .torch_checkpoint import as_modular_state_dict, caller_stacklevel, is_torch_state_dict
from .partitions import check_flat_partitions
from .select import check_selections, route_group
from .pipeline_config import PipelineConfig, load_config
from .plan import LintWarning, Plan, lint_findings, make_plan
from .roles import Optimizer
from .transform import Transform, plain_input, to_plain, walk
from .moments import Link



class Modular(Stepping):
    """An optimizer made of transforms.

    `Modular(params, *transforms, nonfinite=None, config=None, lint=True, stage_group=None,
    max_consecutive_skips=None, **group_defaults)`

    * `params`: tensors, param-group dicts, or `named_parameters()` pairs.
    * `transforms`: run in order on the gradient; the update after the last one
      is subtracted from the parameters. Optimizer transforms (`Adam`, `SGD`,
      `LR`, ...) expose their hyperparameters as param-group keys (`lr`,
      `betas`, `momentum`, `weight_decay`, ...), so torch's schedulers and
      per-group overrides work as with any torch optimizer.
    * `nonfinite`: what a step with an inf/NaN gradient does (None: the config's, else
      `"skip"`): `"skip"` (parameters and every transform's state stay as they were, and
      `opt.stats["skipped_steps"]` counts it), `"raise"`, `"zero"` (non-finite
      elements become 0) or `"ignore"` (no check, no host sync).
    * `lint`: warn (`mo.LintWarning`, once, when built) about transforms that
      provably have no effect (`cfg.lint()`); `False` builds silently.
    * `stage_group`: under pipeline parallelism, the process group of the stages (one
      optimizer per stage, each over its stage's parameters): global statistics (a
      global `ClipNorm`'s norm, a global mean) and the non-finite decision then span
      every stage's parameters, the same on every stage (docs/howto/distributed.md).
      Every stage must call `step()` each time (each all-gathers its totals).
    * `max_consecutive_skips`: stop with `SkipLimitError` after this many skipped steps in a row
      (None: the config's, else no limit; `modopt.core.skip_limit`, read a step late on a GPU).
    * `group_defaults`: defaults for the exposed group keys (`lr=0.1`).

    For frameworks that build the optimizer from keywords (HF Trainer's
    `optimizer_cls_and_kwargs`, Hydra's `_partial_: true`), the pipeline may
    come by name instead: `transforms=[...]` (transforms or their
    `{"type": ...}` dicts) or `config=` (a `PipelineConfig`,
    its dict or `DictConfig`, or a config file path; its `nonfinite` and
    `defaults` apply, and keyword group defaults override them).
    """


    def __init__(
        self,
        params: Iterable[Any],
        *transforms: Transform,
        nonfinite: str | None = None,
        config: Any = None,
        lint: bool = True,
        stage_group: Any = None,
        max_consecutive_skips: int | None = None,
        **group_defaults: Any,
    ):
        transforms, nonfinite, group_defaults = _pipeline_arguments(
            transforms, nonfinite, config, plain_input(group_defaults), load_config
        )
        if config is not None and max_consecutive_skips is None:  # (the config's, as its nonfinite)
            max_consecutive_skips = load_config(config).max_consecutive_skips
        for i, t in enumerate(transforms):
            if not isinstance(t, Transform):
                raise TypeError(f"Modular: transform #{i} is {type(t).__name__}, not a modopt Transform")
        if stage_group is not None:
            import torch.distributed as dist

            if not (dist.is_available() and isinstance(stage_group, dist.ProcessGroup)):
                raise TypeError("Modular: stage_group must be the torch.distributed process group of the pipeline "
                                f"stages (a ProcessGroup) or None, got {type(stage_group).__name__}")
        self._pipeline = PipelineConfig.of("Modular", transforms=list(transforms), nonfinite=nonfinite,
                                           defaults=group_defaults, max_consecutive_skips=max_consecutive_skips)
        self.transforms: tuple[Transform, ...] = tuple(transforms)
        # everything about the whole pipeline, decided once (a pipeline that cannot run fails here, before
        # anything is built); the step reads it
        self.plan: Plan = make_plan(self.transforms, self._pipeline.nonfinite, stage_group=stage_group)
        self._keys = list(self.plan.keys)
        #: the consecutive-skip limit (`max_consecutive_skips`), or None
        self.skip_limit: SkipLimit | None = SkipLimit.of(self._pipeline.max_consecutive_skips, self.plan)
        hyper: dict[str, Any] = {}
        owner: dict[str, str] = {}
        self._routes = self.plan.routes  # optimizer transforms in Masked branches (None: no routing)
        routed = {key for key, _, _ in self._routes or ()}
        for key, t in walk(self.transforms):
            for k, v in (t.hyperparams() if isinstance(t, Optimizer) else {}).items():
                if k in hyper and key in routed and owner[k] in routed:
                    continue  # shared by routed branches: one value per param group (see route_group)
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
        self._last = _LastStep()
        self._group_defaults = dict(group_defaults)
        self._gate = GroupGate(self.transforms)
        self._selections_checked = False  # add_param_group leaves the names to the check below
        self._lint = lint
        super().__init__(params, {**hyper, **group_defaults})
        # the names the selections (Masked's where, AGC's exclude) ask for, against every group's parameter
        # names at once, before any state exists: a typo fails here, not at the first step (check_selections)
        check_selections(self.transforms, list(enumerate(self.param_groups)))
        self._selections_checked = True
        self._check_params([(n, p) for g in self.param_groups
                            for n, p in zip(g.get("param_names") or [None] * len(g["params"]), g["params"])])
        self._set_per_mesh()
        if lint:  # what provably has no effect, told once, now (`modopt.lint`; lint=False to build silently)
            self._warn_lint()
        # the skipped-step count lives where the step decides (a copy to the GPU each step would be a sync,
        # and a compiled step cannot move it)
        self._skipped_steps = self._skipped_steps.to(_counter_device(self.param_groups))

    def _set_per_mesh(self) -> None:
        """The step's torch function mode when the parameters lie on several meshes (`distributed.meshes_mixed`),
        else None: worked out here, when the parameters change, never in a step."""
        ps = [p for g in self.param_groups for p in g["params"]]
        self._per_mesh = distributed.per_mesh_mode() if distributed.meshes_mixed(ps) else None

    def _check_params(self, named: list[tuple[str | None, torch.Tensor]]) -> None:
        """What a transform refuses about the parameters (a device, a dtype, a layout over the ranks) and what it
        warns of (a reading it was not told; lint=False builds silently), then flat partitions (a shape-reading
        rule on a 1-D shard: refused, not wrong): when built and for each group added after, before any state."""
        with warnings.catch_warnings():
            if not self._lint:
                warnings.simplefilter("ignore", LintWarning)
            for t in self.transforms:
                t.check_params(named)
        check_flat_partitions(self.transforms, named)

    def _warn_lint(self) -> None:
        for f in lint_findings(self.plan.transforms, self.plan.nonfinite):
            warnings.warn(f"{f} (modopt.LintWarning: Modular(..., lint=False) or a warnings filter "
                          "silences it)", LintWarning, stacklevel=caller_stacklevel())

    # --- torch.optim.Optimizer contract -------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's `add_param_group`: keys this pipeline does not use are kept, as torch.optim does
        (SWALR's `swa_lr`, Lightning's `name`, timm's `lr_scale`), and saved in checkpoints."""
        if isinstance(param_group, dict) and GROUP_ENTRY in param_group:
            raise ValueError(f"param-group key {GROUP_ENTRY!r} is reserved: state_dict() uses it to carry the transform state")
        given = set(param_group)
        with warnings.catch_warnings():  # torch only warns about duplicates; the check below refuses them
            warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate parameters")
            super().add_param_group(param_group)
        try:
            _check_no_duplicates(self.param_groups[-1], len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()
            raise
        gate, before = self._gate, self._gate.bound
        try:
            if self._routes is not None:
                route_group(self._routes, self.param_groups[-1], len(self.param_groups) - 1,
                            given | set(self._group_defaults))
            # (the bound of values follows the parameters' dtypes: a float32 group after float64 ones lowers it)
            gate.bound = gate.admit(self.param_groups[-1]["params"], len(self.param_groups) - 1)
            gate.check(self.param_groups[-1], len(self.param_groups) - 1, given)
            if self.__dict__.get("_selections_checked", True):  # a group added after the build: its names
                check_selections(self.transforms, [(len(self.param_groups) - 1, self.param_groups[-1])],
                                 patterns=False)
                g = self.param_groups[-1]
                self._check_params(list(zip(g.get("param_names") or [None] * len(g["params"]), g["params"])))
                self._set_per_mesh()
        except Exception:
            gate.bound = before
            self.param_groups.pop()
            raise
        if gate.bound != before:
            gate.checked = []  # every group's values against the new bound at the next step

    # --- train and eval forms of the parameters (Schedule-Free) -----------------------------------------
    @property
    def train(self) -> Callable[[], None]:
        """`opt.train()`: put the parameters in their training form (Schedule-Free's `y`, where the gradient
        is taken), as `schedulefree`'s optimizers do; nothing when they hold it already. Call it before
        training steps after `opt.eval()`. A pipeline without a transform that has such forms has no
        `train` attribute: `AttributeError` saying so (frameworks that look for `optimizer.train`, as
        the Hugging Face Trainer and accelerate do, then leave the optimizer alone)."""
        self._swapping("train")
        return functools.partial(self._swap_weights, "train")

    @property
    def eval(self) -> Callable[[], None]:
        """`opt.eval()`: put the parameters in their evaluation form (Schedule-Free's average `x`), as
        `schedulefree`'s optimizers do; nothing when they hold it already. A step refuses to run until
        `opt.train()`. No such attribute on a pipeline without such a transform (see `train`)."""
        self._swapping("eval")
        return functools.partial(self._swap_weights, "eval")

    def evaluating(self) -> Any:
        """A context manager: the parameters in their evaluation form inside, back in the form they held
        outside (`opt.eval()` on entry, `opt.train()` on exit when they were in the training form; the two
        swaps round as `schedulefree`'s do). `AttributeError` on a pipeline without such a transform."""
        self._swapping("evaluating")
        return _Evaluating(self)

    def _swapping(self, what: str) -> None:
        if not self.plan.swaps:
            raise AttributeError(
                f"Modular.{what}: this pipeline has no transform whose parameters have a train and an eval form "
                "(Schedule-Free: mo.ScheduleFreeAdamW, mo.ScheduleFreeSGD), so there is nothing to swap; "
                "opt.train, opt.eval and opt.evaluating exist only on such pipelines"
            )

    @torch._disable_dynamo
    def _swap_weights(self, to: str) -> None:
        # every group's values through the gate first (the swap divides by the momentum: a NaN, a 0 or a
        # value the field refuses would reach the parameters), then every swap: a refusal changes nothing
        for i, g in enumerate(self.param_groups):
            try:
                self._gate.check(g, i)
            except (ValueError, TypeError) as e:
                forms = sorted({t.weights_mode(self, key) for key, t in self.plan.swaps})
                raise type(e)(f"opt.{to}(): {e}. Nothing was changed: the parameters still hold their "
                              f"{' and '.join(forms)} form") from None
        with torch.no_grad():
            for key, t in self.plan.swaps:
                t.swap_weights(self, key, to)  # type: ignore[arg-type]

    def add_step_tap(self, tap: Callable[[Any], None]) -> Any:
        """Call `tap(step)` in every step, after the non-finite check and before the transforms
        run (`step`: the `modopt.core.step.Step`, whose norm memo holds the gradients' per-tensor
        norms the check computed; what `tap` puts in `step.stats` reaches `opt.stats`). For
        telemetry (`modopt.History`); returns a handle whose `remove()` takes it out."""
        taps = self.__dict__.setdefault("_step_taps", OrderedDict())
        handle = torch.utils.hooks.RemovableHandle(taps)
        taps[handle.id] = tap
        return handle

    @property
    def cancelled_scales(self) -> frozenset[str]:
        """Keys of the transforms whose multiply a normalization right after cancels, and which the
        step therefore leaves out (the plan's, `modopt.core.plan.cancelled_scales`)."""
        return self.plan.cancelled

    @property
    def folded_scale(self) -> str | None:
        """The key of the transform whose global scale the final optimizer's fused kernel takes as its
        `grad_scale` (`Adam(fold_clip=True)`; the plan's, `modopt.core.plan.folded_scale`), or None."""
        return self.plan.folded

    @property
    def moment_links(self) -> dict[str, Link]:
        """Each transform that needs its optimizer's moments (SPAM), by key, with the optimizer transform
        that offers them (the plan's, `modopt.core.moments.link`)."""
        return dict(self.plan.moment_links)

    @property
    def _skip_on_device(self) -> bool:
        """`nonfinite="skip"` decides on the device: every transform keeps its state on a skipped step
        (the plan's answer; per step only where a transform's answer reads group values)."""
        found = self.plan.device_skip  # (decided when built, unless group values decide it)
        return found if found is not None else self.plan.skips_on_device(self.param_groups)

    # --- configs ---------------------------------------------------------------
    @property
    def config(self) -> PipelineConfig:
        """The `PipelineConfig` that rebuilds this optimizer."""
        return self._pipeline

    @classmethod
    def from_config(cls, params: Iterable[Any], config: Any, trust_imports: bool = False) -> "Modular":
        """Build from a `PipelineConfig`, its dict or OmegaConf `DictConfig`, or a config file path."""
        cfg = load_config(config, trust_imports=trust_imports)
        return cls(params, *cfg.transforms, nonfinite=cfg.nonfinite, max_consecutive_skips=cfg.max_consecutive_skips,
                   **cfg.defaults)

    # --- checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus modopt's entry (see docs/howto/checkpoints.md).

        `sd["modopt"]` holds the format version, the pipeline config, every
        transform's state and the skipped-step counter; the transform state and
        counter are also carried in `sd["param_groups"][0]["modopt"]` (the same
        tensors), which is what survives `torch.distributed.checkpoint`. The
        entry is added before any `register_state_dict_post_hook` hook runs.
        """
        user_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict([(-1, Modular._add_modopt_entry), *user_hooks.items()])
        try:
            return super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = user_hooks

    def _add_modopt_entry(self, sd: dict[str, Any]) -> None:
        store = {k: dict(v) for k, v in self._store.items()}
        per_param, store_hist = history_keys(self.transforms)
        if per_param:  # histories (1-D, any length) travel as lists: see checkpoint.encode_history
            for i, entry in list(sd["state"].items()):
                if isinstance(entry, dict) and any(k in per_param for k in entry):
                    sd["state"][i] = {k: encode_history(v) if k in per_param and isinstance(v, torch.Tensor) else v
                                      for k, v in entry.items()}
        skipped = self._skipped_steps.clone()  # (a compiled step counts in place)
        sd["modopt"] = {
            "format_version": FORMAT_VERSION,
            "config": self._pipeline.to_dict(),
            "transforms": store,
            "skipped_steps": skipped,
        }
        limit = self.skip_limit
        run = limit.counts.clone() if limit is not None and limit.counts is not None else None
        if run is not None:  # the run of skipped steps a resume continues (max_consecutive_skips)
            sd["modopt"]["consecutive_skips"] = run
        if sd["param_groups"]:
            sd["param_groups"][0][GROUP_ENTRY] = {
                "format_version": FORMAT_VERSION,
                "transforms": {
                    k: {n: encode_history(x) if split_group_key(n)[0] in store_hist.get(k, ()) and isinstance(x, torch.Tensor)
                        else x for n, x in v.items()}
                    for k, v in store.items()
                },
                "skipped_steps": skipped,
                **({"consecutive_skips": run} if run is not None else {}),
                # what the state holds, so a load through torch.distributed.checkpoint (which fills only the
                # slots its target state dict has) can tell when values were left behind
                # (torch lets `opt.state` hold entries that are not a parameter's: their values are kept as they are)
                "inventory": sorted({k for e in sd["state"].values() if isinstance(e, dict) for k in e}
                                    | {inventory_key(k, n) for k, v in store.items() for n in v}),
                # ... and which parameter held which (a load tells a parameter that never had state from a lost one)
                "param_keys": param_inventory(sd["state"], sd["param_groups"]),
            }

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any], *, strict: bool = True) -> None:
        """Load a checkpoint of a pipeline with the same structure and parameter layout.

        As with torch.optim, the param groups (`lr`, `betas`, extra keys)
        come from the checkpoint; the live transforms keep their other fields
        (a new `max_norm` applies from the next step). Hyperparameters that
        differ are reported in one `UserWarning`. Everything is checked
        before anything changes: on any error the optimizer is left exactly as
        it was. `register_load_state_dict_pre_hook`/`_post_hook` hooks run
        as in torch.

        A checkpoint that lacks state its writer held (the inventory it
        carries; without one, the state this optimizer holds) is refused
        naming each missing part; `strict=False` loads it, those parts
        restarting, with one `UserWarning` that names them.
        """
        if not isinstance(strict, bool):
            raise TypeError(f"load_state_dict: strict must be True or False, got {strict!r}")
        if not isinstance(state_dict, dict):
            raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups' (an optimizer state_dict)")
        state_dict = state_dict.copy()  # shallow, as torch
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        fresh = None
        from_torch = is_torch_state_dict(state_dict)
        if from_torch:  # a plain torch.optim checkpoint: continue a torch run
            state_dict, fresh = as_modular_state_dict(state_dict, self, FORMAT_VERSION)
        # (a torch.optim checkpoint has no inventory; its own warning names the transforms that start fresh)
        new_state, new_groups, new_store, skipped, run, notes, lost = self._prepare_load(
            state_dict, strict=strict, check_lost=not from_torch)
        if fresh:  # (only once everything was checked: a refused load warns about nothing)
            warnings.warn(fresh, UserWarning, stacklevel=caller_stacklevel())
        if lost:
            warnings.warn("load_state_dict(strict=False): the checkpoint lacks these parts of the state, which "
                          "restart from their initial values:\n  " + "\n  ".join(lost), UserWarning,
                          stacklevel=caller_stacklevel())
        if notes:
            warnings.warn(
                "load_state_dict: the checkpoint's hyperparameters differ from this optimizer's:\n  "
                + "\n  ".join(notes)
                + "\n(set opt.param_groups[i][key] after loading to change a group key)",
                UserWarning,
                stacklevel=3,  # the caller of load_state_dict (torch._disable_dynamo wraps it)
            )
        self.state.clear()
        self.state.update(new_state)
        self.param_groups[:] = new_groups
        self._store = new_store
        self._skipped_steps = skipped.to(self._skipped_steps.device)
        if self.skip_limit is not None:
            self.skip_limit.restore(run, self._skipped_steps.device)
        self._runtime.clear()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _prepare_load(self, sd: Any, strict: bool = True, check_lost: bool = True):
        """Everything `load_state_dict` assigns, checked: `(state, groups, store, skipped_steps, notes on
        hyperparameters, the parts that restart)`; raises before anything changes (with `strict`, also
        when a part would restart)."""
        if not isinstance(sd, dict) or not {"state", "param_groups"} <= set(sd):
            raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups' (an optimizer state_dict)")
        saved_groups = sd["param_groups"]
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: the checkpoint has {len(saved_groups) if isinstance(saved_groups, list) else '?'} "
                f"param groups, this optimizer {len(self.param_groups)}"
            )
        meta = sd.get("modopt")
        carried = saved_groups[0].get(GROUP_ENTRY) if saved_groups and isinstance(saved_groups[0], dict) else None
        if meta is None and isinstance(carried, dict):
            # torch.distributed.checkpoint keeps only 'state' and 'param_groups': the group-0 copy has the
            # transform state; the config is this optimizer's own (the structure is checked through the keys)
            meta = {**carried, "config": self._pipeline.to_dict()}
            sd = {**sd, "modopt": meta}
            dcp = True
        else:
            dcp = False
        if not isinstance(meta, dict):
            raise ValueError(
                "load_state_dict: this state dict was not written by modopt.Modular (no 'modopt' entry, "
                "neither at the top nor in param_groups[0])"
            )
        sd = upgrade(sd)  # (the format's version checked, an older one migrated)
        meta = sd["modopt"]
        saved_groups = sd["param_groups"]
        saved_cfg = to_plain(meta.get("config"))
        live_cfg = self._pipeline.to_dict()
        if not isinstance(saved_cfg, dict):
            raise ValueError("load_state_dict: the checkpoint's pipeline differs from this optimizer's: config is not a dict")
        diff = structure_difference(saved_cfg.get("transforms"), live_cfg["transforms"])
        if diff is not None:
            raise ValueError(f"load_state_dict: the checkpoint's pipeline differs from this optimizer's: config.{diff}")
        notes = value_differences(saved_cfg, live_cfg, self.transforms)
        index: dict[Any, torch.Tensor] = {}
        group_of: dict[Any, dict[str, Any]] = {}  # (the group each parameter steps with after the load)
        new_groups = []
        for gi, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if not isinstance(sg, dict) or not isinstance(sg.get("params"), list):
                raise ValueError(f"load_state_dict: param group {gi} of the checkpoint is malformed")
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(
                    f"load_state_dict: param group {gi} has {len(sg['params'])} parameters in the checkpoint, "
                    f"{len(g['params'])} here"
                )
            for idx, p in zip(sg["params"], g["params"]):
                index[idx] = p
            # torch's rule: the group's keys (extra ones included: swa_lr, name, lr_scale) come from the
            # checkpoint; keys this pipeline needs that the checkpoint lacks keep their current value
            ng = {k: copy.deepcopy(v) for k, v in sg.items() if k not in ("params", GROUP_ENTRY)}
            for k in self.defaults:
                if k not in ng:
                    ng[k] = g[k]
            ng["params"] = g["params"]
            if "param_names" in g and "param_names" not in ng:
                ng["param_names"] = g["param_names"]
            self._gate.check(ng, gi, [k for k in sg if k not in ("params", GROUP_ENTRY)])
            new_groups.append(ng)
            group_of.update((idx, ng) for idx in sg["params"])
        state = sd["state"]
        if not isinstance(state, dict):
            raise ValueError("load_state_dict: 'state' must be a dict")
        loader = StateLoader(self.transforms, nonfinite=self._pipeline.nonfinite)
        new_state: dict[torch.Tensor, dict] = {}
        for idx, entry in state.items():
            if not isinstance(idx, int) and idx not in index:  # not a parameter's (torch allows them): kept as it is
                new_state[idx] = copy.deepcopy(entry)
                continue
            if idx not in index:
                raise ValueError(f"load_state_dict: state for parameter index {idx!r}, which no param group holds")
            p = index[idx]
            new_state[p] = loader.param_state(entry, p, self.state.get(p), f"parameter {idx}", group_of[idx])
        first = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
        devices = [g["params"][0].device if g["params"] else first for g in self.param_groups]
        new_store = loader.store(meta.get("transforms", {}), devices)
        skipped = meta.get("skipped_steps", torch.zeros((), dtype=torch.int64))
        if (not isinstance(skipped, torch.Tensor) or skipped.dim() != 0 or skipped.is_floating_point()
                or skipped.is_complex() or skipped.dtype == torch.bool or skipped.is_meta or int(skipped) < 0):
            raise ValueError(f"load_state_dict: skipped_steps must be a 0-d integer tensor >= 0, got {skipped!r}")
        run = meta.get("consecutive_skips")  # (absent: no skip since the last step that went ahead, or no limit)
        if run is not None and not consecutive_skips_ok(run):
            raise ValueError("load_state_dict: consecutive_skips must be 3 integers >= 0 (skipped steps in a row, "
                             f"of them non-finite, of them by a rule: the first the sum of the others), got {run!r:.200}")
        lost = self._lost_state(state, saved_groups, meta, carried) if check_lost else []
        if lost and strict:
            if dcp:
                raise ValueError(
                    f"load_state_dict: the state dict lacks {len(lost)} value(s) its checkpoint was saved with "
                    f"({'; '.join(lost)}). torch.distributed.checkpoint loads only the values its target state "
                    "dict has a slot for, and a fresh optimizer creates its state lazily: step the fresh optimizer "
                    "on zero gradients until every transform has run once (a full cycle of Accumulate) before "
                    "get_state_dict / get_optimizer_state_dict. Nothing was changed")
            raise ValueError(missing_message(lost))
        loader.finish()
        run = None if run is None else run.detach().to("cpu", torch.int64, copy=True)
        return new_state, new_groups, new_store, skipped.detach().to("cpu", torch.int64, copy=True), run, notes, lost

    def _lost_state(self, state: Any, saved_groups: list[dict], meta: dict, carried: Any) -> list[str]:
        """`missing_state` of a checkpoint against this optimizer (its parameters in group order)."""
        ids, names, live_keys = [], [], []
        for g, sg in zip(self.param_groups, saved_groups):
            given = g.get("param_names")
            given = given if isinstance(given, list) and len(given) == len(g["params"]) else None
            for j, (idx, p) in enumerate(zip(sg["params"], g["params"])):
                ids.append(idx)
                names.append(repr(given[j]) if given else f"shape {tuple(p.shape)}")
                live_keys.append(set(self.state.get(p) or ()))
        live_store = {inventory_key(k, n) for k, v in self._store.items() for n in v}
        return missing_state(state, ids, names, meta, carried, live_keys, live_store)

    # --- pickling / deepcopy -------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_runtime"] = {}
        return d

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_last" not in state:  # pickled before stats moved to _LastStep
            state = dict(state)
            state["_last"] = _LastStep(state.pop("stats", {}))
        super().__setstate__(state)
        if "_gate" not in self.__dict__:  # pickled before the group-key gate existed
            self._gate = GroupGate(self.transforms)
        self.__dict__.setdefault("skip_limit", None)  # (pickled before max_consecutive_skips)

    def __repr__(self) -> str:
        inner = ", ".join(repr(t) for t in self.transforms)
        return f"Modular({inner}; {len(self.param_groups)} param group(s))"


# `cfg.build(params)` makes a Modular: the config sits below the optimizer, so it is told the class here
PipelineConfig._optimizer_class = Modular


class _Evaluating:
    """`Modular.evaluating()`: the eval form inside, the form held before outside."""

    def __init__(self, opt: Modular) -> None:
        self.opt = opt
        self.back = False

    def __enter__(self) -> Modular:
        opt = self.opt
        self.back = any(t.weights_mode(opt, key) == "train" for key, t in opt.plan.swaps)
        opt.eval()
        return opt

    def __exit__(self, *exc: Any) -> None:
        if self.back:
            self.opt.train()


def _pipeline_arguments(transforms: tuple, nonfinite: Any, config: Any, group_defaults: dict, load_config) -> tuple:
    """The pipeline given positionally, by `transforms=` or by `config=`, as (transforms, nonfinite, defaults)."""
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


def _counter_device(groups: list[dict[str, Any]]) -> torch.device:
    """The device of the first parameter (the CPU when there is none, or it holds no values: meta)."""
    for g in groups:
        for p in g["params"]:
            return p.device if p.device.type != "meta" else torch.device("cpu")
    return torch.device("cpu")


def _check_no_duplicates(group: dict[str, Any], index: int) -> None:
    """Refuse a parameter listed twice in a group.

    torch.optim only warns (and says it will become an error); its own Adam
    paths then disagree with one another (fused, foreach and for-loop give three
    different trajectories), so there is no behaviour to match.
    """
    params = group["params"]
    if len(params) == len(set(params)):
        return
    seen: dict[torch.Tensor, int] = {}
    names = group.get("param_names")
    for j, p in enumerate(params):
        if p in seen:
            what = f"{names[j]!r}" if names else f"at positions {seen[p]} and {j}"
            raise ValueError(
                f"param group {index} lists parameter {what} more than once; list each parameter once "
                "(torch.optim warns about this and will refuse it; a step would update it twice)"
            )
        seen[p] = j
