"""Continuing a torch run: a plain `torch.optim` state dict read as a `Modular` checkpoint.

`Modular.load_state_dict` accepts the `state_dict()` of `torch.optim.SGD`,
`Adam` or `AdamW` (with or without momentum, amsgrad, ...) when the pipeline's
optimizer transform runs the same algorithm: `mo.SGD`, `mo.Adam`, `mo.AdamW`,
or `mo.TorchOptimizer` of that class (each says so by its `torch_class`, the
torch.optim class whose state it continues). `from_torch` rewrites such a dict into
the form `Modular.state_dict` writes, and `Modular` then checks and loads it
like any of its own checkpoints (all or nothing, the door checks on every
group value).

What maps:

* per parameter, torch's `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, `step`
  (Adam, AdamW) and `momentum_buffer` (SGD) become the optimizer transform's
  values under its key (`"1:AdamW.exp_avg"`), the tensors as torch saved them
  (the load casts floating-point moments to the parameter's dtype, as torch's
  own `load_state_dict` does; `step` stays a 0-d float32 tensor). A
  `TorchOptimizer` takes each parameter's torch state whole (`"1:TorchOptimizer.inner"`);
* the param groups' hyperparameters that the pipeline reads per group (`lr`,
  `betas`, `eps`, `weight_decay`, `amsgrad`, `momentum`, ...) and the keys
  others put there (a scheduler's `initial_lr`); torch's kernel choices
  (`foreach`, `fused`, `capturable`, `differentiable`) are dropped: the live
  transform's own fields choose the kernel;
* the state of transforms that `mo.attach` ran in front of the torch
  optimizer (its `"modopt_attach"` entry), when this pipeline starts with
  the same transforms (`attach(AdamW, ZClip())` -> `Modular(ZClip(), AdamW())`);
* nothing else: every other transform with state (`ZClip`, `ClipNormByEMA`,
  ...) starts fresh, which `from_torch` reports for one warning.

A state dict is torch's when it has `"state"` and `"param_groups"` and none
of `Modular`'s markers (`sd["modopt"]`, `param_groups[0]["modopt"]`, state
under its keys).
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

import torch

from .keys import value_key
from .state import declared_buffers
from .roles import Optimizer
from .transform import Transform, walk

#: torch's kernel choices: how torch computes a step, not what it computes; the live transform's fields decide
KERNEL_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})
#: the per-parameter values each torch algorithm writes
TORCH_STATE = {
    "SGD": frozenset({"momentum_buffer"}),
    "Adam": frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    "AdamW": frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
}
_TORCH_CLASS = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
#: the key under which `mo.attach` carries its handles' state (also in param_groups[0])
ATTACH_KEY = "modopt_attach"


#: where torch's and modopt's own frames live (a warning points at the first frame outside them)
_INTERNAL = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__name__.split(".")[0]]))


def caller_stacklevel() -> int:
    """The `warnings.warn` stacklevel, for the function calling this one, of the first frame outside
    torch and modopt: the user's call (torch wraps `load_state_dict` in a varying number of frames)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def _is_attach_key(k: Any) -> bool:
    return isinstance(k, str) and (k == ATTACH_KEY or k.startswith(ATTACH_KEY + "."))


def _first_group(sd: dict) -> dict:
    groups = sd.get("param_groups")
    return groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], dict) else {}


