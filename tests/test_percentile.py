"""ClipValueByPercentile and clip_grad_percentile_: exactly the spec's lower order statistic."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import modopt as mo
from modopt.spec.percentile import clip_value_by_percentile as spec
from families import layouts, scope_kw
from harness import Harness


def run(t, ts, group_of=None):
    return Harness(t, [torch.zeros_like(x) for x in ts], group_of).step(ts)


def exact(out, ref):
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        assert torch.equal(o, r.to(o.dtype)), (o, r)


@settings(max_examples=60)
@given(lay=layouts(dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16)), data=st.data())
def test_matches_spec_exactly(lay, data):
    shp, group_of, dtype, seed = lay
    kw = scope_kw(data.draw)
    pct = data.draw(st.sampled_from([0, 1, 29, 50, 73, 99, 100]))
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=g).to(dtype) for s in shp]
    exact(run(mo.ClipValueByPercentile(pct, **kw), ts, group_of), spec(ts, group_of, pct, **kw))


def test_n101_pct29_picks_index_29_where_quantile_picks_28():
    u = torch.arange(101, dtype=torch.float64)[torch.randperm(101, generator=torch.Generator().manual_seed(0))]
    for dtype in (torch.float64, torch.float32):
        out = run(mo.ClipValueByPercentile(29), [u.to(dtype)])[0]
        assert out.max() == 29.0
        assert torch.equal(out, u.to(dtype).clamp(-29, 29))
        exact([out], spec([u.to(dtype)], [0], 29))
    assert torch.quantile(u, 0.29, interpolation="lower") == 28.0  # why quantile is not used


def test_pct_0_and_100_and_empty():
    u = torch.tensor([-4.0, 0.5, -2.0, 3.0])
    assert torch.equal(run(mo.ClipValueByPercentile(100), [u])[0], u)
    assert torch.equal(run(mo.ClipValueByPercentile(0), [u])[0], torch.tensor([-0.5, 0.5, -0.5, 0.5]))
    empty = torch.zeros(0, 3)
    for scope in ("tensor", "global"):
        out = run(mo.ClipValueByPercentile(50, scope=scope), [empty, u])
        assert out[0].shape == (0, 3)
        exact(out, spec([empty, u], [0, 0], 50, scope=scope))
    assert run(mo.ClipValueByPercentile(50, scope="tensor", dim=1), [empty])[0].shape == (0, 3)


def test_global_scope_uses_all_elements():
    a, b = torch.tensor([1.0, -2.0]), torch.tensor([3.0, -4.0, 5.0])
    out = run(mo.ClipValueByPercentile(50, scope="global"), [a, b])  # sorted |u| = 1..5, index 2 -> 3
    assert torch.equal(out[0], a) and torch.equal(out[1], torch.tensor([3.0, -3.0, 3.0]))
    out = run(mo.ClipValueByPercentile(50, scope="tensor", dim=1), [torch.tensor([[1.0, -5.0, 3.0], [0.1, 0.2, -0.3]])])
    assert torch.equal(out[0], torch.tensor([[1.0, -3.0, 3.0], [0.1, 0.2, -0.2]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    u = (torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
    out = run(mo.ClipValueByPercentile(90), [u])[0]
    assert out.dtype == dtype
    b = u.abs().float().sort().values[(90 * 999) // 100].to(dtype)
    assert torch.equal(out, u.clamp(-b, b))


def test_above_2_pow_24_elements():
    n = 2**24 + 3
    u = torch.arange(n, dtype=torch.float64)
    u[1::2] *= -1  # sorted |u| is 0, 1, ..., n - 1: the order statistic is its own index
    k = (99 * (n - 1)) // 100
    out = run(mo.ClipValueByPercentile(99), [u])[0]
    assert out[-1].abs() == k and out[k] == u[k] and out[k + 1].abs() == k and out.abs().max() == k


def test_functional_form():
    p, q = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([5.0, -1.0, 2.0, -3.0, 4.0])
    q.grad = torch.tensor([10.0, 20.0, -30.0])
    mo.clip_grad_percentile_([p, q], 50)
    assert torch.equal(p.grad, torch.tensor([3.0, -1.0, 2.0, -3.0, 3.0]))
    assert torch.equal(q.grad, torch.tensor([10.0, 20.0, -20.0]))
    p.grad = torch.tensor([5.0, -1.0, 2.0, -3.0, 4.0])
    q.grad = torch.tensor([10.0, 20.0, -30.0])
    mo.clip_grad_percentile_([p, q], 50, scope="global")  # |g| sorted: 1 2 3 4 5 10 20 30 -> index 3 -> 4
    assert torch.equal(p.grad, torch.tensor([4.0, -1.0, 2.0, -3.0, 4.0]))
    assert torch.equal(q.grad, torch.tensor([4.0, 4.0, -4.0]))


def test_validation():
    for bad in (-1, 101, 50.5):
        with pytest.raises(Exception):
            mo.ClipValueByPercentile(bad)
