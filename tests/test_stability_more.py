"""The stability family, continued: OLMo 2's skip step (`SkipStep`), ADOPT (`ADOPT`) and Clippy (`Clippy`),
against their references (OLMo-core's rule, pytorch_optimizer.ADOPT, hand-computed values), their float64
specs, placement rules, non-finite steps, checkpoints and host syncs."""

from __future__ import annotations

import inspect
import math

import pydantic
import pytest
import torch
from hypothesis import given, settings, strategies as st

import modopt as mo
from checks import Syncs, assert_resumes_bit_for_bit, assert_same, same, saved
from families import close, layouts, scope_kw
from harness import Harness
from modopt.spec import stability as spec

try:
    import pytorch_optimizer
except ImportError:  # pragma: no cover - the dev extra pins it
    pytorch_optimizer = None

needs_reference = pytest.mark.skipif(
    pytorch_optimizer is None, reason="pytorch_optimizer is not installed (pip install -e '.[dev]' pins it)"
)

SKIP = "0:SkipStep"


# === SkipStep ================================================================================================
def olmo_stream(seed, steps, loss_at=(), loss_size=0.0, norm_at=(), norm_size=1.0):
    """Per step a float32 loss (a slow drift and noise) and a 5-element gradient; planted spikes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        loss = 3.0 - 0.002 * k + 0.05 * float(torch.randn((), generator=g))
        grad = torch.randn(5, generator=g) * 0.3
        if k in loss_at:
            loss += loss_size
        if k in norm_at:
            grad = grad * norm_size
        out.append((torch.tensor(loss, dtype=torch.float32), grad))
    return out


# (seed, window, sigma, stream, steps) -> the steps OLMo-core 3.0.0 skips: its `SkipStepOptimizer.get_step_factor`
# run on these streams (the loss as `latest_loss`, the gradient's 2-norm as `latest_grad_norm`, before each step)
OLMO_CASES = [
    (0, 128, 6, dict(loss_at=(150,), loss_size=2.0, norm_at=(170,), norm_size=40.0), 200, [150, 170]),
    (1, 16, 3, dict(loss_at=(30, 31), loss_size=0.5, norm_at=(40,), norm_size=10.0), 60, [30, 31, 40]),
    (2, 8, 2, dict(loss_at=(12,), loss_size=0.3, norm_at=(20,), norm_size=5.0), 60, [3, 11, 12, 20, 49, 53, 57]),
]


def run_skip_step(t, stream, **kw):
    """Step `Modular([p], t, LR(0.1))` on `(loss, grad)` pairs with `opt.step(loss=...)`; returns the steps it
    skipped for a spike, the parameter and the optimizer."""
    p = torch.nn.Parameter(torch.zeros(5))
    opt = mo.Modular([p], t, mo.LR(0.1), **kw)
    skipped = []
    for k, (loss, grad) in enumerate(stream):
        p.grad = grad.clone()
        opt.step(loss=loss)
        if bool(opt.stats[f"{SKIP}.spike"]):
            skipped.append(k)
    return skipped, p, opt


@pytest.mark.parametrize("seed,window,sigma,planted,steps,golden", OLMO_CASES)
def test_skip_step_skips_the_steps_olmo_core_skips(seed, window, sigma, planted, steps, golden):
    """The golden lists come from OLMo-core's own code (version 3.0.0) on the same streams; the parameter
    equals the plain sum of the steps that were not skipped."""
    stream = olmo_stream(seed, steps, **planted)
    skipped, p, opt = run_skip_step(mo.SkipStep(window=window, sigma=sigma), stream)
    assert skipped == golden
    kept = sum((-0.1 * g.double() for k, (_, g) in enumerate(stream) if k not in golden), torch.zeros(5, dtype=torch.float64))
    torch.testing.assert_close(p.detach().double(), kept, rtol=1e-6, atol=1e-6)
    assert int(opt.stats["skipped_steps"]) == len(golden)


def reference_rule(losses, norms, window, sigma, watch="loss_and_norm"):
    """OLMo-core's rule restated on Python lists (float32 tensors, `torch.std_mean` as it uses): keep the last
    `window + 1` values, the current one last; once there are `max(2, window // 2)` losses, skip when the
    current value minus the mean of the others is not `<= sigma * std` of them."""
    ls, ns, out = [], [], []
    for loss, norm in zip(losses, norms):
        ls = (ls + [loss])[-(window + 1):]
        ns = (ns + [norm])[-(window + 1):]
        skip = False
        if len(ls) >= max(2, window // 2):
            tests = {"loss_and_norm": (ls, ns), "loss": (ls,), "norm": (ns,)}[watch]
            for xs in tests:
                std, mean = torch.std_mean(torch.stack(xs[:-1]))
                skip = skip or not bool(xs[-1] - mean <= sigma * std)
        out.append(skip)
    return out


@pytest.mark.parametrize("seed", [3, 4, 5])
@pytest.mark.parametrize("window,sigma", [(128, 6.0), (10, 2.0), (32, 3.0)])
@pytest.mark.parametrize("watch", ["loss_and_norm", "loss", "norm"])
def test_skip_step_decides_as_the_reference_rule(seed, window, sigma, watch):
    """Random streams with planted loss and norm spikes, several windows and sigmas: the same decision at
    every step as the restated reference rule (float32 statistics), and the same parameters."""
    stream = olmo_stream(seed, 150, loss_at=(70, 71, 120), loss_size=1.0, norm_at=(90, 130), norm_size=20.0)
    want = reference_rule([l for l, _ in stream], [torch.linalg.vector_norm(g) for _, g in stream], window, sigma, watch)
    skipped, _, _ = run_skip_step(mo.SkipStep(window=window, sigma=sigma, watch=watch), stream)
    assert skipped == [k for k, s in enumerate(want) if s]
    assert any(want[70:]), "the planted spikes must be seen"


def skip_stream(draw, steps):
    """(loss or None, gradients, poisoned) per step: smooth values, planted spikes, NaN/inf losses, missing
    losses, and steps whose gradients are not finite."""
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        loss = 2.0 + 0.1 * float(torch.randn((), generator=g))
        size = 1.0 + 0.05 * float(torch.randn((), generator=g))
        kind = draw(st.sampled_from(["plain"] * 6 + ["loss_spike", "norm_spike", "nan_loss", "inf_loss", "no_loss",
                                                     "poison"]))
        if kind == "loss_spike":
            loss += 50.0
        if kind == "norm_spike":
            size *= 100.0
        if kind == "nan_loss":
            loss = math.nan
        if kind == "inf_loss":
            loss = math.inf
        grads = [torch.randn(3, generator=g) * size, torch.randn(2, 2, generator=g) * size]
        if kind == "poison":
            grads[1][0, 1] = math.nan
        out.append((None if kind == "no_loss" else loss, grads, kind == "poison"))
    return out


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_skip_step_matches_spec(data):
    """Runtime == spec (modopt.spec.stability.SkipStep) step by step: the decisions, and the windows'
    means and standard deviations, with NaN/inf and missing losses and steps skipped for non-finite
    gradients among them."""
    window = data.draw(st.sampled_from([2, 3, 5, 16]))
    kw = dict(window=window, sigma=data.draw(st.sampled_from([0.0, 1.0, 3.0, 6.0])),
              min_steps=data.draw(st.sampled_from([None, 1, 4])),
              watch=data.draw(st.sampled_from(["loss_and_norm", "loss", "norm"])))
    ps = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    opt = mo.Modular(ps, mo.SkipStep(**kw), mo.LR(1.0))
    ref = spec.SkipStep(**kw)
    for k, (loss, grads, poisoned) in enumerate(skip_stream(data.draw, 30)):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        before = [p.detach().clone() for p in ps]
        opt.step(loss=loss)
        want = ref.step(grads, loss, nonfinite=poisoned)
        assert bool(opt.stats[f"{SKIP}.spike"]) == want, k
        moved = not all(torch.equal(a, p) for a, p in zip(before, ps))
        assert moved == (not want and not poisoned), k
        store = opt.state_dict()["modopt"]["transforms"][SKIP]
        for name in ("loss", "norm"):
            count = store.get(f"{name}_count")
            assert (0 if count is None else int(count)) == ref.counts[name], (k, name)
            held = ref.values[name]
            if len(held) >= 2:
                win = store[f"{name}_window"][:len(held)].double()
                mean, std = ref.stats(name)
                assert float(win.mean()) == pytest.approx(mean, rel=1e-6)
                assert float(win.std()) == pytest.approx(std, rel=1e-4, abs=1e-6 * abs(mean))


def test_skip_step_by_hand():
    """window 4, tests from the 3rd value: losses 1, 3 then 2 (mean 2, std sqrt(2): 2 - 2 <= 6 * 1.41),
    then 9: mean of (1, 3, 2) is 2, std 1, and 9 - 2 = 7 > 6 * 1: skipped."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = mo.Modular([p], mo.SkipStep(window=4, min_steps=3, watch="loss"), mo.LR(1.0))
    for loss, skipped in [(1.0, False), (3.0, False), (2.0, False), (9.0, True), (2.5, False)]:
        p.grad = torch.ones(1)
        opt.step(loss=loss)
        assert bool(opt.stats[f"{SKIP}.spike"]) == skipped, loss
    assert p.item() == -4.0  # four steps of 1 went ahead
    store = opt.state_dict()["modopt"]["transforms"][SKIP]
    # a ring of the last 4: the skipped 9 is in it (as in OLMo-core), and 2.5 took the oldest slot, 1's
    assert store["loss_window"].tolist() == [2.5, 3.0, 2.0, 9.0] and int(store["loss_count"]) == 5
    assert "norm_window" not in store