def is_torch_state_dict(sd: Any) -> bool:
    """A state dict written by a torch optimizer: `state` and `param_groups`, and none of `Modular`'s
    markers (its `"modopt"` entry, or per-parameter values under its keys, `"1:Adam.exp_avg"`: a
    Modular checkpoint that lost its entry). An `attach` handle's entries may be there."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd or "modopt" in sd:
        return False
    if "modopt" in _first_group(sd):
        return False
    state = sd["state"]
    return not (isinstance(state, dict) and any(
        isinstance(e, dict) and any(isinstance(k, str) and ":" in k.split(".", 1)[0] for k in e)
        for e in state.values()))


def torch_algorithm(groups: list[dict[str, Any]]) -> str:
    """`"SGD"`, `"Adam"`, `"AdamW"` or `"Adam or AdamW"` (a torch older than 2.6 does not save which),
    read from torch's param-group keys; `ValueError` for anything else."""
    who = "load_state_dict"
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"{who}: 'param_groups' must be a list of dicts (an optimizer state_dict)")
    if not groups:
        raise ValueError(f"{who}: the torch state dict has no param groups")
    if all("betas" in g for g in groups):
        decoupled = {g.get("decoupled_weight_decay") for g in groups}
        if decoupled == {True}:
            return "AdamW"
        if decoupled == {False}:
            return "Adam"
        if decoupled == {None}:
            return "Adam or AdamW"
        raise ValueError(f"{who}: the torch state dict mixes Adam and AdamW param groups "
                         "(decoupled_weight_decay differs between groups); modopt runs one of them per optimizer")
    if all("momentum" in g and "dampening" in g for g in groups):
        return "SGD"
    keys = sorted({k for g in groups for k in g if k != "params"}, key=str)
    raise ValueError(f"{who}: this torch state dict is not one of torch.optim.SGD, Adam or AdamW (param-group keys: "
                     f"{keys}); modopt continues those three, in mo.SGD, mo.Adam, mo.AdamW or mo.TorchOptimizer "
                     "of the same class")


def _live_optimizer(transforms: tuple[Transform, ...]) -> tuple[str, Transform, str]:
    """The pipeline's optimizer transform: (key, transform, the torch algorithm it runs or ''), read from
    its `torch_class` (the torch.optim class whose state it continues; `mo.SGD`, `mo.Adam`, `mo.AdamW` and
    `mo.TorchOptimizer` declare it)."""
    found = [(k, t) for k, t in walk(transforms) if isinstance(t, Optimizer)]
    if len(found) != 1:
        names = ", ".join(k for k, _ in found) or "none"
        raise ValueError(f"load_state_dict: a torch.optim state dict continues one optimizer transform; this "
                         f"pipeline has {len(found)} ({names})")
    key, t = found[0]
    parents = dict(walk(transforms))
    for i in range(1, key.count("/") + 1):  # a parent that routes parameters would leave torch state unplaced
        parent = parents["/".join(key.split("/")[:i])]
        if type(parent).__name__ != "Chain":
            raise ValueError(f"load_state_dict: a torch.optim state dict continues an optimizer transform of the "
                             f"whole chain; {key} runs inside {type(parent).__name__}")
    cls = getattr(t, "torch_class", None)
    return key, t, next((name for name, c in _TORCH_CLASS.items() if cls is c), "")


def _torch_buffer(t: Transform) -> str | None:
    """The name of `t`'s buffer that keeps each parameter's torch state whole (kind `"torch"`:
    `TorchOptimizer`'s `"inner"`), or None; such a transform takes torch's state and param groups as they are."""
    return next((name for name, b in declared_buffers(t).items() if b.kind == "torch"), None)


def _signature_defaults(cls: type) -> dict[str, Any]:
    sig = inspect.signature(cls.__init__)
    return {n: p.default for n, p in sig.parameters.items()
            if n not in ("self", "params") and p.default is not inspect.Parameter.empty}


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # (a tensor against a tuple, ...)
        return False


def _attached(sd: dict, names: list[str], transforms: tuple[Transform, ...], okey: str) -> tuple[dict, int]:
    """The one `attach` handle entry of a torch state dict, checked against the transforms before the
    optimizer transform `okey` (their keys are the handle's: `"0:ZClip"` in both), and their number."""
    from .checkpoint import structure_difference

    if len(names) > 1:
        raise ValueError(f"load_state_dict: this torch state dict carries {len(names)} mo.attach handles ({names}); "
                         "one handle maps onto the transforms before a Modular's optimizer transform")
    name = names[0]
    entry = sd[name] if name in sd else _first_group(sd)[name]
    if not (isinstance(entry, dict) and isinstance(entry.get("state"), dict)
            and isinstance(entry.get("transforms"), dict) and isinstance(entry.get("config"), list)):
        raise ValueError(f"load_state_dict: the state dict's {name!r} entry is not an attach handle's state "
                         "(a dict with 'state', 'transforms' and 'config')")
    n = int(okey.split("/")[0].split(":")[0])  # the top-level position of the optimizer transform (or its chain)
    diff = structure_difference(entry["config"], [t.to_dict() for t in transforms[:n]])
    if diff is not None:
        raise ValueError(f"load_state_dict: the transforms attached in front of the torch optimizer differ from "
                         f"those before {okey} here ({diff}); build the Modular as the attached transforms "
                         "followed by the optimizer transform")
    return entry, n


