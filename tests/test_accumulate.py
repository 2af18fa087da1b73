"""Accumulate (modopt/transforms/accumulate.py): the mean over a cycle's calls, its spec, checkpoints mid-cycle."""

from __future__ import annotations

import io

import pytest
import torch

import modopt as mo
from modopt.spec import guards as spec
from harness import Harness


def test_zero_nonfinite_matches_spec():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        u = torch.tensor([[1.0, float("inf")], [float("-inf"), float("nan")], [-2.5, 0.0]]).to(dtype)
        h = Harness(mo.ZeroNonFinite(), [torch.zeros_like(u)])
        out = h.step([u])[0]
        assert out.dtype == dtype
        assert torch.equal(out, spec.zero_nonfinite([u])[0].to(dtype))
        assert int(h.stats["0:ZeroNonFinite.zeroed"]) == 3


def test_zero_nonfinite_in_a_pipeline_with_ignore():
    p = torch.nn.Parameter(torch.ones(3))
    opt = mo.Modular([p], mo.ZeroNonFinite(), mo.SGD(lr=1.0), nonfinite="ignore")
    p.grad = torch.tensor([1.0, float("nan"), float("inf")])
    opt.step()
    assert torch.equal(p.detach(), torch.tensor([0.0, 1.0, 1.0]))


def micro_grads(k, shapes):
    g = torch.Generator().manual_seed(100 + k)
    return [torch.randn(s, generator=g) for s in shapes]


@pytest.mark.parametrize("sgd", [dict(lr=0.1), dict(lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True)])
def test_accumulate_then_sgd_is_sgd_on_the_mean_gradient(sgd):
    shapes = [(3, 2), (4,)]
    torch.manual_seed(0)
    pa = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    acc = mo.Modular(pa, mo.Accumulate(4), mo.SGD(**sgd))
    ref = torch.optim.SGD(pb, **sgd)
    for k in range(16):
        for p, g in zip(pa, micro_grads(k, shapes)):
            p.grad = g
        before = [p.detach().clone() for p in pa]
        acc.step()
        if k % 4 != 3:  # non-final micro-steps: nothing moves
            assert all(torch.equal(b, p) for b, p in zip(before, pa))
        else:
            grads = [micro_grads(j, shapes) for j in range(k - 3, k + 1)]
            for i, p in enumerate(pb):
                p.grad = sum(gs[i] for gs in grads) / 4
            ref.step()
            for x, y in zip(pa, pb):
                assert torch.allclose(x, y, rtol=1e-6, atol=1e-7)


def test_accumulate_matches_spec_and_stops_the_chain():
    spec_acc = spec.Accumulate(3)
    h = Harness(mo.Accumulate(3), [torch.zeros(2)])
    for k in range(7):
        u = [torch.tensor([float(k), -2.0 * k])]
        out, ref = h.step(u), spec_acc.step(u)
        assert (out is None) == (ref is None) == (k % 3 != 2)
        if out is not None:
            assert torch.allclose(out[0].double(), ref[0])
    # later transforms do not run on the waiting calls: Adam creates no state
    p = torch.nn.Parameter(torch.zeros(2))
    opt = mo.Modular([p], mo.Accumulate(2), mo.Adam(lr=0.1))
    p.grad = torch.ones(2)
    opt.step()
    assert not any(k.startswith("1:Adam") for k in opt.state[p])
    p.grad = torch.ones(2)
    opt.step()
    assert any(k.startswith("1:Adam") for k in opt.state[p])


def test_accumulate_sums_half_precision_in_float32():
    h = Harness(mo.Accumulate(4), [torch.zeros(1, dtype=torch.float16)])
    outs = [h.step([torch.tensor([v], dtype=torch.float16)]) for v in (60000.0, 60000.0, -60000.0, -57984.0)]
    assert outs[-1][0].dtype == torch.float16 and float(outs[-1][0]) == 504.0  # no overflow of the sum


def test_accumulate_checkpoint_mid_cycle():
    def make():
        p = torch.nn.Parameter(torch.zeros(2))
        return p, mo.Modular([p], mo.Accumulate(3), mo.SGD(lr=1.0))

    pa, oa = make()
    for v in (1.0, 2.0):
        pa.grad = torch.full((2,), v)
        oa.step()
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    buf.seek(0)
    pb, ob = make()
    ob.load_state_dict(torch.load(buf, weights_only=True))
    for p, o in ((pa, oa), (pb, ob)):
        p.grad = torch.full((2,), 6.0)
        o.step()
        assert torch.equal(p.detach(), torch.full((2,), -3.0))


def test_accumulate_cannot_be_attached_and_validates():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="cannot be attached"):
        mo.attach(opt, mo.Accumulate(2))
    for bad in (0, -1, 1.5):
        with pytest.raises(Exception):
            mo.Accumulate(bad)