def adagc_pipeline(*extra, skip=mo.SkipStep(window=8, sigma=3.0)):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return m, mo.Modular(m.parameters(), skip, mo.AdaGC(warmup_steps=3), *extra)


def set_grads(model, k, scale=1.0):
    g = torch.Generator().manual_seed(50 + k)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * scale


@pytest.mark.parametrize("final", [mo.AdamW(lr=1e-2, weight_decay=0.1), mo.SGD(lr=0.1, momentum=0.9, dampening=0.1),
                                   mo.ADOPT(lr=1e-2)])
def test_a_spike_step_changes_nothing_after_it_and_no_step_syncs(final):
    """On the device path: a spike (in the norm, then in the loss) leaves the parameters and every state of
    the transforms after SkipStep bit-identical, no step synchronises with the host, and a run with the
    spikes is the run without them (SkipStep's own windows aside)."""
    ma, oa = adagc_pipeline(final)
    mb, ob = adagc_pipeline(final)
    syncs = Syncs()
    for k in range(12):
        loss = torch.tensor(1.0 + 0.01 * (k % 3))
        if k in (9, 10):
            set_grads(mb, k, scale=1e3 if k == 9 else 1.0)
            before = saved(ob, mb)
            with syncs:
                ob.step(loss=torch.tensor(100.0) if k == 10 else loss)
            assert bool(ob.stats[f"{SKIP}.spike"]) and bool(ob.stats["skipped"])
            after = saved(ob, mb)
            for d in (before, after):
                for key in [x for x in d if "SkipStep" in x]:
                    d.pop(key)
            same(before, after)
        set_grads(ma, k)
        set_grads(mb, k)
        oa.step(loss=loss)
        with syncs:
            ob.step(loss=loss)
    assert ob._skip_on_device and syncs.n == 0
    assert int(ob.stats["skipped_steps"]) == 2 and int(oa.stats["skipped_steps"]) == 0
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(p, q)


