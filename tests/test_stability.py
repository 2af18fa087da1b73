"""The stability family: AdaGC against pytorch_optimizer's AdaGC, against its float64 spec, its properties,
non-finite steps, checkpoints, host syncs and a compiled step."""

from __future__ import annotations

import inspect
import math

import pydantic
import pytest
import torch
from hypothesis import given, settings, strategies as st

import modopt as mo
from checks import assert_bad_steps_change_nothing, assert_resumes_bit_for_bit, run_twins, split, twin_params
from families import close, layouts, scope_kw, sequence
from harness import Harness
from modopt.spec import stability as spec

try:
    import pytorch_optimizer
except ImportError:  # pragma: no cover - the dev extra pins it
    pytorch_optimizer = None

needs_reference = pytest.mark.skipif(
    pytorch_optimizer is None, reason="pytorch_optimizer is not installed (pip install -e '.[dev]' pins it)"
)

KEY = "0:AdaGC"
SHAPES = {"mixed": [(5, 3), (7,), (), (4, 2, 3)], "one": [(6, 4)], "many": [(3,), (2, 2), (8,), (1, 1), (5, 2)]}


# --- parity with pytorch_optimizer.AdaGC ----------------------------------------------------------------
def grads_stream(shapes, dtype, seed, steps, late=None):
    """Per step, one gradient per shape (None for tensor 0 before step `late`): random, every 7th step 30x."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        big = 30.0 if k % 7 == 3 else 1.0
        out.append([
            None if late is not None and i == 0 and k < late
            else (torch.randn(s, generator=g, dtype=torch.float64) * big * (0.1 + i)).to(dtype)
            for i, s in enumerate(shapes)
        ])
    return out


def gammas_equal(ref, opt, a, b):
    for p, q in zip(a, b):
        if "gamma" in ref.state[p]:
            assert torch.equal(ref.state[p]["gamma"], opt.state[q][f"{KEY}.gamma"])


@needs_reference
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shapes", sorted(SHAPES))
@pytest.mark.parametrize("warmup,steps,groups", [(None, 120, False), (5, 30, True), (1, 12, False)])
def test_matches_pytorch_optimizer_adagc_bit_for_bit_in_float32(seed, shapes, warmup, steps, groups):
    """`pytorch_optimizer.AdaGC` with its own defaults (warm-up 100: 120 steps cross it) is
    `mo.AdaGC()` then torch's AdamW kernel (`fused=False`) with the reference's weight decay 0.1:
    the same parameters and thresholds after every step, bit for bit."""
    shp = SHAPES[shapes]
    a, b = twin_params(shp, torch.float32, seed)
    kw = {} if warmup is None else {"warmup_steps": warmup}
    ref = pytorch_optimizer.AdaGC(split(a, groups), **kw)
    opt = mo.Modular(split(b, groups), mo.AdaGC(**kw), mo.AdamW(lr=1e-3, weight_decay=0.1, fused=False))

    def each(k):
        for p, q in zip(a, b):
            assert torch.equal(p, q), k
        gammas_equal(ref, opt, a, b)

    run_twins(ref, opt, a, b, grads_stream(shp, torch.float32, seed, steps), each)


@needs_reference
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_pytorch_optimizer_adagc_in_float64(seed):
    """float64: within 1e-8 of the largest element. The reference adds up its warm-up global norm in
    float32 whatever the gradients' dtype (`get_global_gradient_norm`); modopt keeps float64, so the
    warm-up scale, and what follows from it, differ at float32's rounding (measured: about 1e-9)."""
    shp = SHAPES["mixed"]
    a, b = twin_params(shp, torch.float64, seed)
    ref = pytorch_optimizer.AdaGC(a)
    opt = mo.Modular(b, mo.AdaGC(), mo.AdamW(lr=1e-3, weight_decay=0.1, fused=False))

    def each(k):
        for p, q in zip(a, b):
            assert (p - q).abs().max() <= 1e-8 * p.abs().max(), k

    run_twins(ref, opt, a, b, grads_stream(shp, torch.float64, seed, 120), each)


