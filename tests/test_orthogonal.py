"""The orthogonal family: Orthogonalize, OrthoGrad, Momentum and Muon.

Against their float64 spec (modopt/spec/orthogonal.py), against torch.optim.Muon (bit for bit),
torchzero's Orthogonalize and OrthoGrad, optax's Newton-Schulz and scale_by_muon (when optax is
installed), and the measured distance of five Newton-Schulz steps from the exact polar factor.
"""

from __future__ import annotations

import math

import pydantic
import pytest
import torch
from hypothesis import given, strategies as st
from torch.torch_version import TorchVersion

import modopt as mo
from checks import (Syncs, assert_a_nan_step_changes_no_bit, assert_resumes_bit_for_bit, assert_same_run, randn, same,
                    saved, seeded_grads, twin_params)
from harness import Harness
from modopt.spec import orthogonal as spec
from modopt.transforms.orthogonal import newton_schulz

TZ_EPS = 2 * torch.finfo(torch.bfloat16).tiny  # torchzero's clamp of the Frobenius norm
SHAPES = [(), (5,), (1, 6), (6, 1), (4, 7), (7, 4), (5, 5), (3, 2, 2), (4, 2, 3, 3), (0, 3)]

matrix_shapes = st.tuples(st.integers(1, 9), st.integers(1, 9))
any_shapes = st.one_of(st.sampled_from(SHAPES), matrix_shapes,
                       st.lists(st.integers(1, 4), min_size=3, max_size=4).map(tuple))




def assert_close(out, ref, rel, what=""):
    """`out` equals `ref` (float64) to `rel` of `ref`'s largest magnitude."""
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        atol = rel * max(r.abs().max().item() if r.numel() else 0.0, 1e-300)
        err = (o.to(torch.float64) - r).abs().max().item() if r.numel() else 0.0
        assert err <= atol, f"{what}: max error {err:.3g} > {atol:.3g}"


# --- Orthogonalize against its spec ------------------------------------------------------------------
#: max |runtime - float64 spec| / max |spec| of five Newton-Schulz steps, per working precision. The
#: iteration magnifies a rounding error by up to its slope at 0, a**5 = 485 for torch's coefficients, so the
#: bound depends on how small the singular values of x0 = x / ||x||_F are. Measured on 51k Gaussian
#: matrices up to 9x9 (three coefficient sets) whose x0 has no singular value below 0.02: bfloat16 median
#: 0.009, 99.9th percentile 0.077, max 0.115; float32 below 5e-6; float64 below 1e-14. Without that
#: condition bfloat16 reached 0.40 (a 5x5 with a singular value of x0 near the steep part).
NS_TOL = {"bfloat16": 0.15, "float32": 1e-4, "float64": 1e-12}
#: the bfloat16 bound applies when x0's smallest singular value is at least this
BF16_WELL_CONDITIONED = 0.02


@given(shape=any_shapes, seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.float64]),
       ns_dtype=st.sampled_from(["bfloat16", "float32", "float64"]),
       adjust=st.sampled_from(["none", "original", "match_rms_adamw"]),
       coefficients=st.sampled_from([spec.NS_COEFFICIENTS, spec.TORCHZERO_COEFFICIENTS, (3.0, -3.2, 1.2)]))
def test_orthogonalize_matches_spec(shape, seed, dtype, ns_dtype, adjust, coefficients):
    """One step through the runner on every shape (0-d, 1-d and empty pass through; 3-d and 4-d as
    `reshape(shape[0], -1)`), in each working precision, to its measured tolerance."""
    steps = len(coefficients) if isinstance(coefficients, list) else 5
    t = mo.Orthogonalize(ns_coefficients=coefficients, ns_steps=steps, adjust_lr=adjust, ns_dtype=ns_dtype)
    u = randn(shape, seed, dtype)
    out = Harness(t, [torch.zeros(shape, dtype=dtype)]).step([u])
    ref = spec.orthogonalize([u], coefficients, steps, 1e-7, adjust)
    assert out[0].dtype == dtype and out[0].is_contiguous()
    if spec.matrix_of(u) is None:
        assert torch.equal(out[0], u)  # passed through unchanged
        return
    rel = max(NS_TOL[ns_dtype], 1e-6 if dtype == torch.float32 else 0.0)
    m = spec.matrix_of(u)
    if ns_dtype == "bfloat16" and torch.linalg.svdvals(m / torch.linalg.matrix_norm(m)).min() < BF16_WELL_CONDITIONED:
        # ill-conditioned: only the band (bfloat16 can move a small singular value anywhere below it)
        r = spec.adjust_ratio(m.shape[0], m.shape[1], adjust)
        assert torch.isfinite(out[0]).all()
        assert torch.linalg.svdvals(spec.matrix_of(out[0]) / r).max() <= 1.3  # (every coefficient set here)
        return
    assert_close(out, ref, rel, f"{t}")