def test_the_host_decides_with_a_host_policy_and_skips_alike():
    """nonfinite="raise" (and torch's non-fused Adam kernel, which needs the host's decision): the host decides
    (one sync for the policy, one for the spike), the chain stops at SkipStep and the run equals the device's,
    its skips counted in skipped_steps as the device's are."""
    stream = olmo_stream(1, 60, loss_at=(30, 31), loss_size=0.5, norm_at=(40,), norm_size=10.0)
    want, p_dev, _ = run_skip_step(mo.SkipStep(window=16, sigma=3.0), stream)
    got, p_host, opt = run_skip_step(mo.SkipStep(window=16, sigma=3.0), stream, nonfinite="raise")
    assert got == want == [30, 31, 40] and torch.equal(p_dev, p_host) and int(opt.stats["skipped_steps"]) == 3
    p = torch.nn.Parameter(torch.zeros(5))
    opt = mo.Modular([p], mo.SkipStep(window=16, sigma=3.0), mo.Adam(lr=0.1, fused=False))
    assert not opt._skip_on_device
    for k, (loss, grad) in enumerate(stream):
        p.grad = grad.clone()
        state = {k2: v.clone() for k2, v in opt.state[p].items()}
        opt.step(loss=loss)
        if k in want:
            assert all(torch.equal(state[k2], opt.state[p][k2]) for k2 in state), k


