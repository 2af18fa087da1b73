"""modopt/core/hyper.py: every value that enters an optimizer is checked before anything changes.

The doors through which a hyperparameter enters (constructor keywords, group dicts,
`add_param_group`, a config's `defaults`, `TorchOptimizer`'s kwargs, a checkpoint's
groups, a scheduler), the one rule for group keys, and `load_state_dict` as all or
nothing: dtypes cast by torch's rule whether or not the optimizer holds state, and
values that no modopt run writes (NaN, negative counts and variances) refused.
Every refusal is checked to leave parameters, every state tensor and the groups as
they were.
"""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import modopt as mo
from checks import assert_same, train
from modopt.core.keys import split_group_key, split_value_key
from modopt.core.norms import acc_dtype
from modopt.core.state import declared_buffers
from modopt.core.transform import walk

NAN, INF = float("nan"), float("inf")


def make_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(dtype)


def everything(model, opt):
    """What a refusal must leave as it was: parameters, state (tensors and store), groups."""
    return copy.deepcopy({"params": [p.detach().clone() for p in model.parameters()], "opt": opt.state_dict()})


def refused(model, opt, call, match):
    before = everything(model, opt)
    with pytest.raises((ValueError, TypeError), match=match):
        call()
    assert_same(before, everything(model, opt))


