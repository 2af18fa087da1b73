"""torch.distributed.checkpoint in one process: get/set_optimizer_state_dict and dcp.save/dcp.load resume
bit-exactly (no process group: DCP then saves and loads as a single process). FSDP2 on 2 gloo
processes is in tests/distributed/."""

from __future__ import annotations

import warnings

import pytest
import torch

import modopt as mo

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - every CPU wheel of torch 2.13 ships it
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

PIPELINES = {
    # every kind of state: global/group/tensor/slice statistics, per-parameter vectors, histories
    # (store and per parameter), Adam's buffers
    "stats": lambda: [mo.ZClip(warmup_steps=2), mo.ClipNormByEMA(scope="tensor", dim=0, inverse_dims=True),
                      mo.AutoClip(window=3, scope="group"), mo.AutoClip(percentile=90, scope="tensor"), mo.AdamW(lr=1e-2)],
    "momentum": lambda: [mo.ClipNormGrowth(), mo.HistClip(warmup_steps=2), mo.SGD(lr=0.05, momentum=0.9)],
    "torch-optimizer": lambda: [mo.ClipNorm(0.5), mo.TorchOptimizer(torch.optim.RMSprop, lr=1e-2, momentum=0.5)],
}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def groups(model):
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named[:2]], "name": "body"}, {"params": [p for _, p in named[2:]], "lr": 5e-3}]


def train(model, opt, ks):
    for k in ks:
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(6, 3, generator=g) * (1 + k % 4), torch.randn(6, 2, generator=g)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()


def fresh(name):
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3)  # different weights: the load must restore them
    return model, mo.Modular(groups(model), *PIPELINES[name]())


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@pytest.mark.parametrize("name", list(PIPELINES))
def test_get_set_optimizer_state_dict_resumes_bit_exactly(name):
    model = make_model()
    opt = mo.Modular(groups(model), *PIPELINES[name]())
    train(model, opt, range(7))
    osd = get_optimizer_state_dict(model, opt)
    assert set(osd) == {"state", "param_groups"}  # DCP's own format: modopt's entry rides in param_groups[0]
    assert "0.weight" in osd["state"]
    msd = {k: v.clone() for k, v in model.state_dict().items()}
    m2, o2 = fresh(name)
    m2.load_state_dict(msd)
    set_optimizer_state_dict(m2, o2, osd)
    assert o2.param_groups[0]["name"] == "body" and o2.param_groups[1]["lr"] == 5e-3
    train(model, opt, range(7, 13))
    train(m2, o2, range(7, 13))
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert int(o2.stats["skipped_steps"]) == int(opt.stats["skipped_steps"])


@pytest.mark.parametrize("name", list(PIPELINES))
def test_dcp_save_load_resumes_bit_exactly(name, tmp_path):
    model = make_model()
    opt = mo.Modular(groups(model), *PIPELINES[name]())
    train(model, opt, range(7))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    train(model, opt, range(7, 13))

    m2, o2 = fresh(name)
    msd2, osd2 = get_state_dict(m2, o2)
    target = {"model": msd2, "optim": osd2}
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_state_dict(m2, o2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    train(m2, o2, range(7, 13))
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for k, s in opt._store.items():  # every transform's own statistics too
        for n, v in s.items():
            got = o2._store[k][n]
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(got)), (k, n)


def test_a_dcp_state_dict_of_another_pipeline_is_refused():
    model = make_model()
    opt = mo.Modular(groups(model), *PIPELINES["momentum"]())
    train(model, opt, range(3))
    osd = get_optimizer_state_dict(model, opt)
    m2 = make_model()
    o2 = mo.Modular(groups(m2), mo.ClipNormGrowth(), mo.ZClip(warmup_steps=2), mo.SGD(lr=0.05, momentum=0.9))
    with pytest.raises(ValueError, match=r"transform state for unknown key\(s\) \['1:HistClip'\]"):
        set_optimizer_state_dict(m2, o2, osd)


def warm_up(model, opt, steps):
    """Step on zero gradients so every transform has created its state (the fresh side of a DCP load)."""
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    opt.zero_grad()


def test_dcp_with_accumulate_names_the_missing_state_and_the_documented_fix_resumes(tmp_path):
    """Accumulate stops the chain on DCP's own initialising step, so a fresh optimizer has no slots for the
    state of the transforms after it: the load says so (instead of silently starting them afresh), and
    stepping the fresh optimizer through one accumulation cycle first makes the round trip exact."""
    pipeline = lambda: [mo.Accumulate(2), mo.ZClip(warmup_steps=2), mo.AutoClip(window=3), mo.Adam(lr=1e-2)]  # noqa: E731
    model = make_model()
    opt = mo.Modular(groups(model), *pipeline())
    train(model, opt, range(7))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    train(model, opt, range(7, 13))

    m2 = make_model()
    o2 = mo.Modular(groups(m2), *pipeline())
    msd2, osd2 = get_state_dict(m2, o2)
    target = {"model": msd2, "optim": osd2}
    dcp.load(target, checkpoint_id=str(tmp_path))
    with pytest.raises(ValueError, match=r"lacks \d+ value\(s\) its checkpoint was saved with .*a full cycle of Accumulate"):
        set_state_dict(m2, o2, model_state_dict=target["model"], optim_state_dict=target["optim"])

    m3 = make_model()
    o3 = mo.Modular(groups(m3), *pipeline())
    warm_up(m3, o3, 2)
    msd3, osd3 = get_state_dict(m3, o3)
    target = {"model": msd3, "optim": osd3}
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_state_dict(m3, o3, model_state_dict=target["model"], optim_state_dict=target["optim"])
    train(m3, o3, range(7, 13))
    for a, b in zip(model.parameters(), m3.parameters()):
        assert torch.equal(a, b)