def test_the_loss_reaches_the_step_through_the_closure():
    """The closure's return value is the loss; `step` returns it, as torch's optimizers do."""
    stream = olmo_stream(1, 60, loss_at=(30, 31), loss_size=0.5, norm_at=(40,), norm_size=10.0)
    p = torch.nn.Parameter(torch.zeros(5))
    opt = mo.Modular([p], mo.SkipStep(window=16, sigma=3.0), mo.LR(0.1))
    skipped = []
    for k, (loss, grad) in enumerate(stream):
        def closure(loss=loss, grad=grad):
            p.grad = grad.clone()
            return loss
        assert opt.step(closure) is loss
        skipped += [k] if bool(opt.stats[f"{SKIP}.spike"]) else []
    assert skipped == [30, 31, 40]


def test_without_a_loss_the_norm_alone_decides():
    """No loss given: the norm's spike (step 40) is skipped, the loss spikes (30, 31) are not seen."""
    stream = olmo_stream(1, 60, loss_at=(30, 31), loss_size=0.5, norm_at=(40,), norm_size=10.0)
    skipped, _, opt = run_skip_step(mo.SkipStep(window=16, sigma=3.0), [(None, g) for _, g in stream])
    assert skipped == [40] and "0:SkipStep.loss" not in opt.stats


@pytest.mark.parametrize("bad,what", [(torch.ones(2), "shape \\(2,\\)"), ("1.0", "str"), (True, "bool"),
                                      (torch.tensor(1 + 1j), "complex")])
def test_a_bad_loss_is_refused_by_its_door(bad, what):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = mo.Modular([p], mo.SkipStep(), mo.LR(0.1))
    p.grad = torch.ones(2)
    with pytest.raises(TypeError, match=r"opt.step\(loss=...\): the loss must be .*" + what):
        opt.step(loss=bad)
    with pytest.raises(TypeError, match="SkipStep \\(the closure's return value\\): the loss must be"):
        opt.step(lambda: bad)
    assert torch.equal(p.detach(), torch.zeros(2))
    with pytest.raises(TypeError, match="not both"):
        opt.step(lambda: 1.0, loss=1.0)
    plain = mo.Modular([p], mo.LR(0.1))  # no transform reads the loss: a closure may return anything
    assert plain.step(lambda: "anything") == "anything"


def test_a_nan_loss_is_skipped_and_never_enters_the_window():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = mo.Modular([p], mo.SkipStep(window=4, min_steps=3, watch="loss"), mo.LR(1.0))
    for loss in (1.0, 1.2, 0.9):
        p.grad = torch.ones(1)
        opt.step(loss=loss)
    window = opt.state_dict()["modopt"]["transforms"][SKIP]["loss_window"].clone()
    for bad in (math.nan, math.inf):
        p.grad = torch.ones(1)
        opt.step(loss=bad)
        assert bool(opt.stats[f"{SKIP}.spike"]) and p.item() == -3.0
    store = opt.state_dict()["modopt"]["transforms"][SKIP]
    assert torch.equal(store["loss_window"], window) and int(store["loss_count"]) == 3


@pytest.mark.parametrize("pipeline,match", [
    (lambda: [mo.AdaGC(), mo.SkipStep(), mo.SGD(0.1)], "comes after 0:AdaGC, which keep state"),
    (lambda: [mo.Masked(mo.SkipStep(), where="*"), mo.SGD(0.1)], "must be at the top level"),
    (lambda: [mo.Chain(mo.SkipStep(), mo.ClipNorm(1.0)), mo.SGD(0.1)], "must be at the top level"),
])
def test_skip_step_goes_first(pipeline, match):
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=match):
        mo.Modular([p], *pipeline())
    mo.Modular([p], mo.ClipNorm(1.0), mo.SkipStep(), mo.SGD(0.1))  # stateless transforms before it are fine
    with pytest.raises(ValueError, match="SkipStep"):
        mo.attach(torch.optim.SGD([p], lr=0.1), mo.SkipStep())


def test_skip_step_checkpoint_resumes_bit_exactly_and_refuses_another_window():
    """Beyond the registry's resume (whose SkipStep never skips): the spikes after the cut (steps 25 and 30 of
    40, cut at 20) are found against the loss and norm windows loaded; a checkpoint does not load into another
    window's SkipStep."""
    stream = olmo_stream(2, 40, loss_at=(25,), loss_size=0.3, norm_at=(30,), norm_size=5.0)
    skipped, _, _ = run_skip_step(mo.SkipStep(window=8, sigma=2.0), stream)
    assert 25 in skipped and 30 in skipped

    def step(m, opt, k):
        loss, grad = stream[k]
        m[0].grad = grad.clone()
        opt.step(loss=loss)

    r = assert_resumes_bit_for_bit(lambda: torch.nn.ParameterList([torch.zeros(5)]),
                                   lambda m: mo.Modular(m.parameters(), mo.SkipStep(window=8, sigma=2.0), mo.LR(0.1)),
                                   step=step, steps=40, cut=20)
    other = mo.Modular([torch.nn.Parameter(torch.zeros(5))], mo.SkipStep(window=16, sigma=2.0), mo.LR(0.1))
    with pytest.raises(ValueError, match=r"loss_window has shape \(8,\); SkipStep\(window=16\)"):
        other.load_state_dict(r.saved)


