"""Every registered transform is paired with its float64 spec, or says why it has none.

The pairing is ``SPECS`` / ``NO_SPEC`` in ``tests/examples.py``, next to ``NON_DEFAULT``.
A ``Spec`` entry is checked here, generically: one step through ``Modular`` after a
real ``.grad``, on drawn shapes (0-d included), two param groups, float32 and
float64, with the ``NON_DEFAULT`` instances, the default instance and other scopes.
A test-name entry names the test that checks a stateful transform step by step.
Also here: every shipped transform is exported flat, and the worked example of
``docs/transform-reference.md`` is the shipped code.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pydantic
import pytest
import torch
from hypothesis import given, settings, strategies as st

import modopt as mo
import modopt.transforms
from examples import NO_SPEC, NON_DEFAULT, SPECS, Spec, Steps, instances
from families import layouts, run_vs_spec
from modopt.core.registry import get_transform
from modopt.spec import core as spec_core
from test_production_path import check, step_updates
from test_runtime_vs_spec import assert_close_to_inputs, scope_kwargs, tensors_and_groups

ROOT = Path(__file__).resolve().parents[1]
TEST_ID = re.compile(r"\b(tests/[\w/]+\.py)::(\w+)")


def shipped() -> set[str]:
    """The package's own registered transforms (tests register throwaway ones in the same process)."""
    return {n for n in mo.available() if get_transform(n).__module__.startswith("modopt.")}


# --- the pairing ---------------------------------------------------------------------------------
def test_every_shipped_transform_is_paired_with_its_spec_or_says_why_not():
    names = shipped()
    missing = sorted(names - set(SPECS) - set(NO_SPEC))
    assert not missing, (
        f"transform(s) {missing} are paired with no spec: add to tests/examples.py a SPECS line, "
        + " or ".join(
            f'"{n}": Spec(modopt.spec.<family>.<function>) for a one-step transform (run by this file), or '
            f'"{n}": "tests/test_<family>.py::test_<name>_matches_spec" naming the test that checks it step by step'
            for n in missing
        )
        + "; or, without a float64 spec, a NO_SPEC line "
        + ", ".join(f'"{n}": "<why, and what checks it instead>"' for n in missing)
        + " (see docs/contributing.md)"
    )
    both = sorted(set(SPECS) & set(NO_SPEC))
    assert not both, f"{both} are in both SPECS and NO_SPEC in tests/examples.py: keep the one that is true"
    stale = sorted((set(SPECS) | set(NO_SPEC)) - names)
    assert not stale, f"{stale} in SPECS / NO_SPEC of tests/examples.py are not registered transforms: remove them"
    for name, how in SPECS.items():
        assert isinstance(how, (Spec, Steps)) or (isinstance(how, str) and TEST_ID.fullmatch(how)), (
            f'SPECS["{name}"] must be a Spec(...), a Steps(...) or "tests/<file>.py::<test>", got {how!r}'
        )
        if isinstance(how, Spec):
            assert how.fn.__module__.startswith("modopt.spec."), f"{name}'s spec must live in modopt/spec/"
    for name, why in NO_SPEC.items():
        assert isinstance(why, str) and len(why.split()) >= 5, f'NO_SPEC["{name}"]: say why, and what checks it instead'


def named_tests() -> list[tuple[str, str, str]]:
    """``(transform, file, test)`` for every test SPECS names and every test a NO_SPEC reason cites."""
    out = [(name, *TEST_ID.fullmatch(how).groups()) for name, how in SPECS.items() if isinstance(how, str)]
    out += [(name, f, t) for name, why in NO_SPEC.items() for f, t in TEST_ID.findall(why)]
    return out


def test_every_named_test_exists():
    found = named_tests()
    assert len(found) >= 15
    for name, file, test in found:
        path = ROOT / file
        assert path.is_file(), f"{name}: {file} does not exist"
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert test.startswith("test") and test in defined, f"{name}: {file} defines no test function {test}"


