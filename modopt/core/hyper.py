"""The one gate for hyperparameters that enter through param groups.

A transform's fields are validated when it is built. The param-group keys it
exposes (`lr`, `betas`, `momentum`, a wrapped optimizer's arguments) can
also enter later, through other doors: `Modular`'s keyword defaults, a param
group dict, `add_param_group`, a config's `defaults`, `load_state_dict`'s
groups, a scheduler. Every door calls `GroupGate.check`, which validates
the group's values as the transform's own fields (`Optimizer.check_group_values`),
so a value refused by `mo.Adam(lr=...)` is refused in a group too, naming
the group and the key.

The rule for group keys, stated once (docs/concepts.md quotes it):

* a key that a transform of the pipeline reads per group (`hyperparams()`) is
  validated as that transform's field;
* a key that modopt knows as a hyperparameter but that no transform of this
  pipeline reads per group is refused: a field of one of its transforms
  (`max_norm` for `ClipNorm`: set per parameter with `Masked`/`Select`), or a
  group key of a modopt optimizer that is not in the pipeline (`momentum`
  given to `Adam`);
* every other key rides along, as in torch (`swa_lr`, Lightning's `name`,
  timm's `lr_scale`, a scheduler's `initial_lr`), and is saved in checkpoints.

`check_live` is the per-step part: a scheduler or a hand writes into the groups between steps, and
a value out of its rule (`modopt.core.values`: the key's declared range, finite, within what the
parameters' compute dtype holds) is refused before the step changes anything. A tensor value a
scheduler fills in place keeps its identity, so the step reads it each time: on the CPU the host
reads it (`read_host_tensors`); elsewhere its rule joins the step's non-finite decision on the
device (`device_ok`: a bad value skips the step, counted as a non-finite gradient is, no sync).
A traced step folds every tensor value in the graph (`traced_ok`).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Iterable

import torch

from . import registry
from .roles import Optimizer
from .hostdata import refuse_device_path
from .transform import Transform, walk
from .values import F64_MAX, Rule, bound_of, check_tensor, dtype_name, host_number

#: group keys modopt itself reads or writes (parameter names, the transform state of a checkpoint)
RESERVED = frozenset({"params", "param_names", "names", "name", "modopt"})


def _plain(v: Any) -> bool:
    """A number or a tuple of numbers (not a bool, a tensor or a string): what the rule table suffices for."""
    if isinstance(v, tuple):
        return all(_plain(x) for x in v)
    return type(v) in (float, int)


def _numbers(v: Any) -> list[tuple[int | None, Any]]:
    """The numbers in a group value with their place in a tuple (None for the value itself)."""
    return list(enumerate(v)) if isinstance(v, tuple) else [(None, v)]


def _in_group(t: Transform, group: dict[str, Any], keys: tuple[str, ...], changed: str) -> Transform:
    """`t` with the group's other values for `keys` that are not tensors (no host read), so that a rule between keys is read
    with this group's values (`nesterov` needs the group's `momentum`, not the transform's); `t` itself where
    those values do not make a transform (the changed key's own check then says what is wrong)."""
    context = {kk: group[kk] for kk in keys if kk != changed and kk in group and not isinstance(group[kk], torch.Tensor)}
    if not context:
        return t
    try:
        return t.model_copy(update=context)
    except (ValueError, TypeError):
        return t



def _and(names: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"

class GroupGate:
    """Which transform reads which group key, and the checks every door runs (see the module)."""

    # (defaults for a gate unpickled from before these attributes existed)
    rules: dict[str, Rule] = {}
    bound = F64_MAX
    host_tensors: list[list[Any]] = []
    device_tensors: list[tuple[int, str, int | None, torch.Tensor]] = []
    device_path = False
    field_numbers: list[tuple[str, float]] = []

    def __init__(self, transforms: Iterable[Transform]):
        walked = walk(tuple(transforms))
        self.readers: dict[str, list[str]] = {}
        self.checks: list[tuple[str, Optimizer, tuple[str, ...]]] = []
        for key, t in walked:
            if not isinstance(t, Optimizer):
                continue
            keys = tuple(t.hyperparams())
            for k in keys:
                self.readers.setdefault(k, []).append(key)
            if keys:
                self.checks.append((key, t, keys))
        self.fields: dict[str, list[str]] = {}
        for key, t in walked:
            for f in type(t).model_fields:
                if f not in self.readers and f not in RESERVED:
                    self.fields.setdefault(f, []).append(key)
        self.optimizer_keys: dict[str, list[str]] = {}
        for name, cls in sorted(registry._TRANSFORMS.items()):
            if issubclass(cls, Optimizer):
                for k in cls.group_keys:
                    if k not in self.readers:
                        self.optimizer_keys.setdefault(k, []).append(name)
        self.live: tuple[str, ...] = tuple(self.readers)  # the group keys a transform reads, checked at every step
        self.checked: list[Any] = []  # their values (per group) that check_live last found good
        #: each live key's range: the meet of its readers' field declarations (a key no field declares, a
        #: wrapped torch optimizer's: any finite number); tuple values (betas) are held to it element-wise
        self.rules: dict[str, Rule] = {}
        for key, t, keys in self.checks:
            for k in keys:
                info = type(t).model_fields.get(k)
                rule = Rule.of_field(info) if info is not None and not _is_tuple_field(info) else Rule()
                self.rules[k] = self.rules[k].meet(rule) if k in self.rules else rule
        #: the largest magnitude of a value for the parameters' compute dtype (`values.bound_of`; set by `Modular`)
        self.bound: float = F64_MAX
        #: tensor values of live keys, as the last `check_live` found them: `(group, key, place, tensor)`; those
        #: the host reads each step (on the CPU) with the number last read, and those the device checks
        self.host_tensors: list[list[Any]] = []
        self.device_tensors: list[tuple[int, str, int | None, torch.Tensor]] = []
        self.device_path: bool = False  # the host's `device_path` the partition above was made under
        #: the transforms' own finite float field values, held to the bound when a group's parameters arrive
        self.field_numbers = [(f"{key}.{f}", x) for key, t in walked for f in type(t).model_fields
                              for x in _floats(getattr(t, f))]

    def admit(self, params: list[torch.Tensor], index: int) -> float:
        """The bound once a group of `params` joins (`values.bound_of`: float32's unless every parameter is
        float64), after checking every field value of the pipeline against it; the caller sets `bound` to it
        once the group's other checks pass."""
        bound = min(self.bound, bound_of(params)) if params else self.bound
        for where, x in self.field_numbers:
            if abs(x) > bound:
                raise ValueError(f"param group {index}: {_out_of_rule(where, x, Rule(), bound)}")
        return bound

    def check(self, group: dict[str, Any], index: int, given: Iterable[str] | None = None) -> None:
        """Refuse a group whose keys or values this pipeline cannot run with (`given`: the keys the
        user set, for the placement rule; default: all of the group's)."""
        for k in given if given is not None else group:
            if k in RESERVED or k in self.readers or not isinstance(k, str):
                continue
            if k in self.fields:
                owners = ", ".join(self.fields[k])
                raise ValueError(
                    f"param group {index}: key {k!r} is a field of {owners}, which does not read it per param group "
                    f"(only {', '.join(map(repr, sorted(self.readers))) or 'no keys'} are). To give some parameters "
                    f"another {k}, put the transform in mo.Masked(..., where=mo.Select(groups=[...])) once per setting"
                )
            if k in self.optimizer_keys:
                raise ValueError(
                    f"param group {index}: no transform of this pipeline reads {k!r} (a group key of "
                    f"{_and(self.optimizer_keys[k])}); its group keys are: "
                    f"{', '.join(sorted(self.readers)) or 'none'}"
                )
        for key, t, keys in self.checks:
            values = {k: group[k] for k in keys if k in group}
            try:
                t.check_group_values(values)
                for k, v in values.items():
                    self._check_number(k, v)
            except (ValueError, TypeError) as e:
                raise ValueError(f"param group {index}, as read by {key}: {e}") from None
        _as_0d(group, self.live)

    def _check_number(self, k: str, v: Any, read: bool = True) -> None:
        """`v` (a live key's value) against the key's rule and the bound, each number of a tuple against
        the bound (the field's own check holds its range); a tensor the host does not `read`, by its kind."""
        rule = self.rules.get(k, Rule())
        for place, x in _numbers(v):
            if isinstance(x, torch.Tensor) and not read:
                check_tensor(x, k)
                continue
            x = host_number(x, k)
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                continue  # (a flag, a string, None: the field's own check says what it accepts)
            r = rule if place is None else Rule()
            if not r.holds(x, self.bound):
                raise ValueError(_out_of_rule(k if place is None else f"{k}[{place}]", x, r, self.bound))

    def check_live(self, groups: list[dict[str, Any]], now: list[Any], device_path: bool = False) -> None:
        """The per-step check of the group values that transforms read: what a scheduler or a hand wrote
        since the last step is refused, naming the group and key, before the step changes anything.

        `now` is `[g.get(k) for g in groups for k in self.live]`. The step calls this only when `now`
        differs from the values last found good (`checked`) by identity: a step whose groups hold the
        same objects checks nothing again. A changed number is held to its key's rule (a few Python
        comparisons); any other changed value (a tuple, a tensor, a NumPy scalar, a string, None) is
        checked as the transform's field as well (`check`). Tensor values are then sorted into those the
        host reads at every step (`read_host_tensors`: on the CPU, unless the host takes the device path,
        `device_path`) and those the device checks (`device_ok`)."""
        if device_path is not False and device_path is not True:  # (before the step changes anything)
            refuse_device_path(device_path)
        old = self.checked if len(self.checked) == len(now) else [None] * len(now)
        n = len(self.live)
        host: list[list[Any]] = []
        device: list[tuple[int, str, int | None, torch.Tensor]] = []
        for i, g in enumerate(groups):
            for j, k in enumerate(self.live):
                v = now[i * n + j]
                if v is old[i * n + j] or k not in g:
                    continue
                try:
                    self._check_number(k, v, read=False)
                    # (a tensor by its value: the host's read below, or the device's `device_ok`)
                    if not isinstance(v, torch.Tensor) and (not _plain(v) or isinstance(v, tuple)):
                        for key, t, keys in self.checks:
                            if k in keys:
                                try:
                                    _in_group(t, g, keys, k).check_group_values({k: _host_only(v, device_path)})
                                except (ValueError, TypeError) as e:
                                    raise ValueError(f"as read by {key}: {e}") from None
                except (ValueError, TypeError) as e:
                    raise ValueError(f"param group {i}: {e} (set by a scheduler or by hand since the last step; "
                                     "nothing was changed by this step)") from None
        _as_0d(groups, self.live, now)
        for i, v in enumerate(now):  # the tensor values: read by the host at every step, or by the device
            for place, x in _numbers(v):
                if isinstance(x, torch.Tensor):
                    k = self.live[i % n]
                    if not device_path and x.device.type == "cpu":
                        host.append([i // n, k, place, x, None])
                    else:
                        device.append((i // n, k, place, x))
        self.host_tensors, self.device_tensors, self.device_path = host, device, device_path
        self.read_host_tensors()
        self.checked = now

    def check_step(self, groups: list[dict[str, Any]], device_path: bool = False) -> None:
        """The host's part of the per-step check, for a step that runs traced (`compile_step` calls it before
        its graph). `Modular.step` runs the same lines inline (a call fewer per step)."""
        now = [g.get(k) for g in groups for k in self.live]
        if len(now) != len(self.checked) or not all(map(operator.is_, now, self.checked)) \
                or self.device_path != device_path:
            self.check_live(groups, now, device_path)
        elif self.host_tensors:
            self.read_host_tensors()

    def read_host_tensors(self) -> None:
        """The tensor values the host reads (on the CPU: a read of memory, no sync), each step: one filled in
        place since it was last read is held to its key's rule and field, or refused naming it."""
        for entry in self.host_tensors:
            i, k, place, t, last = entry
            x = t.item()
            if x == last:
                continue
            name = k if place is None else f"{k}[{place}]"
            r = self.rules.get(k, Rule()) if place is None else Rule()
            problem = None if r.holds(x, self.bound) else _out_of_rule(name, x, r, self.bound)
            if problem is None and place is None:
                for key, t_, keys in self.checks:
                    if k in keys:
                        try:
                            t_.check_group_values({k: x})
                        except (ValueError, TypeError) as e:
                            problem = f"as read by {key}: {e}"
            if problem is not None:
                raise ValueError(f"param group {i}: {problem} (a tensor filled in place since the last step; "
                                 "nothing was changed by this step)")
            entry[4] = x

    def device_ok(self) -> torch.Tensor:
        """0-d bool: every tensor value the host does not read is within its rule (no sync; NaN is not).
        The step folds it into its non-finite decision: a bad value skips the step."""
        oks = [(self.rules.get(k, Rule()) if place is None else Rule()).ok(t, self.bound)
               for _, k, place, t in self.device_tensors]
        ok = oks[0]
        for o in oks[1:]:
            ok = ok & o.to(ok.device, non_blocking=True)
        return ok

    def traced_ok(self, groups: list[dict[str, Any]]) -> torch.Tensor | None:
        """`device_ok` for a traced step, over every live value (the host checks nothing there): a tensor by
        its rule in the graph, a number by its rule now (a number is a constant of the graph: a bad one
        makes a graph that skips). None when every value is a good number."""
        ok: Any = None
        bad_number = False
        for g in groups:
            for k in self.live:
                for place, x in _numbers(g.get(k)):
                    r = self.rules.get(k, Rule()) if place is None else Rule()
                    if isinstance(x, torch.Tensor):
                        o = r.ok(x, self.bound)
                        ok = o if ok is None else ok & o
                    elif isinstance(x, (int, float)) and not isinstance(x, bool) and not r.holds(x, self.bound):
                        bad_number = True
        if bad_number:
            return torch.zeros((), dtype=torch.bool) if ok is None else ok & False
        return ok


def _floats(v: Any) -> list[float]:
    """The finite floats of a field value (a tuple's too)."""
    if isinstance(v, tuple):
        return [x for x in v if type(x) is float and math.isfinite(x)]
    return [v] if type(v) is float and math.isfinite(v) else []


def _is_tuple_field(info: Any) -> bool:
    import typing

    ann = info.annotation
    while typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    return typing.get_origin(ann) is tuple or ann is tuple


def _as_0d(groups: Any, keys: tuple[str, ...], now: list[Any] | None = None) -> None:
    """A one-element tensor value of another shape (torch.optim takes `lr` of shape [1] or [1, 1]) becomes its
    0-d view in the group, which the kernels take: the same memory, so a scheduler's `fill_` of either reaches
    the step. `now` (check_live's list of the values) follows."""
    for i, g in enumerate([groups] if isinstance(groups, dict) else groups):
        for j, k in enumerate(keys):
            v = g.get(k)
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                g[k] = v.reshape(())
                if now is not None:
                    now[i * len(keys) + j] = g[k]


def _host_only(v: Any, device_path: bool) -> Any:
    """`v` for the field check: a tuple's tensors that the host does not read replaced by 0.0 (their values
    are checked on the device)."""
    if isinstance(v, tuple):
        return tuple(x if not isinstance(x, torch.Tensor) or (not device_path and x.device.type == "cpu") else 0.0
                     for x in v)
    return v


def _out_of_rule(name: str, x: Any, rule: Rule, bound: float) -> str:
    if isinstance(x, float) and not math.isfinite(x):
        return f"{name!r} is {x!r}; a hyperparameter must be finite"
    if abs(x) > bound:
        return (f"{name!r} = {x!r} is beyond what the parameters' {dtype_name(bound)} holds ({bound:.3g}): "
                "used by the step it becomes inf")
    return f"{name!r} = {x!r}: must be {rule.says()}"
