"""`Select`: which parameters, as data (used by `Masked` and by AGC's `exclude`).

A parameter is selected when it satisfies *every* criterion that is set:

* `names`: its name matches one of these glob patterns (`fnmatch`, case
  sensitive; `*` also matches dots). `None` (default): any name.
* `exclude`: its name matches none of these patterns.
* `min_ndim` / `max_ndim`: `min_ndim <= p.dim() <= max_ndim`.
* `groups`: its param group is listed, by index in `optimizer.param_groups`
  or by the group's `"name"` entry. `None` (default): any group.

A plain string is shorthand for `names=[string]`; a list of strings for
`names=list`. Names come from `Modular(model.named_parameters(), ...)` or a
param group's `"param_names"` (or `"names"`) list. Selecting by name when a
parameter has no name is an error.

The names are checked when the `Modular` is built (`check_selections`): every
`names` pattern must match the name of some parameter of the optimizer (a
typo is an error naming the pattern), and selecting by name where the
parameters have no names is refused then, not at the first step. `exclude`
patterns may name parameters the model lacks (shared exclude lists do).

    ```pycon
    >>> import modopt as mo
    >>> mo.Select("*.weight", min_ndim=2)
    Select(names=['*.weight'], min_ndim=2)

    ```
"""

from __future__ import annotations

import fnmatch
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import compile_marks
from .keys import transform_key
from .step import Step
from .roles import Optimizer, SelectsByName
from .transform import Transform


#: one parameter as a selection's checks see it: `(param, name or None, group index, param group)`
Entry = tuple[torch.Tensor, Optional[str], int, dict[str, Any]]
#: an optimizer transform in a pipeline: `(state key, transform, the selections enclosing it, outermost first)`
Route = tuple[str, Transform, tuple["Select", ...]]


def _schema_shorthands(schema: dict[str, Any]) -> None:
    """In the JSON schema, a selection is the object, a glob string or a list of globs."""
    obj = dict(schema)
    title = obj.pop("title", "Select")
    schema.clear()
    schema.update(title=title, anyOf=[obj, {"type": "string"}, {"type": "array", "items": {"type": "string"}}])


