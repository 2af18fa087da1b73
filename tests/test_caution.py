"""The caution family (modopt/transforms/caution.py): `Cautious`, `Grams`, `WeightDecay` / `CautiousWeightDecay`.

Against the float64 spec (`modopt/spec/caution.py`) on drawn updates and gradients, and against the
references with their own defaults through `Modular.step()` after a real `backward()`:
pytorch_optimizer 4.1.0 (`apply_cautious`, `ADOPT(cautious=True)`, `Grams`) and timm's cautious AdamW
(`AdamWLegacy(caution=True)`, timm's `cadamw`).
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import modopt as mo
from checks import Syncs, assert_step_changes_nothing
from modopt.core.step import Step, run_step
from modopt.spec import caution as spec

SCALES = ["timm", "c_optim", "heavyball", "none"]
VALUES = [0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 0.5, -0.5, 1.0, -1.0, 7.0, -7.0, 1e30, -1e30, 3e38, float("nan")]
SHAPES = [(), (0,), (1,), (5,), (2, 3), (3, 1, 4)]


def _run(transforms, updates, grads=None, params=None, lrs=None):
    """One pass of `transforms` over `updates` (independent of the gradients) outside an optimizer: the
    same `apply` the step runs. Each tensor is its own param group, with lr `lrs[i]` when given."""
    params = params if params is not None else [torch.zeros_like(u) for u in updates]
    for p, g in zip(params, grads if grads is not None else updates):
        p.grad = g.clone()
    ranges = [(i, i + 1) for i in range(len(params))]
    groups = [{"lr": lr} for lr in lrs] if lrs is not None else [{} for _ in params]
    return run_step(list(transforms), Step.over(params, groups=groups, ranges=ranges), [u.clone() for u in updates])


def _tensor(draw, shape, dtype):
    n = math.prod(shape)
    return torch.tensor(draw(st.lists(st.sampled_from(VALUES), min_size=n, max_size=n)), dtype=torch.float64) \
        .reshape(shape).to(dtype)


@st.composite
def _case(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    shapes = draw(st.lists(st.sampled_from(SHAPES), min_size=1, max_size=3))
    updates = [_tensor(draw, s, dtype) for s in shapes]
    grads = [_tensor(draw, s, dtype) for s in shapes]
    return updates, grads


def _close(out, ref, dtype):
    for a, b in zip(out, ref):
        assert a.dtype == dtype and a.shape == b.shape
        rtol = 1e-6 if dtype == torch.float32 else 1e-14
        torch.testing.assert_close(a, b.to(dtype), rtol=rtol, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("scale", SCALES)
@settings(max_examples=60, deadline=None)
@given(case=_case())
def test_cautious_matches_spec(scale, case):
    """Zeros, signed zeros, tiny and huge values, NaN, empty and 0-d tensors, float32 and float64."""
    updates, grads = case
    out = _run([mo.Cautious(scale)], updates, grads)
    _close(out, spec.cautious(updates, grads, scale=scale), updates[0].dtype)


@settings(max_examples=60, deadline=None)
@given(case=_case())
def test_grams_matches_spec(case):
    updates, grads = case
    out = _run([mo.Grams()], updates, grads)
    for a, b in zip(out, spec.grams(updates, grads)):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.to(a.dtype).nan_to_num())


@pytest.mark.parametrize("make", [
    lambda: mo.WeightDecay(0.1), lambda: mo.WeightDecay(0.1, cautious=True), lambda: mo.CautiousWeightDecay(0.3),
], ids=["plain", "cautious", "CautiousWeightDecay"])
@settings(max_examples=40, deadline=None)
@given(case=_case(), lrs=st.lists(st.sampled_from([0.0, 0.01, 0.5, 2.0]), min_size=3, max_size=3))
def test_weight_decay_matches_spec(make, case, lrs):
    """Each tensor in its own param group with its own lr (the decay reads the group's lr)."""
    t = make()
    updates, weights = case
    params = [w.clone() for w in weights]
    out = _run([t], updates, grads=updates, params=params, lrs=lrs[: len(updates)])
    ref = spec.weight_decay(updates, weights, lrs[: len(updates)], weight_decay=t.weight_decay, cautious=t.cautious)
    _close(out, ref, updates[0].dtype)


# --- the mask masks: an update that disagrees with the gradient does not move its weight ------------------
def _steps(pipeline, grads, w0):
    w = torch.nn.Parameter(w0.clone())
    opt = mo.Modular([w], *pipeline)
    moves = []
    for c in grads:
        opt.zero_grad()
        (w * c).sum().backward()  # a real backward: the gradient is c
        before = w.detach().clone()
        opt.step()
        moves.append(before - w.detach())
    return moves, opt


@pytest.mark.parametrize("scale", SCALES)
def test_cautious_zeroes_what_disagrees_with_the_gradient(scale):
    """After a step of gradient +1/-1, a small gradient of the other sign leaves Adam's momentum (and so its
    update) pointing the old way in elements 0 and 2: Cautious keeps those weights where they are (a mask
    built from the momentum times itself, C-Optim's fork's bug, would keep every element) and scales the
    two kept moves by the variant's s."""
    grads = [torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.tensor([-0.01, 1.0, 0.01, -1.0])]
    w0 = torch.tensor([0.3, -0.2, 0.1, 0.4])
    plain, _ = _steps([mo.Adam(lr=0.1)], grads, w0)
    assert (plain[1][[0, 2]] * grads[1][[0, 2]] < 0).all()  # Adam alone moves them against their gradients
    moves, opt = _steps([mo.Adam(lr=0.1), mo.Cautious(scale)], grads, w0)
    assert torch.equal(moves[1][[0, 2]], torch.zeros(2))
    bare, _ = _steps([mo.Adam(lr=0.1), mo.Cautious("none")], grads, w0)  # (Adam's update math, not its fused write)
    torch.testing.assert_close(bare[1][[1, 3]], plain[1][[1, 3]], rtol=1e-4, atol=0)
    s = {"timm": 2.0, "c_optim": 4 / 3, "heavyball": 2.0, "none": 1.0}[scale]
    torch.testing.assert_close(moves[1][[1, 3]], bare[1][[1, 3]] * s, rtol=1e-6, atol=0)
    if scale != "none":
        assert opt.stats["1:Cautious.kept"].tolist() == [0.5]


def test_heavyball_keeps_positive_updates_where_the_gradient_is_zero():
    u = [torch.tensor([1.0, -1.0, 2.0, 3.0])]
    g = [torch.tensor([0.0, 0.0, 1.0, -1.0])]
    assert _run([mo.Cautious("heavyball")], u, g)[0].tolist() == [2.0, 0.0, 4.0, 0.0]  # 2 of 4 kept: s = 2
    assert _run([mo.Cautious("timm")], u, g)[0].tolist() == [0.0, 0.0, 8.0, 0.0]  # 1 of 4: s = 4


def test_the_rescalings_at_their_bounds():
    """timm's s is at most 1000 (the mean is clamped at 1e-3); the count rules reach N / 2 and N."""
    n = 5000
    u = [torch.ones(n, dtype=torch.float64)]
    g = [torch.cat([torch.ones(1), -torch.ones(n - 1)]).double()]
    got = {s: _run([mo.Cautious(s)], u, g)[0][0].item() for s in SCALES}
    assert got == {"timm": 1000.0, "c_optim": n / 2, "heavyball": float(n), "none": 1.0}
    for s in SCALES:  # nothing kept: a zero update, never NaN
        assert torch.equal(_run([mo.Cautious(s)], u, [-u[0]])[0], torch.zeros(n, dtype=torch.float64))


def test_fp16_mask_does_not_lose_underflowing_products():
    """In fp16, u (which carries lr) times g underflows to 0 for ordinary values; the mask compares signs."""
    u = [torch.tensor([1e-5, -1e-5, 1e-5], dtype=torch.float16)]
    g = [torch.tensor([1e-4, -1e-4, -1e-4], dtype=torch.float16)]
    assert (u[0] * g[0] == 0).all()
    assert _run([mo.Cautious("none")], u, g)[0].tolist() == [u[0][0].item(), u[0][1].item(), 0.0]


# --- parity with the references, their defaults, through Modular.step() after backward() -----------------
def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(dtype)


def _train_pair(make_ref, pipeline, dtype, steps=12):
    a, b = _model(dtype), _model(dtype)
    ref, opt = make_ref(list(a.parameters())), mo.Modular(list(b.parameters()), *pipeline)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(5, 6, generator=g).to(dtype), torch.randn(5, 3, generator=g).to(dtype)
        for m, o in ((a, ref), (b, opt)):
            o.zero_grad()
            (m(x) - y).pow(2).mean().backward()
            o.step()
    return list(a.parameters()), list(b.parameters())


#: float32: a few ulps a step (the references multiply in another order; measured at most 2.1e-7 on weights
#: of order 0.1-1 after 12 steps); float64: the same rule (measured at most 3.3e-16)
TOL = {torch.float32: dict(rtol=1e-6, atol=5e-7), torch.float64: dict(rtol=1e-14, atol=1e-15)}


def test_c_optim_rule_equals_pytorch_optimizers_apply_cautious_bit_for_bit():
    base = pytest.importorskip("pytorch_optimizer.base.optimizer")
    g = torch.Generator().manual_seed(0)
    for shape in [(7,), (3, 5), (2, 3, 4), (1000,)]:
        u, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        ref = u.clone()
        base.BaseOptimizer.apply_cautious(ref, grad)
        assert torch.equal(_run([mo.Cautious("c_optim")], [u], [grad])[0], ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_cautious_adopt_matches_pytorch_optimizer(dtype):
    """pytorch_optimizer's ADOPT(cautious=True), its defaults: modopt's ADOPT then Cautious("c_optim")."""
    po = pytest.importorskip("pytorch_optimizer")
    ref, got = _train_pair(lambda ps: po.ADOPT(ps, cautious=True), [mo.ADOPT(), mo.Cautious("c_optim")], dtype)
    plain, _ = _train_pair(lambda ps: po.ADOPT(ps), [mo.ADOPT()], dtype)
    for a, b, c in zip(ref, got, plain):
        torch.testing.assert_close(b, a, **TOL[dtype])
    assert any((a - c).abs().max() > 1e-4 for a, c in zip(ref, plain))  # caution changed the run


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_grams_matches_pytorch_optimizer(dtype):
    """pytorch_optimizer's Grams, its defaults (lr 1e-3, eps 1e-6, no decay): modopt's Adam then Grams."""
    po = pytest.importorskip("pytorch_optimizer")
    ref, got = _train_pair(lambda ps: po.Grams(ps), [mo.Adam(lr=1e-3, eps=1e-6), mo.Grams()], dtype)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, **TOL[dtype])


def _timm_adamw():
    """timm's `timm/optim/adamw.py`, loaded with its two helper modules only. `import timm` imports
    torchvision, whose wheel on the package index is built for CUDA torch and fails to load next to a CPU torch;
    the optimizer itself needs torch alone. Skips when timm is not installed (it is not in the dev
    extra for that reason)."""
    found = importlib.util.find_spec("timm")
    if found is None or not found.submodule_search_locations:
        pytest.skip("timm is not installed")
    name = "_modopt_test_timm_optim"
    if name + ".adamw" not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [f"{list(found.submodule_search_locations)[0]}/optim"]
        sys.modules[name] = pkg
        importlib.import_module(name + ".adamw")
    return sys.modules[name + ".adamw"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_cautious_adamw_matches_timm(dtype):
    """timm's cautious AdamW (`cadamw`: AdamWLegacy(caution=True)), its defaults (lr 1e-3, weight_decay
    1e-2, decoupled and not masked): Adam, Cautious() (timm's rescaling, the default), WeightDecay(1e-2)."""
    timm_adamw = _timm_adamw()
    make = lambda ps: timm_adamw.AdamWLegacy(ps, caution=True)  # noqa: E731
    ref, got = _train_pair(make, [mo.Adam(), mo.Cautious(), mo.WeightDecay(1e-2)], dtype)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, **TOL[dtype])
    # the decay masked too (cautious weight decay) is another run: the test tells the two apart
    _, masked = _train_pair(make, [mo.Adam(), mo.Cautious(), mo.CautiousWeightDecay(1e-2)], dtype, steps=12)
    assert any((a - b).abs().max() > 1e-7 for a, b in zip(ref, masked))


# --- the step: no sync, skip on the device, one graph, checkpoints, doors ---------------------------------
PIPELINES = {
    "Adam-Cautious-CWD": lambda: [mo.Adam(lr=1e-2), mo.Cautious(), mo.CautiousWeightDecay(0.1)],
    "SGD-Grams-WD": lambda: [mo.SGD(lr=0.05, momentum=0.9), mo.Grams(), mo.WeightDecay(0.1)],
}


def _backward(m, k):
    g = torch.Generator().manual_seed(k)
    m.zero_grad()
    (m(torch.randn(5, 6, generator=g)) - 1).pow(2).mean().backward()
    if k == 3:
        m[2].weight.grad[0, 1] = float("nan")


@pytest.mark.parametrize("name", list(PIPELINES))
def test_after_the_optimizer_no_sync_and_a_skipped_step_changes_nothing(name):
    """After the optimizer (the registry puts these transforms before it): no host sync, and the NaN step
    (step 3) changes no bit."""
    m = _model(torch.float32)
    opt = mo.Modular(list(m.parameters()), *PIPELINES[name]())
    assert opt._skip_on_device
    syncs = Syncs()
    for k in range(5):
        _backward(m, k)
        if k == 3:
            assert_step_changes_nothing(m, opt, syncs)
            assert bool(opt.stats["skipped"])
        else:
            with syncs:
                opt.step()
    assert syncs.n == 0


@pytest.mark.parametrize("name", list(PIPELINES))
@pytest.mark.compile
def test_after_the_optimizer_compiles_to_one_graph_equal_to_eager(name):
    """After the optimizer (the registry compiles these transforms before it)."""
    torch._dynamo.reset()
    a, b = _model(torch.float32), _model(torch.float32)
    eager, comp = mo.Modular(list(a.parameters()), *PIPELINES[name]()), mo.Modular(list(b.parameters()), *PIPELINES[name]())
    step = torch.compile(comp.step, fullgraph=True)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (eager, comp)]
    for k in range(5):
        _backward(a, k)
        _backward(b, k)
        eager.step()
        step()
        for s in scheds:
            s.step()
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert int(comp.stats["skipped_steps"]) == 1