def test_skip_step_defaults_are_olmo_cores():
    t = mo.SkipStep()
    assert (t.window, t.sigma, t.first_test) == (128, 6.0, 64)  # rolling_interval_length, sigma_factor, W // 2
    assert mo.SkipStep(window=10).first_test == 5 and mo.SkipStep(window=3).first_test == 2


# === Clippy ==================================================================================================
CLIPPY = "1:Clippy"


def test_clippy_by_hand():
    """Two tensors after SGD(lr=1): w = (1, -2), g = (0.5, 0.1): bounds 0.1*1 + 0.01 = 0.11 and 0.1*2 + 0.01 =
    0.21; ratios 0.11/0.5 = 0.22 and 0.21/0.1 = 2.1, so scale 0.22 and the step (0.11, 0.022). The second
    tensor, w = (0, 4), g = (3, 0): the zero element is left out; bound 0.01, ratio 0.01/3, step (0.01, 0)."""
    a = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    b = torch.nn.Parameter(torch.tensor([0.0, 4.0], dtype=torch.float64))
    opt = mo.Modular([a, b], mo.SGD(lr=1.0), mo.Clippy(lambda_w=0.1, lambda_abs=0.01))
    a.grad = torch.tensor([0.5, 0.1], dtype=torch.float64)
    b.grad = torch.tensor([3.0, 0.0], dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(a.detach(), torch.tensor([1.0 - 0.11, -2.0 - 0.022], dtype=torch.float64))
    torch.testing.assert_close(b.detach(), torch.tensor([-0.01, 4.0], dtype=torch.float64))
    torch.testing.assert_close(opt.stats[f"{CLIPPY}.scale"], torch.tensor([0.22, 0.01 / 3], dtype=torch.float64))
    # scope="global": one scale, the smaller, for both; a step within every bound is left alone (scale 1)
    c = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    d = torch.nn.Parameter(torch.tensor([0.0, 4.0], dtype=torch.float64))
    opt = mo.Modular([c, d], mo.SGD(lr=1.0), mo.Clippy(lambda_w=0.1, lambda_abs=0.01, scope="global"))
    c.grad, d.grad = a.grad.clone(), b.grad.clone()
    opt.step()
    torch.testing.assert_close(c.detach(), torch.tensor([1.0 - 0.5 / 300, -2.0 - 0.1 / 300], dtype=torch.float64))
    c.grad, d.grad = torch.full((2,), 1e-3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    opt.step()
    assert opt.stats[f"{CLIPPY}.scale"].tolist() == [1.0] and opt.stats[f"{CLIPPY}.clipped"].tolist() == [False]


@settings(max_examples=40, deadline=None)
@given(lay=layouts(), data=st.data())
def test_clippy_matches_spec(lay, data):
    """Runtime == spec on random steps and parameters (zeros among them), every scope and slices."""
    shp, group_of, dtype, seed = lay
    kw = scope_kw(data.draw)
    kw.update(lambda_w=data.draw(st.sampled_from([0.1, 0.0, 2.0])),
              lambda_abs=data.draw(st.sampled_from([1e-7, 0.0, 0.5])))
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        params = [(torch.randn(s, generator=g, dtype=torch.float64) * (torch.rand(s, generator=g) > 0.2)).to(dtype)
                  for s in shp]
        us = [(torch.randn(s, generator=g, dtype=torch.float64) * (torch.rand(s, generator=g) > 0.3)
               * data.draw(st.sampled_from([1e-3, 1.0, 1e3]))).to(dtype) for s in shp]
        out = Harness(mo.Clippy(**kw), params, group_of).step(us)
        close(out, spec.clippy(us, params, group_of, **kw), dtype)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), lam=st.sampled_from([0.01, 0.1, 1.0]))