class Select(BaseModel):
    """Which parameters: every criterion that is set must hold (see the module `modopt.core.select`)."""

    model_config: ClassVar[ConfigDict] = ConfigDict(frozen=True, extra="forbid", json_schema_extra=_schema_shorthands)

    names: Optional[list[str]] = None
    exclude: list[str] = Field(default_factory=list)
    min_ndim: Optional[int] = Field(None, ge=0)
    max_ndim: Optional[int] = Field(None, ge=0)
    groups: Optional[list[Union[int, str]]] = None

    def __repr__(self) -> str:
        args = [f"{k}={getattr(self, k)!r}" for k in type(self).model_fields if k in self.model_fields_set]
        return f"Select({', '.join(args)})"

    def __init__(self, names: Any = None, /, **kwargs: Any) -> None:
        if names is not None:
            if "names" in kwargs:
                raise TypeError("Select got names both positionally and by name")
            kwargs["names"] = [names] if isinstance(names, str) else names
        super().__init__(**kwargs)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"names": [data]}
        if isinstance(data, (list, tuple)) and all(isinstance(x, str) for x in data):
            return {"names": list(data)}
        return data

    @model_validator(mode="after")
    def _ndims(self) -> "Select":
        if self.min_ndim is not None and self.max_ndim is not None and self.min_ndim > self.max_ndim:
            raise ValueError(f"min_ndim ({self.min_ndim}) > max_ndim ({self.max_ndim}): nothing could be selected")
        return self

    # --- plain data ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field as plain data (lists, not tuples)."""
        return {
            "names": None if self.names is None else list(self.names),
            "exclude": list(self.exclude),
            "min_ndim": self.min_ndim,
            "max_ndim": self.max_ndim,
            "groups": None if self.groups is None else list(self.groups),
        }

    def cache_key(self) -> tuple[Hashable, ...]:
        """A hashable key of this selection (for per-layout caches)."""
        return (
            "modopt.select",
            None if self.names is None else tuple(self.names),
            tuple(self.exclude),
            self.min_ndim,
            self.max_ndim,
            None if self.groups is None else tuple(self.groups),
        )

    def describe(self) -> str:
        """Short, user-facing form: `Select(names=['*.weight'], min_ndim=2)` (set fields only)."""
        d = self.to_dict()
        parts = [f"{k}={v!r}" for k, v in d.items() if v not in (None, [])]
        return f"Select({', '.join(parts)})"

    @property
    def by_name(self) -> bool:
        """Whether this selection asks for parameter names (`names` or `exclude` set)."""
        return self.names is not None or bool(self.exclude)

    # --- matching --------------------------------------------------------------
    def matches(self, name: str | None, p: "torch.Tensor", group_index: int, group: dict[str, Any]) -> bool:
        """Does this selection take parameter `p` (named `name`) of param group `group_index`?"""
        if not self._pre(p, group_index, group):
            return False
        if self.by_name:
            if name is None:  # checked (with a clear message) by the callers before matching
                raise ValueError(self._unnamed_message(1))
            any_match = compile_marks.any_match if torch.compiler.is_compiling() else _any_match
            if self.names is not None and not any_match(name, tuple(self.names)):
                return False
            if any_match(name, tuple(self.exclude)):
                return False
        return True

    def _pre(self, p: "torch.Tensor", group_index: int, group: dict) -> bool:
        """The criteria that need no name (groups, ndim)."""
        if self.groups is not None:
            gname = group.get("name")
            if group_index not in self.groups and (gname is None or gname not in self.groups):
                return False
        nd = p.dim()
        if self.min_ndim is not None and nd < self.min_ndim:
            return False
        if self.max_ndim is not None and nd > self.max_ndim:
            return False
        return True

    def _name_message(self, problem: str, owner: str | None = None) -> str:
        """The one text of every error about the names a selection asks for (at build or at a step)."""
        return f"{owner or self.describe()} selects parameters by name, but {problem}"

    def _unnamed_message(self, count: int, owner: str | None = None) -> str:
        return self._name_message(
            f"{count} parameter(s) have no name: "
            "build the optimizer from model.named_parameters(), or give each param group a 'param_names' "
            "list (or select by groups/min_ndim/max_ndim instead)",
            owner,
        )

    def _unmatched_message(self, bad: list[tuple[str, str]], known: list[str], owner: str | None = None) -> str:
        from .transform import did_you_mean

        listed = "; ".join(f"{field} pattern {pat!r}{did_you_mean(pat, known)}" for field, pat in bad)
        shown = ", ".join(repr(n) for n in known[:6]) + (f", ... ({len(known) - 6} more)" if len(known) > 6 else "")
        return self._name_message(
            f"{listed} {'matches' if len(bad) == 1 else 'match'} none of the {len(known)} parameter name(s) "
            f"of the optimizer ({shown}); patterns are fnmatch globs, case sensitive, and `*` also matches dots",
            owner,
        )

    def check_names(self, entries: list[Entry], known: list[str] | None = None, owner: str | None = None,
                    selected: bool = True) -> list[Entry]:
        """Check the names this selection asks for over `entries` (`(param, name, group_index, group)`)
        as a step would, and, given `known` (every parameter name of the optimizer), more:

        * a name selection over unnamed entries raises the step's error (`_unnamed_message`);
        * with no names at all (`known == []`), asking for names is that same error;
        * a `names` pattern that matches none of `known` (a typo) raises naming it. `exclude`
          patterns are not checked this way: excluding a name the model lacks takes nothing away
          (shared exclude lists name parameters some models do not have).

        Returns the entries the selection takes (`selected=False`: not computed, `[]`)."""
        if not entries:
            return []
        params, names, gidx, groups = (list(x) for x in zip(*entries))
        self._check_named(params, names, gidx, groups, owner)  # the step's check
        if known is not None and self.by_name:
            if not known:
                raise ValueError(self._unnamed_message(len(entries), owner))
            bad = [("names", pat) for pat in (self.names or ()) if not any(fnmatch.fnmatchcase(n, pat) for n in known)]
            if bad:
                raise ValueError(self._unmatched_message(bad, known, owner))
        if not selected:
            return []
        return [e for e in entries if self.matches(e[1], e[0], e[2], e[3])]

    def _check_named(self, params: list, names: list, group_indices: list[int], groups: list[dict],
                     owner: str | None = None) -> None:
        """A selection by name needs the names of the parameters its other criteria take."""
        if self.by_name:  # names are needed only where the other criteria hold
            unnamed = sum(1 for p, n, gi, g in zip(params, names, group_indices, groups)
                          if n is None and self._pre(p, gi, g))
            if unnamed:
                raise ValueError(self._unnamed_message(unnamed, owner))

    def mask_of(self, params: list[torch.Tensor], names: list[str | None], group_indices: list[int],
                groups: list[dict[str, Any]], owner: str | None = None) -> list[bool]:
        """Per parameter: selected or not. `group_indices[i]` / `groups[i]`: the group of `params[i]`."""
        self._check_named(params, names, group_indices, groups, owner)
        return [self.matches(n, p, gi, g) for p, n, gi, g in zip(params, names, group_indices, groups)]

    def mask(self, ctx: Any, owner: str | None = None) -> list[bool]:
        """Per parameter of the step: selected or not; computed once per layout (`ctx.layout.cache`; `ctx`: a `modopt.core.step.Step`)."""
        cache = ctx.layout.cache
        key = self.cache_key()
        if key in cache:
            return cache[key]
        gidx: list[int] = []
        groups: list[dict] = []
        for gi, g, (a, b) in zip(ctx.group_ids, ctx.groups, ctx.ranges):
            gidx.extend([gi] * (b - a))
            groups.extend([g] * (b - a))
        names = step_names(ctx) if self.by_name else [None] * len(ctx.params)
        out = cache[key] = self.mask_of(ctx.params, names, gidx, groups, owner)
        return out