def test_orthogonalize_default_equals_torch_muon_iteration_bit_for_bit():
    """torch.optim.Muon's own function, on tall, wide and square matrices, float32 and bfloat16 inputs."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    for seed, shape in enumerate([(8, 4), (4, 8), (16, 16), (3, 33), (33, 3), (1, 5)]):
        for dtype in (torch.float32, torch.bfloat16):
            x = randn(shape, seed, dtype)
            ours = newton_schulz(x, [spec.NS_COEFFICIENTS] * 5, 1e-7, torch.bfloat16)
            theirs = _zeropower_via_newtonschulz(x.clone(), spec.NS_COEFFICIENTS, 5, 1e-7)
            assert torch.equal(ours, theirs), (shape, dtype)


@pytest.mark.parametrize("shape", [(8, 8), (4, 12), (12, 4), (1, 5)])
def test_newton_schulz_flops_are_what_torchs_flop_counter_counts(shape):
    """The cost formula of the docs' table (`newton_schulz_flops`) against torch's own counter."""
    from torch.utils.flop_counter import FlopCounterMode

    from modopt.transforms.orthogonal import newton_schulz_flops

    with FlopCounterMode(display=False) as fc:
        newton_schulz(torch.randn(shape), [spec.NS_COEFFICIENTS] * 5, 1e-7, torch.float32)
    assert fc.get_total_flops() == newton_schulz_flops(*shape, 5) > 0


def test_orthogonalize_leaves_its_input_alone_and_zeros_stay_zero():
    for dtype in (torch.bfloat16, torch.float32):
        u = randn((6, 4), 0, dtype)
        keep = u.clone()
        newton_schulz(u, [spec.NS_COEFFICIENTS] * 5, 1e-7, torch.bfloat16)
        assert torch.equal(u, keep)  # torch divides in place: on a bfloat16 input, the caller's tensor
    out = Harness(mo.Orthogonalize(), [torch.zeros(5, 3)]).step([torch.zeros(5, 3)])
    assert torch.equal(out[0], torch.zeros(5, 3))


def test_orthogonalize_adjust_lr_factors():
    u = randn((8, 2), 1)
    base = Harness(mo.Orthogonalize(ns_dtype="float64"), [u]).step([u])[0]
    for rule, r in (("original", 2.0), ("match_rms_adamw", 0.2 * math.sqrt(8))):
        out = Harness(mo.Orthogonalize(ns_dtype="float64", adjust_lr=rule), [u]).step([u])[0]
        assert torch.allclose(out, base * r, rtol=1e-15, atol=0)


def test_orthogonalize_fields_are_checked():
    with pytest.raises(pydantic.ValidationError, match="one per step"):
        mo.Orthogonalize(ns_coefficients=spec.TORCHZERO_COEFFICIENTS, ns_steps=4)
    for bad in ({"eps": 0.0}, {"ns_steps": 100}, {"ns_steps": -1}, {"ns_dtype": "float16"},
                {"ns_coefficients": (1.0, math.nan, 0.0)}, {"adjust_lr": "sqrt"}):
        with pytest.raises(pydantic.ValidationError):
            mo.Orthogonalize(**bad)


# --- the spread: five Newton-Schulz steps are not the polar factor -----------------------------------
def test_the_polar_factor_is_semi_orthogonal_and_nearest():
    for seed, shape in enumerate([(6, 6), (9, 4), (4, 9)]):
        x = randn(shape, seed)
        q = spec.polar(x)
        k = min(shape)
        gram = q.T @ q if shape[0] >= shape[1] else q @ q.T
        assert torch.allclose(gram, torch.eye(k, dtype=torch.float64), atol=1e-13)
        u, _, vh = torch.linalg.svd(x, full_matrices=False)
        assert torch.allclose(q, u @ vh, atol=1e-13)
    assert torch.equal(spec.polar(torch.zeros(3, 4, dtype=torch.float64)), torch.zeros(3, 4, dtype=torch.float64))


def test_five_steps_map_every_singular_value_above_the_threshold_into_the_band():
    s = torch.logspace(-6, 0, 200001, dtype=torch.float64)
    y = spec.scalar_map(s)
    kept = y[s >= spec.BAND_FROM]
    assert spec.BAND[0] - 5e-4 <= kept.min().item() and kept.max().item() <= spec.BAND[1]
    assert y[s < 0.95 * spec.BAND_FROM].max().item() < spec.BAND[0]  # below it: too small for the band
    assert spec.scalar_map(torch.tensor([1.0], dtype=torch.float64)).item() == pytest.approx(0.6964, abs=1e-4)
    assert (3.4445**5) == pytest.approx(484.9, abs=0.1)  # the slope at 0


#: (label, min s, max s, s in band, spectral distance, relative Frobenius distance) in float64, as
#: docs/modules/orthogonal.md's table prints them (spec.spread_table)
SPREAD_F64 = {
    "Gaussian 256x64": (0.682, 1.134, 1.00, 0.318, 0.218),
    "Gaussian 64x256": (0.682, 1.134, 1.00, 0.318, 0.214),
    "Gaussian 128x128": (0.401, 1.202, 0.992, 0.599, 0.204),
    "cond 1e+02, 128x128": (0.682, 1.202, 1.00, 0.318, 0.193),
    "cond 1e+04, 128x128": (0.018, 1.202, 0.594, 0.982, 0.549),
    "cond 1e+06, 128x128": (0.000, 1.202, 0.414, 1.000, 0.719),
}


def test_the_spread_table_of_the_docs():
    """The measured distance from the polar factor, in float64 and as the runtime computes it (bfloat16):
    the numbers of docs/modules/orthogonal.md, within 0.006."""
    for label, x in spec.matrices():
        if label not in SPREAD_F64:
            continue
        r64 = spec.spread(spec.newton_schulz(x), x)
        got = (r64["s_min"], r64["s_max"], r64["in_band"], r64["spectral"], r64["frobenius_rel"])
        for g, want in zip(got, SPREAD_F64[label]):
            assert g == pytest.approx(want, abs=6e-3), (label, got)
        rbf = spec.spread(newton_schulz(x.float(), [spec.NS_COEFFICIENTS] * 5, 1e-7, torch.bfloat16).double(), x)
        assert rbf["s_max"] <= 1.21 and abs(rbf["frobenius_rel"] - r64["frobenius_rel"]) < 0.01, (label, rbf)
        assert rbf["in_band"] >= r64["in_band"] - 0.02


def test_bfloat16_lifts_the_null_directions_of_a_rank_deficient_matrix():
    """A gradient over a batch of 8 (rank 8, 64x64): float64 keeps its 56 null directions at 0, bfloat16
    rounding puts noise of about 4e-3 there, which five steps lift towards the band (the docs' last rows)."""
    (x,) = [m for label, m in spec.matrices() if label == "rank 8, 64x64"]
    s64 = torch.linalg.svdvals(spec.newton_schulz(x))
    sbf = torch.linalg.svdvals(newton_schulz(x.float(), [spec.NS_COEFFICIENTS] * 5, 1e-7, torch.bfloat16).double())
    assert (s64[8:] < 1e-6).all() and (s64[:8] > 0.68).all()
    assert sbf[8:].max() > 0.3
    assert spec.spread(spec.newton_schulz(x), x)["frobenius_rel"] == pytest.approx(0.160, abs=5e-3)
    r = spec.spread(newton_schulz(x.float(), [spec.NS_COEFFICIENTS] * 5, 1e-7, torch.bfloat16).double(), x)
    assert r["frobenius_rel"] == pytest.approx(0.425, abs=0.03)


@given(shape=matrix_shapes, seed=st.integers(0, 2**16))
def test_runtime_singular_values_stay_in_the_band_on_well_conditioned_matrices(shape, seed):
    """Singular values of x0 = x/||x||_F above the threshold land in [0.68, 1.21] (float64 and float32
    exactly as the scalar map says; bfloat16 within 0.02 of the band)."""
    x = randn(shape, seed)
    s_in = torch.linalg.svdvals(x / torch.linalg.matrix_norm(x))
    for ns_dtype, slack in (("float64", 1e-9), ("float32", 1e-4), ("bfloat16", 0.03)):
        o = newton_schulz(x, [spec.NS_COEFFICIENTS] * 5, 1e-7, getattr(torch, ns_dtype)).double()
        s_out = torch.linalg.svdvals(o)
        assert s_out.max().item() <= spec.BAND[1] + slack
        if s_in.min().item() >= spec.BAND_FROM * 1.5:
            assert s_out.min().item() >= spec.BAND[0] - slack


# --- OrthoGrad -----------------------------------------------------------------------------------
@st.composite
def orthograd_cases(draw):
    n = draw(st.integers(1, 4))
    shapes = [draw(any_shapes) for _ in range(n)]
    cut = draw(st.integers(0, n))
    scope = draw(st.sampled_from(["global", "group", "tensor"]))
    kw = {"scope": scope, "eps": draw(st.sampled_from([1e-8, 0.0, 1e-3])), "renormalize": draw(st.booleans()),
          "min_size": draw(st.sampled_from([2, 3]))}
    if scope == "tensor" and draw(st.booleans()):
        kw["dim"] = draw(st.sampled_from([0, -1, (0, 1)]))
        kw["inverse_dims"] = draw(st.booleans())
    return shapes, [0] * cut + [1] * (n - cut), kw, draw(st.integers(0, 2**16))


def magnification(us, ws, group_of, kw) -> float:
    """The largest |u| / |u_perp| over the segments that OrthoGrad changes: how much its rescale
    magnifies the rounding of the projection."""
    worst = 1.0
    for seg in spec.segments([u.double() for u in us], group_of, kw["scope"], kw.get("dim"),
                             kw.get("inverse_dims", False)):
        x, w = spec.gather(us, seg), spec.gather(ws, seg)
        if x.numel() < kw["min_size"] or not kw["renormalize"]:
            continue
        y = x - float(w @ x) / (float(w @ w) + kw["eps"]) * w if float(w @ w) + kw["eps"] > 0 else x
        if float(y.norm()) > 0:
            worst = max(worst, float(x.norm() / y.norm()))
    return worst


@given(case=orthograd_cases(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_orthograd_matches_spec(case, dtype):
    shapes, group_of, kw, seed = case
    ws = [randn(s, seed + i, dtype) for i, s in enumerate(shapes)]
    us = [randn(s, seed + 100 + i, dtype) for i, s in enumerate(shapes)]
    out = Harness(mo.OrthoGrad(**kw), ws, group_of).step(us)
    ref = spec.ortho_grad(us, ws, group_of, **kw)
    for o, r in zip(out, ref):
        assert o.dtype == dtype and torch.isfinite(o).all()
    # the projection cancels: its error is relative to the inputs' size, magnified by the rescale
    rel = (1e-13 if dtype == torch.float64 else 1e-6) * magnification(us, ws, group_of, kw)
    scale = max([u.abs().max().item() for u in us if u.numel()] + [1e-30])
    for o, r in zip(out, ref):
        if r.numel():
            assert (o.double() - r).abs().max().item() <= rel * scale * 10, kw


def test_orthograd_parallel_updates_and_scalars():
    """An update exactly parallel to its weight leaves zero or rounding noise, never NaN; a one-element
    tensor is left alone (min_size=2), which is the exact rule's answer with eps > 0."""
    w = randn((4, 3), 0, torch.float32)
    for scope in ("tensor", "global"):
        out = Harness(mo.OrthoGrad(scope=scope, renormalize=False), [w]).step([w.clone()])[0]
        assert out.abs().max().item() <= 1e-6 * w.abs().max().item()
        out = Harness(mo.OrthoGrad(scope=scope), [w]).step([w.clone()])[0]
        assert torch.isfinite(out).all() and out.norm().item() <= w.norm().item() * (1 + 1e-6)
    s, u = torch.tensor(2.0), torch.tensor(-3.0)
    assert torch.equal(Harness(mo.OrthoGrad(), [s]).step([u])[0], u)
    # float32 statistics that overflow (entries near 1e20, weights near 1e19): finite, never NaN
    big_w, big_u = w * 1e19, randn((4, 3), 1, torch.float32) * 1e20
    for scope in ("tensor", "global"):
        assert torch.isfinite(Harness(mo.OrthoGrad(scope=scope), [big_w]).step([big_u])[0]).all()
    assert torch.equal(spec.ortho_grad([u], [s], [0], min_size=1)[0], u.double())  # exact: the same answer


def test_orthograd_removes_the_parallel_part_and_keeps_the_norm():
    w, u = randn((5, 4), 0), randn((5, 4), 1)
    out = Harness(mo.OrthoGrad(eps=0.0), [w]).step([u])[0]
    assert abs((out * w).sum().item()) < 1e-12
    assert out.norm().item() == pytest.approx(u.norm().item(), rel=1e-14)
    zero = Harness(mo.OrthoGrad(), [w]).step([torch.zeros(5, 4, dtype=torch.float64)])[0]
    assert torch.equal(zero, torch.zeros(5, 4, dtype=torch.float64))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_orthograd_global_equals_torchzero(seed):
    tz = pytest.importorskip("torchzero")
    shapes = [(8, 4), (4,), (3, 5, 2), ()]
    ws, us = [randn(s, seed * 10 + i, torch.float32) for i, s in enumerate(shapes)], \
        [randn(s, seed * 10 + 5 + i, torch.float32) for i, s in enumerate(shapes)]
    a = [torch.nn.Parameter(w.clone()) for w in ws]
    b = [torch.nn.Parameter(w.clone()) for w in ws]
    for p, q, u in zip(a, b, us):
        p.grad, q.grad = u.clone(), u.clone()
    tz.Optimizer(a, tz.m.OrthoGrad(), tz.m.LR(1.0)).step()
    mo.Modular(b, mo.OrthoGrad(scope="global"), mo.LR(1.0)).step()
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=2e-6, atol=2e-6)


# --- torchzero's Orthogonalize --------------------------------------------------------------------
#: max |modopt - torchzero| over entries (of size up to about 1) of torchzero's default Orthogonalize,
#: both in bfloat16 (torchzero composes each step from separate rounded ops, torch.optim.Muon's two
#: `addmm` round once): measured 0.042 on these shapes and seeds
TZ_ORTHOGONALIZE_TOL = 0.06


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("adjust", [False, True])
def test_orthogonalize_matches_torchzero_defaults(seed, adjust):
    tz = pytest.importorskip("torchzero")
    for i, shape in enumerate([(8, 4), (4, 8), (16, 16), (3, 33), (5,)]):
        w0, g = randn(shape, seed * 100 + i, torch.float32), randn(shape, seed * 100 + 50 + i, torch.float32)
        a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
        a.grad, b.grad = g.clone(), g.clone()
        tz.Optimizer([a], tz.m.Orthogonalize(adjust_lr=adjust), tz.m.LR(1.0)).step()
        ours = mo.Orthogonalize(ns_coefficients=spec.TORCHZERO_COEFFICIENTS, eps=TZ_EPS,
                                adjust_lr="match_rms_adamw" if adjust else "none")
        mo.Modular([b], ours, mo.LR(1.0)).step()
        ua, ub = (w0 - a.detach()).double(), (w0 - b.detach()).double()
        if len(shape) < 2:
            assert torch.equal(ua, ub) and torch.allclose(ub, g.double(), atol=1e-6)  # both pass vectors through
            continue
        r = spec.adjust_ratio(*shape, "match_rms_adamw" if adjust else "none")
        ref = spec.newton_schulz(g, spec.TORCHZERO_COEFFICIENTS, 5, TZ_EPS) * r
        assert (ua - ub).abs().max().item() <= TZ_ORTHOGONALIZE_TOL * r
        # both within the bfloat16 tolerance of the float64 iteration; modopt's is the tighter
        for u in (ua, ub):  # both within the bfloat16 tolerance of the float64 iteration
            assert (u - ref).abs().max().item() <= 0.06 * ref.abs().max().item()


# --- optax ---------------------------------------------------------------------------------------
def _optax():
    pytest.importorskip("optax")
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from optax.contrib import scale_by_muon
    from optax.contrib._muon import orthogonalize_via_newton_schulz

    return jnp, scale_by_muon, orthogonalize_via_newton_schulz


@pytest.mark.parametrize("coefficients", [spec.NS_COEFFICIENTS, spec.TORCHZERO_COEFFICIENTS])
def test_newton_schulz_matches_optax_in_float64(coefficients):
    """optax divides by `||x||_F + eps` where torch clamps: with optax's eps=0 the two are one rule."""
    jnp, _, ortho = _optax()
    for seed, shape in enumerate([(8, 4), (4, 8), (16, 16), (1, 7)]):
        x = randn(shape, seed)
        o = torch.from_numpy(__import__("numpy").asarray(
            ortho(jnp.asarray(x.numpy()), jnp.asarray(coefficients, dtype=jnp.float64), 5, eps=0.0)))
        assert torch.allclose(o, spec.newton_schulz(x, coefficients), rtol=0, atol=1e-13)
        ours = Harness(mo.Orthogonalize(ns_coefficients=coefficients, ns_dtype="float64"), [x]).step([x])[0]
        assert torch.allclose(o, ours, rtol=0, atol=1e-13)


def test_momentum_and_orthogonalize_match_optax_scale_by_muon_without_nesterov():
    """optax's momentum is bias-corrected (`mu / (1 - beta^t)`), a positive scale that the
    orthogonalization cancels: without Nesterov the chain equals `scale_by_muon` in float64. (With
    Nesterov optax corrects its two terms with different factors, so the directions differ.)"""
    jnp, scale_by_muon, _ = _optax()
    import numpy as np

    g = torch.Generator().manual_seed(0)
    shape = (6, 10)
    tx = scale_by_muon(eps=0.0, nesterov=False)
    state = tx.init(jnp.zeros(shape, dtype=jnp.float64))
    w = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    opt = mo.Modular([w], mo.Momentum(0.95, nesterov=False), mo.Orthogonalize(ns_dtype="float64"), mo.LR(1.0))
    for _ in range(6):
        grad = torch.randn(shape, generator=g, dtype=torch.float64)
        u, state = tx.update(jnp.asarray(grad.numpy()), state)
        before = w.detach().clone()
        w.grad = grad
        opt.step()
        assert np.abs(np.asarray(u) - (before - w.detach()).numpy()).max() < 1e-13


# --- Momentum ------------------------------------------------------------------------------------
@given(shape=any_shapes, seed=st.integers(0, 2**16), beta=st.sampled_from([0.0, 0.5, 0.95]),
       nesterov=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_momentum_matches_spec(shape, seed, beta, nesterov, dtype):
    h = Harness(mo.Momentum(beta, nesterov=nesterov), [torch.zeros(shape, dtype=dtype)])
    ref = spec.Momentum(beta, nesterov)
    size = 0.0  # the average cancels: its rounding is relative to the inputs so far, not to its value
    for k in range(8):
        u = randn(shape, seed + k, dtype) * (1e4 if k == 4 else 1.0)
        size = max(size, u.abs().max().item() if u.numel() else 0.0)
        (out,), (want,) = h.step([u]), ref.step([u])
        assert out.dtype == dtype and out.shape == want.shape
        if want.numel():
            assert (out.double() - want).abs().max().item() <= (1e-15 if dtype == torch.float64 else 1e-6) * size


def test_momentum_returns_a_copy_of_its_buffer():
    """Without Nesterov the direction is the buffer's value, not the buffer: a later in-place transform
    (a clip) must not write into the saved state."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = mo.Modular([p], mo.Momentum(0.5, nesterov=False), mo.ClipValue(1e-3), mo.LR(1.0))
    p.grad = torch.ones(3)
    opt.step()
    (buf,) = [v for k, v in opt.state[p].items() if k.endswith("momentum_buffer")]
    assert torch.equal(buf, torch.full((3,), 0.5))


# --- Muon ----------------------------------------------------------------------------------------




MUON_SETTINGS = [
    {},
    {"lr": 0.02, "adjust_lr_fn": "original"},
    {"lr": 0.02, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.01},
    {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
    {"lr": 0.05, "nesterov": False},
    {"lr": 0.01, "ns_steps": 3, "eps": 1e-5, "ns_coefficients": (3.0, -3.2, 1.2)},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("kw", MUON_SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults")
@pytest.mark.parametrize("nonfinite", ["skip", "ignore"])
@pytest.mark.parametrize("seed", [0, 1])
def test_muon_equals_torch_muon_bit_for_bit(dtype, kw, nonfinite, seed):
    """12 steps with OneCycleLR (which also cycles `momentum`) and two param groups, the default
    device-decided skip (new values kept with a `where`) and the in-place path (`nonfinite="ignore"`)."""
    if dtype == torch.bfloat16 and kw.get("nesterov") is False and torch_muon_divides_its_bf16_buffer():
        pytest.skip(f"torch {torch.__version__}'s Muon divides its bfloat16 momentum buffer in place without "
                    "Nesterov: test_torch_muon_bf16_without_nesterov_writes_its_buffer")
    shapes = [(8, 4), (4, 8), (16, 16), (3, 33), (33, 3)]
    ours, ref = twin_params(shapes, dtype, seed)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": kw.get("lr", 1e-3) * 2}]  # noqa: E731
    a = mo.Modular(groups(ours), mo.Muon(**kw), nonfinite=nonfinite)
    b = torch.optim.Muon(groups(ref), **kw)
    sa, sb = (torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.02, 0.04], total_steps=12) for o in (a, b))
    for k in range(12):
        seeded_grads(ours, k, seed, dtype)
        seeded_grads(ref, k, seed, dtype)
        a.step()
        b.step()
        sa.step()
        sb.step()
        for p, q in zip(ours, ref):
            assert torch.equal(p, q), (k, p.shape)
    for p, q in zip(ours, ref):
        (buf,) = [v for key, v in a.state[p].items() if key.endswith("momentum_buffer")]
        assert torch.equal(buf, b.state[q]["momentum_buffer"])


#: the first torch whose Muon keeps its bfloat16 momentum buffer without Nesterov (2.13.0 and 2.14.0 divide
#: it; 2.15.0 does not: docs/torch-versions.md)
TORCH_MUON_BF16_BUFFER_FIXED_IN = "2.15.0"


def torch_muon_divides_its_bf16_buffer() -> bool:
    return TorchVersion(torch.__version__) < TORCH_MUON_BF16_BUFFER_FIXED_IN


def test_torch_muon_bf16_without_nesterov_writes_its_buffer():
    """A behaviour of torch before 2.15 that modopt does not copy: `grad.bfloat16()` is the buffer itself
    when it is already bfloat16, and torch divides it in place by its norm. modopt's buffer stays the
    EMA; from 2.15 torch's does too (and `test_muon_equals_torch_muon_bit_for_bit` runs that case)."""
    p, q = twin_params([(8, 4)], torch.bfloat16)
    g = randn((8, 4), 7, torch.bfloat16)
    p[0].grad, q[0].grad = g.clone(), g.clone()
    a = mo.Modular(p, mo.Muon(lr=0.0, weight_decay=0.0, nesterov=False))
    b = torch.optim.Muon(q, lr=0.0, weight_decay=0.0, nesterov=False)
    a.step()
    b.step()
    ema = torch.lerp(torch.zeros_like(g), g, 0.05)
    (ours,) = [v for key, v in a.state[p[0]].items() if key.endswith("momentum_buffer")]
    assert torch.equal(ours, ema)
    if torch_muon_divides_its_bf16_buffer():
        assert b.state[q[0]]["momentum_buffer"].float().norm().item() == pytest.approx(1.0, abs=0.01)
    else:
        assert torch.equal(b.state[q[0]]["momentum_buffer"], ema), \
            f"torch {torch.__version__}'s Muon changed its bfloat16 buffer: TORCH_MUON_BF16_BUFFER_FIXED_IN is wrong"


def test_muon_matches_spec():
    """The float64 trajectory of the spec (momentum, the float64 Newton-Schulz, torch's update order)
    with a scheduler, for every shape rule: 2-d, 4-d (reshaped), 1-d and 0-d (no orthogonalization)."""
    shapes = [(6, 4), (3, 8), (4, 2, 3, 3), (5,), ()]
    for kw in ({}, {"adjust_lr_fn": "match_rms_adamw", "nesterov": False, "weight_decay": 0.0},
               {"ns_coefficients": spec.TORCHZERO_COEFFICIENTS, "momentum": 0.5}):
        ps, _ = twin_params(shapes, torch.float64)
        opt = mo.Modular(ps, mo.Muon(lr=0.03, ns_dtype="float64", **kw))
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        ref = spec.Muon(**kw)
        want = [p.detach().clone() for p in ps]
        for k in range(8):
            seeded_grads(ps, k, 3, torch.float64)
            lr = opt.param_groups[0]["lr"]
            want = ref.step(want, [p.grad for p in ps], lr)
            opt.step()
            sched.step()
            for p, w in zip(ps, want):
                assert torch.allclose(p.detach(), w, rtol=1e-12, atol=1e-13), (kw, k, p.shape)


def test_muon_is_its_chain():
    """`Muon(weight_decay=0)` and `Chain(Momentum, Orthogonalize(adjust_lr=...), LR)` make the same step,
    to float32 rounding (Muon adds `-lr*r*O` in one op, the chain multiplies twice, then subtracts)."""
    for nesterov, adjust in ((True, "original"), (False, "match_rms_adamw")):
        a, b = twin_params([(8, 4), (4, 8), (5,)], torch.float32)
        oa = mo.Modular(a, mo.Muon(0.02, weight_decay=0.0, nesterov=nesterov, adjust_lr_fn=adjust))
        ob = mo.Modular(b, mo.Chain(mo.Momentum(0.95, nesterov=nesterov), mo.Orthogonalize(adjust_lr=adjust),
                                    mo.LR(0.02)))
        assert_same_run(oa, a, ob, b, 6)


def test_muon_in_a_chain_returns_its_update():
    """Not the last transform (a ClipValue that clips nothing writes the parameters): Muon returns the
    update `lr r O + lr wd p`, equal to torch's in-place step up to float32 rounding."""
    a, b = twin_params([(8, 4), (4, 8)], torch.float32)
    oa = mo.Modular(a, mo.Muon(0.02), mo.ClipValue(1e30))
    ob = torch.optim.Muon(b, lr=0.02)
    assert_same_run(oa, a, ob, b, 5)


def test_muon_skips_a_nan_step_without_a_host_sync_and_keeps_every_bit():
    """The default step (the device decides): no host sync; a NaN step changes nothing, so the run with
    it equals torch's run without it, bit for bit."""
    ours, ref = twin_params([(8, 4), (4, 8)], torch.float32)
    assert_a_nan_step_changes_no_bit(ours, mo.Modular(ours, mo.Muon(0.02)), ref, torch.optim.Muon(ref, lr=0.02))


def _bits(t):
    return t.detach().clone().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "max"])
@pytest.mark.parametrize("kw", [{}, {"nesterov": False}, {"ns_coefficients": (-1.0, 3.0, 0.5), "ns_steps": 2}],
                         ids=["nesterov", "plain", "negative_a"])
def test_a_skipped_muon_step_keeps_every_bit_in_each_dtype(dtype, weight_decay, bad, kw):
    """The device-skipped step is torch's in-place step made a no-op: float32/float64 take arithmetic with
    0-d factors (the gradient times NaN, its NaNs zeroed, lerps with weights -0.0 and +0.0, so that the
    direction and Newton-Schulz's output are +0.0), half precision a `where`. Either way every bit of the
    parameters and of the momentum buffers stays, a -0.0 among each, compared as integers: for a NaN, an
    infinity, or a finite gradient whose norm overflows (`max`: the largest value of the dtype, beside a
    -0.0 buffer element), with and without Nesterov, and with coefficients whose `a < 0` (where
    Newton-Schulz of zeros might give -0.0, so `O` is zeroed with a `where`; this CPU's matrix products
    give +0.0 there too, so that case shows the `where` path keeps every bit, not that it is needed)."""
    ps, _ = twin_params([(8, 4), (4, 8), (6,)], dtype)
    opt = mo.Modular(ps, mo.Muon(0.02, weight_decay=weight_decay, **kw))
    for k in range(2):
        seeded_grads(ps, k, 0, dtype)
        opt.step()
    with torch.no_grad():  # elements 0-2: -0.0, +0.0, -0.0 in the parameter and the buffer; element 3: a -0.0
        for p in ps:         # parameter beside a negative buffer value
            p.view(-1)[:4] = torch.tensor([-0.0, 0.0, -0.0, -0.0], dtype=dtype)
            (buf,) = [v for key, v in opt.state[p].items() if key.endswith("momentum_buffer")]
            buf.view(-1)[:4] = torch.tensor([-0.0, 0.0, -0.0, -0.5], dtype=dtype)
    before = [_bits(p) for p in ps] + [_bits(v) for p in ps for v in opt.state[p].values()
                                       if isinstance(v, torch.Tensor) and v.dim()]
    seeded_grads(ps, 2, 0, dtype)
    for p in ps:
        p.grad.view(-1)[0] = -1.0  # beside each -0.0 buffer element and at element 3: a negative gradient
        p.grad.view(-1)[3] = -1.0
    ps[0].grad.view(-1)[5] = torch.finfo(dtype).max if bad == "max" else bad
    if bad == "max":
        ps[1].grad.view(-1)[0] = -torch.finfo(dtype).max  # beside a -0.0 element of the buffer and the param
    syncs = Syncs()
    with syncs:
        opt.step()
    assert syncs.n == 0 and bool(opt.stats["skipped"])
    after = [_bits(p) for p in ps] + [_bits(v) for p in ps for v in opt.state[p].values()
                                      if isinstance(v, torch.Tensor) and v.dim()]
    assert len(after) == 6
    for x, y in zip(before, after):
        assert torch.equal(x, y)


def test_muon_checkpoint_resumes_bit_exactly_with_the_bfloat16_default():
    """Beyond the registry's resume (whose Muon examples set a float32 or float64 `ns_dtype`): Muon's default,
    Newton-Schulz in bfloat16."""
    def model():
        return torch.nn.ParameterList(twin_params([(8, 4), (4, 8)], torch.float32)[0])

    def step(m, opt, k):
        seeded_grads(list(m), k, 1, torch.float32)
        opt.step()

    assert_resumes_bit_for_bit(model, lambda m: mo.Modular(list(m), mo.Muon(0.02, adjust_lr_fn="match_rms_adamw")),
                               step=step, steps=6, cut=3)


@pytest.mark.compile
def test_muon_default_compiles_fullgraph_close_to_eager():
    """`torch.compile(step, fullgraph=True)` with the bfloat16 default: inductor splits an `addmm` into a
    product and a sum, each rounded to bfloat16 (eager rounds once), so each step's orthogonalized
    matrix differs by up to about 0.03 per entry (NS_TOL); the parameters stay within lr * 0.05 per step.
    A NaN step is skipped on the device inside the graph."""
    torch._dynamo.reset()
    a, b = twin_params([(8, 4), (4, 8), (6,)], torch.float32)
    eager, comp = mo.Modular(a, mo.Muon(0.02)), mo.Modular(b, mo.Muon(0.02))
    step = torch.compile(comp.step, fullgraph=True)
    for k in range(6):
        for ps in (a, b):
            seeded_grads(ps, k, 2, torch.float32, nan_at=4)
        eager.step()
        step()
        assert bool(comp.stats["skipped"]) == (k == 4)
        for p, q in zip(a, b):
            assert (p - q).abs().max().item() <= 0.02 * 0.05 * (k + 1)


def test_muon_fields_and_group_keys():
    assert mo.Muon(0.02).lr == 0.02 and mo.Muon().weight_decay == 0.1 and mo.Muon().momentum == 0.95
    assert mo.Muon().hyperparams() == {"lr": 1e-3, "momentum": 0.95, "weight_decay": 0.1, "nesterov": True}
    for bad in ({"momentum": 1.0}, {"lr": -1.0}, {"weight_decay": math.inf}, {"adjust_lr_fn": "none"}):
        with pytest.raises(pydantic.ValidationError):
            mo.Muon(**bad)
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="momentum"):
        mo.Modular([{"params": [p], "momentum": 1.5}], mo.Muon())