def test_after_adam_no_element_moves_more_than_its_bound(seed, lam):
    """The property Clippy promises: |p_new - p_old| <= lambda_w |p_old| + lambda_abs for every element."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    opt = mo.Modular(m.parameters(), mo.Adam(lr=0.5), mo.Clippy(lambda_w=lam, lambda_abs=1e-4))
    for k in range(4):
        set_grads(m, seed + k, scale=10.0 ** (k - 1))
        before = [p.detach().clone() for p in m.parameters()]
        opt.step()
        for old, p in zip(before, m.parameters()):
            assert ((p - old).abs() <= (lam * old.abs() + 1e-4) * (1 + 1e-5)).all()


@settings(max_examples=10, deadline=None)
@given(lay=layouts())
def test_clippy_keeps_zeros(lay):
    shp, group_of, dtype, _ = lay
    for kw in ({}, {"scope": "global"}, {"lambda_w": 0.0, "lambda_abs": 0.0}):
        out = Harness(mo.Clippy(**kw), [torch.zeros(s, dtype=dtype) for s in shp], group_of).step(
            [torch.zeros(s, dtype=dtype) for s in shp])
        assert all(torch.equal(o, torch.zeros_like(o)) for o in out)


# === ADOPT ===================================================================================================
SHAPES = {"mixed": [(5, 3), (7,), (), (4, 2, 3)], "one": [(6, 4)]}
VARIANTS = {  # name -> (pytorch_optimizer.ADOPT kwargs, mo.ADOPT kwargs)
    "defaults": ({}, {}),
    "l2": (dict(weight_decay=0.1), dict(weight_decay=0.1)),
    "decoupled": (dict(weight_decay=0.1, weight_decouple=True), dict(weight_decay=0.1, decoupled_weight_decay=True)),
    "fixed": (dict(weight_decay=0.01, weight_decouple=True, fixed_decay=True),
              dict(weight_decay=0.01, decoupled_weight_decay=True, fixed_decay=True)),
    "no-clip-maximize": (dict(clip_lambda=None, maximize=True, lr=1e-2, betas=(0.8, 0.99), eps=1e-4),
                         dict(clip_power=None, maximize=True, lr=1e-2, betas=(0.8, 0.99), eps=1e-4)),
}


def adopt_twins(shapes, dtype, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    init = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
    return [torch.nn.Parameter(x.clone()) for x in init], [torch.nn.Parameter(x.clone()) for x in init]


def adopt_grads(shapes, dtype, seed, steps):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(s, generator=g, dtype=torch.float64) * (30.0 if k % 7 == 3 else 1.0) * (0.1 + i)).to(dtype)
             for i, s in enumerate(shapes)] for k in range(steps)]


@needs_reference
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("seed,shapes,groups", [(0, "mixed", False), (1, "one", False), (2, "mixed", True)])
def test_adopt_matches_pytorch_optimizer_bit_for_bit(variant, dtype, seed, shapes, groups):
    """`mo.ADOPT` as the last transform is `pytorch_optimizer.ADOPT` (its default foreach path), the same
    parameters and moments after every step, bit for bit in every dtype; 40 steps (the clip binds on the
    30x steps)."""
    shp = SHAPES[shapes]
    ref_kw, kw = VARIANTS[variant]
    a, b = adopt_twins(shp, dtype, seed)
    split = (lambda ps: [{"params": ps[:1]}, {"params": ps[1:]}]) if groups else (lambda ps: ps)
    ref = pytorch_optimizer.ADOPT(split(a), **ref_kw)
    opt = mo.Modular(split(b), mo.ADOPT(**kw))
    for k, gs in enumerate(adopt_grads(shp, dtype, seed, 40)):
        for p, q, gr in zip(a, b, gs):
            p.grad, q.grad = gr.clone(), gr.clone()
        ref.step()
        opt.step()
        for i, (p, q) in enumerate(zip(a, b)):
            assert torch.equal(p, q), (k, i)
            assert torch.equal(ref.state[p]["exp_avg_sq"], opt.state[q]["0:ADOPT.exp_avg_sq"]), (k, i)
            assert torch.equal(ref.state[p]["exp_avg"], opt.state[q]["0:ADOPT.exp_avg"]), (k, i)


@needs_reference
@pytest.mark.parametrize("variant", ["defaults", "decoupled"])
def test_adopt_inside_a_chain_returns_the_references_step(variant):
    """Followed by another transform, ADOPT returns `lr * m` (plus the decoupled decay term) as the update:
    the reference's parameters to float32 rounding (its two writes become one subtraction)."""
    ref_kw, kw = VARIANTS[variant]
    a, b = adopt_twins(SHAPES["mixed"], torch.float32, 3)
    ref = pytorch_optimizer.ADOPT(a, **ref_kw)
    opt = mo.Modular(b, mo.ADOPT(**kw), mo.Identity())
    for gs in adopt_grads(SHAPES["mixed"], torch.float32, 3, 30):
        for p, q, gr in zip(a, b, gs):
            p.grad, q.grad = gr.clone(), gr.clone()
        ref.step()
        opt.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)


