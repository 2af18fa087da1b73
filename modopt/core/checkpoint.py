"""The checkpoint format: its version and the upgrades from older ones (`FORMAT_VERSION`, `MIGRATIONS`,
`upgrade`), and checking and copying saved transform state, shared by `Modular` and `attach` handles.

A checkpoint loads when the pipeline's *structure* matches: transform types and
order, nesting, the fields that decide where a transform's state lives
(`scope`, `dim`, `inverse_dims`, a wrapped optimizer's `cls`), and
every saved value fits the declaration of its transform (`state_buffers`, see
`modopt.core.state.Buffer`). Hyperparameter values may differ: they are
reported by `value_differences()` and the caller decides what wins (torch's
rule: param-group keys come from the checkpoint, the live transforms keep their
other fields).

Everything here only reads its inputs and returns new objects, so a caller
that checks everything before assigning leaves the optimizer as it was when a
check fails.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any, Callable, Iterable

import torch

from .keys import inventory_key, split_group_key, split_value_key, value_key
from .reduce import acc_dtype
from .state import Buffer, declared_buffers
from .roles import Optimizer, Segmented
from .transform import Transform, to_plain

#: fields whose value decides where (and in which shape) a transform keeps its state
LAYOUT_FIELDS = ("scope", "dim", "inverse_dims", "cls")


# --- the format and its versions ------------------------------------------------------
#: the checkpoint format `state_dict` writes (`sd["modopt"]["format_version"]`)
FORMAT_VERSION = 2
#: `MIGRATIONS[n]` upgrades a state dict of format `n` to format `n + 1`.
#: When a change to `state_dict` bumps `FORMAT_VERSION` to `n + 1`, register
#: here the function that rewrites an `n` checkpoint (renamed keys, new
#: buffers with their initial values, ...). It must return a new dict and never
#: modify its argument; `load_state_dict` runs the chain `n -> n+1 -> ...`
#: before any check, so an old checkpoint is validated as a current one.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def _v1_to_v2(sd: dict[str, Any]) -> dict[str, Any]:
    """Format 2 also carries the transform state in `param_groups[0]["modopt"]` (the part of a state
    dict that torch.distributed.checkpoint keeps); format 1 had it only in `sd["modopt"]`, which
    stays the primary copy, so the upgrade only renumbers."""
    return {**sd, "modopt": {**sd["modopt"], "format_version": 2}}


MIGRATIONS[1] = _v1_to_v2
#: the key of param_groups[0] in a state dict that carries the transform state (what DCP keeps)
GROUP_ENTRY = "modopt"


def migrate(sd: dict[str, Any], version: int) -> dict[str, Any]:
    """Upgrade a state dict of format `version` to `FORMAT_VERSION` through `MIGRATIONS`."""
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


def upgrade(sd: dict[str, Any]) -> dict[str, Any]:
    """`sd` (its `sd["modopt"]` a dict) at `FORMAT_VERSION`: refused when its format is not one this modopt
    reads, run through `migrate` when older (then a new dict), else `sd` itself."""
    version = sd["modopt"].get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION or version < 1:
        raise ValueError(f"load_state_dict: unsupported checkpoint format_version {version!r} (this modopt reads <= {FORMAT_VERSION})")
    if version < FORMAT_VERSION:
        sd = migrate(sd, version)
    return sd


def param_inventory(state: dict[Any, Any], groups: list[dict[str, Any]]) -> list[list[list[str] | list[int]]]:
    """Which saved values each parameter holds: `[[keys], [positions]]` pairs, one per distinct key set,
    a parameter named by its position in the param groups' order (torch.distributed.checkpoint renames
    the state's keys to parameter names but keeps that order). Parameters without state are absent."""
    position = {pid: i for i, pid in enumerate(pid for g in groups for pid in g.get("params", ()))}
    by_keys: dict[tuple[str, ...], list[int]] = {}
    for pid, entry in state.items():
        if pid in position and isinstance(entry, dict) and entry:
            by_keys.setdefault(tuple(sorted(map(str, entry))), []).append(position[pid])
    return [[list(k), sorted(v)] for k, v in sorted(by_keys.items())]


def _is_store_key(k: str) -> bool:
    """An inventory entry of transform-wide state (`"0:ZClip/mu"`), not per-parameter (`"1:Adam.step"`)."""
    return "/" in k.rsplit(":", 1)[-1]


