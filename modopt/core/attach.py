"""`attach`: run transforms in front of an existing torch optimizer (a step pre-hook)."""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any

import torch

from .pipeline_config import PipelineConfig
from .runner import drive
from .hyper import GroupGate
from .plan import Plan, make_plan
from .select import check_selections
from .state import declared_buffers
from .torch_checkpoint import caller_stacklevel
from . import distributed
from .hostdata import Host
from .partitions import check_flat_partitions
from .checkpoint import param_inventory
from .keys import inventory_key
from .roles import NOT_ATTACHABLE
from .transform import Transform, walk

#: `AttachHandle._pending` after a load of a state dict without the handle's entry: start fresh
_FRESH = object()


def _unscale_for_transforms(optimizer: torch.optim.Optimizer) -> None:
    """Unscale the gradients of an optimizer that takes GradScaler's scale itself, before the transforms read them.

    `GradScaler.step` leaves the gradients of an optimizer with `_step_supports_amp_scaling` (torch's
    fused ones) scaled and hands it `optimizer.grad_scale` and `found_inf` instead of calling
    `unscale_`. The attached transforms must see the true gradients, so they are unscaled here exactly
    as `scaler.unscale_(optimizer)` would (the same reciprocal, the same kernel), and `grad_scale`
    becomes None so the kernel does not divide again; `found_inf` (already taken) still skips the step.
    """
    scale = getattr(optimizer, "grad_scale", None)
    if not isinstance(scale, torch.Tensor):
        return
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                by_device[p.grad.device].append(p.grad)
    inv = scale.double().reciprocal().float()
    for device, grads in by_device.items():
        found = torch.zeros(1, dtype=torch.float32, device=device)  # (the scaler's own found_inf is kept)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv.to(device))
    optimizer.grad_scale = None