@needs_reference
def test_adopt_defaults_are_the_references():
    sig = inspect.signature(pytorch_optimizer.ADOPT.__init__).parameters
    t = mo.ADOPT()
    for name in ("lr", "betas", "eps", "weight_decay", "maximize"):
        assert getattr(t, name) == sig[name].default, name
    assert sig["weight_decouple"].default is t.decoupled_weight_decay is False
    assert sig["clip_lambda"].default(16) == 16**t.clip_power


@settings(max_examples=25, deadline=None)
@given(lay=layouts(), data=st.data())
def test_adopt_matches_spec(lay, data):
    """Runtime == the float64 spec, as the last transform (its own write) and inside a chain (`lr * m`)."""
    shp, group_of, dtype, seed = lay
    kw = dict(lr=data.draw(st.sampled_from([1e-3, 0.1])), eps=data.draw(st.sampled_from([1e-6, 1e-3])),
              clip_power=data.draw(st.sampled_from([0.25, None, 1.0])), maximize=data.draw(st.booleans()))
    wd = data.draw(st.sampled_from(["none", "l2", "decoupled", "fixed"]))
    if wd != "none":
        kw.update(weight_decay=0.05, decoupled_weight_decay=wd != "l2", fixed_decay=wd == "fixed")
    final = data.draw(st.booleans())
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(dtype)) for s in shp]
    opt = mo.Modular(ps, mo.ADOPT(**kw), *([] if final else [mo.Identity()]))
    ref = spec.ADOPT(**kw)
    want = [p.detach().double().clone() for p in ps]  # (not a view: the step writes the parameters)
    for k, gs in enumerate(adopt_grads(shp, dtype, seed, 8)):
        for p, gr in zip(ps, gs):
            p.grad = gr.clone()
        opt.step()
        want = ref.step(want, gs)
        # (relative to the parameters' scale, O(1): a parameter that moved near 0 keeps float32's absolute rounding)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        close([p.detach() for p in ps], want, dtype, tol, floor=tol)


def test_adopt_by_hand():
    """lr 0.1: step 1 sets v = g**2 = (1, 4) and does not move; step 2 normalises g = (4, 2) by sqrt(v) = (1, 2)
    to (4, 1), clips it to 2**0.25 = 1.1892, m = 0.1 * (1.1892, 1), so p = -0.1 * m; then v = 0.9999 v + 1e-4 g**2."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = mo.Modular([p], mo.ADOPT(lr=0.1))
    p.grad = torch.tensor([1.0, 2.0], dtype=torch.float64)
    opt.step()
    assert torch.equal(p.detach(), torch.zeros(2, dtype=torch.float64))
    p.grad = torch.tensor([4.0, 2.0], dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([-0.01 * 2**0.25, -0.01], dtype=torch.float64))
    torch.testing.assert_close(opt.state[p]["0:ADOPT.exp_avg_sq"],
                               torch.tensor([0.9999 + 16e-4, 4 * 0.9999 + 4e-4], dtype=torch.float64))


def test_adopt_a_late_parameter_starts_its_own_steps():
    """A parameter whose first gradient comes at step 4 takes its own first step then (v only) and its clip
    counts its own steps (modopt's per-parameter count; the reference counts the group's steps)."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = mo.Modular([a, b], mo.ADOPT(lr=0.1))
    for k in range(6):
        a.grad = torch.ones(3)
        b.grad = torch.ones(3) * 2 if k >= 3 else None
        before = b.detach().clone()
        opt.step()
        if k == 3:
            assert torch.equal(b.detach(), before)
    assert float(opt.state[a]["0:ADOPT.step"]) == 6 and float(opt.state[b]["0:ADOPT.step"]) == 3