# --- the recipe: Muon on the hidden matrices, AdamW on the rest -----------------------------------
class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.hidden = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, tokens):
        return self.head(self.norm(self.hidden(self.embed(tokens))))


HIDDEN = mo.Select("hidden.*", min_ndim=2)
REST = mo.Select(exclude=["hidden.*.weight"])


def _recipe(muon_last: bool, *front):
    branches = [mo.Masked(mo.Muon(0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"), where=HIDDEN),
                mo.Masked(mo.AdamW(0.02, weight_decay=0.01), where=REST)]
    return [*front, *(branches[::-1] if muon_last else branches)]


def _torch_recipe(model):
    hidden = [p for n, p in model.named_parameters() if n.startswith("hidden.") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.startswith("hidden.") and p.dim() == 2)]
    return (torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=0.02, weight_decay=0.01, fused=True))


@pytest.mark.parametrize("muon_last", [False, True])
def test_the_muon_adamw_recipe_equals_torch_muon_plus_torch_adamw(muon_last):
    """One Modular, Masked routing, one scheduler, the same gradients: torch.optim.Muon on the hidden
    weights and torch.optim.AdamW(fused=True) (modopt's default kernel) on the rest. Each routed branch
    writes its parameters with its own kernel, in either order: bit for bit the two torch optimizers."""
    m1, m2 = TinyLM(), TinyLM()
    opt = mo.Modular(m1.named_parameters(), *_recipe(muon_last))
    muon, adamw = _torch_recipe(m2)
    scheds = [torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.1, total_iters=8) for o in (opt, muon, adamw)]
    for k in range(8):
        seeded_grads(list(m1.parameters()), k, 4, torch.float32)
        seeded_grads(list(m2.parameters()), k, 4, torch.float32)
        for o in (opt, muon, adamw):
            o.step()
        for s in scheds:
            s.step()
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), n