def _saved_inventory(carried: Any, n_params: int, who: str,
                     where: str = "param_groups[0]['modopt']") -> tuple[list[str], list[tuple[set[str], list[int]]] | None] | None:
    """The inventory a checkpoint carries (`param_groups[0]["modopt"]`): `(keys, per-parameter pairs or
    None)`, or None when it carries none. A malformed one is refused."""
    if not isinstance(carried, dict) or "inventory" not in carried:
        return None
    keys = carried["inventory"]
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ValueError(f"{who}: {where}['inventory'] must be a list of state keys, got {keys!r:.200}")
    pairs = carried.get("param_keys")
    if pairs is None:
        return keys, None
    ok = isinstance(pairs, list) and all(
        isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], list) and isinstance(e[1], list)
        and all(isinstance(k, str) for k in e[0])
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_params for i in e[1]) for e in pairs)
    if not ok:
        raise ValueError(f"{who}: {where}['param_keys'] must be [[state keys], [parameter positions "
                         f"0..{n_params - 1}]] pairs, got {pairs!r:.200}")
    return keys, [(set(k), list(i)) for k, i in pairs]


class Missing(list[str]):
    """`missing_state`'s lines; `values`: how many saved values they name."""

    values: int = 0


def missing_state(state: Any, ids: list[Any], names: list[str], meta: dict[str, Any], carried: Any,
                  live_keys: list[set[str]], live_store: set[str], who: str = "load_state_dict",
                  where: str = "param_groups[0]['modopt']") -> Missing:
    """What a checkpoint lacks of the state its pipeline keeps, one line per part that would restart
    (`[]`: nothing). The reference is the inventory the checkpoint carries (what the optimizer that
    saved it held: a parameter that never had a gradient, or a checkpoint taken before the first
    step, lacks state legitimately); a checkpoint without one is compared with the live optimizer.

    `state`/`ids`: the checkpoint's per-parameter state and its keys in parameter order; `names`: how
    to name each parameter; `meta`: the checkpoint's modopt entry (its `transforms` and
    `skipped_steps` are what loads); `live_keys`/`live_store`: this optimizer's per-parameter keys in
    parameter order and its transform-wide values (`inventory_key` form)."""
    out = Missing()
    if not isinstance(state, dict):
        return out  # (refused by the load's own checks)
    entries = [state.get(i) for i in ids]
    have = [set(e) if isinstance(e, dict) else set() for e in entries]
    store = meta.get("transforms")
    have_store = {inventory_key(k, n) for k, v in store.items() if isinstance(v, dict) for n in v} \
        if isinstance(store, dict) else set()
    saved = _saved_inventory(carried, len(ids), who, where)  # (`where`: how the error names `carried`)
    if saved is None:  # no inventory: what the live optimizer holds
        need = live_keys
        need_store = live_store
        anywhere: set[str] = set()
    else:
        keys, pairs = saved
        need_store = {k for k in keys if _is_store_key(k)}
        need = [set() for _ in ids]
        for ks, positions in pairs or ():
            for i in positions:
                need[i] |= ks
        # an inventory without per-parameter pairs: each key held by some parameter
        anywhere = {k for k in keys if not _is_store_key(k)} if pairs is None else set()
    for i, (n, h) in enumerate(zip(need, have)):
        lost = n - h
        if lost:
            out.append(f"parameter {ids[i]!r} ({names[i]}): {', '.join(map(repr, sorted(lost)))}")
            out.values += len(lost)
    held = set().union(*have) if have else set()
    lost_anywhere = sorted(anywhere - held)
    if lost_anywhere:
        out.append(f"held by no parameter (the inventory lists them): {', '.join(map(repr, lost_anywhere))}")
        out.values += len(lost_anywhere)
    by_transform: dict[str, list[str]] = {}
    for k in sorted(need_store - have_store):
        key, name = k.rsplit("/", 1)
        by_transform.setdefault(key, []).append(name)
        out.values += 1
    out += [f"transform {key}: {', '.join(map(repr, names_))}" for key, names_ in by_transform.items()]
    if "transforms" not in meta and saved is None and not need_store:  # (nothing to tell what it held)
        out.append("every transform's transform-wide state (the 'modopt' entry has no 'transforms')")
        out.values += 1
    if "skipped_steps" not in meta:
        out.append("the skipped-step count ('skipped_steps')")
        out.values += 1
    return out


