"""Mixed precision: torch.amp.GradScaler with Modular, and half-precision statistics.

Facts relied on (torch 2.13, ``torch.amp.GradScaler.step``): unless the
optimizer sets ``_step_supports_amp_scaling`` (``Modular`` does not),
``scaler.step(opt)`` calls ``scaler.unscale_(opt)`` itself when the user has
not, then calls ``opt.step()`` only if no gradient held inf/NaN. So clipping
inside ``Modular`` always sees unscaled gradients, and a step the scaler skips
never reaches ``Modular``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import modopt as mo
from checks import assert_same
from examples import all_examples, pipeline_for

EXAMPLES = all_examples()


def model_fn(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 4, generator=g) * 3 for _ in range(n)]


def train(model, opt, xs, scaler=None, explicit_unscale=True, record=None):
    for x in xs:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if explicit_unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        if record is not None:
            record.append(opt.stats["0:ClipNorm.norm"].clone())


@pytest.mark.parametrize("explicit_unscale", [True, False])
def test_clipping_sees_unscaled_gradients(explicit_unscale):
    xs = data(6)
    ref_model, ref_norms = model_fn(), []
    train(ref_model, mo.Modular(ref_model.parameters(), mo.ClipNorm(0.5), mo.Adam(lr=1e-2)), xs, record=ref_norms)
    model, norms = model_fn(), []
    opt = mo.Modular(model.parameters(), mo.ClipNorm(0.5), mo.Adam(lr=1e-2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    train(model, opt, xs, scaler, explicit_unscale, record=norms)
    assert scaler.get_scale() == 2.0**12  # no step was skipped
    for a, b in zip(ref_norms, norms):  # the pre-clip norm Modular measured is the unscaled one
        torch.testing.assert_close(b, a, rtol=1e-5, atol=0)
    assert any(bool(n > 0.5) for n in norms), "clipping must have been active"
    for p, q in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,t", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_skipped_scaler_step_leaves_every_transform_state_unchanged(name, t):
    model = model_fn()
    opt = mo.Modular(model.named_parameters(), *pipeline_for(t))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    train(model, opt, data(3), scaler)
    before_sd = copy.deepcopy(opt.state_dict())
    before_params = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    scaler.scale(model(data(1, seed=9)[0]).pow(2).mean()).backward()
    model[0].weight.grad[0, 0] = math.inf  # an overflow in the scaled backward
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9  # the scaler saw the inf and backed off
    for p, q in zip(before_params, model.parameters()):
        assert torch.equal(p, q)
    assert_same(before_sd, opt.state_dict())



def test_attach_with_grad_scaler_clips_unscaled_gradients():
    xs = data(5)
    ref = model_fn()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    mo.attach(ropt, mo.ClipNorm(0.5))
    train(ref, ropt, xs)
    model = model_fn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = mo.attach(opt, mo.ClipNorm(0.5))
    train(model, opt, xs, torch.amp.GradScaler("cpu", init_scale=2.0**12), explicit_unscale=False)
    assert float(handle.stats["0:ClipNorm.norm"][0]) < 1e3  # unscaled: the scaled norm would be ~4096x larger
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ord", [2.0, 1.0, "linf", 3.0, "std", "mad", "sum"])
@pytest.mark.parametrize("scope", ["global", "group", "tensor"])
def test_half_statistics_accumulate_in_float32_without_overflow(dtype, ord, scope):
    # fp16: near its maximum (65504); bf16 shares float32's range, so its statistics overflow where float32 ones do
    big = 6.0e4 if dtype == torch.float16 else 1.0e9
    g1 = torch.full((64, 8), big, dtype=dtype)
    g1[::2] = -big / 2
    g2 = torch.full((100,), big, dtype=dtype)
    ps = [torch.nn.Parameter(torch.zeros_like(g1)), torch.nn.Parameter(torch.zeros_like(g2))]
    ps[0].grad, ps[1].grad = g1.clone(), g2.clone()
    opt = mo.Modular([{"params": [ps[0]]}, {"params": [ps[1]]}], mo.ClipNorm(1.0, ord=ord, scope=scope), mo.LR(1.0))
    opt.step()
    norm = opt.stats["0:ClipNorm.norm"]
    assert norm.dtype == torch.float32
    from modopt.spec.stats import stat as stat_of  # float64 reference of every ord

    if scope == "global":
        expected = [float(stat_of(torch.cat([g1.double().reshape(-1), g2.double()]), ord))]
    elif scope == "group" or scope == "tensor":
        expected = [float(stat_of(g1.double().reshape(-1), ord)), float(stat_of(g2.double(), ord))]
    want = torch.tensor(expected, dtype=torch.float64)
    if want.abs().max() < torch.finfo(torch.float32).max:
        assert torch.isfinite(norm).all(), norm
        torch.testing.assert_close(norm.double(), want, rtol=1e-3, atol=0)
    for p in ps:
        assert torch.isfinite(p).all() and p.dtype == dtype


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD, torch.optim.Adam])
def test_attach_on_a_fused_optimizer_under_grad_scaler_clips_unscaled_gradients(cls):
    # GradScaler.step does not unscale for fused optimizers (they take grad_scale themselves): the
    # attached clip must still see the true gradients, as after the user's own scaler.unscale_(opt)
    xs = data(5)
    runs = {}
    for explicit in (True, False):
        model = model_fn()
        opt = cls(model.parameters(), lr=1e-2, fused=True)
        handle = mo.attach(opt, mo.ClipNorm(0.1))
        norms = []
        for x in xs:
            opt.zero_grad()
            scaler = runs.setdefault(explicit, torch.amp.GradScaler("cpu", init_scale=2.0**12))
            scaler.scale(model(x).pow(2).mean()).backward()
            if explicit:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            norms.append(handle.stats["0:ClipNorm.norm"].clone())
        runs[("model", explicit)], runs[("norms", explicit)] = model, norms
    assert all(bool(n > 0.1) for n in runs[("norms", True)]), "the clip must have been active"
    for a, b in zip(runs[("norms", True)], runs[("norms", False)]):
        assert torch.equal(a, b)  # the same unscaled norm
    for p, q in zip(runs[("model", True)].parameters(), runs[("model", False)].parameters()):
        assert torch.equal(p, q)  # bit for bit: the same unscale, then the same fused step