def from_torch(sd: dict[str, Any], transforms: tuple[Transform, ...], group_keys: set[str]
               ) -> tuple[dict[Any, dict[str, Any]], list[dict[str, Any]], dict[str, Any], list[dict[str, Any]] | None,
                          str | None]:
    """`(state, param_groups, store, attached config, warning)`: a torch.optim state dict rewritten
    for this pipeline.

    `group_keys`: the keys the pipeline reads per group (`Modular.defaults`).
    Raises `ValueError` naming what does not fit (the algorithm, a state
    value torch's algorithm does not write, a torch hyperparameter the
    pipeline cannot take per group); only reads `sd`. The state of the
    transforms an `attach` handle ran in front of the torch optimizer (its
    `"modopt_attach"` entry) goes to the same transforms at the start of this
    pipeline (`store`: their transform-wide state; `attached config`: their
    saved config, None without a handle). `warning` names the transforms that
    start fresh (None: none has state).
    """
    groups = sd["param_groups"]
    algo = torch_algorithm(groups)
    key, t, live = _live_optimizer(transforms)
    if not live:
        raise ValueError(f"load_state_dict: this is a torch.optim.{algo} state dict; it continues in mo.SGD, mo.Adam, "
                         f"mo.AdamW or mo.TorchOptimizer of the same class, and this pipeline's optimizer transform "
                         f"is {key} ({type(t).__name__})")
    inner = _torch_buffer(t)
    wrapped = inner is not None
    fits = live == algo or (algo == "Adam or AdamW" and live in ("Adam", "AdamW"))
    if wrapped and algo != "SGD" and live != "SGD":  # torch's Adam takes decoupled_weight_decay per group
        fits = True
    if not fits:
        what = f"mo.TorchOptimizer({getattr(t, 'cls', '')})" if wrapped else f"{type(t).__name__}"
        raise ValueError(f"load_state_dict: this is a torch.optim.{algo} state dict and this pipeline's optimizer "
                         f"transform is {key} ({what}): a torch run continues with the same algorithm, "
                         f"here {'mo.Adam or mo.AdamW' if algo == 'Adam or AdamW' else 'mo.' + algo}")
    torch_name = algo if algo != "Adam or AdamW" else live
    names = sorted({k for k in sd if _is_attach_key(k)} | {k for k in _first_group(sd) if _is_attach_key(k)})
    handle, n_attached = _attached(sd, names, transforms, key) if names else (None, 0)
    defaults = _signature_defaults(_TORCH_CLASS[torch_name])
    new_groups = []
    for gi, g in enumerate(groups):
        ng: dict[str, Any] = {}
        for k, v in g.items():
            if _is_attach_key(k):
                continue  # (read above)
            if k == "params" or k in group_keys or wrapped:
                ng[k] = v
            elif k in KERNEL_KEYS or k == "decoupled_weight_decay":
                continue  # the kernel is the live transform's choice; the algorithm was checked above
            elif k in defaults:  # a torch hyperparameter this pipeline does not read per group
                mine = getattr(t, k, defaults[k])
                if not _same(v, mine):
                    raise ValueError(
                        f"load_state_dict: param group {gi} of the torch state dict has {k}={v!r}; {key} runs with "
                        f"{k}={mine!r} and does not read it per param group: build it with {k}={v!r}"
                    )
            else:  # another key rides along, as in torch (a scheduler's initial_lr, a user's name)
                ng[k] = v
        new_groups.append(ng)
    allowed = TORCH_STATE[torch_name]
    state = sd["state"]
    if not isinstance(state, dict):
        raise ValueError("load_state_dict: 'state' must be a dict")
    new_state: dict[Any, dict] = {}
    for idx, entry in state.items():
        if not isinstance(entry, dict):
            raise ValueError(f"load_state_dict: state of parameter {idx!r} is not a dict")
        bad = [k for k in entry if k not in allowed]
        if bad:
            raise ValueError(f"load_state_dict: state of parameter {idx!r} holds {bad}, which torch.optim.{torch_name} "
                             f"does not write (it writes {sorted(allowed)})")
        if inner is not None:
            new_state[idx] = {value_key(key, inner): dict(entry)}
            continue
        out = {}
        for k, v in entry.items():
            if v is None:  # (an SGD buffer torch never made)
                continue
            if k == "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                v = torch.tensor(float(v), dtype=torch.float32)  # an old torch's number, as torch's load converts it
            out[value_key(key, k)] = v
        new_state[idx] = out
    store: dict = {}
    if handle is not None:
        for idx, entry in handle["state"].items():
            if not isinstance(entry, dict):
                raise ValueError(f"load_state_dict: the attach handle's state of parameter {idx!r} is not a dict")
            new_state[idx] = {**new_state.get(idx, {}), **entry}
        store = dict(handle["transforms"])
    covered = {k for k, _ in walk(transforms[:n_attached])}
    fresh = [k for k, x in walk(transforms) if k != key and k not in covered and declared_buffers(x)]
    notes = []
    if fresh:
        notes.append(f"load_state_dict: the torch.optim.{torch_name} state dict has no state for {', '.join(fresh)}: "
                     f"{'it starts' if len(fresh) == 1 else 'they start'} fresh, as on a first step (the optimizer's "
                     f"moments, step counts and param groups were loaded into {key})")
    if not wrapped and groups:
        saved, mine = _torch_kernel(groups[0]), _modopt_kernel(t)
        if saved != mine:  # torch would continue with the checkpoint's kernel; the transform's own continues here
            notes.append(
                f"load_state_dict: the torch.optim.{torch_name} state dict was written by torch's {saved} kernel; "
                f"{key} continues with its own, the {mine} kernel, so the run continues equal up to float rounding, "
                f"not bit for bit (torch.optim follows the checkpoint's kernel). Build {type(t).__name__}("
                f"{_KERNEL_ARGS[saved]}) to continue with the checkpoint's kernel"
            )
    warning = "\n".join(notes) or None
    return new_state, new_groups, store, None if handle is None else handle["config"], warning


