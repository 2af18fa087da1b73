"""The one gate for hyperparameters that enter through param groups.

A transform's fields are validated when it is built. The param-group keys it
exposes (`lr`, `betas`, `momentum`, a wrapped optimizer's arguments) can
also enter later, through other doors: `Modular`'s keyword defaults, a param
group dict, `add_param_group`, a config's `defaults`, `load_state_dict`'s
groups, a scheduler. Every door calls `GroupGate.check`, which validates
the group's values as the transform's own fields (`Transform.check_group_values`),
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

`check_live` is the per-step part: a scheduler writes plain numbers into the
groups, and a non-finite one is refused before the step changes anything (a
few Python comparisons; skipped under `torch.compile`, where group values are
guarded constants or tensors).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from . import registry
from .transform import Transform, walk

#: group keys modopt itself reads or writes (parameter names, the transform state of a checkpoint)
RESERVED = frozenset({"params", "param_names", "names", "name", "modopt"})


def _nonfinite(v: Any) -> bool:
    if isinstance(v, float):
        return not math.isfinite(v)
    if isinstance(v, (tuple, list)):
        return any(_nonfinite(x) for x in v)
    return False


def _plain(v: Any) -> bool:
    """A number or a tuple of numbers (not a bool, a tensor or a string): what the finite check suffices for."""
    if isinstance(v, tuple):
        return all(_plain(x) for x in v)
    return type(v) in (float, int)


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

    def __init__(self, transforms: Iterable[Transform]):
        walked = walk(tuple(transforms))
        self.readers: dict[str, list[str]] = {}
        self.checks: list[tuple[str, Transform, tuple[str, ...]]] = []
        for key, t in walked:
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
            if cls.is_optimizer:
                for k in cls.group_keys:
                    if k not in self.readers:
                        self.optimizer_keys.setdefault(k, []).append(name)
        self.live = tuple(self.readers)  # the group keys a transform reads, checked at every step
        self.checked: list[Any] = []  # their values (per group) that check_live last found good

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
            except (ValueError, TypeError) as e:
                raise ValueError(f"param group {index}, as read by {key}: {e}") from None

    def check_live(self, groups: list[dict[str, Any]], now: list[Any]) -> None:
        """The per-step check of the group values that transforms read: what a scheduler or a hand wrote
        since the last step is refused, naming the group and key, before the step changes anything.

        `now` is `[g.get(k) for g in groups for k in self.live]`. The step calls this only when `now`
        differs from the values last found good (`checked`) by identity: a step whose groups hold the
        same objects checks nothing again. A changed plain number (a scheduler's) is checked to be
        finite; any other changed value (a tensor, a string, None, a list) is checked as the
        transform's field (`check`): a 0-d tensor by its value, one host read when it changes."""
        old = self.checked if len(self.checked) == len(now) else [None] * len(now)
        n = len(self.live)
        for i, g in enumerate(groups):
            for j, k in enumerate(self.live):
                v = now[i * n + j]
                if v is old[i * n + j]:
                    continue
                if _nonfinite(v):
                    raise ValueError(
                        f"param group {i}: {k!r} is {v!r}; a hyperparameter must be finite (set by a scheduler or "
                        "by hand since the last step). Nothing was changed by this step"
                    )
                if k in g and not _plain(v):
                    for key, t, keys in self.checks:
                        if k in keys:
                            try:
                                _in_group(t, g, keys, k).check_group_values({k: v})
                            except (ValueError, TypeError) as e:
                                raise ValueError(f"param group {i}, as read by {key}: {e} (set since the last step; "
                                                 "nothing was changed by this step)") from None
        self.checked = now