# --- 1. one gate for hyperparameters ---------------------------------------------------------------
@pytest.mark.parametrize("bad", [NAN, INF, -1.0, "fast"])
def test_every_door_refuses_a_bad_learning_rate_naming_the_group_and_key(bad):
    model = make_model()
    with pytest.raises(ValueError, match=r"param group 0.*'lr'"):
        mo.Modular(model.parameters(), mo.Adam(), lr=bad)  # keyword default
    with pytest.raises(ValueError, match=r"param group 1.*'lr'"):
        mo.Modular([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": bad}], mo.Adam())
    cfg = {"defaults": {"lr": bad}, "transforms": [{"type": "ClipNorm", "max_norm": 1.0}, {"type": "Adam"}]}
    with pytest.raises(ValueError, match=r"param group 0.*'lr'"):
        mo.load_config(cfg).build(model.parameters())
    with pytest.raises(ValueError, match=r"param group 0.*'lr'"):
        mo.Modular(model.parameters(), mo.TorchOptimizer(torch.optim.RMSprop), lr=bad)
    # add_param_group: refused, and the optimizer keeps its groups
    opt = mo.Modular(model[0].parameters(), mo.Adam())
    refused(model, opt, lambda: opt.add_param_group({"params": model[2].parameters(), "lr": bad}), r"param group 1.*'lr'")
    assert len(opt.param_groups) == 1
    # torch refuses the same values in its own constructor
    if not (isinstance(bad, float) and math.isinf(bad)):  # (torch's check is `0.0 <= lr`: inf passes it)
        with pytest.raises((ValueError, TypeError)):
            torch.optim.Adam(model.parameters(), lr=bad)


@pytest.mark.parametrize("kwargs", [{"lr": NAN}, {"lr": INF}, {"alpha": NAN}, {"lr": -1.0}])
def test_torch_optimizer_kwargs_are_checked_when_built(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        mo.TorchOptimizer(torch.optim.RMSprop, **kwargs)


def test_torch_optimizer_that_cannot_be_built_is_refused_at_once():
    with pytest.raises(ValueError, match="missing 1 required positional argument: 'defaults'"):
        mo.TorchOptimizer("torch.optim.Optimizer")


def test_group_values_are_checked_as_the_transforms_own_fields():
    model = make_model()
    cases = [
        ({"betas": (0.9, 1.5)}, mo.Adam(), r"'betas' = \(0.9, 1.5\): betas\[1\] must be in \[0, 1\)"),
        ({"eps": -1e-8}, mo.Adam(), r"'eps' = -1e-08"),
        ({"weight_decay": NAN}, mo.AdamW(), r"'weight_decay' = nan"),
        ({"momentum": 0.0, "nesterov": True}, mo.SGD(0.1), "nesterov requires momentum > 0"),
        ({"lr": "0.1"}, mo.Adam(), "'lr' = '0.1': a number is needed, got the string '0.1'"),  # the kernels would get the string
    ]
    for group, t, match in cases:
        with pytest.raises(ValueError, match=r"param group 0, as read by 0:\w+: " + match):
            mo.Modular([{"params": model.parameters(), **group}], t)
    # a tensor learning rate is checked by its value, and is kept as given
    opt = mo.Modular([{"params": model.parameters(), "lr": torch.tensor(0.01)}], mo.Adam())
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    with pytest.raises(ValueError, match="'lr'"):
        mo.Modular([{"params": model.parameters(), "lr": torch.tensor(NAN)}], mo.Adam())


def test_a_scheduler_writing_nan_is_refused_before_the_step_changes_anything():
    model = make_model()
    opt = mo.Modular(model.parameters(), mo.ZClip(), mo.Adam(lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 2 else NAN)
    for _ in range(2):
        train(model, opt, 1)
        sched.step()
    model.zero_grad()
    model(torch.randn(5, 3)).pow(2).sum().backward()
    refused(model, opt, opt.step, r"param group 0: 'lr' is nan; a hyperparameter must be finite")


def test_a_checkpoint_with_bad_group_values_is_refused_and_changes_nothing():
    model = make_model()
    opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    train(model, opt, 2)
    for key, value, match in [("lr", NAN, "'lr' = nan"), ("lr", "fast", "'lr' = 'fast'"), ("eps", -1.0, "'eps'"),
                              ("betas", (0.9,), "betas"), ("max_norm", 2.0, "'max_norm' is a field of 0:ClipNorm")]:
        sd = copy.deepcopy(opt.state_dict())
        sd["param_groups"][0][key] = value
        refused(model, opt, lambda: opt.load_state_dict(sd), match)


# --- 7. group keys have one rule ---------------------------------------------------------------------
def test_a_group_key_that_names_an_unread_field_is_refused_pointing_to_masked():
    model = make_model()
    with pytest.raises(ValueError, match=r"'max_norm' is a field of 0:ClipNorm, which does not read it per param "
                                         r"group.*mo\.Masked"):
        mo.Modular([{"params": model.parameters(), "max_norm": 2.0}], mo.ClipNorm(1.0), mo.Adam())
    with pytest.raises(ValueError, match=r"no transform of this pipeline reads 'momentum' \(a group key of Muon, SGD and ScheduleFreeSGD\)"):
        mo.Modular([{"params": model.parameters(), "momentum": 0.9}], mo.Adam())
    with pytest.raises(ValueError, match="no transform of this pipeline reads 'weight_decay'"):
        mo.Modular([{"params": model.parameters(), "weight_decay": 0.1}], mo.ClipNorm(1.0), mo.LR(0.1))


def test_keys_modopt_does_not_know_ride_along_and_are_saved():
    model = make_model()
    opt = mo.Modular([{"params": model.parameters(), "swa_lr": 0.05, "lr_scale": 0.5, "name": "all"}], mo.Adam())
    train(model, opt, 1)
    sd = opt.state_dict()
    assert (sd["param_groups"][0]["swa_lr"], sd["param_groups"][0]["lr_scale"]) == (0.05, 0.5)
    opt2 = mo.Modular(make_model().parameters(), mo.Adam())
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["name"] == "all"


def test_per_parameter_settings_go_through_masked():
    """What the refusal message recommends works: a second ClipNorm for the group that needs another max_norm."""
    model = make_model()
    opt = mo.Modular(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}],
        mo.Masked(mo.ClipNorm(1.0), where=mo.Select(groups=[0])),
        mo.Masked(mo.ClipNorm(2.0), where=mo.Select(groups=[1])),
        mo.SGD(0.1),
    )
    train(model, opt, 2)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --- 2. load is all or nothing, and casts as torch does -------------------------------------------------
def _expected_dtype(b, p, saved):
    if b.kind == "counter":
        return torch.float32 if b.dtype == "float32" else saved
    return {"param": p.dtype, "acc": acc_dtype(p.dtype)}.get(b.dtype, saved)


@pytest.mark.parametrize("saved_dtype,live_dtype", [(torch.float64, torch.float32), (torch.float32, torch.bfloat16),
                                                    (torch.float32, torch.float64)])
def test_state_of_another_dtype_is_cast_as_a_fresh_optimizer_would_create_it(saved_dtype, live_dtype):
    sys.path.insert(0, "tests")
    from examples import base_examples, pipeline_for

    for name, t in base_examples():
        pipe = pipeline_for(t)
        src = make_model(saved_dtype)
        named = list(src.named_parameters())
        opt = mo.Modular(named, *pipe)
        train_typed(src, opt, 3, saved_dtype)
        live = make_model(live_dtype)
        fresh = mo.Modular(list(live.named_parameters()), *pipe)
        fresh.load_state_dict(opt.state_dict())  # a fresh optimizer: no state to compare with
        ref = mo.Modular(list(live.named_parameters()), *pipe)
        train_typed(live, ref, 1, live_dtype)  # what a run in live_dtype creates
        owners = dict(walk(fresh.transforms))
        for p in live.parameters():
            for k, v in fresh.state[p].items():
                if not isinstance(v, torch.Tensor):
                    continue
                prefix, n = split_value_key(k)
                b = declared_buffers(owners[prefix])[n]
                if b.kind == "torch":
                    continue
                assert v.dtype == ref.state[p][k].dtype, (name, k, v.dtype, ref.state[p][k].dtype)
        train_typed(live, fresh, 2, live_dtype)  # and it steps
        assert all(torch.isfinite(p).all() for p in live.parameters()), name


def train_typed(model, opt, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(5, 3, generator=g).to(dtype)).float().pow(2).sum().backward()
        opt.step()


def test_a_double_checkpoint_resumes_a_float_model_as_a_cast_one_does():
    """The case that failed halfway: float64 moments loaded into a fresh float32 optimizer."""
    src = make_model(torch.float64)
    opt = mo.Modular(src.parameters(), mo.ZClip(), mo.Adam(lr=1e-2))
    train_typed(src, opt, 3, torch.float64)
    sd = opt.state_dict()
    cast = copy.deepcopy(sd)
    for entry in cast["state"].values():
        for k in ("1:Adam.exp_avg", "1:Adam.exp_avg_sq"):
            entry[k] = entry[k].float()
        for k in ("0:ZClip.count", "0:ZClip.mu", "0:ZClip.var"):
            if k in entry:
                entry[k] = entry[k].float()
    a, b = make_model(), make_model()
    for m in (a, b):
        with torch.no_grad():
            for p, q in zip(m.parameters(), src.parameters()):
                p.copy_(q)
    oa, ob = mo.Modular(a.parameters(), mo.ZClip(), mo.Adam(lr=1e-2)), mo.Modular(b.parameters(), mo.ZClip(), mo.Adam(lr=1e-2))
    oa.load_state_dict(sd)
    ob.load_state_dict(cast)
    train(a, oa, 3)
    train(b, ob, 3)
    assert_same([p.detach() for p in a.parameters()], [p.detach() for p in b.parameters()])
    assert_same(oa.state_dict()["state"], ob.state_dict()["state"])


# --- 3. values that no run writes --------------------------------------------------------------------
def _trained(nonfinite="skip"):
    model = make_model()
    opt = mo.Modular(model.parameters(), mo.ZClip(scope="tensor"), mo.ClipNormByEMA(), mo.Adam(lr=1e-2),
                     nonfinite=nonfinite)
    train(model, opt, 4)
    return model, opt


@pytest.mark.parametrize("key,value,match", [
    ("2:Adam.exp_avg", NAN, "is not finite"),
    ("2:Adam.exp_avg", INF, "is not finite"),
    ("2:Adam.exp_avg_sq", NAN, "is not free of NaN"),
    ("2:Adam.exp_avg_sq", -1.0, ">= 0"),
    ("2:Adam.step", -3.0, ">= 0"),
    ("2:Adam.step", INF, "is not finite"),
    ("0:ZClip.var", -1.0, ">= 0"),
    ("0:ZClip.mu", NAN, "is not finite"),
    ("0:ZClip.count", -1.0, ">= 0"),
    ("1:ClipNormByEMA.ema", NAN, "is not finite"),
])
def test_values_no_run_writes_are_refused_and_nothing_changes(key, value, match):
    model, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    v = sd["state"][1][key]
    v.view(-1)[0] = value
    refused(model, opt, lambda: opt.load_state_dict(sd), rf"buffer '{key}' of parameter 1 .*{match}")


def test_squares_may_hold_inf_and_ignore_loads_what_it_let_in():
    model, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["2:Adam.exp_avg_sq"].view(-1)[0] = INF  # what gradients of 1e20 leave in float32
    opt.load_state_dict(sd)
    model, opt = _trained(nonfinite="ignore")
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["2:Adam.exp_avg"].view(-1)[0] = NAN
    opt.load_state_dict(sd)  # nonfinite="ignore": the user let NaN reach the state
    assert opt.state[next(model.parameters())]["2:Adam.exp_avg"].isnan().any()


def test_skipped_steps_must_be_a_count():
    model, opt = _trained()
    for bad in (torch.tensor(-1), torch.tensor(1.5), torch.tensor([1, 2]), 3):
        sd = copy.deepcopy(opt.state_dict())
        sd["modopt"]["skipped_steps"] = bad
        refused(model, opt, lambda: opt.load_state_dict(sd), "skipped_steps must be a 0-d integer tensor >= 0")


def test_declared_invariants_hold_in_every_state_modopt_writes():
    """What the load refuses is never written: every declared buffer of every transform, after steps
    of normal, tiny, huge (1e20) and non-finite gradients, is free of NaN, finite where declared, >= low."""
    sys.path.insert(0, "tests")
    from examples import all_examples, pipeline_for

    for name, t in all_examples():
        for dtype in (torch.bfloat16, torch.float32):
            torch.manual_seed(0)
            ps = [torch.nn.Parameter(torch.randn(4, 5, dtype=dtype)), torch.nn.Parameter(torch.randn(5, dtype=dtype))]
            opt = mo.Modular([(f"{i}.w", p) for i, p in enumerate(ps)], *pipeline_for(t))
            for s, scale in enumerate([1.0, 1e-30, 1e20, 1.0, 1e20, 1.0]):
                for p in ps:
                    p.grad = torch.randn_like(p) * scale
                if s == 3:
                    ps[0].grad[0, 0] = NAN
                opt.step()
            owners = dict(walk(opt.transforms))
            values = [(k, declared_buffers(owners[split_value_key(k)[0]])[split_value_key(k)[1]], v)
                      for p in ps for k, v in opt.state[p].items()]
            values += [(f"{key}/{n}", declared_buffers(owners[key])[split_group_key(n)[0]], v)
                       for key, d in opt._store.items() for n, v in d.items()]
            assert values or name in ("Identity", "ClipValue", "ClipNorm", "Normalize", "Centralize",
                                      "GradientCentralization", "Chain", "LR", "AGC") or not t.state_buffers \
                or (isinstance(t, mo.ProjectNorm) and t.radius is not None), name  # (a given radius: no state)
            for k, b, v in values:
                if b.kind == "torch" or not isinstance(v, torch.Tensor):
                    continue
                assert not v.isnan().any(), (name, dtype, k)
                if b.finite:
                    assert torch.isfinite(v).all(), (name, dtype, k)
                if b.low is not None:
                    assert (v >= b.low).all(), (name, dtype, k)


# --- the hypothesis: any mutation is refused with nothing changed, or loads and steps finitely --------
MUTATIONS = ["dtype64", "dtype16", "int", "bool", "flatten", "grow", "nan", "inf", "ninf", "neg", "huge",
             "delete", "rename", "group_nan", "group_str", "group_neg", "group_none", "group_list", "junk_key",
             "misplaced_key"]


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipe=st.sampled_from(["zclip", "ema", "hist", "autoclip", "sgd"]), mutation=st.sampled_from(MUTATIONS),
       pick=st.integers(0, 10_000), grads=st.sampled_from(["normal", "huge"]))
def test_a_mutated_state_dict_is_refused_with_nothing_changed_or_loads_and_steps_finitely(pipe, mutation, pick, grads):
    transforms = {
        "zclip": lambda: (mo.ZClip(), mo.AdamW(lr=1e-2, amsgrad=True)),
        "ema": lambda: (mo.ClipNormByEMA(scope="tensor"), mo.ClipValueByEMA(), mo.Adam(lr=1e-2)),
        "hist": lambda: (mo.HistClip(scope="group"), mo.ClipNormGrowth(), mo.Adam(lr=1e-2)),
        "autoclip": lambda: (mo.AutoClip(), mo.ClipValueGrowth(), mo.SGD(lr=1e-2, momentum=0.9)),
        "sgd": lambda: (mo.Accumulate(2), mo.SGD(lr=1e-2, momentum=0.9)),
    }[pipe]
    model = make_model()
    opt = mo.Modular(model.parameters(), *transforms())
    g = torch.Generator().manual_seed(pick)
    for _ in range(4):
        opt.zero_grad()
        (model(torch.randn(5, 3, generator=g)).pow(2).sum() * (1e18 if grads == "huge" else 1.0)).backward()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    slots = [(sd["state"][i], k) for i in sorted(sd["state"]) for k in sorted(sd["state"][i])]
    slots += [(sd["modopt"]["transforms"][t], n) for t in sorted(sd["modopt"]["transforms"])
              for n in sorted(sd["modopt"]["transforms"][t])]
    group = sd["param_groups"][pick % len(sd["param_groups"])]
    gkey = sorted(k for k in group if k not in ("params", "modopt"))[pick % 3]
    where, key = slots[pick % len(slots)]
    v = where[key]
    if mutation.startswith("group_"):
        group[gkey] = {"group_nan": NAN, "group_str": "fast", "group_neg": -1.0, "group_none": None,
                       "group_list": [1, 2, 3]}[mutation]
    elif mutation == "junk_key":
        group["my_framework_key"] = 1  # rides along
    elif mutation == "misplaced_key":
        group["max_norm" if pipe != "sgd" else "betas"] = 1.0
    elif mutation == "delete":
        del where[key]
    elif mutation == "rename":
        where[key + "x"] = where.pop(key)
    elif isinstance(v, torch.Tensor):
        if mutation in ("dtype64", "dtype16", "int", "bool"):
            where[key] = v.to({"dtype64": torch.float64, "dtype16": torch.float16, "int": torch.int64,
                               "bool": torch.bool}[mutation])
        elif mutation == "flatten":
            where[key] = v.reshape(-1)
        elif mutation == "grow":
            where[key] = torch.cat([v.reshape(-1), v.reshape(-1)[:1]]) if v.numel() else v.reshape(1, 0)
        elif v.is_floating_point() and v.numel():
            v.view(-1)[pick % v.numel()] = {"nan": NAN, "inf": INF, "ninf": -INF, "neg": -1.0, "huge": 1e30}[mutation]
    before = everything(model, opt)
    try:
        opt.load_state_dict(sd)
    except (ValueError, TypeError):
        assert_same(before, everything(model, opt))
        return
    train(model, opt, 2, seed=1)
    assert all(torch.isfinite(p).all() for p in model.parameters()), (pipe, mutation, key)


@pytest.mark.parametrize("bad", [torch.tensor(float("nan")), "0.1", None, [0.1], 1j, float("inf")],
                         ids=["tensor-nan", "string", "none", "list", "complex", "inf"])
@pytest.mark.parametrize("key", ["lr", "eps", "weight_decay"])
def test_a_group_value_written_between_steps_is_refused_before_anything_changes(bad, key):
    p = torch.nn.Parameter(torch.randn(3))
    opt = mo.Modular([p], mo.ClipNorm(1.0), mo.Adam())
    p.grad = torch.randn(3)
    opt.step()
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    opt.param_groups[0][key] = bad
    p.grad = torch.randn(3)
    with pytest.raises(ValueError, match=f"param group 0.*'{key}'.*nothing was changed by this step|"
                                         f"param group 0: '{key}' is .*Nothing was changed"):
        opt.step()
    assert torch.equal(p, before[0])
    assert all(torch.equal(v, opt.state[p][k]) for k, v in before[1].items())


def test_a_changed_group_value_is_checked_with_the_groups_other_values():
    # a group's own momentum makes its nesterov=True right (the transform's momentum is 0): found by
    # tests/test_torch_optim_suite.py (torch's param-group tests); the rule still holds for the group's values
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    opt = mo.Modular([{"params": [p], "momentum": 0.9, "nesterov": True}], mo.SGD())
    opt.step()
    opt = mo.Modular([{"params": [p], "momentum": 0.0}], mo.SGD())
    opt.param_groups[0]["nesterov"] = True
    before = p.detach().clone()
    with pytest.raises(ValueError, match="nesterov requires momentum > 0"):
        opt.step()
    assert torch.equal(p, before)


def test_an_unchanged_group_value_is_not_checked_again_and_a_good_tensor_lr_passes(monkeypatch):
    p = torch.nn.Parameter(torch.randn(3))
    opt = mo.Modular([p], mo.Adam(amsgrad=False))
    calls = []
    real = mo.Adam.check_group_values
    monkeypatch.setattr(mo.Adam, "check_group_values", lambda self, values: calls.append(dict(values)) or real(self, values))
    p.grad = torch.randn(3)
    opt.step()  # the first step checks every value once (they may have been written since the build)
    calls.clear()
    for _ in range(3):
        p.grad = torch.randn(3)
        opt.step()
    assert calls == []  # nothing changed since: nothing checked again
    opt.param_groups[0]["lr"] = torch.tensor(0.01)
    opt.param_groups[0]["amsgrad"] = True
    p.grad = torch.randn(3)
    opt.step()
    assert [sorted(c) for c in calls] == [["lr"], ["amsgrad"]]  # only what changed, each checked once