class AttachHandle(Host):
    """What `attach()` returns: holds the transforms' state; `remove()` detaches them.

    The attached transforms' state travels inside the optimizer's own
    `optimizer.state_dict()` (under the key `"modopt_attach"`, at the top and
    in `param_groups[0]`), so the checkpoints of Lightning, HF Trainer and
    accelerate carry it with no extra code. It comes back in either order:
    `optimizer.load_state_dict()` after `attach` restores it at once; a load
    before `attach` leaves it in `optimizer.param_groups[0]` (torch keeps a
    group's keys and drops the others), where `attach` picks it up.
    `handle.state_dict()` / `handle.load_state_dict()` save it on its own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, transforms: tuple[Transform, ...], nonfinite: str):
        self.optimizer = optimizer
        self.transforms = transforms
        self.nonfinite = nonfinite
        #: what is decided about the attached pipeline once (`modopt.core.plan`); the step reads it
        self.plan: Plan = make_plan(transforms, nonfinite)
        # the transforms' values against the parameters' compute dtype, the bound every door holds them to
        # (`modopt.core.hyper`; the optimizer's own values are its own constructor's to check)
        gate = GroupGate(transforms)
        try:
            for i, g in enumerate(optimizer.param_groups):
                gate.bound = gate.admit(g["params"], i)
        except ValueError as e:
            raise ValueError(f"mo.attach: {e}") from None
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        self._store: dict[str, dict] = {}
        self._runtime: dict[str, dict] = {}
        self.stats: dict[str, torch.Tensor] = {}
        self._pending: dict[str, Any] | None = None
        self._mesh_groups, self._per_mesh = -1, None  # (the per-mesh split, decided at the first step: `_run`)
        live = getattr(optimizer, "_modopt_attach_keys", set())
        n = 0
        while (f"modopt_attach.{n}" if n else "modopt_attach") in live:
            n += 1
        #: the key of this handle's entry in `optimizer.state_dict()`
        self._key = f"modopt_attach.{n}" if n else "modopt_attach"
        self._restore_loaded()  # (before anything is registered: a refusal leaves the optimizer as it was)
        optimizer._modopt_attach_keys = live | {self._key}
        self._hooks = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_state_dict_post_hook(self._sd_post),
            optimizer.register_load_state_dict_pre_hook(self._load_pre),
            optimizer.register_load_state_dict_post_hook(self._load_post),
        ]

    def __repr__(self) -> str:
        """`AttachHandle(AdamW, ClipNorm(max_norm=1.0))`: the optimizer's class, the transforms, non-defaults."""
        parts = [type(self.optimizer).__name__, *(repr(t) for t in self.transforms)]
        if self.nonfinite != "skip":
            parts.append(f"nonfinite={self.nonfinite!r}")
        removed = not getattr(self, "_hooks", None)
        return f"AttachHandle({', '.join(parts)}{'; removed' if removed else ''})"

    def _stateful(self) -> list[str]:
        """The keys of the attached transforms that keep state (what a load without theirs resets)."""
        return [k for k, t in walk(self.transforms) if declared_buffers(t)]

    def _restore_loaded(self) -> None:
        """At attach: the state a checkpoint loaded before `attach` left in `param_groups[0]`, restored
        (and taken out of the group); without one, a warning when the optimizer already holds state
        the attached transforms have none of (they start fresh)."""
        optimizer = self.optimizer
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        entry = group.get(self._key)
        if entry is not None:
            try:
                self.load_state_dict(entry)
            except ValueError as e:
                raise ValueError(
                    f"mo.attach: the checkpoint loaded into this {type(optimizer).__name__} before attach carries "
                    f"state for other transforms (optimizer.param_groups[0][{self._key!r}]): {e}. Attach the "
                    f"transforms it was saved with, or `del optimizer.param_groups[0][{self._key!r}]` to start "
                    "these fresh"
                ) from None
            del group[self._key]
            return
        stateful = self._stateful()
        if stateful and any(optimizer.state.values()):
            warnings.warn(
                f"mo.attach: this {type(optimizer).__name__} already holds state (it has stepped, or loaded a "
                f"checkpoint) and none for the attached {', '.join(stateful)}: "
                f"{'it starts' if len(stateful) == 1 else 'they start'} fresh. If the checkpoint was saved with "
                "these transforms attached by an earlier modopt (its state only under the state dict's top-level "
                f"{self._key!r} key, which torch's load_state_dict drops), load it again now that they are "
                "attached: optimizer.load_state_dict(checkpoint)",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )

    def transform_store(self, key: str) -> dict[str, Any]:
        """The saved values of the transform with state key `key` (created empty)."""
        return self._store.setdefault(key, {})

    def runtime_store(self, key: str) -> dict[str, Any]:
        """The unsaved cache of the transform with state key `key` (created empty)."""
        return self._runtime.setdefault(key, {})

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        # torch passes step's arguments with the optimizer first: (opt, closure?)
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if closure is None:
            self._run()
            return None
        # step(closure): the closure computes the gradients inside step(), after this hook.
        # Hand the optimizer a closure that runs the transforms on the gradients it made.
        calls = [0]

        def closure_with_transforms() -> Any:
            calls[0] += 1
            if calls[0] > 1:
                raise RuntimeError(
                    f"mo.attach: {type(optimizer).__name__}.step called its closure more than once in one step "
                    "(LBFGS-style line search); attached transforms run once per step and cannot follow "
                    "re-evaluations. Use mo.Modular, or compute the gradients before step() (no closure)."
                )
            with torch.enable_grad():
                loss = closure()
            self._run()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_with_transforms}
        return (args[0], closure_with_transforms, *args[2:]), kwargs

    @torch.no_grad()
    def _run(self) -> None:
        """Run the transforms on the gradients now held by the optimizer's parameters."""
        optimizer = self.optimizer
        _unscale_for_transforms(optimizer)
        stats: dict[str, torch.Tensor] = {}
        groups = optimizer.param_groups
        if len(groups) != self._mesh_groups:  # (decided when attached, and again when a group was added)
            self._mesh_groups = len(groups)
            mixed = distributed.meshes_mixed([p for g in groups for p in g["params"]])
            self._per_mesh = distributed.per_mesh_mode() if mixed else None
        if self._per_mesh is not None:  # (several meshes: each multi-tensor op split per mesh, as Modular's step)
            with self._per_mesh:
                ctx, go, out = drive(self, groups, self.transforms, self.nonfinite, stats)
        else:
            ctx, go, out = drive(self, groups, self.transforms, self.nonfinite, stats)
        if not go:  # torch optimizers leave params without a grad (and their state) alone
            for p in ctx.params:
                p.grad = None
            stats["skipped"] = torch.ones((), dtype=torch.bool)
        elif ctx.params:
            for p, u in zip(ctx.params, out or []):
                if u is not p.grad:
                    p.grad = u
            stats["skipped"] = torch.zeros((), dtype=torch.bool)
        self.stats = stats

    # --- the handle's state inside the optimizer's own state_dict ----------------
    def _sd_post(self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        entry = self.state_dict()
        sd[self._key] = entry
        # also in the first param group (the same objects: saved once): torch keeps a group's keys when
        # it loads, so a load *before* attach keeps the entry for attach to pick up (_restore_loaded)
        if isinstance(sd.get("param_groups"), list) and sd["param_groups"]:
            sd["param_groups"][0] = {**sd["param_groups"][0], self._key: entry}
        return sd

    def _load_pre(self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any] | None:
        self._pending = None
        groups = sd.get("param_groups")
        first = groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], dict) else {}
        if self._key not in sd and self._key not in first:
            # a checkpoint saved without this handle (a plain torch run's): the attached transforms start fresh
            self._pending = _FRESH
            return None
        entry = sd[self._key] if self._key in sd else first[self._key]
        # check it now, before the optimizer loads anything: a bad entry leaves both as they were
        saved_state = {p: dict(s) for p, s in self.state.items()}
        saved_store = self._store
        try:
            self.load_state_dict(entry)
        finally:
            self.state.clear()
            self.state.update(saved_state)
            self._store = saved_store
        self._pending = entry
        out = {k: v for k, v in sd.items() if k != self._key}
        if self._key in first:  # (not into the optimizer's groups: the handle holds it)
            out["param_groups"] = [{k: v for k, v in first.items() if k != self._key}, *groups[1:]]
        return out

    def _load_post(self, optimizer: torch.optim.Optimizer) -> None:
        entry, self._pending = self._pending, None
        if entry is _FRESH:
            self.state.clear()
            self._store = {}
            self._runtime.clear()
            stateful = self._stateful()
            if stateful:
                warnings.warn(
                    f"{type(optimizer).__name__}.load_state_dict: the state dict carries no state for "
                    f"{', '.join(stateful)} attached by mo.attach (it was saved without them, e.g. by a plain "
                    f"torch run): {'it starts' if len(stateful) == 1 else 'they start'} fresh",
                    UserWarning,
                    stacklevel=caller_stacklevel(),
                )
        elif entry is not None:
            self.load_state_dict(entry)

    def remove(self) -> None:
        """Detach: the optimizer steps as if nothing had been attached."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.optimizer._modopt_attach_keys = getattr(self.optimizer, "_modopt_attach_keys", set()) - {self._key}

    def __enter__(self) -> "AttachHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def state_dict(self) -> dict[str, Any]:
        """The attached transforms' state: `{"state": {param index: ...}, "transforms": ..., "config": ...}`."""
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        state = {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index}
        store = {k: dict(v) for k, v in self._store.items()}
        return {
            "state": state,
            "transforms": store,
            "config": [t.to_dict() for t in self.transforms],
            # what the handle holds, so a load can tell a lost value from one never kept (as Modular's checkpoints)
            "inventory": sorted({k for e in state.values() for k in e} | {inventory_key(k, n) for k, v in store.items()
                                                                        for n in v}),
            "param_keys": param_inventory(state, [{"params": list(range(len(index)))}]),
        }

    def load_state_dict(self, sd: dict[str, Any], *, strict: bool = True) -> None:
        """Load a handle checkpoint, checked as `Modular.load_state_dict` checks its own.

        The transforms must have the same structure (types, order, nesting,
        scopes); changed hyperparameters are reported in one `UserWarning`
        and the live ones kept; every saved value must fit its transform's
        declaration and parameter, and lands on the parameter's device. A
        checkpoint that lacks state its writer held (the inventory it carries;
        without one, the state this handle holds) is refused naming each
        missing part; `strict=False` loads it, those parts restarting, with one
        `UserWarning` that names them. On any error the handle is left as it was.
        """
        import warnings

        from .checkpoint import StateLoader, missing_message, missing_state, structure_difference, value_differences

        who = "AttachHandle.load_state_dict"
        if not isinstance(strict, bool):
            raise TypeError(f"{who}: strict must be True or False, got {strict!r}")
        if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) or not isinstance(sd.get("transforms"), dict):
            raise ValueError(f"{who}: expected a dict with 'state' and 'transforms' (a handle's state_dict)")
        live = [t.to_dict() for t in self.transforms]
        notes: list[str] = []
        if "config" in sd:  # handle checkpoints written before the config was saved have none
            diff = structure_difference(sd["config"], live)
            if diff is not None:
                raise ValueError(f"{who}: the checkpoint's transforms differ from this handle's: {diff}")
            notes = value_differences({"transforms": sd["config"]}, {"transforms": live}, self.transforms)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        loader = StateLoader(self.transforms, who, self.nonfinite)
        new_state = {}
        for i, entry in sd["state"].items():
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(params):
                raise ValueError(f"{who}: state for parameter index {i!r}; the optimizer has {len(params)} parameters")
            new_state[params[i]] = loader.param_state(entry, params[i], self.state.get(params[i]), f"parameter {i}")
        first = params[0].device if params else torch.device("cpu")
        devices = [g["params"][0].device if g["params"] else first for g in self.optimizer.param_groups]
        new_store = loader.store(sd["transforms"], devices)
        ids = list(range(len(params)))
        lost = missing_state(sd["state"], ids, [f"shape {tuple(p.shape)}" for p in params],
                             {"transforms": sd["transforms"], "skipped_steps": None}, sd,
                             [set(self.state.get(p) or ()) for p in params],
                             {inventory_key(k, n) for k, v in self._store.items() for n in v}, who, "the handle's entry")
        if lost and strict:
            raise ValueError(missing_message(lost, who, f"handle.load_state_dict(sd[{self._key!r}], strict=False)"))
        loader.finish()
        if lost:
            warnings.warn(f"{who}(strict=False): the checkpoint lacks these parts of the state, which restart from "
                          "their initial values:\n  " + "\n  ".join(lost), UserWarning, stacklevel=2)
        if notes:
            warnings.warn(f"{who}: the checkpoint's hyperparameters differ from this handle's:\n  " + "\n  ".join(notes),
                          UserWarning, stacklevel=2)
        self.state.clear()
        self.state.update(new_state)
        self._store = new_store
        self._runtime.clear()


