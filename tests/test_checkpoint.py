"""Checkpoints (modopt/core/checkpoint.py): weights_only round trip, mismatch errors, and failed loads that change nothing.

`load_state_dict` is all or nothing: state of another dtype is cast by torch's rule whether or not the
optimizer holds state, values that no modopt run writes (NaN, negative counts and variances) are refused,
and any mutation of a state dict is refused with nothing changed or loads and steps finitely."""

from __future__ import annotations

import copy
import io
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import modopt as mo
from checks import assert_same, everything, refused, train
from modopt.core.keys import split_group_key, split_value_key
from modopt.core.reduce import acc_dtype
from modopt.core.state import declared_buffers
from modopt.core.transform import walk
import warnings

NAN, INF = float("nan"), float("inf")


def model_and_opt(*transforms, seed=0, **kw):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = mo.Modular(model.parameters(), *(transforms or (mo.ClipNorm(1.0), mo.Adam(lr=1e-2))), **kw)
    return model, opt



def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def snapshot(opt):
    return copy.deepcopy(opt.state_dict())



def test_state_dict_is_plain_data_with_the_config():
    model, opt = model_and_opt()
    train(model, opt, 2)
    sd = roundtrip(opt.state_dict())
    assert sd["modopt"]["format_version"] == mo.core.checkpoint.FORMAT_VERSION == 2
    assert sd["modopt"]["config"] == opt.config.to_dict()
    assert mo.PipelineConfig.from_dict(sd["modopt"]["config"]) == opt.config
    assert set(sd["state"][0]) == {"1:Adam.step", "1:Adam.exp_avg", "1:Adam.exp_avg_sq"}