def selected_named(where: Select, named: list[tuple[str | None, "torch.Tensor"]]) -> list[tuple[str | None, "torch.Tensor"]]:
    """The `(name, parameter)` pairs of `named` that `where` takes, as far as a check at build can tell: a
    selection by param group cannot be told there (`named` holds no groups), nor one by name when some
    parameter is unnamed: every pair is kept then (the checks err on the side of looking at more)."""
    if where.groups is None and not (where.by_name and any(n is None for n, _ in named)):
        return [(n, p) for n, p in named if where.matches(n, p, 0, {})]
    return list(named)


def _any_match(name: str, patterns: tuple[str, ...]) -> bool:
    """Does `name` match one of the glob `patterns` (`fnmatch`, case-sensitive)? Traced by `torch.compile`
    as a constant (`compile_marks.any_match`): it runs when a layout is first seen (its result is cached
    per layout), and dynamo cannot trace `fnmatch` itself."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


compile_marks.constant("any_match", _any_match)


def group_names(group: dict[str, Any]) -> list[str | None] | None:
    """A param group's parameter names: its `"param_names"` (torch's key) or `"names"` list, or None."""
    names = group.get("param_names") or group.get("names")
    return list(names) if names else None


def step_names(ctx: Step) -> list[str | None]:
    """The name of each parameter of the step: `ctx.names`, else the group's `"names"` list."""
    names = list(ctx.names)
    if all(n is not None for n in names):
        return names
    for g, (a, b) in zip(ctx.groups, ctx.ranges):
        gnames = group_names(g)
        if not gnames:
            continue
        by_id = {id(p): n for p, n in zip(g["params"], gnames)}
        for i in range(a, b):
            if names[i] is None:
                names[i] = by_id.get(id(ctx.params[i]))
    return names


# --- the names, checked when the optimizer is built ------------------------------------
def check_selections(transforms: Sequence[Transform], groups: list[tuple[int, dict[str, Any]]],
                     patterns: bool = True) -> None:
    """Check the names the transforms' selections ask for against the parameters of `groups`
    (`(index, param group)` pairs), as `Modular` does when it is built (and, `patterns=False`, for a
    group added later: only the step's check of unnamed parameters). See `Select.check_names`.
    Raises `ValueError` with the text a step would give.

    Every `names` pattern is checked against every parameter name of `groups` (a typo names no
    parameter at all; a pattern that names parameters outside an enclosing selection is not an
    error); `exclude` patterns are not. The check of unnamed parameters sees what a step would: the
    parameters the enclosing selections take.

    A transform takes part through `name_selection(key)`, returning `(select, owner)` (or None):
    `owner` is the label its step's errors use, and the selection restricts what its children
    see (`Masked`; AGC's `exclude` has no children). The parameters' names are their group's
    `"param_names"` (or `"names"`) list, as at a step.
    """
    entries: list[tuple] = []
    for gi, g in groups:
        ps = list(g["params"])
        names = (group_names(g) or [])[: len(ps)]
        names += [None] * (len(ps) - len(names))
        entries.extend(zip(ps, names, [gi] * len(ps), [g] * len(ps)))
    known = [e[1] for e in entries if e[1] is not None] if patterns else None
    _check_tree(transforms, "", entries, known)