#: the kernel of a torch.optim param group's `fused`/`foreach` keys, and the modopt arguments that pick it
_KERNEL_ARGS = {"fused": "fused=True", "foreach": "foreach=True", "for-loop": "foreach=False",
                "default (fused=None, foreach=None)": "fused=False"}


def _torch_kernel(group: dict[str, Any]) -> str:
    """Which kernel torch.optim runs for a param group as saved: its `fused` and `foreach` keys."""
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    return "foreach" if foreach is True else "for-loop" if foreach is False else "default (fused=None, foreach=None)"


def _modopt_kernel(t: Any) -> str:
    """The same name for the kernel an SGD/Adam/AdamW transform runs (its default is torch's fused kernel)."""
    if t.foreach is not None and t.fused is not True:
        return "foreach" if t.foreach else "for-loop"
    return "default (fused=None, foreach=None)" if t.fused is False else "fused"


def as_modular_state_dict(sd: dict[str, Any], opt: Any, format_version: int) -> tuple[dict[str, Any], str | None]:
    """A torch.optim state dict as `opt.state_dict()` would have written it (`opt`: a `Modular`), and
    the warning naming the transforms that start fresh; `Modular.load_state_dict` then loads it as
    its own (the config is the live one, but for attached transforms; no skipped steps).
    `format_version`: the format `Modular.state_dict` writes."""
    state, groups, store, attached, warning = from_torch(sd, opt.transforms, set(opt.defaults))
    config = opt.config.to_dict()
    if attached is not None:  # (so that the load reports the attached transforms' changed hyperparameters)
        config = {**config, "transforms": list(attached) + config["transforms"][len(attached):]}
    meta = {
        "format_version": format_version,
        "config": config,
        "transforms": store,
        "skipped_steps": torch.zeros((), dtype=torch.int64),
    }
    return {**sd, "state": state, "param_groups": groups, "modopt": meta}, warning