def test_the_recipe_skips_a_nan_step_in_every_branch_without_a_host_sync():
    """A NaN in one branch's gradient: neither branch writes (each keeps its parameters and its state bit
    for bit), with the decision on the device."""
    model = TinyLM()
    opt = mo.Modular(model.named_parameters(), *_recipe(False, mo.ClipNorm(1.0)))
    seeded_grads(list(model.parameters()), 0, 4, torch.float32)
    opt.step()
    before = saved(opt, model)
    seeded_grads(list(model.parameters()), 1, 4, torch.float32)
    model.head.bias.grad[0] = float("nan")  # an AdamW parameter; the Muon branch writes first
    syncs = Syncs()
    with syncs:
        opt.step()
    assert syncs.n == 0 and bool(opt.stats["skipped"])
    same(before, saved(opt, model))


def test_a_branch_that_may_stop_the_step_keeps_the_single_writer_order():
    """When a later branch can stop the step (`Accumulate` between cycles), earlier branches do not write
    first: on a call that does not end the cycle no parameter moves."""
    m1 = TinyLM()
    opt = mo.Modular(m1.named_parameters(), mo.Masked(mo.AdamW(0.02), where=REST),
                     mo.Masked(mo.Accumulate(2), mo.Muon(0.02, weight_decay=0.01), where=HIDDEN))
    before = [p.detach().clone() for p in m1.parameters()]
    seeded_grads(list(m1.parameters()), 0, 4, torch.float32)
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), before))
    seeded_grads(list(m1.parameters()), 1, 4, torch.float32)
    opt.step()
    assert all(not torch.equal(p, q) for p, q in zip(m1.parameters(), before))


