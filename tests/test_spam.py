"""SPAM and Stable-SPAM: against pytorch_optimizer's SPAM and StableSPAM, against their float64 specs, the
moment contract that links them to the optimizer (modopt.core.moments), non-finite steps, host syncs, masks
and every Adam kernel. (A checkpoint resumed across a reset: the registry's examples, tests/test_conformance.py.)"""

from __future__ import annotations

import inspect
import math

import pydantic
import pytest
import torch
from hypothesis import given, settings, strategies as st

import modopt as mo
from checks import assert_bad_steps_change_nothing, run_twins, split, twin_params
from families import close, layouts, scope_kw, sequence
from harness import Harness
from modopt.spec import spam as spec
from modopt.transforms.spam import warmup_factors

try:
    import pytorch_optimizer
    from pytorch_optimizer.optimizer.spam import CosineDecay
except ImportError:  # pragma: no cover - the dev extra pins it
    pytorch_optimizer = None

needs_reference = pytest.mark.skipif(
    pytorch_optimizer is None, reason="pytorch_optimizer is not installed (pip install -e '.[dev]' pins it)"
)

SHAPES = {"mixed": [(5, 3), (7,), (), (4, 2, 3)], "one": [(6, 4)], "many": [(3,), (2, 2), (8,), (1, 1), (5, 2)]}


# --- helpers -------------------------------------------------------------------------------------------
def grads_stream(shapes, seed, steps, spike_every=7):
    """Per step, one float32 gradient per shape: random, every `spike_every`-th step one tensor 300x."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        out.append([(torch.randn(s, generator=g, dtype=torch.float64) * (0.1 + i)
                     * (300.0 if k % spike_every == 3 and i == k % len(shapes) else 1.0)).float()
                    for i, s in enumerate(shapes)])
    return out


# --- Stable-SPAM against pytorch_optimizer.StableSPAM: bit for bit --------------------------------------
@needs_reference
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shapes", sorted(SHAPES))
@pytest.mark.parametrize("every,steps,groups", [(10, 35, False), (7, 22, True)])
def test_stable_spam_matches_pytorch_optimizer_bit_for_bit(seed, shapes, every, steps, groups):
    """`mo.StableSPAM()` then torch's AdamW kernel (`fused=False`, the reference's weight decay 0) is
    `pytorch_optimizer.StableSPAM`: the same parameters, moments and norm statistics after every step,
    bit for bit, across several resets (its bias correction restarts there)."""
    shp = SHAPES[shapes]
    a, b = twin_params(shp, torch.float32, seed)
    ref = pytorch_optimizer.StableSPAM(split(a, groups), update_proj_gap=every)
    opt = mo.Modular(split(b, groups), mo.StableSPAM(reset_every=every), mo.AdamW(weight_decay=0.0, fused=False))

    def each(k):
        for p, q in zip(a, b):
            assert torch.equal(p, q), k
            for mine, theirs in (("1:AdamW.exp_avg", "exp_avg"), ("1:AdamW.exp_avg_sq", "exp_avg_sq"),
                                 ("0:StableSPAM.m_max", "m_max_t"), ("0:StableSPAM.m_norm", "m_norm_t"),
                                 ("0:StableSPAM.v_norm", "v_norm_t")):
                assert torch.equal(opt.state[q][mine], ref.state[p][theirs]), (k, mine)

    run_twins(ref, opt, a, b, grads_stream(shp, seed, steps), each)


@needs_reference
@pytest.mark.slow
def test_stable_spam_with_the_reference_defaults_across_its_first_reset():
    """The reference's own defaults (a reset at step 1000), 1005 steps: bit for bit."""
    shp = SHAPES["mixed"]
    a, b = twin_params(shp, torch.float32, 7)
    ref = pytorch_optimizer.StableSPAM(a)
    opt = mo.Modular(b, mo.StableSPAM(), mo.AdamW(weight_decay=0.0, fused=False))
    run_twins(ref, opt, a, b, grads_stream(shp, 7, 1005, spike_every=97))
    assert int(opt.state_dict()["state"][0]["1:AdamW.step"]) == 6  # restarted at step 1000: 1000..1005
    for p, q in zip(a, b):
        assert torch.equal(p, q)


