"""Fuzzing: random valid pipelines of every registered transform on hostile gradients; random invalid configs.

Pipelines are drawn from the ``NON_DEFAULT`` examples of every transform with
fields perturbed at random (values drawn from a pool of valid and invalid
values of every kind; a perturbation the model rejects is itself checked to
raise ``pydantic.ValidationError``). Each pipeline runs on a model with a 0-d,
a 1-element, a matrix, an empty and a vector parameter in 2-3 param groups,
with gradients drawn per parameter and step among: normal, zeros, tiny,
huge, inf, NaN, None. Properties:

* no exception but the documented ones (``FloatingPointError`` for
  ``nonfinite="raise"`` on a non-finite gradient);
* parameters stay finite whenever every gradient was finite, or the policy
  removes non-finite values (``skip``, ``zero``);
* the config round-trips exactly (dict, JSON, YAML) and rebuilds an equal pipeline;
* a checkpoint (``torch.save`` / ``torch.load(weights_only=True)``) resumes
  bit-exactly: the resumed run equals the uninterrupted one.

``COUNTS`` tallies the examples run; run with ``-s`` to see the figures.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import re
from collections import Counter

import pydantic
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import modopt as mo
from examples import NON_DEFAULT, instances, needs_moments

COUNTS: Counter = Counter()
#: examples per fuzz test (CI default; `MODOPT_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py -s` for a long hunt)
N_EXAMPLES = int(os.environ.get("MODOPT_FUZZ_EXAMPLES", "120"))
NAMES = sorted(NON_DEFAULT)
#: what ends the update stage (an optimizer, or a wrapper around one), what precedes it, what follows the write
OPTIMIZERS = [n for n in NAMES if isinstance(instances(n)[0], (mo.roles.Optimizer, mo.roles.LastWriter))]
WEIGHTS = [n for n in NAMES if isinstance(instances(n)[0], mo.roles.WeightStage)]
#: transforms that read the lr an optimizer before them exposes: drawn right after one
AFTER_OPTIMIZER = [n for n in ("WeightDecay", "CautiousWeightDecay") if n in NAMES]
MODULES = [n for n in NAMES if n not in OPTIMIZERS and n not in WEIGHTS and n not in AFTER_OPTIMIZER]

#: values a perturbed field may take: valid for some fields, invalid for others
POOL = [None, 0, 1, 2, -1, 0.5, 1e-8, 3.0, 1e6, math.inf, -math.inf, math.nan, True, False, "l1", "linf", "std",
        "mad", "sum", "l0", "global", "group", "tensor", "zeros", "update", "raw", "clipped", "bogus", (0,), (0, 1),
        [-1], [], (0.5, 0.9), "percentile", "mean", "max", "reciprocal"]

GRADS = ["normal", "zeros", "tiny", "huge", "inf", "nan", "none"]
FINITE_GRADS = ["normal", "zeros", "tiny", "huge", "none"]
SHAPES = [(), (1,), (3, 4), (0,), (5,)]


@st.composite
def perturbed(draw, name: str):
    """An instance of ``name``: one of its examples with some fields set to values from POOL."""
    base = draw(st.sampled_from(instances(name)))
    data = base.to_dict()
    cls = type(base)
    fields = [f for f in cls.model_fields if f not in ("transforms", "cls", "kwargs", "criterion")]
    for f in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)) if fields else []:
        data[f] = draw(st.sampled_from(POOL))
    try:
        t = mo.Transform.from_dict(data)
    except pydantic.ValidationError:
        COUNTS["perturbation rejected (ValidationError)"] += 1
        return base
    COUNTS["perturbation accepted"] += 1
    return t


@st.composite
def pipelines(draw):
    mods = [draw(perturbed(n)) for n in draw(st.lists(st.sampled_from(MODULES), min_size=1, max_size=3))]
    if any(needs_moments(t) for t in mods):  # SPAM, Stable-SPAM: an optimizer that offers its moments ends it
        mods.append(draw(perturbed(draw(st.sampled_from(["Adam", "AdamW"])))))
    elif draw(st.booleans()) or not mods:
        mods.append(draw(perturbed(draw(st.sampled_from(OPTIMIZERS)))))
        if AFTER_OPTIMIZER and not isinstance(mods[-1], mo.roles.LastWriter) and draw(st.booleans()):
            mods.append(draw(perturbed(draw(st.sampled_from(AFTER_OPTIMIZER)))))
    # the weight stage, after the write (not after Schedule-Free: its y/z relation refuses one)
    if draw(st.booleans()) and not any(isinstance(t, mo.roles.WeightSwap) for t in mods):
        mods.append(draw(perturbed(draw(st.sampled_from(WEIGHTS)))))
    skips = [t for t in mods if isinstance(t, mo.roles.SkipDecider)]
    if skips:  # skip transforms go first, before every transform that keeps state (Modular refuses them elsewhere):
        # SkipNorm keeps none, so it may come before one SkipStep, which does
        steps = [t for t in skips if isinstance(t, mo.SkipStep)][:1]
        mods = [t for t in skips if not isinstance(t, mo.SkipStep)] + steps \
            + [t for t in mods if not isinstance(t, mo.roles.SkipDecider)]
    return mods


def make_params(n_groups: int):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    names = [f"p{i}" for i in range(len(ps))]
    cuts = {1: [len(ps)], 2: [2, len(ps)], 3: [1, 3, len(ps)]}[n_groups]
    groups, start = [], 0
    for c in cuts:
        groups.append({"params": ps[start:c], "param_names": names[start:c]})
        start = c
    return ps, groups


def grad_for(kind: str, p: torch.Tensor, g: torch.Generator):
    if kind == "none":
        return None
    x = torch.randn(p.shape, generator=g)
    if kind == "zeros":
        return torch.zeros_like(p)
    if kind == "tiny":
        return x * 1e-30
    if kind == "huge":
        return x * 1e20
    if kind in ("inf", "nan") and p.numel():
        x.view(-1)[0] = math.inf if kind == "inf" else math.nan
    return x


def run(opt, ps, plan, seed):
    """Apply ``plan`` (one grad kind per parameter per step); returns whether every step's grads were finite."""
    g = torch.Generator().manual_seed(seed)
    finite = True
    for kinds in plan:
        for p, k in zip(ps, kinds):
            p.grad = grad_for(k, p, g)
            finite &= k in FINITE_GRADS or p.numel() == 0
        opt.step()
    return finite


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and
                                 torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))


@settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    pipe=pipelines(),
    policy=st.sampled_from(["skip", "zero", "raise", "ignore"]),
    n_groups=st.sampled_from([1, 2, 3]),
    plan=st.lists(st.lists(st.sampled_from(GRADS), min_size=len(SHAPES), max_size=len(SHAPES)), min_size=2, max_size=4),
    plan2=st.lists(st.lists(st.sampled_from(GRADS), min_size=len(SHAPES), max_size=len(SHAPES)), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_random_pipelines_on_hostile_gradients(pipe, policy, n_groups, plan, plan2, seed):
    COUNTS["pipelines run"] += 1
    ps, groups = make_params(n_groups)
    try:
        opt = mo.Modular(groups, *pipe, nonfinite=policy)
    except ValueError as e:  # a perturbed Masked(where=...) naming no parameter, or capturable=True with
        # torch's non-fused kernels on CPU parameters: refused when built
        assert re.search(r"selects parameters by name, but names pattern '.*' matches none|capturable=True: "
                         r"torch's non-fused kernels capture only on", str(e)), e
        COUNTS["documented error (a name no parameter has, at build)"] += 1
        return
    # config round trip: dict, JSON and YAML give back the same pipeline
    cfg = opt.config
    assert mo.PipelineConfig.from_dict(cfg.to_dict()) == cfg
    assert mo.PipelineConfig.from_dict(json.loads(cfg.to_json())).to_dict() == cfg.to_dict()
    assert mo.PipelineConfig.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg
    try:
        finite = run(opt, ps, plan, seed)
    except FloatingPointError:
        assert policy == "raise"
        COUNTS["documented error (nonfinite='raise')"] += 1
        return
    if finite or policy in ("skip", "zero"):
        assert all(torch.isfinite(p).all() for p in ps), [p for p in ps]
        COUNTS["finiteness checked"] += 1
    # checkpoint round trip: the resumed run equals the uninterrupted one, bit for bit
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in ps]}, buf)
    ps2, groups2 = make_params(n_groups)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    with torch.no_grad():
        for p, v in zip(ps2, ck["params"]):
            p.copy_(v)
    opt2 = mo.Modular.from_config(groups2, cfg)
    opt2.load_state_dict(ck["opt"])
    errors = []
    for o, q in ((opt, ps), (opt2, ps2)):
        try:
            run(o, q, plan2, seed + 1)
            errors.append(None)
        except FloatingPointError as e:
            errors.append(type(e))
    assert errors[0] == errors[1]
    for a, b in zip(ps, ps2):
        assert same(a.detach(), b.detach())
    COUNTS["checkpoint round trips"] += 1


# --- invalid configs -----------------------------------------------------------------------------

#: (field type marker, an invalid value) used to break a valid config
@st.composite
def invalid_configs(draw):
    name = draw(st.sampled_from(NAMES))
    data = draw(st.sampled_from(instances(name))).to_dict()
    how = draw(st.sampled_from(["unknown_field", "bad_type_name", "field_value", "missing_type", "wrong_container"]))
    if how == "unknown_field":
        data[draw(st.sampled_from(["max_nrom", "lr_", "scpoe", "x"]))] = 1.0
    elif how == "bad_type_name":
        data["type"] = draw(st.sampled_from(["ClipNrom", "", "os.system", "Transform", 3]))
    elif how == "missing_type":
        data.pop("type")
    elif how == "wrong_container":
        return {"transforms": data}  # a dict where a list belongs
    else:
        fields = [f for f in data if f != "type"]
        if not fields:
            data["type"] = "NoSuchTransform"
        else:
            f = draw(st.sampled_from(fields))
            for v in draw(st.permutations(POOL + [{"a": 1}, object.__name__, -1e9])):
                trial = {**data, f: v}
                try:
                    mo.Transform.from_dict(trial)
                except pydantic.ValidationError:
                    data = trial
                    break
                except (TypeError, ValueError) as e:  # pragma: no cover - must not happen: report it
                    raise AssertionError(f"{name}.{f}={v!r} raised {type(e).__name__}, not a ValidationError") from e
            else:
                data["type"] = "NoSuchTransform"
    return {"transforms": [data]}


@settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(cfg=invalid_configs(), policy=st.sampled_from(["skip", "bogus"]))
def test_invalid_configs_never_build(cfg, policy):
    COUNTS["invalid configs"] += 1
    cfg = {**cfg, "nonfinite": policy}
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(pydantic.ValidationError):
        mo.PipelineConfig.from_dict(cfg).build([p])
    # from_config reads its input like a config file: a ConfigError naming the place (from the ValidationError)
    with pytest.raises(mo.ConfigError, match="invalid config") as info:
        mo.Modular.from_config([p], cfg)
    assert isinstance(info.value.__cause__, pydantic.ValidationError)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print("\nfuzz counts: " + ", ".join(f"{k}={v}" for k, v in sorted(COUNTS.items())))