def attach(optimizer: torch.optim.Optimizer, *transforms: Transform, nonfinite: str = "skip") -> AttachHandle:
    """Run `transforms` on the gradients before every `optimizer.step()`.

    ```pycon
    >>> import torch, modopt as mo
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> handle = mo.attach(opt, mo.ClipNorm(1.0))
    >>> handle.remove()

    ```

    `nonfinite="skip"` (default) skips a step with an inf/NaN gradient by
    clearing the gradients, so the optimizer leaves parameters and state alone.
    Optimizer transforms cannot be attached.

    `optimizer.step(closure)` (Lightning's automatic optimisation) works: the
    transforms run on the gradients the closure computes, before the optimizer
    reads them. An optimizer that calls its closure more than once per step
    (`torch.optim.LBFGS`) is refused with an error at that second call.

    Checkpoints: `optimizer.load_state_dict(sd)` restores the transforms'
    state along with the optimizer's, called before or after `attach`. A
    state dict saved without these transforms (a plain torch run's) leaves
    them to start fresh, with a warning that names them.
    """

    PipelineConfig.of("attach", transforms=list(transforms), nonfinite=nonfinite)  # validate
    # the names a selection asks for, against the optimizer's `param_names`, before any hook exists
    check_selections(list(transforms), list(enumerate(optimizer.param_groups)))
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "mo.attach: LBFGS evaluates its closure several times per step; attached transforms run once per "
            "step and cannot follow its line search. Put the transforms in a mo.Modular instead."
        )
    for key, t in walk(transforms):
        if isinstance(t, NOT_ATTACHABLE):  # (the innermost such transform is named)
            raise ValueError(f"{key}: {type(t).__name__} cannot be attached in front of a torch optimizer")
    # what a transform refuses about the parameters (a layout over the ranks, a device), and a shape-reading
    # transform in front of flat partitions (DeepSpeed ZeRO-3, FSDP1), as by Modular
    named = [(n, p) for g in optimizer.param_groups
             for n, p in zip(g.get("param_names") or [None] * len(g["params"]), g["params"])]
    for t in transforms:
        t.check_params(named)
    check_flat_partitions(tuple(transforms), named)
    return AttachHandle(optimizer, tuple(transforms), nonfinite)