@needs_reference
def test_in_front_of_torch_adamw_through_attach_matches_the_reference():
    """`mo.attach(torch.optim.AdamW(...), mo.AdaGC())` is the reference too, bit for bit."""
    shp = SHAPES["mixed"]
    a, b = twin_params(shp, torch.float32, 3)
    ref = pytorch_optimizer.AdaGC(a, warmup_steps=4)
    opt = torch.optim.AdamW(b, lr=1e-3, weight_decay=0.1)
    mo.attach(opt, mo.AdaGC(warmup_steps=4))

    def each(k):
        for p, q in zip(a, b):
            assert torch.equal(p, q), k

    run_twins(ref, opt, a, b, grads_stream(shp, torch.float32, 3, 20), each)


@needs_reference
def test_a_tensor_whose_first_gradient_comes_after_warm_up_warms_up_once():
    """A tensor without a gradient until step 11 (warm-up 5) takes the global warm-up clip on its first
    step, as the reference does (it has no threshold yet), then its relative clip: its threshold and
    Adam's first moment equal the reference's, bit for bit. (Its parameter is not compared: the
    reference's bias correction counts its group's steps, torch's AdamW counts the parameter's own.)"""
    shp = SHAPES["mixed"]
    a, b = twin_params(shp, torch.float32, 4)
    ref = pytorch_optimizer.AdaGC(split(a, True), warmup_steps=5)
    opt = mo.Modular(split(b, True), mo.AdaGC(warmup_steps=5), mo.AdamW(lr=1e-3, weight_decay=0.1, fused=False))
    seen = []

    def each(k):
        gammas_equal(ref, opt, a, b)
        for i, (p, q) in enumerate(zip(a, b)):
            if "exp_avg" in ref.state[p]:
                assert torch.equal(ref.state[p]["exp_avg"], opt.state[q]["1:AdamW.exp_avg"]), (k, i)
            if i:
                assert torch.equal(p, q), (k, i)
        seen.append(bool(opt.stats[f"{KEY}.warmup"][0]))

    run_twins(ref, opt, a, b, grads_stream(shp, torch.float32, 4, 25, late=10), each)
    assert seen[:4] == [True] * 4 and seen[4:10] == [False] * 6  # (no entry for tensor 0 before step 11)
    assert seen[10] and not any(seen[11:])


@needs_reference
def test_with_torchs_default_fused_adamw_it_stays_within_rounding():
    """modopt's AdamW defaults to torch's fused kernel, which rounds differently from the reference's
    for-loop arithmetic: within 1e-6 of the largest element after 120 steps."""
    shp = SHAPES["mixed"]
    a, b = twin_params(shp, torch.float32, 5)
    ref = pytorch_optimizer.AdaGC(a)
    opt = mo.Modular(b, mo.AdaGC(), mo.AdamW(lr=1e-3, weight_decay=0.1))
    run_twins(ref, opt, a, b, grads_stream(shp, torch.float32, 5, 120))
    for p, q in zip(a, b):
        assert (p - q).abs().max() <= 1e-6 * p.abs().max()


@needs_reference
def test_defaults_are_the_references():
    sig = inspect.signature(pytorch_optimizer.AdaGC.__init__).parameters
    t = mo.AdaGC()
    for name in ("beta", "lambda_abs", "lambda_rel", "warmup_steps", "eps"):
        assert getattr(t, name) == sig[name].default, name
    assert t.scope == "tensor"


# --- the float64 spec -------------------------------------------------------------------------------------
REL = {torch.float64: 1e-9, torch.float32: 1e-4}


@settings(max_examples=30, deadline=None)
@given(lay=layouts(), data=st.data())
def test_adagc_matches_spec(lay, data):
    """Runtime == spec on `families.sequence` streams (a 1e4 spike at step 20, a stretch of alternating
    signs), from its all-zero first step or from step 1, with every scope."""
    shp, group_of, dtype, seed = lay
    kw = scope_kw(data.draw)
    kw.update(
        beta=data.draw(st.sampled_from([0.0, 0.5, 0.98])),
        lambda_abs=data.draw(st.sampled_from([1.0, 0.1, 50.0])),
        lambda_rel=data.draw(st.sampled_from([1.05, 0.5, 2.0])),
        warmup_steps=data.draw(st.sampled_from([0, 1, 2, 10, 100])),
        eps=data.draw(st.sampled_from([1e-8, 0.0, 1e-3])),
    )
    start = data.draw(st.sampled_from([0, 1]))  # step 0 of a sequence is all zeros: gamma starts at 0
    h = Harness(mo.AdaGC(**kw), [torch.zeros(s, dtype=dtype) for s in shp], group_of)
    ref = spec.AdaGC(group_of, **kw)
    for k, us in enumerate(sequence(shp, dtype, seed, steps=40)[start:]):
        out, want = h.step(us), ref.step(us)
        try:
            close(out, want, dtype, REL[dtype])
        except AssertionError as e:
            raise AssertionError(f"step {k}: {e}") from None