def test_resume_with_a_scheduler_is_bit_exact():
    model, opt = model_and_opt(mo.ClipNorm(0.5), mo.AdamW(lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)
    for _ in range(4):
        train(model, opt, 1, seed=_)
        sched.step()
    ck = roundtrip({"m": model.state_dict(), "o": opt.state_dict(), "s": sched.state_dict()})
    for k in range(4, 9):
        train(model, opt, 1, seed=k)
        sched.step()
    m2, o2 = model_and_opt(mo.ClipNorm(0.5), mo.AdamW(lr=1e-2), seed=5)
    s2 = torch.optim.lr_scheduler.StepLR(o2, 3, gamma=0.5)
    m2.load_state_dict(ck["m"])
    o2.load_state_dict(ck["o"])
    s2.load_state_dict(ck["s"])
    for k in range(4, 9):
        train(m2, o2, 1, seed=k)
        s2.step()
    for p, q in zip(model.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert o2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_different_structure_is_refused_naming_the_difference_and_changes_nothing():
    model, opt = model_and_opt(mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    train(model, opt, 2)
    other_model, other = model_and_opt(mo.ClipNorm(2.0, scope="tensor"), mo.Adam(lr=1e-2))
    train(other_model, other, 3)
    before = snapshot(other)
    with pytest.raises(ValueError, match=r"config\.transforms\.0\.scope: 'global' != 'tensor'"):
        other.load_state_dict(opt.state_dict())
    assert_same(before, snapshot(other))
    _, third = model_and_opt(mo.ClipNorm(1.0), mo.SGD(lr=1e-2))
    with pytest.raises(ValueError, match=r"config\.transforms\.1\.type: 'Adam' != 'SGD'"):
        third.load_state_dict(opt.state_dict())
    _, fourth = model_and_opt(mo.Chain(mo.ClipNorm(1.0)), mo.Adam(lr=1e-2))
    with pytest.raises(ValueError, match=r"config\.transforms\.0\.type: 'ClipNorm' != 'Chain'"):
        fourth.load_state_dict(opt.state_dict())
    _, fifth = model_and_opt(mo.Adam(lr=1e-2))
    with pytest.raises(ValueError, match=r"config\.transforms: length 2 != 1"):
        fifth.load_state_dict(opt.state_dict())


def test_different_parameter_layout_is_refused_and_changes_nothing():
    model, opt = model_and_opt()
    train(model, opt, 2)
    torch.manual_seed(0)
    bigger = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    o2 = mo.Modular(bigger.parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    train(bigger, o2, 1)
    before = snapshot(o2)
    with pytest.raises(ValueError, match="param group 0 has 4 parameters in the checkpoint, 6 here"):
        o2.load_state_dict(opt.state_dict())
    assert_same(before, snapshot(o2))
    two = mo.Modular([{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:]}],
                     mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    with pytest.raises(ValueError, match="1 param groups, this optimizer 2"):
        two.load_state_dict(opt.state_dict())


@pytest.mark.parametrize(
    "tamper,match",
    [
        (lambda sd: (sd.pop("modopt"), sd["param_groups"][0].pop("modopt")), "not written by modopt"),
        (lambda sd: sd["modopt"].__setitem__("format_version", 99), "unsupported checkpoint format_version 99"),
        (lambda sd: sd["state"].__setitem__(17, {}), "parameter index 17"),
        (lambda sd: sd["state"][0].__setitem__("9:Evil.x", torch.zeros(1)), "belongs to no transform"),
        (lambda sd: sd["state"][0].__setitem__("1:Adam.exp_avg", object()), "unsupported value"),
        (lambda sd: sd["param_groups"][0].__setitem__("params", "x"), "param group 0 of the checkpoint is malformed"),
        (lambda sd: sd["state"][0].__setitem__("1:Adam.undeclared", torch.zeros(1)), "does not declare"),
        (lambda sd: sd["state"][0].__setitem__("1:Adam.exp_avg", torch.zeros(5)), "does not fit the parameter"),
        (lambda sd: sd["modopt"]["transforms"].__setitem__("0:ClipNorm", {"x": torch.zeros(())}), "does not declare"),
        (lambda sd: sd.pop("param_groups"), "expected a dict with 'state' and 'param_groups'"),
        (lambda sd: sd["modopt"]["transforms"].__setitem__("7:Nope", {}), "unknown key"),
    ],
)
def test_tampered_state_dict_raises_and_changes_nothing(tamper, match):
    model, opt = model_and_opt()
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    tamper(sd)
    train(model, opt, 1, seed=1)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert_same(before, snapshot(opt))


def test_load_keeps_state_dtypes_for_half_parameters():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3, dtype=torch.bfloat16)).float().pow(2).sum().backward()
        opt.step()
    sd = roundtrip(opt.state_dict())
    o2 = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    o2.load_state_dict(sd)
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert o2.state[p][k].dtype == v.dtype and torch.equal(o2.state[p][k], v)


def test_a_state_entry_that_is_not_a_parameters_is_saved_and_loaded_as_torch_does():
    """torch.optim lets `opt.state` hold other entries (its state-dict hook tests do): they travel as they are."""
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    opt = mo.Modular([p], mo.Adam())
    opt.step()
    opt.state["test"] = {"note": 1}
    sd = opt.state_dict()
    assert sd["state"]["test"] == {"note": 1}
    again = mo.Modular([p], mo.Adam())
    again.load_state_dict(sd)
    assert again.state["test"] == {"note": 1}
    again.step()
    sd["state"][7] = {}  # an index no group holds is still refused
    with pytest.raises(ValueError, match="no param group holds"):
        mo.Modular([p], mo.Adam()).load_state_dict(sd)


def test_a_step_count_saved_as_a_number_loads_as_a_tensor_as_torch_does():
    p = torch.nn.Parameter(torch.randn(3))
    q = torch.nn.Parameter(p.detach().clone())
    opt, ref = mo.Modular([p], mo.Adam()), torch.optim.Adam([q])
    for o, x in ((opt, p), (ref, q)):
        x.grad = torch.ones(3)
        o.step()
    sd, tsd = opt.state_dict(), ref.state_dict()
    sd["state"][0]["0:Adam.step"], tsd["state"][0]["step"] = 1.0, 1.0
    opt2, ref2 = mo.Modular([p], mo.Adam()), torch.optim.Adam([q])
    opt2.load_state_dict(sd)
    ref2.load_state_dict(tsd)
    assert isinstance(opt2.state[p]["0:Adam.step"], torch.Tensor)
    for o, x in ((opt2, p), (ref2, q)):
        x.grad = torch.ones(3)
        o.step()
    assert torch.equal(p, q) and float(opt2.state[p]["0:Adam.step"]) == 2.0


# --- load is all or nothing, and casts as torch does -------------------------------------------------
def make_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(dtype)


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


# --- values that no run writes --------------------------------------------------------------------
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


def ema_model_and_opt(*transforms, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = mo.Modular(model.parameters(), *(transforms or (mo.ClipNormByEMA(scope="tensor"), mo.Adam(lr=1e-2))))
    return model, opt


def test_truncated_checkpoint_file_raises_and_changes_nothing():
    model, opt = ema_model_and_opt()
    train(model, opt, 3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    data = buf.getvalue()
    train(model, opt, 1, seed=1)
    before = snapshot(opt)
    for cut in (len(data) // 3, len(data) - 50):
        with pytest.raises(Exception):
            opt.load_state_dict(torch.load(io.BytesIO(data[:cut]), weights_only=True))
        assert_same(before, snapshot(opt))


def _drop_param_state(sd):
    sd["state"].pop(next(iter(sd["state"])))


@pytest.mark.parametrize(
    "tamper,match",
    [
        (lambda sd: sd["state"][0].__setitem__("1:Adam.exp_avg", torch.zeros(99)), "does not fit the parameter"),
        (lambda sd: sd["state"][0].__setitem__("1:Adam.exp_avg", torch.zeros(4, 3, 2)), "does not fit"),
        (lambda sd: sd["state"][0].__setitem__("0:ClipNormByEMA.ema", torch.zeros(3, 4)), "does not fit"),
        (lambda sd: sd["state"][1].__setitem__("1:Adam.exp_avg_sq", torch.zeros(2)), "does not fit"),
        (lambda sd: sd["state"][0].__setitem__("1:Adam.exp_avg", torch.zeros(4, 3, dtype=torch.int64)), "floating-point"),
        (lambda sd: sd["state"][0].__setitem__("1:Adam.exp_avg", torch.zeros(4, 3, dtype=torch.complex64)), "complex"),
        (lambda sd: sd["state"][0].__setitem__("1:Adam.step", torch.zeros(1, 1, 1)), "does not fit"),
        (lambda sd: sd["modopt"].__setitem__("format_version", "1"), "format_version"),
        (lambda sd: sd["modopt"].__setitem__("format_version", True), "format_version"),
        (lambda sd: sd["modopt"].__setitem__("config", {"transforms": []}), "pipeline differs"),
        (lambda sd: sd["modopt"].__setitem__("skipped_steps", 3), "skipped_steps"),
        (lambda sd: sd.__setitem__("state", [1, 2]), "'state' must be a dict"),
        (lambda sd: sd["param_groups"][0].__setitem__("params", "all"), "malformed"),
    ],
)
def test_tampered_buffers_are_refused_before_anything_changes(tamper, match):
    model, opt = ema_model_and_opt()
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    tamper(sd)
    train(model, opt, 1, seed=1)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert_same(before, snapshot(opt))
    train(model, opt, 1, seed=2)  # still steps normally
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_wrong_shape_buffer_is_refused_on_a_fresh_optimizer():
    model, opt = ema_model_and_opt()
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2]["1:Adam.exp_avg"] = torch.zeros(3, 4)  # the (2, 4) weight's buffer, transposed
    _, fresh = ema_model_and_opt()
    with pytest.raises(ValueError, match=r"buffer '1:Adam.exp_avg' of parameter 2 \(shape \(2, 4\)\) has shape \(3, 4\)"):
        fresh.load_state_dict(sd)
    assert len(fresh.state) == 0


def _lost(sd, what):
    """`sd` with part of its state removed, as a damaged or hand-edited checkpoint has it."""
    if what == "a parameter's state":
        _drop_param_state(sd)
    elif what == "one value of a parameter":
        del sd["state"][1]["1:Adam.exp_avg_sq"]
    elif what == "the transform state":
        del sd["modopt"]["transforms"]
    elif what == "one transform":
        del sd["modopt"]["transforms"]["0:ZClip"]
    elif what == "the skipped-step count":
        del sd["modopt"]["skipped_steps"]
    return sd


LOST = {  # what the refusal names
    "a parameter's state": r"parameter 0 \(shape \(4, 3\)\): '1:Adam.exp_avg', '1:Adam.exp_avg_sq', '1:Adam.step'",
    "one value of a parameter": r"parameter 1 \(shape \(4,\)\): '1:Adam.exp_avg_sq'",
    "the transform state": r"transform 0:ZClip: 'count', 'mu', 'var'",
    "one transform": r"transform 0:ZClip: 'count', 'mu', 'var'",
    "the skipped-step count": r"the skipped-step count \('skipped_steps'\)",
}


@pytest.mark.parametrize("into", ["fresh", "stepped"])
@pytest.mark.parametrize("what", list(LOST))
def test_a_checkpoint_missing_state_is_refused_naming_it_and_strict_false_loads_it_with_one_warning(what, into):
    """The inventory a checkpoint carries says what its writer held: a part missing from the state is
    refused by name, with nothing changed, whether the optimizer is fresh or has state of its own."""
    model, opt = ema_model_and_opt(mo.ZClip(warmup_steps=2), mo.Adam(lr=1e-2))
    train(model, opt, 3)
    sd = _lost(roundtrip(opt.state_dict()), what)
    m2, o2 = ema_model_and_opt(mo.ZClip(warmup_steps=2), mo.Adam(lr=1e-2), seed=1)
    if into == "stepped":
        train(m2, o2, 2, seed=1)
    refused(m2, o2, lambda: o2.load_state_dict(sd), LOST[what] + r"(.|\n)*Nothing was changed(.|\n)*strict=False")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o2.load_state_dict(sd, strict=False)
    restarts = [w for w in caught if "strict=False" in str(w.message)]
    assert len(restarts) == 1 and __import__("re").search(LOST[what], str(restarts[0].message))
    train(m2, o2, 2, seed=2)  # the restarted parts start again from their initial values
    assert all(torch.isfinite(p).all() for p in m2.parameters())


def test_a_checkpoint_without_an_inventory_is_compared_with_the_live_optimizer():
    """Without the inventory (stripped, or a hand-made dict), the state the running optimizer holds is
    what the checkpoint must cover; into a fresh optimizer there is nothing to compare and it loads."""
    model, opt = ema_model_and_opt(mo.ZClip(warmup_steps=2), mo.Adam(lr=1e-2))
    train(model, opt, 3)
    sd = roundtrip(opt.state_dict())
    del sd["param_groups"][0]["modopt"]
    _drop_param_state(sd)
    refused(model, opt, lambda: opt.load_state_dict(sd), r"parameter 0 \(shape \(4, 3\)\): '1:Adam.exp_avg'")
    _, fresh = ema_model_and_opt(mo.ZClip(warmup_steps=2), mo.Adam(lr=1e-2))
    fresh.load_state_dict(sd)
    assert len(fresh.state) == len(opt.state) - 1


def test_state_that_was_never_there_is_not_missing():
    """torch's usage: a fresh optimizer's state_dict (no step yet) loads into a trained one (its state is
    dropped, as torch does), and a parameter that never had a gradient has no state to lose."""
    model, opt = ema_model_and_opt(mo.ZClip(warmup_steps=2), mo.Adam(lr=1e-2))
    _, fresh = ema_model_and_opt(mo.ZClip(warmup_steps=2), mo.Adam(lr=1e-2))
    empty = roundtrip(fresh.state_dict())
    train(model, opt, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either
        opt.load_state_dict(empty)
    assert len(opt.state) == 0 and opt._store == {}
    model, opt = ema_model_and_opt(mo.ZClip(warmup_steps=2), mo.Adam(lr=1e-2))
    model[0].bias.requires_grad_(False)
    train(model, opt, 2)
    sd = roundtrip(opt.state_dict())
    assert len(sd["state"]) == 3
    m2, o2 = ema_model_and_opt(mo.ZClip(warmup_steps=2), mo.Adam(lr=1e-2), seed=1)
    o2.load_state_dict(sd)
    assert len(o2.state) == 3


def test_an_inventory_without_param_keys_still_names_a_value_no_parameter_holds():
    """A format-2 checkpoint written before `param_keys` lists the keys only: a key that no parameter's
    entry holds any more is refused by name."""
    model, opt = ema_model_and_opt(mo.ZClip(warmup_steps=2), mo.Adam(lr=1e-2))
    train(model, opt, 2)
    sd = roundtrip(opt.state_dict())
    del sd["param_groups"][0]["modopt"]["param_keys"]
    for entry in sd["state"].values():
        del entry["1:Adam.exp_avg_sq"]
    _, fresh = ema_model_and_opt(mo.ZClip(warmup_steps=2), mo.Adam(lr=1e-2))
    refused(model, fresh, lambda: fresh.load_state_dict(sd), r"held by no parameter .*'1:Adam.exp_avg_sq'")


def test_a_malformed_inventory_is_refused_by_name():
    model, opt = ema_model_and_opt(mo.ZClip(warmup_steps=2), mo.Adam(lr=1e-2))
    train(model, opt, 2)
    sd = roundtrip(opt.state_dict())
    sd["param_groups"][0]["modopt"]["param_keys"] = [[["1:Adam.step"], [7]]]
    refused(model, opt, lambda: opt.load_state_dict(sd), r"\['modopt'\]\['param_keys'\] must be")
    with pytest.raises(TypeError, match="strict must be True or False"):
        opt.load_state_dict(roundtrip(opt.state_dict()), strict="no")


def _torch_adam_checkpoint(model) -> dict:
    """A torch.optim.Adam checkpoint after two real steps (what a user resumes from)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for seed in range(2):
        opt.zero_grad()
        model(torch.randn(5, 3, generator=torch.Generator().manual_seed(seed))).pow(2).mean().backward()
        opt.step()
    return copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "after_steps"])
@pytest.mark.parametrize("tamper,match", [
    (lambda s: s["exp_avg_sq"].fill_(float("nan")), "not free of NaN"),
    (lambda s: s["exp_avg_sq"].fill_(-1.0), ">= 0"),
    (lambda s: s["exp_avg"].fill_(float("inf")), "not finite"),
    (lambda s: s.__setitem__("step", torch.tensor(float("nan"))), "not finite"),
    (lambda s: s.__setitem__("step", torch.tensor(-5.0)), ">= 0"),
    (lambda s: s.__setitem__("step", -5.0), ">= 0"),
    (lambda s: s.pop("exp_avg_sq"), "lacks 'exp_avg_sq'"),
    (lambda s: s.__setitem__("exp_avg", s["exp_avg"].to(torch.int64)), "floating-point tensor shaped like"),
    (lambda s: s.__setitem__("exp_avg", torch.zeros(7)), "floating-point tensor shaped like"),
])
def test_torch_optimizer_refuses_a_wrapped_state_torchs_step_cannot_use(tamper, match, fresh):
    # mo.TorchOptimizer(torch.optim.Adam) loading a torch.optim.Adam checkpoint (or its own): each of
    # these loaded and then made NaN parameters or crashed inside torch's step
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    sd = _torch_adam_checkpoint(model)
    tamper(sd["state"][0])
    opt = mo.Modular(model.parameters(), mo.TorchOptimizer(torch.optim.Adam, lr=1e-2))
    if not fresh:
        train(model, opt, 1)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the kernel note of a torch checkpoint)
        opt.load_state_dict(sd)
    assert_same(before, snapshot(opt))
    train(model, opt, 1, seed=3)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("make, group, drop", [
    (lambda: mo.TorchOptimizer(torch.optim.Adam, lr=1e-2, amsgrad=True), {}, "max_exp_avg_sq"),
    (lambda: mo.TorchOptimizer(torch.optim.Adam, lr=1e-2), {"amsgrad": True}, "max_exp_avg_sq"),
    (lambda: mo.TorchOptimizer(torch.optim.SGD, lr=1e-2, momentum=0.9), {}, "momentum_buffer"),
    (lambda: mo.TorchOptimizer(torch.optim.RMSprop, lr=1e-2, centered=True), {}, "grad_avg"),
    (lambda: mo.TorchOptimizer(torch.optim.Rprop, lr=1e-2), {}, "prev"),
], ids=["amsgrad", "amsgrad as a group value", "SGD momentum", "RMSprop centered", "Rprop"])
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "after_steps"])
def test_torch_optimizer_refuses_a_state_without_a_key_the_group_flags_need(make, group, drop, fresh):
    """The keys the wrapped class creates under the loaded group's flags (a probe step of the class):
    an amsgrad state without `max_exp_avg_sq` loaded, then the next step raised KeyError."""
    model, opt = ema_model_and_opt(make())
    for g in opt.param_groups:
        g.update(group)
    train(model, opt, 2)
    sd = roundtrip(opt.state_dict())
    del sd["state"][1]["0:TorchOptimizer.inner"][drop]
    m2, o2 = ema_model_and_opt(make(), seed=1)
    if not fresh:
        train(m2, o2, 1)
    refused(m2, o2, lambda: o2.load_state_dict(sd), f"buffer '0:TorchOptimizer.inner' of parameter 1 .*the checkpoint "
                                                    f"lacks '{drop}'")
    train(m2, o2, 1, seed=3)
    sd = roundtrip(opt.state_dict())  # the whole state loads and steps
    o2.load_state_dict(sd)
    train(m2, o2, 1, seed=4)


def test_torch_optimizer_loads_an_untouched_torch_checkpoint_and_continues_as_torch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    twin = copy.deepcopy(model)
    sd = _torch_adam_checkpoint(model)
    ref = torch.optim.Adam(twin.parameters(), lr=1e-2)
    _torch_adam_checkpoint(twin)  # the same two steps on the twin
    ref.load_state_dict(copy.deepcopy(sd))
    opt = mo.Modular(model.parameters(), mo.TorchOptimizer(torch.optim.Adam, lr=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.load_state_dict(sd)
    for m, o in ((model, opt), (twin, ref)):
        o.zero_grad()
        m(torch.ones(5, 3)).pow(2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