# --- the generic one-step test -------------------------------------------------------------------
GENERIC = sorted(name for name, how in SPECS.items() if isinstance(how, Spec))


@st.composite
def two_groups(draw):
    """1 to 4 tensors in each of two param groups, one dtype (float32 or float64)."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    a, _ = draw(tensors_and_groups(dtype=dtype))
    b, _ = draw(tensors_and_groups(dtype=dtype))
    return a + b, [0] * len(a) + [1] * len(b)


def default_instance(t: mo.Transform) -> mo.Transform:
    """``t``'s class with every field at its default (required fields as in ``t``)."""
    cls = type(t)
    return cls(**{f: getattr(t, f) for f, info in cls.model_fields.items() if info.is_required()})


def other_scope(draw, t: mo.Transform) -> mo.Transform:
    kw = {"dim": None, "inverse_dims": False, **scope_kwargs(draw, t.scope)}
    try:
        return t.model_copy(update=kw)
    except pydantic.ValidationError:  # a min_size below the transform's own minimum
        kw.pop("min_size")
        return t.model_copy(update=kw)


def run_spec(fn, ts, group_of, t: mo.Transform) -> list[torch.Tensor]:
    fields = {f: getattr(t, f) for f in type(t).model_fields}
    updates = [x.double() for x in ts]
    if "group_of" in inspect.signature(fn).parameters:
        return fn(updates, group_of, **fields)
    return fn(updates, **fields)


def test_every_transform_with_a_one_step_spec_is_run_below():
    assert {"ClipNorm", "ClipNormByRMS", "Normalize", "Centralize", "ClipValue", "LR", "Identity"} <= set(GENERIC)


@pytest.mark.parametrize("name", GENERIC)
@given(data=st.data())
def test_one_step_through_modular_matches_the_spec(name, data):
    how = SPECS[name]
    ts, group_of = data.draw(two_groups())
    t = data.draw(st.sampled_from(instances(name) + [default_instance(instances(name)[0])]))
    if isinstance(t, mo.Scoped) and data.draw(st.booleans()):
        t = other_scope(data.draw, t)
    params = [torch.nn.Parameter(torch.zeros_like(x)) for x in ts]
    groups = [{"params": [p for p, g in zip(params, group_of) if g == k]} for k in (0, 1)]
    opt = mo.Modular(groups, *([t] if isinstance(t, mo.roles.Optimizer) else [t, mo.LR(1.0)]))
    out = step_updates(opt, params, ts)  # the parameters start at zero: -p is the update
    ref = run_spec(how.fn, ts, group_of, t)
    if how.cancels:
        assert_close_to_inputs(out, ref, ts)
    else:
        check(out, ref, ts[0].dtype)


# --- the generic step-by-step test of a stateful transform -------------------------------------------
STEPWISE = sorted(name for name, how in SPECS.items() if isinstance(how, Steps))


def test_every_transform_with_a_stepwise_spec_is_run_below():
    assert {"ClipNormByEMA"} <= set(STEPWISE)


@pytest.mark.parametrize("name", STEPWISE)
@settings(max_examples=20)
@given(lay=layouts(), data=st.data())
def test_steps_through_modular_match_the_spec(name, lay, data):
    """Several steps (`families.sequence`: spikes, zeros, a flat stretch) of the transform, each one's
    updates equal to its spec class's, with the state carried between steps on both sides."""
    shp, group_of, dtype, seed = lay
    t = data.draw(st.sampled_from(instances(name) + [default_instance(instances(name)[0])]))
    if isinstance(t, mo.Scoped) and data.draw(st.booleans()):
        t = other_scope(data.draw, t)
    fields = {f: getattr(t, f) for f in type(t).model_fields}
    cls = SPECS[name].cls
    spec = cls(group_of, **fields) if "group_of" in inspect.signature(cls).parameters else cls(**fields)
    run_vs_spec(t, spec, shp, group_of, dtype, seed)


