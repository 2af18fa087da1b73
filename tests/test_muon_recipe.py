"""Muon's 2026 recipe: named Newton-Schulz schedules, NorMuon and AdaMuon.

Against the float64 spec (modopt/spec/orthogonal.py), against pytorch_optimizer 4.1's
`zero_power_via_newton_schulz_5`, `NorMuon` and `AdaMuon` (when installed), and against the coefficient
tables of the sources the presets name (microsoft/dion, karpathy/nanochat, the Polar Express paper,
NVIDIA-NeMo/Emerging-Optimizers), copied here as golden values.
"""

from __future__ import annotations

import math

import pydantic
import pytest
import torch
from hypothesis import given, settings, strategies as st

import modopt as mo
from checks import assert_a_nan_step_changes_no_bit, assert_same_run, randn, seeded_grads, twin_params
from modopt.spec import orthogonal as spec
from modopt.transforms.orthogonal import NS_PRESETS, coefficient_steps

PRESETS = ["original", "quintic", "polar_express", "polar_express_paper", "deepseek_v4"]
SHAPES = [(), (5,), (1, 6), (6, 1), (4, 7), (7, 4), (5, 5), (3, 2, 2), (4, 2, 3, 3), (0, 3)]








def _pto():
    return pytest.importorskip("pytorch_optimizer")