# --- SPAM against pytorch_optimizer.SPAM -------------------------------------------------------------------
def spam_twins(shp, seed, groups=False, eps=1e-6, **kw):
    a, b = twin_params(shp, torch.float32, seed)
    ref_kw = {"update_proj_gap": kw.get("reset_every", 500), "warmup_epoch": kw.get("warmup_steps", 50),
              "grad_accu_steps": kw.get("clip_delay", 20), "threshold": kw.get("theta", 5000)}
    torch.manual_seed(seed)  # (the reference draws its all-true masks of matrices from the global generator)
    ref = pytorch_optimizer.SPAM(split(a, groups), eps=eps, **ref_kw)
    opt = mo.Modular(split(b, groups), mo.SPAM(**kw), mo.AdamW(eps=eps, weight_decay=0.0, fused=False))
    return a, b, ref, opt


def moments_equal(ref, opt, a, b, k):
    for p, q in zip(a, b):
        for mine, theirs in (("1:AdamW.exp_avg", "exp_avg"), ("1:AdamW.exp_avg_sq", "exp_avg_sq")):
            assert torch.equal(opt.state[q][mine], ref.state[p][theirs].reshape(q.shape)), (k, mine)


@needs_reference
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shapes", sorted(SHAPES))
@pytest.mark.parametrize("groups", [False, True])
def test_spam_matches_pytorch_optimizer(seed, shapes, groups):
    """`mo.SPAM(...)` then torch's AdamW kernel with the reference's eps (1e-6) and weight decay (0) against
    `pytorch_optimizer.SPAM`, resets every 12 steps, a 5-step warm-up, clipping from step 4: the optimizer's
    moments, and so every clip and reset, bit for bit after every step. The parameters differ by the eps
    placement alone: the reference puts eps outside the bias correction (`m / (sqrt(v) + eps)` times
    `lr sqrt(1 - b2^t) / (1 - b1^t)`), torch inside (`sqrt(v) / sqrt(1 - b2^t) + eps`), which weighs most
    where `sqrt(v)` is near eps (small gradients, early steps): within 3% of `lr` per step taken."""
    shp = SHAPES[shapes]
    lr = 1e-3
    a, b, ref, opt = spam_twins(shp, seed, groups, reset_every=12, warmup_steps=5, clip_delay=4)
    clipped = []

    def each(k):
        moments_equal(ref, opt, a, b, k)
        for p, q in zip(a, b):
            assert (p - q).abs().max() <= 0.03 * lr * (k + 1), k
        clipped.append(int(opt.stats["0:SPAM.clipped"].sum()))

    run_twins(ref, opt, a, b, grads_stream(shp, seed, 40), each)
    assert sum(clipped) > 0  # the stream's spikes are clipped


@needs_reference
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shapes", sorted(SHAPES))
def test_spam_with_eps_zero_differs_from_the_reference_by_rounding_only(seed, shapes):
    """With eps=0 the two update formulas are the same number, so what is left is rounding: within 1e-7 of
    the largest element after 70 steps across two resets and their warm-ups (measured 3.6e-8: the reference
    multiplies its step size by the warm-up factor in Python and divides once, torch divides by the bias
    corrections in float32)."""
    shp = SHAPES[shapes]
    a, b, ref, opt = spam_twins(shp, seed, eps=0.0, reset_every=30, warmup_steps=8, clip_delay=5)
    run_twins(ref, opt, a, b, grads_stream(shp, seed, 70), lambda k: moments_equal(ref, opt, a, b, k))
    for p, q in zip(a, b):
        assert (p - q).abs().max() <= 1e-7 * p.abs().max()


