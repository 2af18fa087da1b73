"""AGC: the per-unit formula for linear/conv weights, biases and scalars; exclusion by name."""

from __future__ import annotations

import pytest
import torch

import modopt as mo
from modopt.spec.agc import agc as spec
from harness import Harness


def formula(u, w, clipping, eps):
    """REFERENCE.md's rule, unit by unit, written out directly."""
    u, w = u.double(), w.double()
    if u.dim() < 2:
        units_u, units_w = [u.reshape(-1)], [w.reshape(-1)]
    else:
        units_u, units_w = list(u.reshape(u.shape[0], -1)), list(w.reshape(w.shape[0], -1))
    out = []
    for ui, wi in zip(units_u, units_w):
        allowed = clipping * max(wi.norm().item(), eps)
        n = ui.norm().item()
        out.append(ui * (allowed / max(n, 1e-6)) if n > allowed else ui)
    return torch.stack(out).reshape(u.shape) if u.dim() >= 2 else out[0].reshape(u.shape)


SHAPES = {"linear": (6, 5), "conv": (4, 3, 3, 3), "bias": (6,), "scalar": ()}


@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("clipping,eps", [(0.01, 1e-3), (0.5, 1e-3), (0.1, 10.0)])
def test_matches_formula_per_unit(kind, clipping, eps):
    g = torch.Generator().manual_seed(0)
    shape = SHAPES[kind]
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    if len(shape) >= 2:
        w[0] = 0.0  # a unit with a zero weight: eps decides its bound
        w[1] *= 1e4  # a unit that is not clipped
    u = torch.randn(shape, generator=g, dtype=torch.float64)
    out = Harness(mo.AGC(clipping=clipping, eps=eps), [w]).step([u])[0]
    want = formula(u, w, clipping, eps)
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-15)
    assert torch.allclose(out, spec([u], [w], clipping, eps)[0], rtol=1e-12, atol=1e-15)
    if len(shape) >= 2:
        assert torch.equal(out[1], u[1])  # unclipped unit untouched
        assert out[0].norm() == pytest.approx(clipping * eps)


def test_float32_and_half():
    for dtype, rel in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        g = torch.Generator().manual_seed(1)
        ws = [torch.randn(s, generator=g).to(dtype) for s in SHAPES.values()]
        us = [torch.randn(s, generator=g).to(dtype) for s in SHAPES.values()]
        out = Harness(mo.AGC(clipping=0.05), ws).step(us)
        for o, r in zip(out, spec(us, ws, 0.05, 1e-3)):
            assert o.dtype == dtype
            assert torch.allclose(o.double(), r, rtol=rel, atol=rel * r.abs().max().item())


def test_zero_update_stays_zero_and_telemetry():
    w = torch.randn(3, 2)
    h = Harness(mo.AGC(), [w])
    assert torch.equal(h.step([torch.zeros(3, 2)])[0], torch.zeros(3, 2))
    assert not bool(h.stats["0:AGC.clipped"])
    h.step([torch.full((3, 2), 100.0)])
    assert int(h.stats["0:AGC.clipped_units"]) == 3 and bool(h.stats["0:AGC.clipped"])


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def test_exclude_by_name_with_named_parameters():
    m = model()
    for p in m.parameters():
        p.grad = torch.full_like(p, 10.0)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    opt = mo.Modular(m.named_parameters(), mo.AGC(clipping=0.01, exclude=["2.*"]), mo.LR(1.0))
    opt.step()
    for n, p in m.named_parameters():
        step = before[n] - p.detach()
        if n.startswith("2."):
            assert torch.equal(step, grads[n])  # excluded: the raw gradient
        else:
            assert torch.allclose(step, formula(grads[n], before[n], 0.01, 1e-3).float(), rtol=1e-5, atol=1e-8)
            assert not torch.allclose(step, grads[n])


def test_exclude_needs_names():
    m = model()
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="named_parameters"):  # when the optimizer is built
        mo.Modular(m.parameters(), mo.AGC(exclude=["2.*"]), mo.LR(1.0))
    mo.Modular(m.parameters(), mo.AGC(exclude=[]), mo.LR(1.0)).step()  # nothing to match: fine


def test_defaults():
    t = mo.AGC()
    assert (t.clipping, t.eps, t.exclude) == (0.01, 1e-3, None)
    with pytest.raises(Exception):
        mo.AGC(clipping=0.0)


def test_agc_exclusion_mask_is_cached_per_layout(monkeypatch):
    import fnmatch

    calls = []
    real = fnmatch.fnmatchcase
    monkeypatch.setattr(fnmatch, "fnmatchcase", lambda n, pat: calls.append(n) or real(n, pat))
    lin = torch.nn.Linear(3, 2)
    opt = mo.Modular(lin.named_parameters(), mo.AGC(clipping=0.01, exclude=["bias"]), mo.LR(0.1))
    for _ in range(3):
        lin.weight.grad, lin.bias.grad = torch.ones(2, 3), torch.full((2,), 100.0)
        b0 = lin.bias.detach().clone()
        opt.step()
        assert torch.allclose(lin.bias.detach(), b0 - 10.0)  # excluded: not clipped
    assert len(calls) == 2, calls  # matched once (two names), not once per step
    # a new layout (weight only has a grad) computes its own mask
    lin.bias.grad = None
    lin.weight.grad = torch.ones(2, 3)
    opt.step()
    assert len(calls) == 3
