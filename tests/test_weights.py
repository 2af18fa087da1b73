"""modopt/transforms/weights.py and the weight stage (modopt/core/plan.py): transforms that act on the
parameters after the optimizer wrote them."""

from __future__ import annotations

import functools
import math

import pydantic
import pytest
import torch
from hypothesis import given, settings, strategies as st

import modopt as mo
from checks import Syncs, assert_resumes_bit_for_bit, assert_step_changes_nothing, mse_backward, regression_batches, tanh_mlp
from modopt.spec.weights import frobenius, project_norm


SIZES = (5, 7, 2)


_model = functools.partial(tanh_mlp, SIZES)  # (dtype=..., seed=...)
_batches = functools.partial(regression_batches, sizes=SIZES, rows=4)  # (n, dtype=..., seed=...)
_backward = mse_backward


@pytest.mark.parametrize("kw", [{}, {"radius": 2.0}, {"min_ndim": 1, "eps": 1e-3}, {"radius": 0.5, "min_ndim": 0}])
def test_project_norm_matches_spec(kw):
    """float64, SGD before it: every step the SGD write, then each chosen tensor back to its radius."""
    t = mo.ProjectNorm(**kw)
    model = _model(dtype=torch.float64)
    opt = mo.Modular(model.parameters(), mo.SGD(lr=0.3), t)
    radii = [t.radius if t.radius is not None else frobenius(p) for p in model.parameters()]
    for x, y in _batches(6, dtype=torch.float64):
        _backward(model, x, y)
        fast = [p.detach() - 0.3 * p.grad for p in model.parameters()]
        want = project_norm(fast, radii, t.eps, t.min_ndim)
        opt.step()
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-14)
    for p, r in zip(model.parameters(), radii):
        if p.dim() >= t.min_ndim:
            assert abs(frobenius(p) - r) <= 1e-12 * r + (t.eps * 2)


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(0, 4), min_size=0, max_size=3), scale=st.sampled_from([0.0, 1e-30, 1.0, 1e20]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_project_norm_holds_the_norm_and_never_makes_nan(shape, scale, dtype):
    g = torch.Generator().manual_seed(len(shape))
    p = torch.nn.Parameter((torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype))
    r0 = frobenius(p)
    opt = mo.Modular([p], mo.LR(0.5), mo.ProjectNorm(min_ndim=0))
    p.grad = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    opt.step()
    assert torch.isfinite(p).all()
    after = frobenius(p)
    if after > 0 and r0 > 0:
        assert abs(after - r0) <= 1e-5 * r0
    elif r0 == 0:  # the norm was 0: the radius is 0, the moved tensor is projected to 0 or (norm 0) kept
        assert after == 0 or p.numel() == 0 or abs(after) < float("inf")


def test_a_skipped_step_keeps_every_bit_without_a_sync():
    model = _model(dtype=torch.float32)
    opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2), mo.ProjectNorm())
    assert opt.plan.device_skip is True and [k for k, _ in opt.plan.weights] == ["2:ProjectNorm"]
    for x, y in _batches(3, dtype=torch.float32):
        _backward(model, x, y)
        opt.step()
    _backward(model, *_batches(1, dtype=torch.float32, seed=9)[0])
    for p in model.parameters():
        p.grad.view(-1)[0] = float("nan")
    syncs = Syncs()
    assert_step_changes_nothing(model, opt, syncs)
    assert syncs.n == 0 and bool(opt.stats["skipped"])


def test_a_step_the_update_stage_stops_runs_no_weight_stage():
    """Accumulate's first call stops the step: nothing moved, so nothing is projected (every bit kept)."""
    model = _model(dtype=torch.float32)
    opt = mo.Modular(model.parameters(), mo.Accumulate(2), mo.SGD(lr=0.1), mo.ProjectNorm(3.0))
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, *_batches(1, dtype=torch.float32)[0])
    opt.step()
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    _backward(model, *_batches(1, dtype=torch.float32)[0])
    opt.step()  # the cycle's step: written, then projected
    assert abs(frobenius(model[0].weight) - 3.0) < 1e-5


def test_the_weight_stage_resumes_bit_for_bit():
    data = _batches(10, dtype=torch.float32)
    make = lambda m: mo.Modular(m.parameters(), mo.Adam(lr=1e-2), mo.ProjectNorm())  # noqa: E731
    assert_resumes_bit_for_bit(lambda: _model(dtype=torch.float32), make, data, cut=4)


def test_weight_transforms_end_the_pipeline_at_its_top_level():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="before an update transform"):
        mo.Modular([p], mo.ProjectNorm(), mo.SGD(lr=0.1))
    with pytest.raises(ValueError, match="inside another transform"):
        mo.Modular([p], mo.Chain(mo.SGD(lr=0.1), mo.ProjectNorm()))
    with pytest.raises(ValueError, match="cannot be attached"):
        mo.attach(torch.optim.SGD([p], lr=0.1), mo.ProjectNorm())
    opt = mo.Modular([p], mo.SGD(lr=0.1), mo.ProjectNorm(), mo.ProjectNorm(1.0))  # two in a row: in order
    assert [k for k, _ in opt.plan.weights] == ["1:ProjectNorm", "2:ProjectNorm"]


@pytest.mark.parametrize("kw", [{"radius": math.inf}, {"radius": math.nan}, {"radius": 0.0}, {"eps": math.inf},
                                {"eps": -1.0}, {"radius": True}, {"min_ndim": -1}])
def test_project_norm_refuses_fields_that_would_break_the_weights(kw):
    with pytest.raises(pydantic.ValidationError, match=f"ProjectNorm.{next(iter(kw))}"):
        mo.ProjectNorm(**kw)


def test_project_norm_config_round_trip():
    cfg = mo.PipelineConfig(transforms=[mo.AdamW(lr=3e-4), mo.ProjectNorm(min_ndim=2)])
    assert mo.PipelineConfig.from_dict(cfg.to_dict()) == cfg