@needs_reference
@pytest.mark.slow
def test_spam_with_the_reference_defaults_across_a_reset_and_its_warm_up():
    """The reference's defaults (reset at step 500, a 50-step warm-up, clipping from step 20): 560 steps."""
    shp = SHAPES["mixed"]
    a, b, ref, opt = spam_twins(shp, 5)
    scales = []

    def each(k):
        moments_equal(ref, opt, a, b, k)
        scales.append(float(opt.stats["0:SPAM.lr_scale"]))

    run_twins(ref, opt, a, b, grads_stream(shp, 5, 560, spike_every=31), each)
    for p, q in zip(a, b):
        assert (p - q).abs().max() <= 4e-6 * p.abs().max()
    assert scales[498] == 1.0 and scales[499] < 0.02 and scales[548] < 1.0 and scales[549] == 1.0


@needs_reference
@pytest.mark.parametrize("warmup", [1, 2, 5, 50, 150])
def test_warmup_factors_are_the_references_to_the_last_bit(warmup):
    """The factor on the c-th step after a reset is `1 - CosineDecay(0.99, warmup).get_death_rate(c)`, the
    reference's, stepped as it steps it (a new one at each reset, c = 0, 1, ...); the spec's closed form
    agrees to 1e-15."""
    decay = CosineDecay(0.99, warmup)
    theirs = [1.0 - decay.get_death_rate(c) for c in range(warmup + 3)]
    mine = warmup_factors(warmup)
    assert mine + [1.0, 1.0] == theirs
    assert mine == pytest.approx([spec.warmup_factor(c, warmup) for c in range(warmup + 1)], rel=1e-15, abs=1e-15)


@needs_reference
@pytest.mark.parametrize("cls,theirs,fields", [
    ("SPAM", "SPAM", {"theta": "threshold", "reset_every": "update_proj_gap", "warmup_steps": "warmup_epoch",
                      "clip_delay": "grad_accu_steps"}),
    ("StableSPAM", "StableSPAM", {"gamma1": "gamma1", "gamma2": "gamma2", "gamma3": "theta",
                                  "reset_every": "update_proj_gap", "eps": "eps"}),
])
def test_defaults_are_the_references(cls, theirs, fields):
    sig = inspect.signature(getattr(pytorch_optimizer, theirs).__init__).parameters
    t = getattr(mo, cls)()
    for mine, name in fields.items():
        assert getattr(t, mine) == sig[name].default, mine


# --- the float64 specs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kw", [
    dict(theta=50.0, reset_every=6, warmup_steps=3, clip_delay=2),
    dict(theta=5.0, reset_every=4, warmup_steps=0, clip_delay=0),
    dict(theta=20.0, reset_every=None, clip_delay=3),
    dict(theta=0.0, reset_every=5, warmup_steps=4),
])
@pytest.mark.parametrize("kernel", [{}, {"fused": False}])
def test_spam_matches_spec(seed, kw, kernel):
    """`SPAM` then `Adam` (float64) against `spec.SPAM` feeding `spec.Adam` (torch's formula, with the
    contract's reset and learning-rate factor): the parameters within 1e-11 over 26 steps of
    `families.sequence` (a first all-zero step, a 1e4 spike, alternating signs)."""
    shp = SHAPES["mixed"]
    ps = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shp]
    opt = mo.Modular(ps, mo.SPAM(**kw), mo.Adam(lr=0.01, eps=1e-8, **kernel))
    ref, adam = spec.SPAM(**kw), spec.Adam(lr=0.01, eps=1e-8)
    want = [p.detach().clone() for p in ps]
    for k, us in enumerate(sequence(shp, torch.float64, seed, steps=26, spike_at=9, alt=(14, 20))):
        for p, u in zip(ps, us):
            p.grad = u.clone()
        opt.step()
        clipped, factor = ref.step(us, adam)
        want = adam.step(want, clipped, factor)
        for p, w in zip(ps, want):
            assert (p - w).abs().max() <= 1e-11 * max(1.0, float(w.abs().max())), k


