"""The base contract and the roles (modopt/core/roles.py): `Transform` keeps eight hooks, each rarer part is a
role a transform inherits, and the core finds roles by type, never by looking a method up by name."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import modopt as mo
from modopt.core import roles
from modopt.core.plan import make_plan
from modopt.core.registry import _TRANSFORMS

ROOT = Path(__file__).resolve().parents[1]

#: the base's hooks: what a transform author sets or overrides on every transform
BASE_HOOKS = {"positional", "state_buffers", "update_access", "device_skip", "apply", "children", "check_params",
              "check_loaded"}
#: what the base offers its users and never asks a subclass for (serialisation, copies, pydantic's config)
BASE_API = {"model_config", "to_dict", "from_dict", "model_copy", "field_order"}

ROLES = list(roles.ROLES)


def _public(cls: type) -> set[str]:
    names = set(cls.__dict__) | set(cls.__dict__.get("__annotations__", {}))
    return {n for n in names if not n.startswith("_") and n not in ("model_fields", "model_computed_fields")}


def role_hooks(role: type) -> set[str]:
    """The hooks a role adds: its own public names, less those a class it inherits declares (the base's
    `device_skip`, `Writer`'s `apply_final`, which `Planned` implements)."""
    inherited = set().union(*(_public(k) for k in role.__mro__[1:] if issubclass(k, mo.Transform)))
    return _public(role) - inherited - BASE_HOOKS - {"model_config"}


def test_every_role_class_is_a_declared_role():
    """`roles.ROLES` (which the plan's checks and these tests read) names every role class of the module."""
    defined = {v for v in vars(roles).values() if isinstance(v, type) and issubclass(v, mo.Transform)
               and v.__module__ == roles.__name__ and v is not roles.Chain}
    assert defined == set(ROLES), sorted(k.__name__ for k in defined ^ set(ROLES))


def test_the_guide_stays_within_150_lines():
    """The guide to writing a transform (docs/contributing.md) names every role and stays short."""
    assert len((ROOT / "docs" / "contributing.md").read_text().splitlines()) <= 150


def test_the_base_has_eight_hooks_and_no_more():
    """A new class attribute or method on `Transform` is a new hook every transform carries: it belongs
    in a role. This fails, naming it, when one is added."""
    hooks = _public(mo.Transform) - BASE_API
    assert hooks == BASE_HOOKS, f"added: {sorted(hooks - BASE_HOOKS)}, removed: {sorted(BASE_HOOKS - hooks)}"
    assert len(BASE_HOOKS) <= 8


def test_each_role_has_the_hooks_the_guide_states():
    """The table in modopt/core/roles.py's docstring and the guide (docs/contributing.md) list each role's
    hooks; both must match the classes."""
    doc = roles.__doc__ or ""
    for role in ROLES:
        row = re.search(rf"^\| `{role.__name__}` \|[^|]*\| ([^|]*) \|$", doc, re.M)
        assert row, f"roles.py's table has no row for {role.__name__}"
        listed = set(re.findall(r"`(\w+)`", row.group(1)))
        assert listed == role_hooks(role), (role.__name__, listed, role_hooks(role))
    guide = (ROOT / "docs" / "contributing.md").read_text()
    missing = [r.__name__ for r in ROLES if f"`{r.__name__}`" not in guide]
    if missing == [r.__name__ for r in ROLES]:
        pytest.skip("docs/contributing.md has no roles section yet")
    assert not missing, f"the guide does not name {missing}"


def test_roles_are_abstract_and_not_registered():
    for role in ROLES:
        assert role.__name__ not in _TRANSFORMS


def test_no_hook_is_looked_up_by_name():
    """No `getattr(t, "<hook>")` or `hasattr(t, "<hook>")` in the package for any base or role hook: the
    core asks `isinstance(t, Role)`."""
    hooks = BASE_HOOKS.union(*(role_hooks(r) for r in ROLES)) | {
        "is_optimizer", "attachable", "may_stop", "must_be_last", "decides_skip", "stage", "swaps_weights",
        "positive_scale", "ends_with_scale", "sets_norm"}
    found = []
    for path in sorted((ROOT / "modopt").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in hooks):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert found == []


def test_the_old_flags_are_gone_from_every_transform():
    """No registered transform carries a flag the roles replaced (it would be read by nothing)."""
    old = {"is_optimizer", "attachable", "may_stop", "must_be_last", "decides_skip", "takes_scale_",
           "skip_reads_groups_", "stage", "swaps_weights", "positive_scale", "ends_with_scale", "sets_norm",
           "on_host_skip_", "routes_"}
    for name, cls in _TRANSFORMS.items():
        left = {n for n in old if hasattr(cls, n)}
        assert not left, (name, left)


@pytest.mark.parametrize("name,expected", [
    ("Adam", {roles.Optimizer, roles.Writer, roles.Planned}), ("SGD", {roles.Optimizer, roles.Writer, roles.Planned}),
    ("ADOPT", {roles.Optimizer, roles.Writer, roles.Planned}),
    ("AdaMuon", {roles.Optimizer, roles.Writer, roles.Planned, roles.ShapeDependent}),
    ("LR", {roles.Optimizer, roles.ScaleFact}),
    ("TorchOptimizer", {roles.Optimizer, roles.LastWriter, roles.Writer, roles.ShapeDependent}),
    ("ScheduleFreeAdamW", {roles.Optimizer, roles.LastWriter, roles.Writer, roles.WeightSwap, roles.Planned}),
    ("Lookahead", {roles.LastWriter, roles.Writer, roles.SeesHostSkips}),
    ("Masked", {roles.Router, roles.Writer, roles.SelectsByName, roles.ShapeDependent}),
    ("SkipStep", {roles.SkipDecider, roles.StepStopper}), ("Accumulate", {roles.StepStopper, roles.SeesHostSkips}),
    ("QKClip", {roles.WeightStage, roles.SeesHostSkips, roles.ShapeDependent}),
    ("ProjectNorm", {roles.WeightStage, roles.ShapeDependent}),
    ("ClipNorm", {roles.ScaleFact, roles.Segmented, roles.ShapeDependent}), ("SPAM", {roles.NeedsMoments}),
    ("WeightDecay", {roles.PostOptimizer}), ("ClipValueByPercentile", {roles.StageLimited, roles.Segmented, roles.ShapeDependent}),
    ("ClipValue", set()),
])
def test_the_builtin_transforms_take_their_roles(name, expected):
    assert {r for r in ROLES if issubclass(_TRANSFORMS[name], r)} == expected


def test_attachable_follows_from_the_roles():
    """`mo.attach` takes a transform exactly when no role of it (or of a transform inside it) forbids it."""
    p = torch.nn.Parameter(torch.ones(2))
    for t, ok in [(mo.ClipNorm(1.0), True), (mo.Chain(mo.ClipNorm(1.0), mo.Normalize()), True),
                  (mo.Masked(mo.ClipValue(0.1), where=mo.Select(min_ndim=1)), True), (mo.Adam(), False), (mo.WeightDecay(0.1), False),
                  (mo.Accumulate(2), False), (mo.SkipStep(), False), (mo.SPAM(), False), (mo.ProjectNorm(), False),
                  (mo.Masked(mo.Adam(), where=mo.Select(min_ndim=1)), False), (mo.Lookahead(mo.SGD(lr=0.1)), False)]:
        assert roles.attachable(t) is ok, t
        if ok:
            mo.attach(torch.optim.SGD([p], lr=0.1), t).remove()
        else:
            with pytest.raises(ValueError, match="cannot be attached"):
                mo.attach(torch.optim.SGD([p], lr=0.1), t)


def test_a_role_that_keeps_order_says_so_and_its_takers_decide_on_the_host_unless_they_declare():
    class _Stopper(roles.StepStopper, abstract=True):
        positional = None

        def apply(self, ctx, st, updates):
            return updates

    class _Declared(_Stopper, abstract=True):
        device_skip = True

    assert not roles.skips_on_device(_Stopper()) and roles.skips_on_device(_Declared())
    assert roles.skips_on_device(mo.Accumulate(2))  # (declared by the class itself)


def test_the_plan_reads_a_scale_fact_declared_with_its_apply():
    """One method, `scale_fact()`, states what the three old declarations did; the plan reads it."""
    p = torch.nn.Parameter(torch.ones(3))
    assert make_plan([mo.ClipNorm(1.0), mo.Normalize(), mo.Adam()], "skip").cancelled == {"0:ClipNorm"}
    assert make_plan([mo.ZClip(), mo.Normalize(), mo.Adam()], "skip").cancelled == frozenset()  # not positive
    assert make_plan([mo.ClipNorm(1.0), mo.Normalize(eps=1e-8), mo.Adam()], "skip").cancelled == frozenset()
    assert make_plan([mo.ClipNorm(1.0), mo.Adam()], "skip").deferred == "0:ClipNorm"
    assert mo.Normalize().scale_fact() == roles.Scale("tensor", None, False, sets_norm=True)
    assert mo.Modular([p], mo.ClipNorm(1.0), mo.Adam(fold_clip=True)).plan.folded == "0:ClipNorm"


def test_the_plan_decides_how_each_chain_runs():
    """The runner reads the plan's `RunShape`s (by parent key and `final`), with nothing cached by id()."""
    plan = make_plan([mo.ClipNorm(1.0), mo.Masked(mo.Adam(), where="w*"), mo.Masked(mo.SGD(lr=0.1), where="b*"),
                      mo.Identity()], "skip")
    top = plan.shapes[("", True)]
    assert top.end == 2 and top.first == 1 and top.writes  # two routed branches write in turn; Identity after
    assert plan.shapes[("1:Masked", True)].writes and plan.shapes[("1:Masked", True)].keys == ("1:Masked/0:Adam",)
    keys = ("0:ClipNorm", "1:Masked", "2:Masked", "3:Identity")
    assert plan.shapes[("", False)] == (keys, 3, 3, False)  # (not final: no writer, no routing)
    runner_src = (ROOT / "modopt" / "core" / "runner.py").read_text()
    assert "id(transforms)" not in runner_src and "_RUN_SHAPES" not in runner_src


@pytest.mark.parametrize("hook,role", [("needs", "NeedsMoments"), ("apply_final", "Writer"), ("scale_fact", "ScaleFact"),
                                       ("on_host_skip", "SeesHostSkips"), ("is_optimizer", "Optimizer"),
                                       ("positive_scale", "ScaleFact"), ("stage", "WeightStage")])
def test_a_hook_without_its_role_is_named_when_the_class_is_defined(hook, role):
    """The plan asks `isinstance(t, Role)`: a hook defined without its role would never be called, so the class
    is refused when it is defined, naming the role to take."""
    with pytest.raises(TypeError, match=rf"defines '{hook}', which the {role} role declares"):
        type("_Forgot", (mo.Transform,), {"__module__": __name__, "positional": None, hook: lambda self: ()})
    ok = type("_Took", (getattr(roles, role), mo.Transform), {"__module__": __name__, "positional": None,
                                                             hook: lambda self: ()}) if hook in roles.ROLES[0].__dict__ \
        or any(hook in r.__dict__ for r in roles.ROLES) else None
    assert ok is None or issubclass(ok, getattr(roles, role))


def test_a_planned_transform_whose_new_plan_asks_for_another_is_refused():
    """`run` returns None to ask for a new plan; a plan just built that does so would make `apply` return None,
    which stops the step without a word: it raises instead, naming the transform, with the parameter unmoved."""

    class _Stale:
        def run(self, ctx, st, updates):
            return None

    class _NeverReady(roles.Planned):
        __module__ = __name__
        positional: ClassVar[str | None] = None

        def make_plan(self, ctx, st, updates, write):
            return _Stale()

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = mo.Modular([p], _NeverReady())
    with pytest.raises(RuntimeError, match="_NeverReady: the plan make_plan just built returned None"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))