def missing_message(missing: list[str], who: str = "load_state_dict",
                    anyway: str = "load_state_dict(sd, strict=False)") -> str:
    """The refusal of a checkpoint that lacks state (`missing_state`'s lines); `anyway`: the call that loads it."""
    shown = missing[:8] + ([f"... and {len(missing) - 8} more"] if len(missing) > 8 else [])
    return (f"{who}: the checkpoint lacks state this optimizer keeps, so these parts would restart:\n  "
            + "\n  ".join(shown) + f"\nNothing was changed. {anyway} loads it and restarts them (one warning "
            "names them)")


# --- configs ---------------------------------------------------------------------------
def _is_transform(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("type"), str)


def _nested(v: Any) -> list | None:
    """A field value holding transforms, as a list (None: not transforms)."""
    if _is_transform(v):
        return [v]
    if isinstance(v, list) and v and all(_is_transform(x) for x in v):
        return v
    return None


def structure_difference(saved: Any, live: list[dict[str, Any]], path: str = "transforms") -> str | None:
    """Where the saved plain-data transform list first differs in structure from `live`, or None."""
    if not isinstance(saved, list):
        return f"{path}: {type(saved).__name__} is not a list of transforms"
    if len(saved) != len(live):
        return f"{path}: length {len(saved)} != {len(live)}"
    for i, (a, b) in enumerate(zip(saved, live)):
        p = f"{path}.{i}"
        if not _is_transform(a):
            return f"{p}: {a!r} is not a transform"
        if a["type"] != b["type"]:
            return f"{p}.type: {a['type']!r} != {b['type']!r}"
        for f in LAYOUT_FIELDS:
            if f in b and to_plain(a.get(f)) != to_plain(b[f]):
                return f"{p}.{f}: {a.get(f)!r} != {b[f]!r} (this field decides where the transform keeps its state)"
        for f, v in b.items():
            kids = _nested(v)
            if kids is not None:
                d = structure_difference(_nested(a.get(f)) or a.get(f), kids, f"{p}.{f}")
                if d:
                    return d
    return None