@settings(max_examples=30, deadline=None)
@given(lay=layouts(), data=st.data())
def test_stable_spam_matches_spec(lay, data):
    """AdaClip and AdaGN alone (no reset) against `spec.StableSPAM` on `families.sequence` streams, with
    every scope: the transform's output, step by step; and with resets through `Adam` against the spec
    pipeline (`spec.Adam` restarts its count)."""
    shp, group_of, dtype, seed = lay
    kw = scope_kw(data.draw)
    kw.update(gamma1=data.draw(st.sampled_from([0.7, 0.0, 0.95])), gamma2=data.draw(st.sampled_from([0.9, 0.5])),
              gamma3=data.draw(st.sampled_from([0.999, 0.9, 0.0])), eps=data.draw(st.sampled_from([1e-8, 0.0, 1e-3])))
    h = Harness(mo.StableSPAM(reset_every=None, **kw), [torch.zeros(s, dtype=dtype) for s in shp], group_of)
    ref = spec.StableSPAM(group_of, reset_every=None, **kw)
    rel = {torch.float64: 1e-9, torch.float32: 1e-4}[dtype]
    for k, us in enumerate(sequence(shp, dtype, seed, steps=30)):
        out, want = h.step(us), ref.step(us)
        try:
            close(out, want, dtype, rel)
        except AssertionError as e:
            raise AssertionError(f"step {k}: {e}") from None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stable_spam_with_resets_matches_the_spec_pipeline(seed):
    shp = SHAPES["many"]
    ps = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shp]
    opt = mo.Modular(ps, mo.StableSPAM(reset_every=5), mo.Adam(lr=0.01))
    ref, adam = spec.StableSPAM([0] * len(shp), reset_every=5), spec.Adam(lr=0.01)
    want = [p.detach().clone() for p in ps]
    for k, us in enumerate(sequence(shp, torch.float64, seed, steps=22, spike_at=7, alt=(12, 16))):
        for p, u in zip(ps, us):
            p.grad = u.clone()
        opt.step()
        want = adam.step(want, ref.step(us, adam))
        for p, w in zip(ps, want):
            assert (p - w).abs().max() <= 1e-11 * max(1.0, float(w.abs().max())), k