# --- the presets: their values are the sources' ------------------------------------------------------
#: golden values read from the sources (facts): the first and last polynomial of each schedule
DION_NANOCHAT_FIRST = (8.156554524902461, -22.48329292557795, 15.878769915207462)  # dion/polar_express.py
DION_NANOCHAT_LAST = (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)
#: Emerging-Optimizers' "polar_express": the paper's polynomials with the 1.01 safety, to four decimals
EMERGING_POLAR_EXPRESS = [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                          (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                          (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)]
#: Emerging-Optimizers' "deepseekv4" (from the DeepSeek-V4 report)
EMERGING_DEEPSEEK_V4 = [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2


def test_the_presets_hold_the_sources_coefficients():
    run = {k: v[0] for k, v in NS_PRESETS.items()}
    assert set(run) == set(PRESETS) == set(spec.PRESETS)
    for name in PRESETS:  # the runtime's table and the spec's (derived independently) agree
        assert len(run[name]) == len(spec.PRESETS[name][0])
        for r, s in zip(run[name], spec.PRESETS[name][0]):
            assert r == pytest.approx(s, rel=1e-15, abs=0), name
        assert NS_PRESETS[name][1] == spec.PRESETS[name][1]
    assert run["polar_express"][0] == DION_NANOCHAT_FIRST and run["polar_express"][-1] == DION_NANOCHAT_LAST
    assert len(run["polar_express"]) == 5 and NS_PRESETS["polar_express"][1] == 1.02
    for r, e in zip(run["polar_express_paper"], EMERGING_POLAR_EXPRESS):
        assert r == pytest.approx(e, abs=1e-4)  # (four decimals, not always rounded to nearest)
    assert NS_PRESETS["polar_express_paper"][1] == 1.01
    assert list(run["deepseek_v4"]) == EMERGING_DEEPSEEK_V4
    assert run["original"] == ((3.4445, -4.775, 2.0315),) == (tuple(torch.optim.Muon([torch.zeros(2, 2)]).defaults["ns_coefficients"]),)


def test_the_presets_equal_pytorch_optimizers_tables():
    """pytorch_optimizer 4.1 names "original" and "quintic" the same schedules; its "polar_express_safer"
    (eight polynomials for eight steps) starts with the four of dion's and nanochat's five-step set."""
    pto = _pto()
    from pytorch_optimizer.optimizer.utils.matrix import get_newton_schulz_weights

    assert [tuple(c) for c in NS_PRESETS["original"][0]] == get_newton_schulz_weights("original")
    assert [tuple(c) for c in NS_PRESETS["quintic"][0]] == get_newton_schulz_weights("quintic")
    safer = get_newton_schulz_weights("polar_express_safer")
    for r, s in zip(NS_PRESETS["polar_express"][0][:4], safer[:4]):
        assert r == pytest.approx(s, rel=1e-13)
    assert pto is not None


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("shape", [(8, 8), (6, 10), (10, 6)])
@pytest.mark.parametrize("safety", [None, 1.01, 1.0])
def test_newton_schulz_with_a_preset_equals_pytorch_optimizers_bit_for_bit(preset, shape, safety):
    """The default bfloat16 iteration, the norm times the safety factor: `zero_power_via_newton_schulz_5`
    (the same three products per step, the last triple repeated past the schedule's end)."""
    _pto()
    from pytorch_optimizer.optimizer.utils.matrix import zero_power_via_newton_schulz_5

    t = mo.Orthogonalize(ns_coefficients=preset, ns_steps=12, ns_safety=safety)
    m = randn(shape, 7, torch.float32)
    ours = t.orthogonalized(m)
    ref = zero_power_via_newton_schulz_5(m, num_steps=12, eps=1e-7, safety_factor=t.safety(),
                                         weights=list(NS_PRESETS[preset][0]), dtype=torch.bfloat16)
    assert torch.equal(ours, ref)


@given(shape=st.one_of(st.sampled_from(SHAPES), st.tuples(st.integers(1, 9), st.integers(1, 9))),
       seed=st.integers(0, 2**16), preset=st.sampled_from(PRESETS), steps=st.integers(0, 12),
       safety=st.sampled_from([None, 1.0, 1.01, 1.05]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_orthogonalize_with_a_preset_matches_spec(shape, seed, preset, steps, safety, dtype):
    """In float64 the runtime is the spec's iteration to rounding; in float32 within 1e-4 of its largest value."""
    steps = max(steps, NS_PRESETS[preset][2])
    t = mo.Orthogonalize(ns_coefficients=preset, ns_steps=steps, ns_safety=safety,
                         ns_dtype="float64" if dtype == torch.float64 else "float32")
    p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
    p.grad = randn(shape, seed, dtype)
    want = spec.orthogonalize([p.grad], ns_coefficients=preset, ns_steps=steps, ns_safety=safety)[0]
    mo.Modular([p], t, mo.LR(1.0)).step()
    got = -p.detach().to(torch.float64)
    # the iteration magnifies rounding by its slope near 0 (Polar Express's first polynomial: 8.2);
    # checked on well-scaled inputs: x0's smallest singular value at least 0.05 (else only finiteness)
    m = spec.matrix_of(p.grad)
    if m is not None and m.numel() and float(torch.linalg.svdvals(m).min() / torch.linalg.matrix_norm(m)) < 0.05:
        assert torch.isfinite(got).all()
        return
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1e-30)
    assert float((got - want).abs().max()) <= tol * scale if want.numel() else True


def test_polar_express_lands_closer_to_the_polar_factor_than_five_jordan_steps():
    """The reason for the preset (the paper's Figure 4, here on the scalar map): over singular values of x0
    in [1e-3, 1], five Polar Express steps (after the 1.02 pre-scaling) land in [0.84, 1.15]; five of
    Keller Jordan's, or of You's, leave the smallest below 0.5. DeepSeek-V4's two settling steps bring
    Jordan's band to within 1e-3 of 1 where ten of Jordan's alone stay at [0.68, 1.13]."""
    s = torch.logspace(-3, 0, 3001, dtype=torch.float64)
    pe = spec.scalar_map(s / 1.02, "polar_express", 5)
    assert 0.84 < float(pe.min()) and float(pe.max()) < 1.15
    for other in ("original", "quintic"):
        assert float(spec.scalar_map(s, other, 5).min()) < 0.5
    s = s[s >= 0.02]
    assert float((spec.scalar_map(s, "deepseek_v4", 10) - 1).abs().max()) < 1e-3
    assert float((spec.scalar_map(s, "original", 10) - 1).abs().max()) > 0.13


def test_the_preset_rules_and_their_refusals():
    assert coefficient_steps("polar_express", 3) == list(NS_PRESETS["polar_express"][0][:3])
    assert coefficient_steps("polar_express", 7)[5:] == [NS_PRESETS["polar_express"][0][-1]] * 2
    assert mo.Orthogonalize(ns_coefficients="polar_express").safety() == 1.02
    assert mo.Orthogonalize(ns_coefficients="polar_express", ns_safety=1.01).safety() == 1.01
    assert mo.Orthogonalize(ns_coefficients="polar_express_paper", ns_steps=8).safety() == 1.01
    assert mo.Orthogonalize().safety() == mo.Orthogonalize(ns_coefficients="quintic").safety() == 1.0
    with pytest.raises(pydantic.ValidationError, match="10-step schedule"):
        mo.Muon(ns_coefficients="deepseek_v4")
    mo.Muon(ns_coefficients="deepseek_v4", ns_steps=10)
    with pytest.raises(pydantic.ValidationError, match="polar_express"):
        mo.Orthogonalize(ns_coefficients="polar-express")
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 1"):
        mo.Orthogonalize(ns_coefficients="polar_express", ns_safety=0.9)
    with pytest.raises(pydantic.ValidationError):
        mo.AdaMuon(ns_safety=math.inf)


@pytest.mark.parametrize("t", [mo.Orthogonalize(ns_coefficients="polar_express", ns_safety=1.01),
                               mo.Muon(0.02, ns_coefficients="deepseek_v4", ns_steps=10),
                               mo.AdaMuon(ns_coefficients="polar_express_paper", ns_steps=8)], ids=str)
def test_a_preset_serialises_as_its_name_and_rebuilds_exactly(t, tmp_path):
    cfg = mo.Modular([torch.nn.Parameter(torch.zeros(3, 3))], t).config
    for text, load in ((cfg.to_yaml(), "yaml"), (cfg.to_json(), "json")):
        assert f'"ns_coefficients": "{t.ns_coefficients}"' in text or f"ns_coefficients: {t.ns_coefficients}\n" in text
        path = tmp_path / f"c.{load}"
        path.write_text(text)
        again = mo.load_config(path)
        assert again.transforms[0] == t and again.transforms[0].ns_coefficients == t.ns_coefficients
    a, b = twin_params([(6, 4), (4, 6)], torch.float32)
    oa, ob = mo.Modular(a, t, mo.LR(0.1)) if not isinstance(t, mo.roles.Optimizer) else mo.Modular(a, t), cfg.build(b)
    for k in range(3):
        seeded_grads(a, k, 1, torch.float32)
        seeded_grads(b, k, 1, torch.float32)
        oa.step()
        ob.step()
    if not isinstance(t, mo.roles.Optimizer):
        return
    for p, q in zip(a, b):
        assert torch.equal(p, q)


# --- ns_steps per parameter -------------------------------------------------------------------------
def test_ns_steps_per_parameter_through_masked_branches():
    """Late layers with ten steps, the rest with five (arXiv 2606.04058's argument): two `Masked` branches
    of `Muon` with their own `ns_steps` (and schedule). Each parameter follows the float64 spec with its
    branch's settings: the branches do not mix."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).double()
    named = list(model.named_parameters())
    late = mo.Select(names=["2.*"], min_ndim=2)
    early = mo.Select(exclude=["2.*"], min_ndim=2)
    vectors = mo.Select(max_ndim=1)
    opt = mo.Modular(named, mo.Masked(mo.Muon(0.02, ns_coefficients="polar_express", ns_steps=10,
                                              ns_dtype="float64"), where=late),
                     mo.Masked(mo.Muon(0.02, ns_steps=5, ns_dtype="float64"), where=early),
                     mo.Masked(mo.Muon(0.02, ns_dtype="float64"), where=vectors))
    refs = {n: spec.Muon(ns_coefficients="polar_express", ns_steps=10) if n.startswith("2.") and p.dim() == 2
            else spec.Muon(ns_steps=5) for n, p in named}
    want = {n: p.detach().clone() for n, p in named}
    x = randn((8, 6), 3)
    for k in range(4):
        opt.zero_grad()
        model(x * (k + 1)).square().sum().backward()
        for n, p in named:
            (want[n],) = refs[n].step([want[n]], [p.grad], 0.02)
        opt.step()
    for n, p in named:
        torch.testing.assert_close(p.detach(), want[n], rtol=1e-11, atol=1e-12, msg=n)
    # and the settings differ where they should: ten Polar Express steps are not five Jordan steps
    other = spec.Muon(ns_steps=5)
    p0 = dict(named)["2.weight"]
    assert not torch.allclose(other.step([p0.detach()], [p0.grad], 0.02)[0],
                              refs["2.weight"].__class__(ns_coefficients="polar_express", ns_steps=10)
                              .step([p0.detach()], [p0.grad], 0.02)[0])


def test_ns_steps_per_parameter_for_orthogonalize_in_one_chain():
    """`Masked(Orthogonalize(ns_steps=k))` on disjoint selections in front of one optimizer."""
    a = torch.nn.Parameter(torch.zeros(5, 4, dtype=torch.float64))
    b = torch.nn.Parameter(torch.zeros(4, 5, dtype=torch.float64))
    opt = mo.Modular([("a", a), ("b", b)],
                     mo.Masked(mo.Orthogonalize(ns_steps=2, ns_dtype="float64"), where=mo.Select("a")),
                     mo.Masked(mo.Orthogonalize(ns_coefficients="deepseek_v4", ns_steps=10, ns_dtype="float64"),
                               where=mo.Select("b")),
                     mo.LR(1.0))
    a.grad, b.grad = randn((5, 4), 1), randn((4, 5), 2)
    wa = spec.orthogonalize([a.grad], ns_steps=2)[0]
    wb = spec.orthogonalize([b.grad], ns_coefficients="deepseek_v4", ns_steps=10)[0]
    opt.step()
    torch.testing.assert_close(-a.detach(), wa, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(-b.detach(), wb, rtol=1e-12, atol=1e-13)


# --- NorMuon ------------------------------------------------------------------------------------------
@settings(max_examples=60)
@given(shapes=st.lists(st.one_of(st.sampled_from(SHAPES), st.tuples(st.integers(1, 7), st.integers(1, 7))),
                       min_size=1, max_size=3),
       seed=st.integers(0, 2**16), per=st.sampled_from(["row", "larger"]), beta2=st.sampled_from([0.0, 0.5, 0.95]),
       eps=st.sampled_from([1e-10, 1e-8, 1e-3]), dtype=st.sampled_from([torch.float32, torch.float64]),
       nonfinite=st.sampled_from(["skip", "ignore"]))
def test_normuon_matches_spec(shapes, seed, per, beta2, eps, dtype, nonfinite):
    """Five steps of `NorMuon` on the raw gradients (its normalization alone; the spec takes the same input)
    equal the spec's, a step with a NaN gradient in the middle skipped (the second moments keep every bit)."""
    ps = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    opt = mo.Modular(ps, mo.NorMuon(beta2, eps=eps, per=per), mo.LR(1.0), nonfinite=nonfinite)
    ref = spec.NorMuon(beta2, eps, per)
    for k in range(5):
        before = [p.detach().clone() for p in ps]
        for i, p in enumerate(ps):
            p.grad = randn(p.shape, seed + 31 * k + i, dtype)
        if k == 2 and nonfinite == "skip" and ps[0].numel():
            saved = [{key: v.clone() for key, v in opt.state[p].items()} for p in ps]
            ps[0].grad.view(-1)[0] = math.nan
            opt.step()
            for p, was in zip(ps, saved):
                assert opt.state[p].keys() == was.keys()
                for key, v in opt.state[p].items():
                    assert torch.equal(v, was[key])
            for p, q in zip(ps, before):
                assert torch.equal(p, q)
            continue
        want = ref.step([p.grad for p in ps])
        opt.step()
        for p, q, w in zip(ps, before, want):
            got = (q - p.detach()).to(torch.float64)
            tol = 1e-12 if dtype == torch.float64 else 2e-5  # (float32: the difference of two parameter values)
            scale = max(float(w.abs().max()) if w.numel() else 0.0, 1e-30)
            assert w.numel() == 0 or float((got - w).abs().max()) <= tol * scale, (k, p.shape)


def test_normuon_keeps_the_norm_and_equalizes_the_rows():
    """One step from zero state: every row's norm becomes the same (sqrt(v) is proportional to the row's
    RMS), the Frobenius norm is the input's; `per="larger"` equalizes the columns of a wide matrix instead."""
    u = torch.tensor([[3.0, 0.0, 0.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    for per, dim in (("row", 1), ("larger", 0)):
        p = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))
        p.grad = u.clone()
        mo.Modular([p], mo.NorMuon(per=per), mo.LR(1.0)).step()
        out = -p.detach()
        norms = out.norm(dim=dim)
        nonzero = norms[norms > 0]
        torch.testing.assert_close(nonzero, torch.full_like(nonzero, nonzero[0].item()))
        torch.testing.assert_close(out.norm(), u.norm())
    zero = torch.nn.Parameter(torch.zeros(3, 2))
    zero.grad = torch.zeros(3, 2)
    mo.Modular([zero], mo.NorMuon(), mo.LR(1.0)).step()
    assert torch.equal(zero, torch.zeros(3, 2))  # a zero update stays zero (not NaN)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("adjust", [False, True])
def test_normuon_chain_equals_pytorch_optimizers_normuon(dtype, adjust):
    """`Chain(Momentum(0.95), Orthogonalize(adjust_lr=...), NorMuon(), LR(lr))` is pytorch_optimizer's
    `NorMuon` with its defaults (Nesterov, bfloat16 Newton-Schulz, preserve_norm), Keller Jordan's shape
    factor on (`use_adjusted_lr=False`: `"original"`). The chain multiplies by the shape factor before the
    normalization and by lr after it where the reference multiplies once at the end: equal to rounding."""
    pto = _pto()
    shapes = [(8, 5), (5, 8), (6, 6), (4, 3, 2, 2)]
    a, b = twin_params(shapes, dtype)
    oa = mo.Modular(a, mo.Momentum(0.95), mo.Orthogonalize(adjust_lr="original" if adjust else "none"),
                    mo.NorMuon(), mo.LR(0.02))
    ob = pto.NorMuon([dict(params=b, use_muon=True)])
    for k in range(8):
        seeded_grads(a, k, 2, dtype)
        seeded_grads(b, k, 2, dtype)
        oa.step()
        ob.step()
    for p, q in zip(a, b):
        if not adjust and p.shape[0] > math.prod(p.shape[1:]):
            continue  # a tall matrix: the reference always applies the factor
        torch.testing.assert_close(p, q, rtol=4e-6 if dtype == torch.float32 else 1e-10, atol=1e-7)
        v_ours = [v for k2, v in oa.state[p].items() if k2.endswith("second_moment")][0]
        r2 = (max(1.0, p.shape[0] / math.prod(p.shape[1:])) if adjust else 1.0)
        torch.testing.assert_close(v_ours.reshape(-1, 1) / r2, ob.state[q]["second_momentum_buffer"],
                                   rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=0)


# --- AdaMuon ------------------------------------------------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 8, bias=False)
        self.b = torch.nn.Linear(8, 3, bias=False)
        self.conv = torch.nn.Conv2d(2, 4, 2, bias=False)

    def forward(self, x, img):
        return self.b(torch.tanh(self.a(x))).square().mean() + self.conv(img).square().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1, "lr": 0.05}, {"betas": (0.8, 0.99), "eps": 1e-8},
                                {"adjust_lr_fn": "original"}, {"ns_steps": 3}],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults")
@pytest.mark.parametrize("nonfinite", ["skip", "ignore"])
def test_adamuon_equals_pytorch_optimizers_adamuon_bit_for_bit(dtype, kw, nonfinite):
    """`Modular.step()` after a real `backward()` on a model with linear and conv weights: the parameters
    equal pytorch_optimizer's `AdaMuon` (its `use_muon=True` group, its defaults) bit for bit, step after step."""
    pto = _pto()
    torch.manual_seed(0)
    net = _Net().to(dtype)
    ref_net = _Net().to(dtype)
    ref_net.load_state_dict(net.state_dict())
    opt = mo.Modular(net.parameters(), mo.AdaMuon(**kw), nonfinite=nonfinite)
    ref_kw = {("use_adjusted_lr" if k == "adjust_lr_fn" else k): (v == "match_rms_adamw" if k == "adjust_lr_fn" else v)
              for k, v in kw.items()}
    ref = pto.AdaMuon([dict(params=list(ref_net.parameters()), use_muon=True, **ref_kw)])
    g = torch.Generator().manual_seed(1)
    for k in range(6):
        x = torch.randn(5, 6, generator=g).to(dtype)
        img = torch.randn(3, 2, 4, 4, generator=g).to(dtype)
        for model, o in ((net, opt), (ref_net, ref)):
            o.zero_grad()
            model(x, img).backward()
            o.step()
        for p, q in zip(net.parameters(), ref_net.parameters()):
            assert torch.equal(p, q), (k, p.shape)


def test_adamuon_matches_spec():
    """The float64 trajectory of the spec with a scheduler, every shape rule (2-d, 4-d, 1-d, 0-d)."""
    shapes = [(6, 4), (3, 8), (4, 2, 3, 3), (5,), ()]
    for kw in ({}, {"adjust_lr_fn": "original", "weight_decay": 0.1, "betas": (0.5, 0.9)},
               {"ns_coefficients": "polar_express", "eps": 1e-6}):
        ps, _ = twin_params(shapes, torch.float64)
        opt = mo.Modular(ps, mo.AdaMuon(lr=0.03, ns_dtype="float64", **kw))
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        ref = spec.AdaMuon(**kw)
        want = [p.detach().clone() for p in ps]
        for k in range(7):
            seeded_grads(ps, k, 3, torch.float64)
            want = ref.step(want, [p.grad for p in ps], opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
            for p, w in zip(ps, want):
                torch.testing.assert_close(p.detach(), w, rtol=1e-11, atol=1e-12, msg=f"{kw} {k} {p.shape}")


def test_adamuon_in_a_chain_returns_its_update():
    """Not the last transform: the update `lr r O + lr wd p` equals the in-place step up to float32 rounding."""
    a, b = twin_params([(8, 4), (4, 8), (5,)], torch.float32)
    oa = mo.Modular(a, mo.AdaMuon(0.02, weight_decay=0.1), mo.ClipValue(1e30))
    ob = mo.Modular(b, mo.AdaMuon(0.02, weight_decay=0.1))
    assert_same_run(oa, a, ob, b, 5)


def test_adamuon_skips_a_nan_step_without_a_host_sync_and_keeps_every_bit():
    """The default step (the device decides): no host sync; the run with a NaN step equals the run without it."""
    pto = _pto()
    ours, theirs = twin_params([(8, 4), (4, 8)], torch.float32)
    a = mo.Modular(ours, mo.AdaMuon(0.02, weight_decay=0.1))
    b = pto.AdaMuon([dict(params=theirs, use_muon=True, weight_decay=0.1)])
    assert_a_nan_step_changes_no_bit(ours, a, theirs, b)


def test_adamuon_fields_and_group_keys():
    t = mo.AdaMuon()
    assert (t.lr, t.betas, t.weight_decay, t.eps, t.ns_eps, t.adjust_lr_fn) == (0.02, (0.9, 0.95), 0.0, 1e-10, 1e-7,
                                                                               "match_rms_adamw")
    assert mo.AdaMuon(0.1).lr == 0.1
    p = torch.nn.Parameter(torch.zeros(3, 3))
    opt = mo.Modular([p], mo.AdaMuon())
    assert {"lr", "betas", "weight_decay"} <= set(opt.param_groups[0])
    with pytest.raises(pydantic.ValidationError):
        mo.AdaMuon(betas=(0.9, 1.0))
    with pytest.raises(pydantic.ValidationError):
        mo.AdaMuon(eps=0.0)


# --- the example config ---------------------------------------------------------------------------------
def test_the_nanochat_config_routes_matrices_to_polar_express_and_normuon_with_nanochats_values():
    """nanochat's values (nanochat/optim.py at 92d63d4): the input divided by 1.01 ||X||_F (not the preset's 1.02),
    NorMuon's beta2 0.9; tests/test_muon_2026.py runs the config against nanochat's own step."""
    from pathlib import Path

    from modopt.cli.tasks import make_task

    path = Path(__file__).resolve().parents[1] / "examples" / "configs" / "muon_normuon_polar_express.yaml"
    cfg = mo.load_config(path)
    task = make_task("transformer", {"vocab": 16, "seq_len": 24, "d_model": 32, "nhead": 2, "layers": 2, "ff": 64}, 0)
    opt = cfg.build(list(task.model.named_parameters()))
    branch = [t for t in opt.transforms if isinstance(t, mo.Masked) and any(isinstance(c, mo.NorMuon) for c in t.transforms)]
    assert len(branch) == 1
    kinds = [type(c) for c in branch[0].transforms]
    assert kinds.index(mo.Orthogonalize) < kinds.index(mo.NorMuon)
    ortho = branch[0].transforms[kinds.index(mo.Orthogonalize)]
    assert ortho.ns_coefficients == "polar_express" and ortho.safety() == 1.01
    normuon = branch[0].transforms[kinds.index(mo.NorMuon)]
    assert (normuon.beta2, normuon.per) == (0.9, "larger")
    assert kinds.index(mo.MuonEq) < kinds.index(mo.Orthogonalize) < kinds.index(mo.MuonPlus) < kinds.index(mo.NorMuon)
    assert kinds[-2:] == [mo.CautiousWeightDecay, mo.ShapeScale]  # the decay on the shape-adjusted lr