# --- exports ---------------------------------------------------------------------------------------
def test_every_family_module_is_exported():
    for info in pkgutil.iter_modules(modopt.transforms.__path__):
        if info.name.startswith("_"):  # helpers, not families
            continue
        family = importlib.import_module(f"modopt.transforms.{info.name}")
        assert isinstance(getattr(family, "__all__", None), list), f"{family.__name__} needs an __all__ (a list)"
        assert set(family.__all__) <= set(modopt.transforms.__all__), (
            f"add `from .{info.name} import *` and `__all__ += {info.name}.__all__` to modopt/transforms/__init__.py"
        )


def test_every_shipped_transform_is_exported_flat_from_its_family():
    for name in shipped():
        cls = get_transform(name)
        assert getattr(mo, name, None) is cls and name in mo.__all__, f"mo.{name} is not exported"
        family = inspect.getmodule(cls)
        if family.__name__.startswith("modopt.transforms."):
            assert name in family.__all__, f"add {name!r} to __all__ in {family.__name__}"
            assert getattr(modopt.transforms, name) is cls and name in modopt.transforms.__all__


# --- the worked example of the guide --------------------------------------------------------------
GUIDE = ROOT / "docs" / "transform-reference.md"  # (the guide, docs/contributing.md, links to it)


def python_blocks(path: Path) -> list[str]:
    """The ```python blocks of a Markdown file (a longer fence may hold a docstring's own fences)."""
    return [m.group(2) + "\n" for m in re.finditer(r"^(`{3,})python\n(.*?)\n\1$", path.read_text(), flags=re.M | re.S)]


def test_the_guides_worked_example_is_the_shipped_code():
    blocks = python_blocks(GUIDE)
    assert inspect.getsource(mo.ClipNormByRMS) in blocks, "docs/transform-reference.md must quote ClipNormByRMS as shipped"
    assert inspect.getsource(spec_core.clip_norm_by_rms) in blocks, "docs/transform-reference.md must quote its spec as shipped"
    quoted = [line.strip() for b in blocks for line in b.splitlines() if line.strip().startswith('"ClipNormByRMS":')]
    assert len(quoted) >= 2  # its NON_DEFAULT and SPECS lines
    examples = {line.strip() for line in (ROOT / "tests" / "examples.py").read_text().splitlines()}
    for line in quoted:
        assert line in examples, f"docs/transform-reference.md quotes {line!r}, which is not in tests/examples.py"
    assert "ClipNormByRMS" in NON_DEFAULT and isinstance(SPECS["ClipNormByRMS"], Spec)


def test_the_worked_example_clips_each_tensor_to_its_rms_threshold():
    a, b = torch.full((100,), 3.0), torch.full((2, 2), 0.5)  # RMS 3 and 0.5
    pa, pb = torch.nn.Parameter(torch.zeros(100)), torch.nn.Parameter(torch.zeros(2, 2))
    pa.grad, pb.grad = a, b
    opt = mo.Modular([pa, pb], mo.ClipNormByRMS(1.5), mo.LR(1.0))
    opt.step()
    assert torch.equal(-pa.detach(), torch.full((100,), 1.5)) and torch.equal(-pb.detach(), b)  # halved; kept
    assert torch.equal(opt.stats["0:ClipNormByRMS.norm"], torch.tensor([3.0, 0.5]))
    assert opt.stats["0:ClipNormByRMS.clipped"].tolist() == [True, False]
    assert mo.ClipNormByRMS(1.5).scale_fact() == mo.roles.Scale("tensor", None, False, positive=True)
    # the linter reads the positive scale fact: a scale constant on each segment of a later Normalize is cancelled by it
    findings = mo.PipelineConfig(transforms=[mo.ClipNormByRMS(1.0), mo.Normalize(scope="global"), mo.SGD(lr=0.1)]).lint()
    assert [f.key for f in findings] == []  # per tensor, under a global Normalize: it changes the direction
    findings = mo.PipelineConfig(transforms=[mo.ClipNormByRMS(1.0, scope="global"), mo.Normalize(), mo.SGD(lr=0.1)]).lint()
    assert [f.key for f in findings] == ["0:ClipNormByRMS"]