def test_by_hand():
    """Warm-up 3, two tensors: steps 1-2 clip the global norm to lambda_abs; step 3 clips each tensor to
    lambda_rel times its threshold, which then moves by (1 - beta)."""
    h = Harness(mo.AdaGC(warmup_steps=3, lambda_abs=2.0, lambda_rel=1.5, beta=0.5, eps=0.0),
                [torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    out = h.step([torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64)])
    assert torch.allclose(out[0], torch.tensor([1.2, 1.6], dtype=torch.float64))  # global norm 5 -> 2
    assert h.stats[f"{KEY}.gamma"].tolist() == pytest.approx([2.0, 0.0])
    out = h.step([torch.tensor([0.3, 0.4], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)])
    assert torch.allclose(out[0], torch.tensor([0.3, 0.4], dtype=torch.float64))  # global norm sqrt(1.25) < 2
    assert h.stats[f"{KEY}.gamma"].tolist() == pytest.approx([0.5, 0.0])  # min(2, 0.5), min(0, 1)
    out = h.step([torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)])
    assert torch.allclose(out[0], torch.tensor([0.45, 0.6], dtype=torch.float64))  # 5 -> 1.5 * 0.5
    assert torch.equal(out[1], torch.zeros(1, dtype=torch.float64))  # gamma 0 with eps 0: cut to 0
    assert h.stats[f"{KEY}.gamma"].tolist() == pytest.approx([0.625, 0.0])
    assert h.stats[f"{KEY}.scale"].tolist() == pytest.approx([0.15, 0.0])
    assert h.stats[f"{KEY}.clipped"].tolist() == [True, True]
    assert h.stats[f"{KEY}.warmup"].tolist() == [False, False]


# --- properties --------------------------------------------------------------------------------------------
def stream(draw, shp, dtype, steps):
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    sizes = [draw(st.sampled_from([1e-3, 1.0, 30.0, 1e3])) for _ in range(steps)]
    return [[(torch.randn(s, generator=g, dtype=torch.float64) * z).to(dtype) for s in shp] for z in sizes]


@settings(max_examples=40, deadline=None)
@given(lay=layouts(), data=st.data())
def test_clipped_norms_respect_the_thresholds(lay, data):
    """During warm-up the step's global norm is at most lambda_abs; after it each tensor's norm is at most
    lambda_rel * max(its previous threshold, eps), and no tensor is ever scaled up."""
    shp, group_of, dtype, _ = lay
    warmup = data.draw(st.sampled_from([1, 3, 6]))
    t = mo.AdaGC(warmup_steps=warmup, lambda_abs=data.draw(st.sampled_from([0.5, 1.0, 10.0])),
                 lambda_rel=data.draw(st.sampled_from([1.05, 0.8, 3.0])), beta=data.draw(st.sampled_from([0.5, 0.98])))
    h = Harness(t, [torch.zeros(s, dtype=dtype) for s in shp], group_of)
    tol = 1 + (1e-5 if dtype == torch.float32 else 1e-12)
    prev = None
    for k, us in enumerate(stream(data.draw, shp, dtype, 10)):
        out = h.step(us)
        norms = torch.stack([o.double().norm() for o in out])
        raw = torch.stack([u.double().norm() for u in us])
        assert (norms <= raw * tol).all()
        if k == 0 or k + 1 < warmup:  # (a tensor's first step warms up, whatever warmup_steps)
            assert norms.norm() <= t.lambda_abs * tol
        else:
            assert (norms <= t.lambda_rel * prev.double().clamp(min=t.eps) * tol).all()
        prev = h.stats[f"{KEY}.gamma"].clone()