# --- by hand --------------------------------------------------------------------------------------------------
def test_spam_by_hand():
    """theta 4, reset every 3, warm-up 2, clipping from step 2 (lr 1, SGD-free: read Adam's v directly)."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = mo.Modular([p], mo.SPAM(theta=4.0, reset_every=3, warmup_steps=2, clip_delay=2), mo.Adam(lr=1.0))
    v = lambda: opt.state[p]["1:Adam.exp_avg_sq"]  # noqa: E731
    p.grad = torch.tensor([1.0, 1.0], dtype=torch.float64)
    opt.step()  # step 1: no clip (1 < clip_delay); v = 0.001
    assert v().tolist() == pytest.approx([1e-3, 1e-3])
    assert opt.stats["0:SPAM.clipped"].tolist() == [0] and not bool(opt.stats["0:SPAM.clipping"])
    p.grad = torch.tensor([1.0, 0.01], dtype=torch.float64)
    opt.step()  # step 2: 1 > 4 * 0.001: cut to sqrt(0.004); 1e-4 is not
    assert opt.stats["0:SPAM.clipped"].tolist() == [1]
    assert v().tolist() == pytest.approx([0.999e-3 + 0.004e-3, 0.999e-3 + 1e-7])
    assert float(opt.stats["0:SPAM.lr_scale"]) == 1.0  # no warm-up before the first reset
    p.grad = torch.tensor([5.0, 5.0], dtype=torch.float64)
    opt.step()  # step 3: a reset (v = 0 first; no clip at phase 0 < clip_delay), the warm-up's first factor
    assert bool(opt.stats["0:SPAM.reset"]) and not bool(opt.stats["0:SPAM.clipping"])
    assert v().tolist() == pytest.approx([0.025, 0.025])
    assert float(opt.stats["0:SPAM.lr_scale"]) == pytest.approx(1 - 0.99 * (1 + math.cos(math.pi / 3)) / 2)
    assert int(opt.state[p]["1:Adam.step"]) == 3  # the bias correction goes on
    p.grad = torch.tensor([5.0, 5.0], dtype=torch.float64)
    opt.step()  # step 4: phase 1 < clip_delay; second warm-up factor
    assert float(opt.stats["0:SPAM.lr_scale"]) == pytest.approx(1 - 0.99 * (1 + math.cos(2 * math.pi / 3)) / 2)
    p.grad = torch.tensor([100.0, 0.1], dtype=torch.float64)
    opt.step()  # step 5: phase 2: clipping again, the warm-up over
    assert bool(opt.stats["0:SPAM.clipping"]) and float(opt.stats["0:SPAM.lr_scale"]) == 1.0
    assert opt.stats["0:SPAM.clipped"].tolist() == [1]


def test_stable_spam_by_hand():
    """One tensor, gammas 0.5: step 1 sets M = 2 (Mhat 4 = max|g|, no clip) and AdaGN's debiased norm EMAs to
    n = 5 and n^2, so the step's norm becomes 5 / sqrt(25) = 1; step 2's max 40 gives Mhat
    (0.5*2 + 0.5*40) / 0.75 = 28: the 40 becomes 28, then AdaGN rescales to m_hat / sqrt(s_hat)."""
    h = Harness(mo.StableSPAM(gamma1=0.5, gamma2=0.5, gamma3=0.5, eps=0.0, reset_every=None),
                [torch.zeros(2, dtype=torch.float64)])
    out = h.step([torch.tensor([3.0, 4.0], dtype=torch.float64).neg()])
    assert out[0].tolist() == pytest.approx([-0.6, -0.8])  # m_hat = n, s_hat = n^2: c = 1
    out = h.step([torch.tensor([40.0, 3.0], dtype=torch.float64)])
    assert h.stats["0:StableSPAM.clipped"].tolist() == [1]
    n = math.hypot(28.0, 3.0)
    m, s = (0.5 * 2.5 + 0.5 * n) / 0.75, (0.5 * 12.5 + 0.5 * n * n) / 0.75
    assert h.stats["0:StableSPAM.norm"].tolist() == pytest.approx([n])
    assert out[0].tolist() == pytest.approx([28.0 / n * m / s**0.5, 3.0 / n * m / s**0.5])


@settings(max_examples=15, deadline=None)
@given(lay=layouts())
def test_zeros_stay_zeros(lay):
    shp, group_of, dtype, _ = lay
    h = Harness(mo.StableSPAM(reset_every=None), [torch.zeros(s, dtype=dtype) for s in shp], group_of)
    for _ in range(3):
        out = h.step([torch.zeros(s, dtype=dtype) for s in shp])
        assert all(torch.equal(o, torch.zeros_like(o)) for o in out)
    ps = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shp]
    opt = mo.Modular(ps, mo.SPAM(clip_delay=0), mo.Adam(lr=1.0))
    for _ in range(3):
        for p in ps:
            p.grad = torch.zeros_like(p)
        opt.step()
    assert all(torch.equal(p, torch.zeros_like(p)) for p in ps)


# --- the contract: links made when built, clear errors -------------------------------------------------------------
@pytest.mark.parametrize("pipe,match", [
    (lambda: [mo.SPAM(), mo.SGD(lr=0.1)], r"0:SPAM: SPAM needs second_moment, reset, lr_scale from the optimizer "
                                          r"transform after it, and 1:SGD does not offer them .*mo.Adam or mo.AdamW"),
    (lambda: [mo.StableSPAM(), mo.LR(0.1)], r"0:StableSPAM: .*1:LR does not offer them"),
    (lambda: [mo.SPAM(reset_every=None), mo.ClipNorm(1.0)], r"0:SPAM: SPAM needs second_moment from an optimizer "
                                                            r"transform after it, and the pipeline has none"),
    (lambda: [mo.Adam(), mo.SPAM()], r"0:SPAM|1:SPAM"),
    (lambda: [mo.Masked(mo.SPAM(), where=mo.Select(min_ndim=1)), mo.Adam()], r"0:Masked/0:SPAM: SPAM scales the "
                                                                             r"learning rate .* 1:Adam"),
    (lambda: [mo.SPAM(), mo.Masked(mo.Adam(), where=mo.Select(min_ndim=1)), mo.Masked(mo.Adam(), where=mo.Select(max_ndim=0))],
     r"0:SPAM: .*the next one is inside 1:Masked"),
    (lambda: [mo.SPAM(), mo.TorchOptimizer(torch.optim.Adam)], r"1:TorchOptimizer does not offer"),
])
def test_a_missing_or_wrong_optimizer_is_refused_when_built(pipe, match):
    with pytest.raises(ValueError, match=match):
        mo.Modular([torch.nn.Parameter(torch.zeros(2))], *pipe())


def test_links_look_through_chains_and_stay_inside_a_selection():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = mo.Modular([p], mo.Chain(mo.SPAM(), mo.ClipNorm(1.0)), mo.Chain(mo.Identity(), mo.AdamW()))
    assert {k: v.key for k, v in opt.moment_links.items()} == {"0:Chain/0:SPAM": "1:Chain/1:AdamW"}
    opt = mo.Modular([p], mo.Masked(mo.SPAM(warmup_steps=0), where=mo.Select(min_ndim=1)), mo.Adam())
    assert {k: v.key for k, v in opt.moment_links.items()} == {"0:Masked/0:SPAM": "1:Adam"}
    # needing nothing, Stable-SPAM without resets goes in front of any optimizer
    assert mo.Modular([p], mo.StableSPAM(reset_every=None), mo.SGD(lr=0.1)).moment_links == {}


def test_a_transform_declaring_an_unknown_need_is_named():
    class _NeedsCurvature(mo.roles.NeedsMoments):
        positional = None

        def needs(self):
            return ("hessian",)

        def apply(self, ctx, st, updates):
            return updates

    with pytest.raises(ValueError, match=r"0:_NeedsCurvature: _NeedsCurvature.needs names \['hessian'\]"):
        mo.Modular([torch.nn.Parameter(torch.zeros(2))], _NeedsCurvature(), mo.Adam())


def test_attach_refuses_them():
    p = torch.nn.Parameter(torch.zeros(2))
    for t in (mo.SPAM(), mo.StableSPAM()):
        with pytest.raises(ValueError, match=type(t).__name__):
            mo.attach(torch.optim.AdamW([p]), t)


# --- fields, config ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls,field,bad", [
    ("SPAM", "theta", -1.0), ("SPAM", "theta", math.inf), ("SPAM", "reset_every", 0), ("SPAM", "warmup_steps", -1),
    ("SPAM", "clip_delay", 1.5), ("StableSPAM", "gamma1", 1.0), ("StableSPAM", "gamma3", -0.1),
    ("StableSPAM", "eps", math.nan), ("StableSPAM", "reset_every", 0), ("StableSPAM", "scope", "layer"),
])
def test_bad_fields_are_refused_by_name(cls, field, bad):
    with pytest.raises(pydantic.ValidationError, match=f"{cls}.{field}"):
        getattr(mo, cls)(**{field: bad})


def test_config_round_trip(tmp_path):
    cfg = mo.PipelineConfig(transforms=[
        mo.Masked(mo.StableSPAM(gamma1=0.6, reset_every=None, scope="group"), where="*"),
        mo.SPAM(theta=100.0, reset_every=7, warmup_steps=3, clip_delay=2), mo.AdamW(weight_decay=0.0)])
    assert mo.load_config(cfg.save(tmp_path / "c.yaml")) == cfg
    assert "type: SPAM" in cfg.to_yaml() and "type: StableSPAM" in cfg.to_yaml()


# --- non-finite steps, host syncs, kernels, masks ----------------------------------------------------------------
def model_and_opt(first, *rest, **kw):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return m, mo.Modular(m.parameters(), first, *rest, **kw)


def set_grads(model, k):
    g = torch.Generator().manual_seed(50 + k)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * (40.0 if k % 4 == 1 else 1.0)


FIRSTS = {"SPAM": lambda: mo.SPAM(theta=20.0, reset_every=3, warmup_steps=2, clip_delay=1),
          "StableSPAM": lambda: mo.StableSPAM(reset_every=3)}


@pytest.mark.parametrize("name", sorted(FIRSTS))
def test_nonfinite_steps_change_nothing_and_no_step_syncs(name):
    """Beyond the registry's skip (one NaN step after six, before Adam): NaN and inf gradients on a reset step
    (step 3; the reset waits for the next step taken) and on step 5 (SPAM's warm-up after it), before torch's
    fused AdamW."""
    assert_bad_steps_change_nothing(lambda: model_and_opt(FIRSTS[name](), mo.AdamW(lr=1e-2)), set_grads, steps=8,
                                    at=(2, 4))


@pytest.mark.parametrize("kernel", [dict(fused=False), dict(foreach=True), dict(fused=True), "not last"])
def test_the_warm_up_reaches_every_adam_kernel(kernel):
    """The learning-rate factor the warm-up asks for is taken by torch's fused kernel (the default), its for-loop
    and foreach kernels and modopt's own formulas (Adam not last): each run within float32 rounding of the
    float64 spec's, which differs from a run without the factor by far more."""
    shp = SHAPES["mixed"]
    kw = dict(theta=30.0, reset_every=4, warmup_steps=3, clip_delay=1)
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in shp]
    tail = [mo.Adam(lr=0.1), mo.Identity()] if kernel == "not last" else [mo.Adam(lr=0.1, **kernel)]
    opt = mo.Modular(ps, mo.SPAM(**kw), *tail)
    ref, adam = spec.SPAM(**kw), spec.Adam(lr=0.1)
    plain = spec.Adam(lr=0.1)
    want = without = [p.detach().double().clone() for p in ps]
    for us in grads_stream(shp, 4, 10):
        for p, u in zip(ps, us):
            p.grad = u.clone()
        opt.step()
        clipped, factor = ref.step(us, adam)
        want = adam.step(want, clipped, factor)
        without = plain.step(without, clipped)
    gap = max(float((w - x).abs().max()) for w, x in zip(want, without))
    err = max(float((p.detach().double() - w).abs().max()) for p, w in zip(ps, want))
    assert err <= 1e-5 < gap