def _diffs(a: Any, b: Any, path: str, out: list[tuple[str, Any, Any]]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(b) + [k for k in a if k not in b]:
            _diffs(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{path}.{k}" if path else str(k), out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diffs(x, y, f"{path}.{i}", out)
    elif a != b:
        out.append((path, a, b))


def _group_key_paths(transforms: Iterable[Transform], path: str = "transforms") -> dict[str, set[str]]:
    """`{path of a transform: the fields it exposes as param-group keys}`, nested transforms included."""
    out: dict[str, set[str]] = {}
    for i, t in enumerate(transforms):
        p = f"{path}.{i}"
        keys = set(t.hyperparams()) | set(t.group_keys) if isinstance(t, Optimizer) else set()
        if "kwargs" in type(t).model_fields and keys:  # TorchOptimizer: its kwargs are the group keys
            keys.add("kwargs")
        out[p] = keys
        for f in t.field_order():
            v = getattr(t, f)
            if isinstance(v, Transform):
                out.update(_group_key_paths([v], f"{p}.{f}"))
            elif isinstance(v, (list, tuple)) and v and all(isinstance(x, Transform) for x in v):
                out.update(_group_key_paths(v, f"{p}.{f}"))
    return out


def value_differences(saved: dict[str, Any], live: dict[str, Any], transforms: Iterable[Transform]) -> list[str]:
    """Every hyperparameter that differs between two configs of the same structure, in user words."""
    out: list[tuple[str, Any, Any]] = []
    _diffs(to_plain(saved), live, "", out)
    owners = _group_key_paths(transforms)
    lines = []
    for path, a, b in out:
        group_key = path.startswith("defaults.")
        m = re.match(r"^(.*?)\.([^.]+)(?:\..*)?$", path)
        if not group_key and m:
            # the transform owning the field: the longest transform path that prefixes it
            for tp in sorted(owners, key=len, reverse=True):
                if path.startswith(tp + "."):
                    field = path[len(tp) + 1 :].split(".", 1)[0]
                    group_key = field in owners[tp]
                    break
        rule = ("a param-group key: the checkpoint's value is restored, as torch.optim does"
                if group_key else "this optimizer's value is kept")
        lines.append(f"{path}: {a!r} in the checkpoint, {b!r} here ({rule})")
    return lines


# --- saved values ------------------------------------------------------------------------
def encode_history(v: torch.Tensor) -> dict[str, Any]:
    """A history as plain data, `{"history": [numbers], "dtype": "float32"}`.

    Histories change length from step to step; torch.distributed.checkpoint
    loads tensors in place into tensors of the live optimizer's shape, so a
    history travels as a list (exact for every float dtype; inf and NaN kept).
    Costs a device-to-host copy, at checkpoint time only.
    """
    return {"history": v.detach().cpu().tolist(), "dtype": str(v.dtype).removeprefix("torch.")}


def _decode_history(v: Any, where: str) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v
    if not (isinstance(v, dict) and set(v) == {"history", "dtype"} and isinstance(v["history"], list)):
        raise ValueError(f"{where}: a history must be a 1-D tensor or {{'history': [numbers], 'dtype': name}}")
    dtype = getattr(torch, str(v["dtype"]), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where}: unknown history dtype {v['dtype']!r}")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v["history"]):
        raise ValueError(f"{where}: a history holds numbers only")
    return torch.tensor(v["history"], dtype=dtype)


def history_keys(transforms: Iterable[Transform]) -> tuple[set[str], dict[str, set[str]]]:
    """Which saved values are histories: per-parameter state keys, and store names per transform key."""
    from .transform import walk

    per_param: set[str] = set()
    store: dict[str, set[str]] = {}
    for key, t in walk(tuple(transforms)):
        for name, b in declared_buffers(t).items():
            if b.kind == "history":
                per_param.add(value_key(key, name))
                store.setdefault(key, set()).add(name)
    return per_param, store


def _undeclared(owner_key: str, t: Transform, name: str, where: str) -> ValueError:
    cls = type(t).__name__
    return ValueError(
        f"load_state_dict: {where} holds {name!r} of transform {owner_key} ({cls}), which {cls} does not "
        f"declare; declare it on the class, e.g. `state_buffers: ClassVar[dict] = {{{name!r}: \"param\"}}` "
        f"(kinds: param, segment, history, counter, fixed, torch; see modopt.Buffer)"
    )


def _check_tensor(v: torch.Tensor, where: str) -> None:
    if v.is_complex() or v.is_sparse:
        raise ValueError(f"{where} is {'complex' if v.is_complex() else 'sparse'}")
    if v.is_meta:
        raise ValueError(f"{where} is on the meta device: it holds no values")


def _check_kind(b: Buffer, v: Any, p: torch.Tensor | None, where: str, expect: tuple[int, ...] | None = None) -> None:
    """Does the saved value `v` fit its declaration (per parameter `p`, or in the store)? `expect`: the
    exact shape of a per-parameter segment value, where the transform says (`Scoped.segment_shape`)."""
    if b.kind == "torch":
        if p is None:
            raise ValueError(f"{where}: a wrapped optimizer's state is per parameter, not transform-wide")
        _check_nested(v, where)
        return
    if b.kind == "counter":
        if isinstance(v, bool) or not isinstance(v, (int, float, torch.Tensor)):
            raise ValueError(f"{where}: a counter must be a number or a 0-d tensor, got {type(v).__name__}")
        if isinstance(v, torch.Tensor):
            _check_tensor(v, where)
            if v.dim() != 0:
                raise ValueError(f"{where}: shape {tuple(v.shape)} does not fit a counter (0-d)")
            if v.dtype == torch.bool:
                raise ValueError(f"{where}: a counter must be a number, got a bool tensor")
        return
    if b.kind == "history":
        v = _decode_history(v, where)
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"{where}: unsupported value of type {type(v).__name__} (a {b.kind} buffer is a tensor)")
    _check_tensor(v, where)
    if b.dtype is not None and not v.is_floating_point():
        raise ValueError(f"{where} has dtype {v.dtype}; a {b.kind} buffer holds floating-point values")
    if b.kind == "fixed":
        if b.shape is not None and tuple(v.shape) != b.shape:
            raise ValueError(f"{where}: shape {tuple(v.shape)} does not fit the declared shape {b.shape}")
        return
    if b.kind == "history":
        if v.dim() != 1:
            raise ValueError(f"{where}: shape {tuple(v.shape)} does not fit a history (1-D)")
        return
    if p is None:  # transform-wide values: 0-d statistics
        if b.kind == "param":
            raise ValueError(f"{where}: a per-parameter buffer cannot be transform-wide")
        if v.dim() != 0:
            raise ValueError(f"{where}: shape {tuple(v.shape)} does not fit a transform-wide statistic (0-d)")
        return
    shape, ps = tuple(v.shape), tuple(p.shape)
    if b.kind == "param" and shape != ps:
        raise ValueError(f"{where} has shape {shape}, which does not fit the parameter (shape {ps})")
    if b.kind == "segment" and expect is not None and shape != expect:
        raise ValueError(f"{where} has shape {shape}; this transform's per-segment value for the parameter "
                         f"(shape {ps}) has shape {expect}")
    if b.kind == "segment" and v.dim() and (v.dim() != p.dim() or any(a not in (c, 1) for a, c in zip(shape, ps))):
        raise ValueError(f"{where} has shape {shape}, which does not fit the parameter (shape {ps})")


def _target_dtype(b: Buffer, p: torch.Tensor | None) -> torch.dtype | None:
    """The dtype a loaded floating-point value of `b` takes (None: the saved one), per `Buffer.dtype`."""
    if b.dtype is None:
        return None
    if b.dtype in ("param", "acc"):
        if p is None or not p.is_floating_point():
            return None  # transform-wide values: converted where they are used
        return p.dtype if b.dtype == "param" else acc_dtype(p.dtype)
    return getattr(torch, b.dtype)


def _check_nested(v: Any, where: str) -> None:
    if isinstance(v, torch.Tensor):
        _check_tensor(v, where)
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_nested(x, f"{where}[{k!r}]")
    elif isinstance(v, (list, tuple)):
        for x in v:
            _check_nested(x, where)
    elif not (v is None or isinstance(v, (int, float, bool, str))):
        raise ValueError(f"{where}: unsupported value of type {type(v).__name__}")


#: per-parameter state keys of torch.optim's optimizers: the ones shaped like the parameter, the ones
#: never negative (counts, second moments, sums of squares), and the keys each class always keeps
_TORCH_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                                 "acc_delta", "sum", "exp_inf", "grad_avg", "ax", "prev", "step_size"})
_TORCH_NONNEGATIVE = frozenset({"step", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum", "exp_inf"})
#: sums and means of squares (and Adamax's max): +inf after gradients of 1e20 in a healthy float32 run, so
#: only NaN is refused there, as for modopt's own `Buffer(finite=False)`
TORCH_SQUARES = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum", "exp_inf"})
_TORCH_REQUIRED = {
    "Adam": {"step", "exp_avg", "exp_avg_sq"}, "AdamW": {"step", "exp_avg", "exp_avg_sq"},
    "RAdam": {"step", "exp_avg", "exp_avg_sq"}, "NAdam": {"step", "exp_avg", "exp_avg_sq", "mu_product"},
    "Adamax": {"step", "exp_avg", "exp_inf"}, "Adagrad": {"step", "sum"}, "RMSprop": {"step", "square_avg"},
    "Adadelta": {"step", "square_avg", "acc_delta"},
}


def check_torch_state(entry: Any, p: torch.Tensor, live: Any, cls_name: str, where: str,
                      queue: list[tuple[str, torch.Tensor, float | None, bool]], made: set[str] | None = None) -> None:
    """A wrapped torch optimizer's saved state for parameter `p`, against what torch's step will read:
    the keys (`made`: those the class creates under the group's values, see `torch_state_keys`; else
    those of the live state `live` when it has one, else the ones `cls_name` always keeps; none other
    than the live state's and `made`), moments shaped like the parameter and floating point, numbers
    finite and counts and second moments not negative. The tensor values' own checks go into `queue`
    (`StateLoader`'s batched read)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: a wrapped optimizer's state is a dict, got {type(entry).__name__}")
    has_live = isinstance(live, dict) and bool(live)
    need = made if made is not None else set(live) if has_live else _TORCH_REQUIRED.get(cls_name, set())
    missing, extra = need - set(entry), (set(entry) - set(live) - (made or set())) if has_live else set()
    if missing or extra:
        raise ValueError(f"{where}: torch.optim.{cls_name}'s state for this parameter has "
                         f"{', '.join(map(repr, sorted(map(str, need)))) or 'no keys'}; the checkpoint "
                         + (f"lacks {', '.join(map(repr, sorted(map(str, missing))))}" if missing else "")
                         + (" and " if missing and extra else "")
                         + (f"adds {', '.join(map(repr, sorted(map(str, extra))))}" if extra else ""))
    for k, v in entry.items():
        at = f"{where}[{k!r}]"
        low = 0.0 if k in _TORCH_NONNEGATIVE else None
        if isinstance(v, torch.Tensor):
            if k in _TORCH_PARAM_SHAPED and (tuple(v.shape) != tuple(p.shape) or not v.is_floating_point()):
                raise ValueError(f"{at} is {tuple(v.shape)} {v.dtype}; torch's step reads it as a floating-point "
                                 f"tensor shaped like the parameter {tuple(p.shape)}")
            if k == "step" and v.dim() != 0:
                raise ValueError(f"{at} has shape {tuple(v.shape)}; a step count is a 0-d tensor or a number")
            if v.is_floating_point() and not v.is_meta:
                queue.append((at, v.detach(), low, k not in TORCH_SQUARES))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            if math.isnan(v) or (math.isinf(v) and k not in TORCH_SQUARES) or (low is not None and v < low):
                raise ValueError(f"{at} is {v!r}: it must be a finite number" + (" >= 0" if low is not None else ""))
        elif k in _TORCH_PARAM_SHAPED and v is not None:
            raise ValueError(f"{at} is a {type(v).__name__}; torch's step reads a tensor")


#: group keys that choose torch's kernel, not which state it keeps (left out of `torch_state_keys`' probe,
#: which runs on the CPU)
_KERNEL_KEYS = ("foreach", "fused", "capturable", "differentiable")


def torch_state_keys(cls: type, values: dict[str, Any], ndim: int) -> set[str] | None:
    """The per-parameter state keys torch optimizer class `cls` creates under the group values `values`
    for a parameter of `ndim` dimensions (Adam's `max_exp_avg_sq` with `amsgrad`, SGD's
    `momentum_buffer` with `momentum`): one step of the class on a zero gradient of a CPU probe
    parameter. None when the probe cannot run (a class that needs a closure or sparse gradients)."""
    kw = {}
    for k, v in values.items():
        if k in _KERNEL_KEYS:
            continue
        if isinstance(v, torch.Tensor):
            if v.numel() != 1 or v.is_meta:
                return None
            v = v.detach().cpu().reshape(()).item()
        kw[k] = v
    try:
        probe = torch.zeros((1,) * ndim, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = cls([probe], **kw)
            probe.grad = torch.zeros_like(probe)
            opt.step()
        return {str(k) for k in opt.state.get(probe, {})}
    except Exception:  # (whatever the class raises: the caller falls back to the keys it knows)
        return None


def _copy_torch_state(v: Any, p: torch.Tensor, key: Any = None) -> Any:
    """A wrapped torch optimizer's state, placed by torch's own rule (its `step` stays where it was,
    floating-point state takes the parameter's dtype and device)."""
    if isinstance(v, torch.Tensor):
        if key == "step":
            return v.detach().clone()
        if p.is_floating_point() and v.is_floating_point():
            return v.detach().to(dtype=p.dtype, device=p.device, copy=True)
        return v.detach().to(device=p.device, copy=True)
    if isinstance(v, dict):
        return {k: _copy_torch_state(x, p, k) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_copy_torch_state(x, p) for x in v)
    return v


class StateLoader:
    """Checks and copies the state of one set of transforms onto one set of parameters.

    `transforms`: the live pipeline (keys as `walk` makes them). Every
    method raises `ValueError` naming the parameter, transform and value at
    fault, and builds new containers only. The checks of the values
    themselves (no NaN, finite counters, at least the declared `low`) are batched: call
    `finish()` after the last `param_state`/`store`, before using what they
    returned (one device-to-host transfer per device).
    """

    def __init__(self, transforms: Iterable[Transform], who: str = "load_state_dict", nonfinite: str = "skip"):
        from .transform import walk

        self.owners: dict[str, Transform] = dict(walk(tuple(transforms)))
        self.who = who
        # with nonfinite="ignore" the user lets inf/NaN reach the state: such a state loads
        self.nan_ok: bool = nonfinite == "ignore"
        self._values: list[tuple[str, torch.Tensor, float | None, bool]] = []  # (where, value, low, finite)
        self._probed: dict[tuple, set[str] | None] = {}  # (torch_state_keys per transform, ndim and values)

    def _owner(self, key: Any, where: str) -> tuple[str, Transform, str]:
        parts = split_value_key(key)
        if parts is None or parts[0] not in self.owners:
            raise ValueError(f"{self.who}: state key {key!r} of {where} belongs to no transform of this pipeline")
        prefix, name = parts
        return prefix, self.owners[prefix], name

    def _value(self, b: Buffer, v: Any, p: torch.Tensor | None, device: torch.device, where: str) -> Any:
        """The loaded copy of one checked value: cast, moved, and queued for the value checks."""
        if not isinstance(v, torch.Tensor):  # a counter given as a Python number
            if (not math.isfinite(v) and not self.nan_ok) or (b.low is not None and v < b.low):
                raise ValueError(f"{where} is {v!r}; a counter is a finite number >= {b.low:g}")
            dtype = _target_dtype(b, p)
            if dtype is not None:  # a counter kept as a tensor (Adam's step): made one, as torch's load does
                return torch.tensor(float(v), dtype=dtype).to(device)
            return v
        dtype = _target_dtype(b, p) if v.is_floating_point() or b.kind == "counter" else None
        out = v.detach().to(device=device, dtype=dtype, copy=True)
        # (loaded onto the meta device, e.g. to build a model before materializing it: check the saved values)
        self._values.append((where, out if not out.is_meta else v.detach().to(dtype=dtype), b.low, b.finite))
        return out

    def param_state(self, entry: Any, p: torch.Tensor, current: dict[str, Any] | None, where: str,
                    group: dict[str, Any] | None = None) -> dict[str, Any]:
        """Check and copy the saved state of one parameter (`current`: what this optimizer holds for it;
        `group`: the param group it will step with, which decides the keys a wrapped torch optimizer needs).

        Floating-point values take the dtype their declaration names for this
        parameter (torch's rule: the parameter's dtype for its moments, step
        counters as they are), whether or not the optimizer holds state yet.
        """
        if not isinstance(entry, dict):
            raise ValueError(f"{self.who}: state of {where} is not a dict")
        out = {}
        for k, v in entry.items():
            prefix, t, name = self._owner(k, where)
            b = declared_buffers(t).get(name)
            if b is None:
                raise _undeclared(prefix, t, name, where)
            what = f"{self.who}: buffer {k!r} of {where} (shape {tuple(p.shape)})"
            shape_of = t.segment_shape if b.kind == "segment" and isinstance(t, Segmented) else None
            if shape_of is not None and shape_of(p) is None:
                raise ValueError(f"{what}: {type(t).__name__}(scope={t.scope!r}) keeps this value transform-wide, "
                                 "not per parameter")
            _check_kind(b, v, p, what, shape_of(p) if shape_of is not None else None)
            if b.kind == "torch":
                check_torch_state(v, p, current.get(k) if current else None,
                                  str(getattr(t, "cls", "")).rsplit(".", 1)[-1], what, self._values,
                                  self._torch_keys(t, group, p.dim()))
                out[k] = _copy_torch_state(v, p)
                continue
            if b.kind == "history":
                v = _decode_history(v, what)
            old = current.get(k) if current else None
            if b.kind == "fixed" and b.shape is None and isinstance(old, torch.Tensor) and old.shape != v.shape:
                raise ValueError(f"{what} has shape {tuple(v.shape)}, this optimizer's is {tuple(old.shape)}")
            out[k] = self._value(b, v, p, p.device if b.device == "param" else torch.device("cpu"), what)
        by_owner: dict[str, dict[str, Any]] = {}
        for k, v in out.items():
            prefix, t, name = self._owner(k, where)
            by_owner.setdefault(prefix, {})[name] = v
        for prefix, values in by_owner.items():  # relations between one transform's values
            self.owners[prefix].check_loaded(values, f"{self.who}: the state of {prefix} for {where}")
        return out

    def _torch_keys(self, t: Transform, group: dict[str, Any] | None, ndim: int) -> set[str] | None:
        """`torch_state_keys` of a wrapped optimizer transform `t` under `group`'s values (cached per load)."""
        cls = getattr(t, "_cls", None)
        if group is None or not isinstance(cls, type) or not isinstance(t, Optimizer):
            return None
        values = {k: group.get(k, v) for k, v in t.hyperparams().items()}
        try:
            key = (id(t), ndim, repr(sorted(values.items())))
        except Exception:
            return None
        if key not in self._probed:
            self._probed[key] = torch_state_keys(cls, values, ndim)
        return self._probed[key]

    def store(self, store: Any, group_devices: list[torch.device]) -> dict[str, dict[str, Any]]:
        """Check and copy the transform-wide state (`{transform key: {name: value}}`).

        `group_devices[g]`: where the values of param group `g` go (the
        device of its first parameter); values of the global scope go to the
        first group's device.
        """
        if not isinstance(store, dict):
            raise ValueError(f"{self.who}: the transform state must be a dict, got {type(store).__name__}")
        bad = [k for k in store if k not in self.owners]
        if bad:
            raise ValueError(f"{self.who}: transform state for unknown key(s) {bad}; this pipeline's: {sorted(self.owners)}")
        default = group_devices[0] if group_devices else torch.device("cpu")
        out: dict[str, dict] = {}
        for key, values in store.items():
            t = self.owners[key]
            if not isinstance(values, dict):
                raise ValueError(f"{self.who}: the state of transform {key} is not a dict")
            decl = declared_buffers(t)
            new = {}
            for name, v in values.items():
                base, gid = split_group_key(name) if isinstance(name, str) else (name, None)
                b = decl.get(base)
                if b is None:
                    raise _undeclared(key, t, str(name), "the transform-wide state")
                if gid is not None and gid >= len(group_devices):
                    raise ValueError(f"{self.who}: {name!r} of transform {key} names param group {gid}, "
                                     f"this optimizer has {len(group_devices)}")
                what = f"{self.who}: {name!r} of transform {key}"
                _check_kind(b, v, None, what)
                if b.kind == "history":
                    v = _decode_history(v, what)
                dev = (group_devices[gid] if gid is not None else default) if b.device == "param" else torch.device("cpu")
                new[name] = self._value(b, v, None, dev, what)
            by_group: dict[Any, dict[str, Any]] = {}
            for name, v in new.items():
                base, gid = split_group_key(name) if isinstance(name, str) else (name, None)
                by_group.setdefault(gid, {})[base] = v
            for gid, vals in by_group.items():  # relations between one transform's values
                t.check_loaded(vals, f"{self.who}: the state of transform {key}" + ("" if gid is None else f", group {gid}"))
            out[key] = new
        return out

    def finish(self) -> None:
        """Refuse a loaded value that is not finite (NaN only, for a `Buffer(finite=False)`: a
        variance of finite gradients of 1e20 overflows float32 to +inf), or below its declared `low`
        (a negative count or variance): under the default non-finite policy modopt never writes one,
        and each turns the parameters into NaN a few steps later. With `nonfinite="ignore"`, NaN
        and inf load: the user let them reach the state."""
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, v, _, _) in enumerate(self._values):
            by_device.setdefault((v.to_local() if hasattr(v, "to_local") else v).device, []).append(i)
        for idx in by_device.values():
            flags = []
            for i in idx:
                _, v, low, finite = self._values[i]
                x = v.to_local() if hasattr(v, "to_local") else v  # a DTensor shard: each rank checks its own
                x = x if x.is_floating_point() else x.double()
                bad = (~torch.isfinite(x) if finite else torch.isnan(x)).any() if not self.nan_ok else x.new_zeros((), dtype=torch.bool)
                if low is not None:
                    bad = bad | (x < low).any()
                flags.append(bad)
            for i, bad in zip(idx, torch.stack(flags).tolist()):
                if bad:
                    where, v, low, finite = self._values[i]
                    rule = ("finite" if finite else "free of NaN") + (f" and >= {low:g}" if low is not None else "")
                    raise ValueError(f"{where} is not {rule}, as every state modopt writes is: the checkpoint is "
                                     "damaged or was edited")
        self._values.clear()
