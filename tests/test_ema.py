"""The EMA family: runtime == spec step by step, special cases, state and telemetry."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import modopt as mo
from modopt.spec import ema as spec
from families import layouts, run_vs_spec, same_state, scope_kw, snapshot
from harness import Harness

ORDS = [2.0, 1.0, math.inf, 3.0, "mad", "std", "sum", "l0"]
# float64 checks the algorithm step by step; float32 its precision (families.FLOOR covers the rounding an EMA of
# alternating signs carries from the spike it has seen)
REL = {torch.float64: 1e-9, torch.float32: 1e-4}


@settings(max_examples=25)
@given(lay=layouts(), data=st.data())
def test_clip_norm_by_ema_matches_spec(lay, data):
    shp, group_of, dtype, seed = lay
    kw = scope_kw(data.draw)
    kw.update(
        beta=data.draw(st.sampled_from([0.0, 0.5, 0.9, 0.99])),
        ord=data.draw(st.sampled_from(ORDS)),
        eps=data.draw(st.sampled_from([0.0, 1e-6, 1e-2])),
        max_ema_growth=data.draw(st.sampled_from([None, 1.5, 1.01, 4.0])),
        ema_init=data.draw(st.sampled_from(["zeros", "update"])),
    )
    run_vs_spec(mo.ClipNormByEMA(**kw), spec.ClipNormByEMA(group_of, **kw), shp, group_of, dtype, seed, rel=REL[dtype])


@settings(max_examples=25)
@given(lay=layouts(), data=st.data())
def test_normalize_by_ema_matches_spec(lay, data):
    shp, group_of, dtype, seed = lay
    kw = scope_kw(data.draw)
    kw.update(
        beta=data.draw(st.sampled_from([0.5, 0.9, 0.99])),
        ord=data.draw(st.sampled_from(ORDS)),
        eps=data.draw(st.sampled_from([0.0, 1e-6])),
        max_ema_growth=data.draw(st.sampled_from([None, 1.5])),
        ema_init=data.draw(st.sampled_from(["zeros", "update"])),
    )
    run_vs_spec(mo.NormalizeByEMA(**kw), spec.NormalizeByEMA(group_of, **kw), shp, group_of, dtype, seed, rel=REL[dtype])


@settings(max_examples=20)
@given(lay=layouts(), beta=st.sampled_from([0.0, 0.5, 0.99]), init=st.sampled_from(["zeros", "update"]))
def test_clip_value_by_ema_matches_spec(lay, beta, init):
    shp, group_of, dtype, seed = lay
    run_vs_spec(mo.ClipValueByEMA(beta=beta, ema_init=init), spec.ClipValueByEMA(beta, init), shp, group_of, dtype, seed, rel=REL[dtype])


def test_defaults_and_validation():
    t = mo.ClipNormByEMA()
    assert (t.beta, t.ord, t.eps, t.scope, t.max_ema_growth, t.ema_init) == (0.99, 2.0, 1e-6, "global", 1.5, "zeros")
    assert mo.NormalizeByEMA().scope == "tensor"
    assert (mo.ClipValueByEMA().beta, mo.ClipValueByEMA().ema_init) == (0.99, "zeros")
    for bad in ({"beta": 1.0}, {"beta": -0.1}, {"eps": -1.0}, {"max_ema_growth": 0.0}, {"ema_init": "ones"}, {"ord": "l7"}):
        with pytest.raises(Exception):
            mo.ClipNormByEMA(**bad)


def test_clip_norm_by_ema_by_hand():
    """beta=0.5, ema_init=update, growth 1.5: the spike is cut to 1.5x the previous EMA norm."""
    h = Harness(mo.ClipNormByEMA(beta=0.5, ema_init="update"), [torch.zeros(2)])
    out = h.step([torch.tensor([3.0, 4.0])])
    assert torch.allclose(out[0], torch.tensor([3.0, 4.0]))
    out = h.step([torch.tensor([30.0, 40.0])])  # m would be (16.5, 22), norm 27.5 > 1.5 * 5
    assert torch.allclose(out[0], torch.tensor([4.5, 6.0]))
    assert torch.allclose(h.stats["0:ClipNormByEMA.ema_norm"], torch.tensor([7.5]))
    assert torch.allclose(h.stats["0:ClipNormByEMA.norm"], torch.tensor([50.0]))
    assert torch.allclose(h.stats["0:ClipNormByEMA.scale"], torch.tensor([0.15]))
    assert bool(h.stats["0:ClipNormByEMA.clipped"][0])


def test_zero_updates_stay_zero():
    for t in (mo.ClipNormByEMA(eps=0.0), mo.NormalizeByEMA(eps=0.0), mo.ClipValueByEMA(), mo.NormalizeByEMA(ord="std")):
        h = Harness(t, [torch.zeros(3), torch.zeros(2, 2)])
        for _ in range(3):
            out = h.step([torch.zeros(3), torch.zeros(2, 2)])
            assert all(torch.equal(o, torch.zeros_like(o)) for o in out)


@pytest.mark.parametrize(
    "t",
    [mo.ClipNormByEMA(), mo.NormalizeByEMA(scope="global"), mo.ClipNormByEMA(scope="tensor"),
     mo.ClipValueByEMA(beta=0.5, ema_init="update")],
)
@pytest.mark.parametrize("policy", ["skip", "zero"])
def test_nonfinite_gradients_never_enter_the_ema(t, policy):
    """The optimizer's non-finite policy keeps inf/NaN out of the EMA: "skip" leaves it as it
    was, "zero" feeds zeros in their place (the EMA itself has no per-element guard, so
    nonfinite="ignore" lets them in, as asked)."""
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    opt = mo.Modular([a, b], t, mo.SGD(lr=0.1), nonfinite=policy)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        a.grad, b.grad = torch.randn(3, generator=g), torch.randn(2, generator=g)
        opt.step()
    a.grad, b.grad = torch.tensor([1.0, float("inf"), 2.0]), torch.tensor([float("nan"), 1.0])
    opt.step()
    for s in opt.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                assert torch.isfinite(v).all()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()


def test_half_precision_runs_and_stays_close():
    for dtype in (torch.bfloat16, torch.float16):
        shp = [(4, 3), (5,)]
        for t, s in ((mo.ClipNormByEMA(), spec.ClipNormByEMA([0, 0])), (mo.ClipValueByEMA(), spec.ClipValueByEMA())):
            h = Harness(t, [torch.zeros(x, dtype=dtype) for x in shp])
            g = torch.Generator().manual_seed(1)
            for _ in range(5):
                us = [torch.randn(x, generator=g).to(dtype) for x in shp]
                out, ref = h.step(us), s.step(us)
                for o, r in zip(out, ref):
                    assert o.dtype == dtype and torch.isfinite(o).all()
                    assert torch.allclose(o.double(), r, rtol=3e-2, atol=3e-2 * r.abs().max().item())


def test_mission_example_trains():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(256, 8)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    opt = mo.Modular(model.parameters(), mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(lr=1e-2))
    losses = []
    for _ in range(150):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
    for k in ("norm", "scale", "clipped", "ema_norm"):
        assert isinstance(opt.stats[f"0:ClipNormByEMA.{k}"], torch.Tensor)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("scope", ["global", "tensor"])
def test_the_saved_ema_is_the_specs_ema_while_the_growth_limit_bites(dtype, scope):
    """Spikes that the growth limit cuts, through Modular.step: the `ema` buffer is the spec's EMA at
    every step, to the dtype's rounding (float32: within 1e-6 of its largest element)."""
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.zeros(5, 3, dtype=dtype)), torch.nn.Parameter(torch.zeros(4, dtype=dtype))]
    opt = mo.Modular(params, mo.ClipNormByEMA(beta=0.9, max_ema_growth=1.2, scope=scope), mo.LR(0.0))
    ref = spec.ClipNormByEMA([0, 0], beta=0.9, max_ema_growth=1.2, scope=scope)
    rel = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3}[dtype]
    for step in range(30):
        size = 100.0 if step in (5, 6, 17) else 1.0  # spikes: the EMA would grow past 1.2x
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g, dtype=torch.float64) * size).to(dtype)
        ref.step([p.grad.clone() for p in params])  # before the step, which clips p.grad in place
        opt.step()
        for i, p in enumerate(params):
            ema = opt.state[p]["0:ClipNormByEMA.ema"].double()
            assert ((ema - ref.m[i]).abs().max() / ref.m[i].abs().max()).item() <= rel