def test_adopt_nonfinite_step_keeps_everything_without_a_sync():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = mo.Modular(m.parameters(), mo.ADOPT(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True))
    syncs = Syncs()
    for k in range(4):
        set_grads(m, k)
        if k in (0, 2):  # its first step (v only) and a later one
            before = saved(opt, m)
            m[0].weight.grad[0, 0] = math.nan
            with syncs:
                opt.step()
            after = saved(opt, m)
            if k == 0:  # the state it created holds its initial values: zero moments, no step taken
                assert all(not after[x].any() for x in after if "ADOPT" in x)
                after = {x: v for x, v in after.items() if "ADOPT" not in x}
            same(before, after)
            set_grads(m, k)
        with syncs:
            opt.step()
    assert opt._skip_on_device and syncs.n == 0 and int(opt.stats["skipped_steps"]) == 2


# === all three: fields, config, telemetry ============================================================================
@pytest.mark.parametrize("cls,field,bad", [
    (mo.SkipStep, "window", 1), (mo.SkipStep, "window", 2.5), (mo.SkipStep, "sigma", -1.0),
    (mo.SkipStep, "sigma", math.inf), (mo.SkipStep, "min_steps", 0), (mo.SkipStep, "watch", "grad"),
    (mo.Clippy, "lambda_w", -0.1), (mo.Clippy, "lambda_abs", math.nan), (mo.Clippy, "scope", "layer"),
    (mo.ADOPT, "lr", -1.0), (mo.ADOPT, "betas", (0.9, 1.0)), (mo.ADOPT, "eps", math.inf),
    (mo.ADOPT, "clip_power", -0.25), (mo.ADOPT, "weight_decay", -0.1),
])
def test_bad_fields_are_refused_by_name(cls, field, bad):
    with pytest.raises(pydantic.ValidationError, match=f"{cls.__name__}.{field}"):
        cls(**{field: bad})


def test_fixed_decay_needs_the_decoupled_decay():
    with pytest.raises(pydantic.ValidationError, match="fixed_decay"):
        mo.ADOPT(weight_decay=0.1, fixed_decay=True)


def test_config_round_trip(tmp_path):
    cfg = mo.PipelineConfig(transforms=[
        mo.SkipStep(window=32, sigma=4.0, min_steps=20, watch="loss"),
        mo.ADOPT(lr=3e-4, betas=(0.85, 0.999), weight_decay=0.1, decoupled_weight_decay=True, clip_power=0.5),
        mo.Clippy(lambda_w=0.05, lambda_abs=1e-6, scope="tensor", dim=0),
    ])
    for name in ("c.yaml", "c.json", "c.toml"):
        assert mo.load_config(cfg.save(tmp_path / name)) == cfg
    opt = cfg.build([torch.nn.Parameter(torch.zeros(2))])
    assert opt.param_groups[0]["lr"] == 3e-4 and opt.param_groups[0]["betas"] == (0.85, 0.999)


def test_telemetry():
    p = torch.nn.Parameter(torch.ones(3))
    opt = mo.Modular([p], mo.SkipStep(window=4), mo.ADOPT(lr=0.1), mo.Clippy())
    p.grad = torch.tensor([3.0, 0.0, 4.0])
    opt.step(loss=torch.tensor(2.0))
    stats = opt.stats
    assert float(stats[f"{SKIP}.norm"]) == 5.0 and float(stats[f"{SKIP}.loss"]) == 2.0
    assert not bool(stats[f"{SKIP}.spike"]) and not bool(stats[f"{SKIP}.norm_spike"])
    assert stats["2:Clippy.scale"].tolist() == [1.0]  # ADOPT's first step does not move
    assert all(isinstance(v, torch.Tensor) for v in stats.values())
    assert_same(stats["skipped"], torch.tensor(False))


@pytest.mark.parametrize("bad", ["1.0", torch.ones(2), torch.tensor(True)], ids=["str", "two-elements", "bool"])
def test_skipstep_refuses_a_bad_loss_before_writing_its_norm_window(bad):
    p = torch.nn.Parameter(torch.zeros(3))
    opt = mo.Modular([p], mo.SkipStep(window=4), mo.SGD(lr=0.1))
    for loss in (1.0, 1.1):
        p.grad = torch.ones(3)
        opt.step(loss=loss)
    before = saved(opt, [p])
    p.grad = torch.full((3,), 5.0)
    with pytest.raises(TypeError, match="the loss must be a real number"):
        opt.step(loss=bad)
    assert_same(before, saved(opt, [p]))  # the norm window took nothing from the refused step
