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