def test_masked_with_its_own_optimizer_equals_the_selection_alone():
    """`Masked(SPAM(), AdamW(), where=weights)` beside `Masked(AdamW(), where=rest)` steps the weights as SPAM
    over them alone would, and the rest as plain AdamW: its resets and warm-up stay in its selection."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    named = list(m.named_parameters())
    clones = {n: torch.nn.Parameter(p.detach().clone()) for n, p in named}
    weights, rest = mo.Select(min_ndim=2), mo.Select(max_ndim=1)
    spam = lambda: mo.SPAM(theta=20.0, reset_every=3, warmup_steps=2, clip_delay=1)  # noqa: E731
    masked = mo.Modular(named, mo.Masked(spam(), mo.AdamW(lr=1e-2), where=weights),
                        mo.Masked(mo.AdamW(lr=1e-2), where=rest))
    alone = mo.Modular([clones[n] for n, p in named if p.dim() >= 2], spam(), mo.AdamW(lr=1e-2))
    plain = mo.Modular([clones[n] for n, p in named if p.dim() < 2], mo.AdamW(lr=1e-2))
    g = torch.Generator().manual_seed(3)
    for k in range(8):
        for n, p in named:
            p.grad = torch.randn(p.shape, generator=g) * (30.0 if k == 5 else 1.0)
            clones[n].grad = p.grad.clone()
        for o in (masked, alone, plain):
            o.step()
    for n, p in named:
        assert torch.equal(p, clones[n]), n


# --- the eager step's shortcuts round as the plain expressions ------------------------------------------
def _bits(x):
    return x.reshape(-1).view(torch.uint8) if x.is_floating_point() else x


PLAIN_CASES = {
    "StableSPAM": lambda: [mo.StableSPAM(reset_every=4), mo.AdamW(weight_decay=0.0, fused=False)],
    "StableSPAM, eps=0": lambda: [mo.StableSPAM(reset_every=None, eps=0.0), mo.LR(1.0)],
    "StableSPAM, global": lambda: [mo.StableSPAM(reset_every=3, scope="global"), mo.Adam()],
    "StableSPAM, group": lambda: [mo.StableSPAM(reset_every=3, scope="group"), mo.Adam()],
    "StableSPAM, slices": lambda: [mo.StableSPAM(reset_every=4, scope="tensor", dim=0), mo.Adam()],
    "SPAM": lambda: [mo.SPAM(theta=0.3, reset_every=6, warmup_steps=3, clip_delay=2), mo.AdamW()],
    "SPAM, defaults": lambda: [mo.SPAM(clip_delay=3, reset_every=7), mo.AdamW()],
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64", "mixed"])
@pytest.mark.parametrize("nonfinite", ["skip", "ignore"])
@pytest.mark.parametrize("case", sorted(PLAIN_CASES))
def test_eager_shortcuts_give_the_bits_of_the_plain_expressions(case, nonfinite, dtype, monkeypatch):
    """The eager step takes shortcuts a compiled step does not: the largest |g| from one min/max pass (not the
    inf-norm kernel), the clips and AdaGN's scaling written in place, and no full-size select on a 0-d condition.
    With them turned off (the plain expressions, as compiled) every parameter, saved value and statistic is the
    same to the bit (NaN payloads included), in every dtype and in mixed ones (0-d tensors among them: there an
    in-place op would round in the narrower dtype, so the plain expression runs), across resets, spikes, zero
    and tiny gradients, and NaN and inf ones (kept by `ignore`, skipped by `skip`)."""
    from modopt.transforms import spam as impl

    shapes = [(5, 3), (7,), (), (4, 2, 3), (64, 33), (0,), (1, 1)]
    kinds = {"float32": [torch.float32], "bfloat16": [torch.bfloat16], "float64": [torch.float64],
             "mixed": [torch.bfloat16, torch.float32, torch.float64]}[dtype]

    def run():
        g = torch.Generator().manual_seed(1)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(kinds[i % len(kinds)]))
              for i, s in enumerate(shapes)]
        opt = mo.Modular([{"params": ps[:3]}, {"params": ps[3:]}], *PLAIN_CASES[case](), nonfinite=nonfinite)
        out, clipped = [], 0
        for k in range(14):
            for i, p in enumerate(ps):
                x = torch.randn(p.shape, generator=g, dtype=torch.float64) * (0.1 + i)
                x = x * (300.0 if k % 5 == 3 and i == k % len(shapes) else 1.0) * (1e-30 if k % 7 == 4 else 1.0)
                x = torch.zeros_like(x) if k % 6 == 2 and i == 1 else x
                p.grad = x.to(p.dtype)
                if k in (3, 8) and p.numel():
                    p.grad.view(-1)[0] = math.nan if k == 3 else math.inf
            opt.step()
            clipped += sum(int(v.sum()) for n, v in opt.stats.items() if n.endswith(".clipped"))
            out.append([p.detach().clone() for p in ps] + [v.clone() for s in opt.state.values() for v in s.values()
                                                           if torch.is_tensor(v)] + [v.clone() for v in opt.stats.values()])
        return out, clipped

    fast, clipped = run()
    monkeypatch.setattr(impl, "_in_place", lambda u, *by: False)
    monkeypatch.setattr(impl, "_max_abs", lambda seg, updates: seg.reduce(updates, math.inf))
    plain, _ = run()
    assert clipped > 0  # the spikes are clipped: the clip's shortcut is exercised
    for k, (a, b) in enumerate(zip(fast, plain)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y)), k
