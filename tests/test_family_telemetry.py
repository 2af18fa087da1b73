"""Telemetry of the clipping families: pre-clip norm, scale and clipped flag as tensors in opt.stats."""

from __future__ import annotations

import pytest
import torch

import modopt as mo

NORM_CLIPPERS = [mo.ClipNormByEMA(ema_init="update"), mo.NormalizeByEMA(scope="global"), mo.ClipNormGrowth(),
                 mo.HistClip(warmup_steps=1), mo.ZClip(warmup_steps=1), mo.AutoClip()]
VALUE_CLIPPERS = [mo.ClipValueByEMA(ema_init="update"), mo.ClipValueGrowth(), mo.AGC()]


def run(t, grads):
    p = torch.nn.Parameter(torch.ones(4))
    opt = mo.Modular([p], t, mo.LR(1.0))
    for g in grads:
        p.grad = torch.full((4,), g)
        opt.step()
    key = f"0:{type(t).__name__}"
    return {k[len(key) + 1:]: v for k, v in opt.stats.items() if k.startswith(key + ".")}


@pytest.mark.parametrize("t", NORM_CLIPPERS, ids=lambda t: type(t).__name__)
def test_norm_clippers_record_norm_scale_clipped(t):
    stats = run(t, [1.0, 1.0, 1.0, 50.0])
    for name in ("norm", "scale", "clipped"):
        assert isinstance(stats[name], torch.Tensor) and stats[name].shape == (1,)
    assert float(stats["norm"][0]) == pytest.approx(100.0)  # the pre-clip norm of the spike
    assert bool(stats["clipped"][0]) == (float(stats["scale"][0]) < 1)
    assert bool(stats["clipped"][0])  # every one of them cuts this spike


@pytest.mark.parametrize("t", VALUE_CLIPPERS, ids=lambda t: type(t).__name__)
def test_value_clippers_record_clipped(t):
    quiet = run(t, [1e-4, 1e-4])
    spike = run(t, [1e-4, 1e-4, 50.0])
    assert not bool(quiet["clipped"]) and bool(spike["clipped"])


SLICE_CLIPPERS = [mo.ClipNorm(0.5, scope="tensor", dim=0), mo.ClipNormByEMA(scope="tensor", dim=0),
                  mo.ClipNormGrowth(scope="tensor", dim=0), mo.HistClip(warmup_steps=1, scope="tensor", dim=0),
                  mo.ZClip(warmup_steps=1, scope="tensor", dim=0), mo.Normalize(scope="tensor", dim=0)]


@pytest.mark.parametrize("t", SLICE_CLIPPERS, ids=lambda t: type(t).__name__)
def test_slice_scopes_record_one_value_per_slice(t):
    """Slice-wise statistics are one 1-D tensor (every tensor's slices in parameter order), so they
    reach opt.stats like any other scope (issue 17: before, slice scopes recorded nothing)."""
    w = torch.nn.Parameter(torch.zeros(3, 2))
    b = torch.nn.Parameter(torch.zeros(4))
    opt = mo.Modular([w, b], t, mo.LR(1.0))
    gw, gb = torch.tensor([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0]]), torch.tensor([1.0, -1.0, 2.0, 0.0])
    w.grad, b.grad = gw.clone(), gb.clone()
    opt.step()
    norm = opt.stats[f"0:{type(t).__name__}.norm"]
    # dim=0 reduces over the rows: w has 2 slices (its columns), b has 1 (itself)
    want = torch.cat([torch.linalg.vector_norm(gw, dim=0), torch.linalg.vector_norm(gb).reshape(1)])
    assert norm.shape == (3,)
    torch.testing.assert_close(norm, want)


def test_record_refuses_anything_but_a_tensor():
    class ListStats(mo.Transform):
        positional = None

        def apply(self, ctx, st, updates):
            st.record("norm", [torch.zeros(())])
            return updates

    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    with pytest.raises(TypeError, match=r"0:ListStats: telemetry 'norm' must be a tensor"):
        mo.Modular([p], ListStats(), mo.LR(1.0)).step()
