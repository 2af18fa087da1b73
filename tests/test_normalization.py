"""modopt/transforms/normalization.py against the references installed from the registry (the float64 specs:
tests/test_spec_coverage.py)."""

from __future__ import annotations

import pytest
import torch

import modopt as mo


def _grads(shapes, steps, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        gs = [torch.randn(s, generator=g) for s in shapes]
        gs[0].view(-1)[:2] = 0.0  # exact zeros: sign(0) = 0
        out.append(gs)
    return out


@pytest.mark.parametrize("momentum", [0.9, 0.0], ids=["defaults", "no-momentum"])
def test_sign_after_momentum_is_pytorch_optimizers_signsgd_bit_for_bit(momentum):
    """pytorch_optimizer's `SignSGD` (its defaults: lr 1e-3, momentum 0.9, an EMA buffer) is
    `Momentum(0.9, nesterov=False), Sign(), LR(1e-3)`; without momentum, `Sign(), LR(1e-3)`."""
    po = pytest.importorskip("pytorch_optimizer")
    shapes = [(4, 3), (5,), ()]
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    ref_opt = po.SignSGD(ref) if momentum else po.SignSGD(ref, momentum=0.0)
    pipe = [mo.Momentum(momentum, nesterov=False)] if momentum else []
    opt = mo.Modular(ours, *pipe, mo.Sign(), mo.LR(1e-3))
    for gs in _grads(shapes, 20, seed=1):
        for p, q, g in zip(ref, ours, gs):
            p.grad, q.grad = g.clone(), g.clone()
        ref_opt.step()
        opt.step()
        for p, q in zip(ref, ours):
            assert torch.equal(p, q)
    assert any(not torch.equal(p, torch.zeros_like(p)) for p in ours)


def test_sign_keeps_zeros_and_the_dtype():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.tensor([3.0, -1e-30, 0.0, -0.0], dtype=torch.bfloat16)
    mo.Modular([p], mo.Sign(), mo.LR(1.0)).step()
    assert p.dtype == torch.bfloat16 and p.tolist() == [-1.0, 1.0, 0.0, 0.0]
