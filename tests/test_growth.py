"""The growth family: runtime == spec over 50-step sequences, worked examples, state rules."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import modopt as mo
from modopt.spec import growth as spec
from families import layouts, run_vs_spec, same_state, scope_kw, snapshot
from harness import Harness

REL = {torch.float64: 1e-9, torch.float32: 1e-4}


def growth_kw(draw):
    return dict(
        add=draw(st.sampled_from([None, 0.1, 2.0])),
        mul=draw(st.sampled_from([None, 1.5, 1.05, 3.0])),
        min_value=draw(st.sampled_from([0.0, 1e-4, 0.5])),
        max_decay=draw(st.sampled_from([None, 2.0, 1.0, 10.0])),
    )


@settings(max_examples=30)
@given(lay=layouts(), data=st.data())
def test_clip_norm_growth_matches_spec(lay, data):
    shp, group_of, dtype, seed = lay
    kw = {**scope_kw(data.draw), **growth_kw(data.draw), "ord": data.draw(st.sampled_from([2.0, 1.0, math.inf, "mad", "sum"]))}
    run_vs_spec(mo.ClipNormGrowth(**kw), spec.ClipNormGrowth(group_of, **kw), shp, group_of, dtype, seed, rel=REL[dtype])


@settings(max_examples=20)
@given(lay=layouts(), data=st.data())
def test_clip_value_growth_matches_spec(lay, data):
    shp, group_of, dtype, seed = lay
    kw = growth_kw(data.draw)
    run_vs_spec(mo.ClipValueGrowth(**kw), spec.ClipValueGrowth(**kw), shp, group_of, dtype, seed, rel=REL[dtype])


def test_defaults():
    t = mo.ClipNormGrowth()
    assert (t.add, t.mul, t.min_value, t.max_decay, t.ord, t.scope) == (None, 1.5, 1e-4, 2.0, 2.0, "global")
    v = mo.ClipValueGrowth()
    assert (v.add, v.mul, v.min_value, v.max_decay) == (None, 1.5, 1e-4, 2.0)
    with pytest.raises(Exception):
        mo.ClipNormGrowth(max_decay=0.5)
    with pytest.raises(Exception):
        mo.ClipValueGrowth(mul=0.0)


def test_clip_norm_growth_by_hand():
    h = Harness(mo.ClipNormGrowth(add=1.0, mul=3.0, max_decay=2.0), [torch.zeros(2, dtype=torch.float64)])
    u = lambda a, b: [torch.tensor([a, b], dtype=torch.float64)]  # noqa: E731
    assert torch.allclose(h.step(u(3.0, 4.0))[0], u(3.0, 4.0)[0])  # first step passes, r = 5
    out = h.step(u(30.0, 40.0))[0]  # A = min(5 + 1, 5 * 3) = 6
    assert torch.allclose(out, u(3.6, 4.8)[0])
    assert bool(h.stats["0:ClipNormGrowth.clipped"][0]) and torch.allclose(h.stats["0:ClipNormGrowth.allowed"], torch.tensor([6.0], dtype=torch.float64))
    out = h.step(u(0.0, 0.0))[0]  # passes; r decays at most by 2: r = 3
    assert torch.equal(out, u(0.0, 0.0)[0])
    out = h.step(u(0.0, 10.0))[0]  # A = min(3 + 1, 9) = 4
    assert torch.allclose(out, u(0.0, 4.0)[0])


def test_all_zero_first_update_allows_min_value_growth():
    h = Harness(mo.ClipNormGrowth(min_value=0.01, mul=2.0), [torch.zeros(3, dtype=torch.float64)])
    h.step([torch.zeros(3, dtype=torch.float64)])
    out = h.step([torch.full((3,), 1.0, dtype=torch.float64)])
    assert math.isclose(float(out[0].norm()), 0.02, rel_tol=1e-12)
    hv = Harness(mo.ClipValueGrowth(min_value=0.01, mul=2.0), [torch.zeros(3, dtype=torch.float64)])
    hv.step([torch.zeros(3, dtype=torch.float64)])
    out = hv.step([torch.tensor([1.0, -1.0, 0.005], dtype=torch.float64)])
    assert torch.allclose(out[0], torch.tensor([0.02, -0.02, 0.005], dtype=torch.float64))


def test_clip_value_growth_is_elementwise():
    h = Harness(mo.ClipValueGrowth(mul=2.0), [torch.zeros(3)])
    h.step([torch.tensor([1.0, -1.0, 4.0])])
    out = h.step([torch.tensor([5.0, -1.5, -100.0])])
    assert torch.equal(out[0], torch.tensor([2.0, -1.5, -8.0]))
    assert bool(h.stats["0:ClipValueGrowth.clipped"])


def test_none_bounds_are_identity():
    h = Harness(mo.ClipNormGrowth(add=None, mul=None), [torch.zeros(2)])
    for x in ([1.0, 1.0], [1e6, 0.0], [3.0, -2.0]):
        assert torch.equal(h.step([torch.tensor(x)])[0], torch.tensor(x))


def test_nonfinite_size_is_never_remembered():
    h = Harness(mo.ClipNormGrowth(), [torch.zeros(2), torch.zeros(3)])
    h.step([torch.ones(2), torch.ones(3)])
    h.step([torch.ones(2), torch.ones(3)])
    before = snapshot(h)
    h.step([torch.tensor([float("inf"), 1.0]), torch.ones(3)])
    same_state(before, snapshot(h))
    hv = Harness(mo.ClipValueGrowth(), [torch.zeros(3)])
    hv.step([torch.tensor([1.0, 2.0, 3.0])])
    hv.step([torch.tensor([float("nan"), 2.0, float("inf")])])
    (r,) = [v for k, v in hv.state[hv.params[0]].items() if k.endswith(".prev")]
    assert torch.equal(r, torch.tensor([1.0, 2.0, 3.0]))


def test_half_precision_close_to_spec():
    for dtype in (torch.bfloat16, torch.float16):
        for t, s in ((mo.ClipNormGrowth(), spec.ClipNormGrowth([0])), (mo.ClipValueGrowth(), spec.ClipValueGrowth())):
            h = Harness(t, [torch.zeros(6, dtype=dtype)])
            g = torch.Generator().manual_seed(3)
            for k in range(6):
                us = [(torch.randn(6, generator=g) * (1 + 3 * k)).to(dtype)]
                out, ref = h.step(us), s.step(us)
                assert out[0].dtype == dtype
                assert torch.allclose(out[0].double(), ref[0], rtol=2e-2, atol=2e-2 * ref[0].abs().max().item())