def _check_tree(transforms: Sequence[Transform], prefix: str, entries: list[Entry], known: list[str] | None) -> None:
    for i, t in enumerate(transforms):
        key = transform_key(i, type(t).__name__, prefix)
        sel = t.name_selection(key) if isinstance(t, SelectsByName) else None
        inner = entries
        if sel is not None:
            select, owner = sel
            inner = select.check_names(entries, known, owner, selected=bool(t.children()))
        kids = t.children()
        if kids:
            _check_tree(kids, key, inner, known)


# --- routing: optimizer transforms in masked branches -----------------------------------
def _optimizer_paths(transforms: Sequence[Transform], prefix: str = "", selects: tuple[Select, ...] = ()) -> list[Route]:
    """Every optimizer transform with its key and the selections (outermost first) enclosing it.

    A transform whose `where` is a `Select` (`Masked`) restricts its children to it.
    """
    out = []
    for i, t in enumerate(transforms):
        key = transform_key(i, type(t).__name__, prefix)
        if isinstance(t, Optimizer):
            out.append((key, t, selects))
        where = getattr(t, "where", None)
        inner = selects + (where,) if isinstance(where, Select) else selects
        out.extend(_optimizer_paths(t.children(), key, inner))
    return out


def routes(transforms: Sequence[Transform]) -> list[Route] | None:
    """The optimizer transforms with their selections when some sits inside a `Masked`, else None."""
    paths = _optimizer_paths(transforms)
    return paths if any(sel for _, _, sel in paths) else None


def route_group(paths: list[Route], group: dict[str, Any], index: int, given: set[str]) -> None:
    """Check that each parameter of param group `index` reaches exactly one optimizer transform, and
    set the group's shared hyperparameters (`lr`, ...) to the defaults of the branch that owns it.

    `given`: keys set explicitly (in the group dict or `Modular`'s keyword defaults); those are kept.
    A group whose parameters belong to branches with different defaults for a shared key must set it.
    """
    params = group["params"]
    names = group_names(group) or [None] * len(params)
    owners: list[list[str]] = [[] for _ in params]
    for key, t, selects in paths:
        for j, (p, n) in enumerate(zip(params, names)):
            if all(_match_for_route(s, n, p, index, group, key) for s in selects):
                owners[j].append(key)

    def label(j: int) -> str:
        return names[j] if names[j] is not None else f"#{j}"

    none = [label(j) for j, o in enumerate(owners) if not o]
    if none:
        raise ValueError(
            f"param group {index}: parameter(s) {', '.join(none)} reach no optimizer transform: in a pipeline that "
            "routes parameters to optimizers in Masked branches, every parameter must be selected by exactly one "
            "branch optimizer (add a branch for them, or an optimizer for the rest)"
        )
    many = [f"{label(j)} ({' and '.join(o)})" for j, o in enumerate(owners) if len(o) > 1]
    if many:
        raise ValueError(
            f"param group {index}: parameter(s) {', '.join(many)} are written by more than one optimizer "
            "transform; make the Masked selections disjoint"
        )
    present = {o[0] for o in owners}
    by_key = {key: t for key, t, _ in paths if key in present}
    values: dict[str, dict[str, Any]] = {}
    for key, t in by_key.items():
        for k, v in (t.hyperparams() if isinstance(t, Optimizer) else {}).items():
            values.setdefault(k, {})[key] = v
    for k, per in values.items():
        if k in given:
            continue
        distinct = list({repr(v): v for v in per.values()}.values())
        if len(distinct) > 1:
            detail = " and ".join(f"{key} ({k}={v!r})" for key, v in per.items())
            raise ValueError(
                f"param group {index} holds parameters routed to {detail}, which read the same group key {k!r} "
                f"with different defaults: put each branch's parameters in its own param group "
                f"(and select it with Select(groups=[...])), or set {k!r} in the group"
            )
        group[k] = distinct[0]


def _match_for_route(s: Select, name, p, index: int, group: dict, key: str) -> bool:
    if s.by_name and name is None and s._pre(p, index, group):
        raise ValueError(s._unnamed_message(1, f"{key} is routed by {s.describe()}, which"))
    return s.matches(name, p, index, group)
