"""Checkpoints: weights_only round trip, mismatch errors, and failed loads that change nothing."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import modopt as mo
from checks import assert_same, train


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