@settings(max_examples=15, deadline=None)
@given(lay=layouts())
def test_zeros_stay_zeros(lay):
    shp, group_of, dtype, _ = lay
    for t in (mo.AdaGC(warmup_steps=2), mo.AdaGC(warmup_steps=0, eps=0.0), mo.AdaGC(warmup_steps=2, scope="global")):
        h = Harness(t, [torch.zeros(s, dtype=dtype) for s in shp], group_of)
        for _ in range(4):  # across the end of warm-up
            out = h.step([torch.zeros(s, dtype=dtype) for s in shp])
            assert all(torch.equal(o, torch.zeros_like(o)) for o in out)
        assert torch.equal(h.stats[f"{KEY}.gamma"], torch.zeros_like(h.stats[f"{KEY}.gamma"]))


@settings(max_examples=30, deadline=None)
@given(lay=layouts(), j=st.integers(-8, 8), data=st.data())
def test_scaling_the_gradients_and_lambda_abs_and_eps_by_a_power_of_two_scales_everything_exactly(lay, j, data):
    """AdaGC(lambda_abs=k*a, eps=k*e) on k*g is k times AdaGC(lambda_abs=a, eps=e) on g, bit for bit for
    k = 2**j (every operation commutes with an exact scaling), outputs and thresholds alike. With
    lambda_abs and eps fixed the rule is not scale-equivariant: the warm-up clip is absolute."""
    shp, group_of, dtype, _ = lay
    k = 2.0**j
    kw = dict(warmup_steps=data.draw(st.sampled_from([1, 4])), scope=data.draw(st.sampled_from(["tensor", "global"])))
    a = Harness(mo.AdaGC(lambda_abs=1.0, eps=1e-8, **kw), [torch.zeros(s, dtype=dtype) for s in shp], group_of)
    b = Harness(mo.AdaGC(lambda_abs=k, eps=1e-8 * k, **kw), [torch.zeros(s, dtype=dtype) for s in shp], group_of)
    for us in stream(data.draw, shp, dtype, 8):
        oa, ob = a.step(us), b.step([u * k for u in us])
        for x, y in zip(oa, ob):
            assert torch.equal(x * k, y)
        assert torch.equal(a.stats[f"{KEY}.gamma"] * k, b.stats[f"{KEY}.gamma"])


# --- fields, config --------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,bad", [
    ("beta", 1.0), ("beta", -0.1), ("beta", math.nan), ("lambda_abs", 0.0), ("lambda_abs", math.inf),
    ("lambda_rel", -1.0), ("lambda_rel", math.nan), ("warmup_steps", -1), ("warmup_steps", 2.5),
    ("eps", -1e-8), ("eps", math.inf), ("scope", "layer"),
])
def test_bad_fields_are_refused_by_name(field, bad):
    with pytest.raises(pydantic.ValidationError, match=f"AdaGC.{field}"):
        mo.AdaGC(**{field: bad})


def test_config_round_trip(tmp_path):
    t = mo.AdaGC(beta=0.9, lambda_abs=2.0, lambda_rel=1.2, warmup_steps=7, eps=1e-6, scope="tensor", dim=0)
    cfg = mo.PipelineConfig(transforms=[t, mo.AdamW(lr=1e-3, weight_decay=0.1)])
    assert mo.load_config(cfg.save(tmp_path / "c.yaml")) == cfg
    assert "type: AdaGC" in cfg.to_yaml()
    assert mo.AdaGC.from_dict(t.to_dict()) == t


# --- non-finite steps, overflow, checkpoints, host syncs, compile ----------------------------------------------
def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def adagc(m, *extra, **kw):
    return mo.Modular(m.parameters(), mo.AdaGC(warmup_steps=3), *extra, **kw)


def model_and_opt(*extra, **kw):
    m = small_model()
    return m, adagc(m, *extra, **kw)


def set_grads(model, k, scale=1.0):
    g = torch.Generator().manual_seed(50 + k)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * scale * (20.0 if k % 4 == 1 else 1.0)


def test_nonfinite_steps_change_nothing_and_no_step_syncs():
    """Beyond the registry's skip (after AdaGC's warm-up): NaN and inf gradients in warm-up too, before torch's
    fused AdamW, change no bit and sync nothing; the skipped steps are not counted in AdaGC's steps."""
    _, ob = assert_bad_steps_change_nothing(lambda: model_and_opt(mo.AdamW(lr=1e-2, weight_decay=0.1)), set_grads,
                                            steps=8, at=(1, 4))
    assert int(ob.state_dict()["modopt"]["transforms"][KEY]["step"]) == 8