def test_weight_decay_reads_the_groups_lr_as_a_scheduler_sets_it():
    p = torch.nn.Parameter(torch.ones(2))
    opt = mo.Modular([p], mo.LR(1.0), mo.WeightDecay(0.5))
    opt.param_groups[0]["lr"] = 0.1
    p.grad = torch.zeros(2)
    opt.step()
    assert p.detach().tolist() == pytest.approx([0.95, 0.95], abs=0, rel=1e-7)


def test_weight_decay_without_an_lr_in_the_groups_says_so():
    p = torch.nn.Parameter(torch.ones(2))
    opt = mo.Modular([p], mo.CautiousWeightDecay(0.1))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="no transform of this pipeline exposes one"):
        opt.step()


def test_weight_decay_is_not_attachable():
    p = torch.nn.Parameter(torch.ones(2))
    assert not mo.roles.attachable(mo.WeightDecay()) and not mo.roles.attachable(mo.CautiousWeightDecay())
    with pytest.raises(Exception, match="WeightDecay"):
        mo.attach(torch.optim.SGD([p], lr=0.1), mo.WeightDecay(0.1))


def test_fields_and_positional():
    assert mo.Cautious("heavyball") == mo.Cautious(scale="heavyball")
    assert mo.Cautious().scale == "timm"
    assert mo.WeightDecay(0.2) == mo.WeightDecay(weight_decay=0.2) and not mo.WeightDecay().cautious
    assert mo.CautiousWeightDecay(0.2).cautious and mo.CautiousWeightDecay().weight_decay == 1e-2
    with pytest.raises(Exception, match="scale"):
        mo.Cautious("mean")
    with pytest.raises(Exception, match="weight_decay"):
        mo.WeightDecay(-1.0)
