"""Statistical clipping: REFERENCE.md golden traces, drytorch's unit values, runtime == spec, state."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import modopt as mo
from modopt.spec import adaptive as spec
from checks import assert_resumes_bit_for_bit
from families import layouts, run_vs_spec, same_state, scope_kw, snapshot
from harness import Harness

WARMUP = [1.0, 1.2, 0.8, 1.1, 0.9] * 5
AFTER = [1.0, 5.0, 1.0, 1.05, 10.0, 1.0, 0.2, 3.0]
GOLDEN = {
    "zclip": [1.000000, 1.030313, 1.0, 1.05, 1.014719, 1.0, 0.2, 1.085029],
    "zstat": [1.000000, 1.031575, 1.0, 1.05, 1.445440, 1.0, 0.2, 3.000000],
    "ema": [1.000000, 1.050000, 1.0, 1.05, 1.131723, 1.0, 0.2, 1.291633],
}
MAKERS = {
    "zclip": lambda: mo.ZClip(max_grad_norm=None, warmup_steps=25),
    "zstat": lambda: mo.HistClip(mo.ZStatCriterion(), warmup_steps=25, warmup_max_norm=None),
    "ema": lambda: mo.HistClip(mo.EMACriterion(), warmup_steps=25, warmup_max_norm=None),
}


def run_trace(t, norms):
    h = Harness(t, [torch.zeros(1, dtype=torch.float64)])
    outs, stores = [], []
    for g in norms:
        out = h.step([torch.tensor([g], dtype=torch.float64)])
        outs.append(float(out[0].abs()))
        stores.append({k: float(v) for k, v in h._store[f"0:{type(t).__name__}"].items()})
    return outs, stores, h


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_traces(name):
    outs, _, _ = run_trace(MAKERS[name](), WARMUP + AFTER)
    assert outs[:25] == pytest.approx(WARMUP, abs=1e-12)  # no clip during warm-up
    assert outs[25:] == pytest.approx(GOLDEN[name], abs=1e-5)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_traces_through_modular_in_float32(name):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = mo.Modular([p], MAKERS[name](), mo.LR(1.0))
    outs = []
    for g in WARMUP + AFTER:
        before = p.detach().clone()
        p.grad = torch.tensor([g])
        opt.step()
        outs.append(float((before - p.detach()).abs()))
    assert outs[25:] == pytest.approx(GOLDEN[name], abs=1e-5)


def test_golden_statistics_after_step_27():
    _, zc, _ = run_trace(MAKERS["zclip"](), WARMUP + AFTER[:2])
    assert zc[-1]["mu"] == pytest.approx(1.000909, abs=1e-6)
    assert zc[-1]["var"] == pytest.approx(0.018844, abs=1e-6)
    _, zs, _ = run_trace(MAKERS["zstat"](), WARMUP + AFTER[:2])
    assert zs[-1]["mu"] == pytest.approx(1.120000, abs=1e-6)
    assert zs[-1]["v"] == pytest.approx(0.499602, abs=1e-6)
    # warm-up statistics: HistClip's variance has ddof 1, ZClip's ddof 0
    _, zs25, _ = run_trace(MAKERS["zstat"](), WARMUP)
    _, zc25, _ = run_trace(MAKERS["zclip"](), WARMUP)
    assert zs25[-1]["v"] == pytest.approx(np.var(WARMUP, ddof=1), abs=1e-12)
    assert zc25[-1]["var"] == pytest.approx(np.var(WARMUP, ddof=0), abs=1e-12)
    assert zs25[-1]["mu"] == pytest.approx(1.0, abs=1e-12) and zs25[-1]["count"] == 25


def test_drytorch_unit_values():
    c = mo.ZStatCriterion(alpha=0.9, z_thresh=2)
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    mu, v = c.update(t(0.0), t(1.0), t(10.0))
    assert (float(mu), float(v)) == pytest.approx((1.0, 10.9), abs=1e-12)
    mu, v = c.update(mu, v, t(20.0))
    assert (float(mu), float(v)) == pytest.approx((2.9, 45.91), abs=1e-12)
    trig, value = c.threshold(t(10.0), t(1.0), t(15.0))
    assert bool(trig) and float(value) == pytest.approx(10.8, abs=1e-6)
    # and the spec agrees
    assert spec.zstat_update(0.0, 1.0, 10.0, alpha=0.9) == pytest.approx((1.0, 10.9))
    assert spec.zstat_threshold(10.0, 1.0, 15.0, alpha=0.9, z_thresh=2)[1] == pytest.approx(10.8, abs=1e-6)


def test_criterion_rules():
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    mu, v, g = t(2.0), t(0.25), t(4.0)  # z = 4 (z_thresh 2), g / mu = 2 (r_thresh 1.5)
    z_vals = {"max": 2.0 + 2 * 0.5, "reciprocal": 2.0 + (4 / 4) * 0.5, "mean": 2.0}
    for rule, want in z_vals.items():
        trig, c = mo.ZStatCriterion(z_thresh=2.0, rule=rule).threshold(mu, v, g)
        assert bool(trig) and float(c) == pytest.approx(want, rel=1e-7)
    e_vals = {"max": 2.0 * 1.5, "reciprocal": 2.0 * 1.5**2 / 2, "mean": 2.0}  # modopt's "mean" clips to mu
    for rule, want in e_vals.items():
        trig, c = mo.EMACriterion(r_thresh=1.5, rule=rule).threshold(mu, v, g)
        assert bool(trig) and float(c) == pytest.approx(want)
    # two-sided: a small outlier triggers, one-sided it does not; mu = 0 never triggers
    assert bool(mo.ZStatCriterion(z_thresh=2.0).threshold(mu, v, t(0.5))[0])
    assert not bool(mo.ZStatCriterion(z_thresh=2.0, two_sided=False).threshold(mu, v, t(0.5))[0])
    assert not bool(mo.ZStatCriterion().threshold(t(0.0), v, g)[0])
    assert not bool(mo.EMACriterion().threshold(t(0.0), v, g)[0])


def test_two_sided_trigger_on_small_norm_never_scales_up():
    h = Harness(mo.HistClip(mo.ZStatCriterion(z_thresh=1.0), warmup_steps=3, warmup_max_norm=None), [torch.zeros(1)])
    for g in (1.0, 1.1, 0.9):
        h.step([torch.tensor([g])])
    out = h.step([torch.tensor([0.01])])
    assert float(out[0]) == pytest.approx(0.01)
    assert bool(h.stats["0:HistClip.triggered"][0]) and not bool(h.stats["0:HistClip.clipped"][0])


def test_histclip_zero_warmup_variance_keeps_initial_variance():
    _, stores, _ = run_trace(mo.HistClip(warmup_steps=3, warmup_max_norm=None), [2.0, 2.0, 2.0])
    assert stores[-1]["mu"] == 2.0 and stores[-1]["v"] == 1.0
    _, stores, _ = run_trace(mo.ZClip(warmup_steps=3, max_grad_norm=None), [2.0, 2.0, 2.0])
    assert stores[-1]["mu"] == 2.0 and stores[-1]["var"] == 0.0  # the zclip package keeps its 0


def test_histclip_warmup_clips_to_warmup_max_norm():
    h = Harness(mo.HistClip(warmup_steps=3, warmup_max_norm=1.0), [torch.zeros(2, dtype=torch.float64)])
    out = h.step([torch.tensor([3.0, 4.0], dtype=torch.float64)])
    assert float(out[0].norm()) == pytest.approx(1.0, rel=1e-5)
    assert bool(h.stats["0:HistClip.clipped"][0])
    assert float(h.stats["0:HistClip.norm"][0]) == pytest.approx(5.0)


def test_config_of_nested_criterion_round_trips(tmp_path):
    t = mo.HistClip(mo.EMACriterion(alpha=0.9, rule="mean"), warmup_steps=4)
    d = t.to_dict()
    assert d["criterion"] == {"kind": "ema", "alpha": 0.9, "r_thresh": 1.05, "rule": "mean"}
    assert mo.Transform.from_dict(d) == t
    cfg = mo.PipelineConfig(transforms=[t, mo.SGD(lr=0.1)])
    for fmt in ("yaml", "json", "toml"):
        assert mo.load_config(cfg.save(tmp_path / f"c.{fmt}")) == cfg
    assert mo.HistClip(criterion={"kind": "zstat", "z_thresh": 3.0}).criterion == mo.ZStatCriterion(z_thresh=3.0)
    with pytest.raises(Exception):
        mo.HistClip(criterion={"kind": "other"})


# --- runtime == spec ---------------------------------------------------------------
def crit_draw(draw):
    if draw(st.booleans()):
        return {"kind": "ema", "alpha": draw(st.sampled_from([0.5, 0.98])), "r_thresh": draw(st.sampled_from([1.05, 2.0])),
                "rule": draw(st.sampled_from(["max", "mean", "reciprocal"]))}
    return {"kind": "zstat", "alpha": draw(st.sampled_from([0.5, 0.97])), "z_thresh": draw(st.sampled_from([1.0, 2.5])),
            "rule": draw(st.sampled_from(["max", "mean", "reciprocal"])), "two_sided": draw(st.booleans())}


@settings(max_examples=30)
@given(lay=layouts(dtypes=(torch.float64,)), data=st.data())
def test_histclip_matches_spec(lay, data):
    shp, group_of, dtype, seed = lay
    kw = scope_kw(data.draw)
    kw.update(
        warmup_steps=data.draw(st.sampled_from([0, 1, 2, 5])),
        warmup_max_norm=data.draw(st.sampled_from([None, 1.0])),
        update_stats_with=data.draw(st.sampled_from(["raw", "clipped"])),
        ord=data.draw(st.sampled_from([2.0, 1.0, math.inf])),
        eps=data.draw(st.sampled_from([0.0, 1e-6])),
    )
    crit = crit_draw(data.draw)
    t = mo.HistClip(criterion=crit, **kw)
    run_vs_spec(t, spec.HistClip(group_of, criterion=crit, **kw), shp, group_of, dtype, seed)


@settings(max_examples=30)
@given(lay=layouts(dtypes=(torch.float64,)), data=st.data())
def test_zclip_matches_spec(lay, data):
    shp, group_of, dtype, seed = lay
    kw = scope_kw(data.draw)
    kw.update(
        alpha=data.draw(st.sampled_from([0.5, 0.97])),
        z_thresh=data.draw(st.sampled_from([0.5, 2.5])),
        max_grad_norm=data.draw(st.sampled_from([None, 1.0, 50.0])),
        warmup_steps=data.draw(st.sampled_from([1, 3, 25])),
        mode=data.draw(st.sampled_from(["zscore", "percentile"])),
        clip_option=data.draw(st.sampled_from(["adaptive_scaling", "mean"])),
        clip_factor=data.draw(st.sampled_from([1.0, 0.7])),
        skip_update_on_spike=data.draw(st.booleans()),
        eps=data.draw(st.sampled_from([1e-6, 0.0])),
    )
    run_vs_spec(mo.ZClip(**kw), spec.ZClip(group_of, **kw), shp, group_of, dtype, seed)


@settings(max_examples=25)
@given(lay=layouts(dtypes=(torch.float64, torch.float32)), data=st.data())
def test_autoclip_matches_spec(lay, data):
    shp, group_of, dtype, seed = lay
    kw = scope_kw(data.draw, dims=False)
    kw.update(
        percentile=data.draw(st.sampled_from([0.0, 10.0, 37.5, 50.0, 100.0])),
        window=data.draw(st.sampled_from([None, 1, 7])),
        eps=data.draw(st.sampled_from([0.0, 1e-6])),
    )
    run_vs_spec(mo.AutoClip(**kw), spec.AutoClip(group_of, **kw), shp, group_of, dtype, seed)


def test_autoclip_percentile_is_numpys():
    h = Harness(mo.AutoClip(percentile=30.0, eps=0.0), [torch.zeros(1, dtype=torch.float64)])
    rng = np.random.default_rng(0)
    norms = list(rng.uniform(0.5, 3.0, size=40))
    for k, g in enumerate(norms):
        out = float(h.step([torch.tensor([g], dtype=torch.float64)])[0])
        assert out == pytest.approx(min(g, np.percentile(norms[: k + 1], 30.0)), rel=1e-12)
    with pytest.raises(Exception):
        mo.AutoClip(scope="tensor", dim=0)


@settings(max_examples=40)
@given(lay=layouts(dtypes=(torch.float64, torch.float32, torch.bfloat16)), data=st.data())
def test_zscore_normalize_matches_spec(lay, data):
    shp, group_of, dtype, seed = lay
    kw = scope_kw(data.draw)
    kw["min_size"] = data.draw(st.sampled_from([2, 3]))
    kw["eps"] = data.draw(st.sampled_from([0.0, 1e-8]))
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=g).to(dtype) for s in shp]
    out = Harness(mo.ZScoreNormalize(**kw), [torch.zeros_like(t) for t in ts], group_of).step(ts)
    ref = spec.z_score_normalize(ts, group_of, **kw)
    rel = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    for o, r in zip(out, ref):
        assert o.dtype == dtype
        assert torch.allclose(o.double(), r.to(dtype).double(), rtol=rel, atol=rel * max(1.0, r.abs().max().item() if r.numel() else 0))


def test_zscore_normalize_is_drytorchs_rule():
    g = torch.randn(5, 4, dtype=torch.float64)
    out = Harness(mo.ZScoreNormalize(), [torch.zeros_like(g)]).step([g])[0]
    assert torch.allclose(out, (g - g.mean()) / (g.std() + 1e-8))
    one = torch.tensor([3.0])
    assert torch.equal(Harness(mo.ZScoreNormalize(), [one]).step([one])[0], one)  # unchanged, not NaN
    const = torch.full((4,), 2.0)
    assert torch.equal(Harness(mo.ZScoreNormalize(eps=0.0), [const]).step([const])[0], torch.zeros(4))


# --- state -------------------------------------------------------------------------
STATEFUL = [
    mo.HistClip(warmup_steps=3),
    mo.HistClip(mo.EMACriterion(), warmup_steps=0, scope="tensor"),
    mo.ZClip(warmup_steps=2, scope="group"),
    mo.ZClip(warmup_steps=30, scope="tensor", dim=0),
]


@pytest.mark.parametrize("t", STATEFUL, ids=lambda t: repr(t)[:40])
def test_nonfinite_norm_never_enters_statistics(t):
    shapes = [(3, 2), (4,)]
    h = Harness(t, [torch.zeros(s) for s in shapes], [0, 1])
    g = torch.Generator().manual_seed(0)
    for k in range(2):  # during warm-up (or after, for warmup_steps=0)
        h.step([torch.randn(s, generator=g) for s in shapes])
        before = snapshot(h)
        bad = [torch.full(s, float("inf")) for s in shapes]
        h.step(bad)
        same_state(before, snapshot(h))
    for k in range(6):
        h.step([torch.randn(s, generator=g) for s in shapes])
    before = snapshot(h)
    h.step([torch.full(s, float("nan")) for s in shapes])
    same_state(before, snapshot(h))


def test_autoclip_history_keeps_nonfinite_out():
    h = Harness(mo.AutoClip(percentile=100.0, eps=0.0), [torch.zeros(1)])
    h.step([torch.tensor([2.0])])
    h.step([torch.tensor([float("inf")])])
    out = h.step([torch.tensor([3.0])])  # the percentile 100 of {2, 3} is 3: the inf is not in it
    assert float(out[0]) == 3.0


@pytest.mark.parametrize("t", [mo.HistClip(warmup_steps=4), mo.ZClip(warmup_steps=4, scope="tensor"),
                               mo.AutoClip(window=3, scope="tensor"), mo.HistClip(warmup_steps=2, scope="tensor", dim=0)],
                         ids=lambda t: type(t).__name__)
def test_checkpoint_round_trip_is_exact(t):
    """Beyond the registry's resume: the cut (after 3 of 12 steps) falls inside the 4-step warm-ups, and a
    gradient spike every fourth step is clipped in the resumed run by the statistics it loaded."""

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))

    def step(m, opt, k):
        g = torch.Generator().manual_seed(k)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g) * (1 + 5 * (k % 4 == 3))
        opt.step()

    assert_resumes_bit_for_bit(model, lambda m: mo.Modular(m.parameters(), t, mo.SGD(lr=0.1)), step=step, steps=12,
                               cut=3)


def test_telemetry_of_statistical_clippers():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = mo.Modular([p], mo.HistClip(warmup_steps=1), mo.ZClip(warmup_steps=1), mo.AutoClip(), mo.LR(0.1))
    for g in (1.0, 100.0):
        p.grad = torch.full((3,), g)
        opt.step()
    for key in ("0:HistClip", "1:ZClip", "2:AutoClip"):
        for name in ("norm", "scale", "clipped"):
            v = opt.stats[f"{key}.{name}"]
            assert isinstance(v, torch.Tensor) and v.shape == (1,)
    assert bool(opt.stats["1:ZClip.spike"][0]) or bool(opt.stats["0:HistClip.clipped"][0])


def test_zclip_caps_every_step_by_default_and_every_place_that_shows_it_says_so():
    from pathlib import Path

    from modopt.cli.modules import describe_modules, format_modules

    cap = mo.ZClip.model_fields["max_grad_norm"].default
    assert cap == 1.0  # the zclip package's default (REFERENCE.md's ZClip signature)
    # the behaviour the texts state: the first step (warm-up: no spike possible) of norm 5 is scaled to the cap
    p = torch.nn.Parameter(torch.zeros(2))
    opt = mo.Modular([p], mo.ZClip(), mo.LR(1.0))
    p.grad = torch.tensor([3.0, 4.0])
    opt.step()
    assert bool(opt.stats["0:ZClip.clipped"][0]) and not bool(opt.stats["0:ZClip.spike"][0])
    torch.testing.assert_close(p.detach(), -torch.tensor([3.0, 4.0]) * cap / (5.0 + 1e-6))
    q = torch.nn.Parameter(torch.zeros(2))
    off = mo.Modular([q], mo.ZClip(max_grad_norm=None), mo.LR(1.0))
    q.grad = torch.tensor([3.0, 4.0])
    off.step()
    assert torch.equal(q.detach(), -torch.tensor([3.0, 4.0])) and not bool(off.stats["0:ZClip.clipped"][0])
    # the README's comment, the docstring's first paragraph, `modopt modules ZClip` and the docs page
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    comment = readme[readme.index("mo.ZClip(),"):readme.index("mo.AdamW(lr=3e-4)")]
    assert f"caps every step's norm at {cap}" in comment and "max_grad_norm=None" in comment
    first = _first_paragraph(mo.ZClip)
    assert f"caps every step's norm at {cap}" in first and "max_grad_norm=None" in first
    shown = format_modules(describe_modules(["ZClip"])).splitlines()
    assert f"caps every step's norm at {cap}" in shown[0]
    assert any(line.lstrip().startswith("max_grad_norm:") and "None: no cap" in line for line in shown)
    page = (root / "docs" / "modules" / "statistical.md").read_text(encoding="utf-8")
    section = page[page.index("\n## ZClip\n"):page.index("\n## AutoClip\n")]
    assert f"`mo.ZClip()` scales every step\nwhose norm is over {cap} down to {cap}" in section


def _first_paragraph(cls) -> str:
    import inspect

    return " ".join((inspect.getdoc(cls) or "").partition("\n\n")[0].split())