def test_a_norm_that_overflows_leaves_the_thresholds_as_they_were():
    """Finite float32 gradients of 1e20 have an infinite norm: that step's update is scaled to 0 and no
    threshold takes it in (pytorch_optimizer would set them to 0 in warm-up: docs/migration.md). With
    `nonfinite="ignore"`, so that the step goes ahead (the default policy skips it on the device)."""
    for warmup in (100, 2):
        p = torch.nn.Parameter(torch.zeros(3))
        opt = mo.Modular([p], mo.AdaGC(warmup_steps=warmup), mo.LR(1.0), nonfinite="ignore")
        for k in range(3):
            p.grad = torch.tensor([0.3, -0.4, 0.1]) * (k + 1)
            opt.step()
        gamma, before = opt.state[p][f"{KEY}.gamma"].clone(), p.detach().clone()
        p.grad = torch.full((3,), 1e20)
        opt.step()
        assert torch.equal(opt.state[p][f"{KEY}.gamma"], gamma) and torch.equal(p.detach(), before)
        assert float(opt.stats[f"{KEY}.scale"][0]) == 0.0


def test_a_global_norm_whose_squares_overflow_still_clips_in_warm_up():
    """Two float32 tensors of norm 1.5e19: each norm is finite, the sum of their squares is not. The warm-up
    clip still brings the step's norm to lambda_abs (pytorch_optimizer's float32 sum overflows there and
    zeroes the step). `nonfinite="ignore"`: the default device-side check skips such a step outright."""
    ps = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    opt = mo.Modular(ps, mo.AdaGC(), mo.LR(1.0), nonfinite="ignore")
    for p in ps:
        p.grad = torch.full((1,), 1.5e19)
    opt.step()
    out = torch.cat([p.detach() for p in ps]).double()
    assert out.norm().item() == pytest.approx(1.0, rel=1e-6)
    assert opt.stats[f"{KEY}.gamma"].tolist() == pytest.approx([0.5**0.5] * 2, rel=1e-6)


def test_checkpoint_resume_across_the_end_of_warm_up_is_bit_exact():
    """Beyond the registry's resume (cut after AdaGC's warm-up): the cut ends the warm-up (2 steps of
    `warmup_steps=3`), so the resumed run's first step is its first relative clip, against the thresholds the
    warm-up left in the checkpoint."""
    def step(m, opt, k):
        set_grads(m, k)
        opt.step()

    assert_resumes_bit_for_bit(small_model, lambda m: adagc(m, mo.Adam(lr=1e-2)), step=step, steps=8, cut=2)


def test_a_checkpoint_with_a_negative_or_nan_threshold_is_refused():
    m, opt = model_and_opt(mo.Adam(lr=1e-2))
    set_grads(m, 0)
    opt.step()
    for bad in (-1.0, math.nan):
        sd = opt.state_dict()
        sd["state"][0][f"{KEY}.gamma"] = torch.tensor(bad)
        with pytest.raises(ValueError, match="gamma"):
            model_and_opt(mo.Adam(lr=1e-2))[1].load_state_dict(sd)


@pytest.mark.compile
def test_compiled_step_fullgraph_matches_eager():
    """Beyond the registry's compile (AdaGC over slices and over a group, skipping): the default per-tensor scope
    under `nonfinite="ignore"` (no skip in the graph), the thresholds compared as well as the parameters."""
    torch._dynamo.reset()
    ma, oa = model_and_opt(mo.Adam(lr=1e-2), nonfinite="ignore")
    mb, ob = model_and_opt(mo.Adam(lr=1e-2), nonfinite="ignore")
    step = torch.compile(ob.step, fullgraph=True)
    for k in range(6):  # warm-up 3: both branches, and the thresholds' first values
        set_grads(ma, k)
        set_grads(mb, k)
        oa.step()
        step()
    for p, q in zip(ma.parameters(), mb.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for p, q in zip(ma.parameters(), mb.parameters()):
        torch.testing.assert_close(oa.state[p][f"{KEY}.gamma"], ob.state[q][f"{KEY}.gamma"], rtol=1e-5, atol=0)