def test_composes_with_the_clipping_family():
    """A global norm clip in front of Muon clips the gradient the momentum sees (equal to torch's
    clip_grad_norm_ then torch.optim.Muon); OrthoGrad then Orthogonalize run as a chain."""
    a, b = twin_params([(8, 4), (4, 8)], torch.float32)
    oa = mo.Modular(a, mo.ClipNorm(0.5), mo.Muon(0.02))
    ob = torch.optim.Muon(b, lr=0.02)
    for k in range(5):
        seeded_grads(a, k, 0, torch.float32)
        seeded_grads(b, k, 0, torch.float32)
        oa.step()
        torch.nn.utils.clip_grad_norm_(b, 0.5)
        ob.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    m = TinyLM()
    opt = mo.Modular(m.named_parameters(), mo.ZClip(warmup_steps=2), mo.OrthoGrad(),
                     mo.Masked(mo.Momentum(), mo.Orthogonalize(adjust_lr="original"), mo.LR(0.02), where=HIDDEN),
                     mo.Masked(mo.AdamW(0.02), where=REST))
    for k in range(4):
        m.zero_grad()
        tokens = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(k))
        torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_the_example_config_routes_the_hidden_matrices_to_muon():
    from pathlib import Path

    from modopt.cli.tasks import make_task

    path = Path(__file__).resolve().parents[1] / "examples" / "configs" / "muon_adamw.yaml"
    cfg = mo.load_config(path)  # (its `optimizer` entry)
    task = make_task("transformer", {"vocab": 16, "seq_len": 24, "d_model": 32, "nhead": 2, "layers": 2, "ff": 64}, 0)
    opt = cfg.build(list(task.model.named_parameters()))  # every parameter reaches exactly one optimizer
    (branch,) = [t for t in opt.transforms if isinstance(t, mo.Masked) and isinstance(t.transforms[0], mo.Muon)]
    assert branch.transforms[0].adjust_lr_fn == "match_rms_adamw"
    named = list(task.model.named_parameters())
    owned = [n for n, p in named if branch.where.matches(n, p, 0, opt.param_groups[0])]
    assert len(owned) == 8 and all(p.dim() == 2 for n, p in named if n in owned)
    assert not any(n.startswith(("embed", "head", "pos")) or "norm" in n for n in owned)


def test_the_docs_page_examples_run(capsys):
    """The python blocks of docs/modules/orthogonal.md run in order and print what the page says."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "modules" / "orthogonal.md").read_text()
    ns: dict = {}
    for block in re.findall(r"^```python\n(.*?)\n```$", page, flags=re.M | re.S):
        exec(compile(block, "orthogonal.md", "exec"), ns)
    # (the recipe's loss, the expert-stack example's first and last loss, its bit-for-bit check)
    assert capsys.readouterr().out.split("\n")[:3] == ["loss 2.324", "loss 1.5709 -> 0.050", "True False"]
