"""modopt/transforms/wrappers.py: Lookahead, against its float64 spec and pytorch-optimizer's Lookahead;
Schedule-Free SGD and AdamW against their float64 spec (the paper's three sequences) and Meta's
`schedulefree` package, bit for bit; the train/eval forms, checkpoints, skipped steps."""

from __future__ import annotations

import functools
import io

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import modopt as mo
from checks import (Syncs, assert_bad_steps_change_nothing, assert_resumes_bit_for_bit, flat_state, mse_backward,
                    regression_batches, tanh_mlp)
from modopt.spec.wrappers import Lookahead as SpecLookahead
from modopt.spec.wrappers import ScheduleFree as SpecScheduleFree


SIZES = (6, 12, 3)


_model = functools.partial(tanh_mlp, SIZES)  # (dtype=..., seed=...)
_batches = functools.partial(regression_batches, sizes=SIZES, rows=5)  # (n, dtype=..., seed=...)
_backward = mse_backward


@pytest.mark.parametrize("k,alpha", [(1, 0.5), (3, 0.3), (5, 0.5), (4, 0.0), (2, 1.0)])
def test_lookahead_matches_spec(k, alpha):
    """float64, inner SGD: every call the fast step, every k-th call the pull toward the slow weights."""
    model = _model(dtype=torch.float64)
    opt = mo.Modular(model.parameters(), mo.Lookahead(mo.SGD(lr=0.1), k=k, alpha=alpha))
    spec = SpecLookahead(list(model.parameters()), k, alpha)
    for x, y in _batches(11, dtype=torch.float64):
        _backward(model, x, y)
        fast = [p.detach() - 0.1 * p.grad for p in model.parameters()]  # SGD's step, in float64
        want = spec.step(fast)
        opt.step()
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("inner", ["adam", "sgd_momentum", "adamw"])
def test_lookahead_equals_pytorch_optimizer_bit_for_bit(inner):
    """pytorch-optimizer's Lookahead with its defaults (k=5, alpha=0.5, pullback 'none') around the same
    torch optimizer: float32 parameters equal bit for bit after 23 steps (four pulls)."""
    from pytorch_optimizer import Lookahead as PoLookahead

    torch_inner, mo_inner = {
        "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True), mo.Adam(lr=1e-2)),
        "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True), mo.SGD(lr=0.05, momentum=0.9)),
        "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), mo.AdamW(lr=1e-2, weight_decay=0.1)),
    }[inner]
    a, b = _model(), _model()
    ours = mo.Modular(a.parameters(), mo.Lookahead(mo_inner))
    theirs = PoLookahead(torch_inner(list(b.parameters())))
    assert (theirs.k, theirs.alpha) == (mo.Lookahead(mo_inner).k, mo.Lookahead(mo_inner).alpha)
    for x, y in _batches(23):
        for m, o in ((a, ours), (b, theirs)):
            _backward(m, x, y)
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    slow_ours = [ours.state[p]["0:Lookahead.slow"] for p in a.parameters()]
    slow_theirs = [theirs.state[q]["slow_params"] for q in b.parameters()]
    for s, t in zip(slow_ours, slow_theirs):
        assert torch.equal(s, t)


def test_lookahead_resumes_bit_for_bit_from_a_checkpoint():
    """Stopped inside a cycle (7 = 4 + 3 calls): the slow weights and the host's count travel."""
    make = lambda m: mo.Modular(m.parameters(), mo.ClipNorm(1.0), mo.Lookahead(mo.Adam(lr=1e-2), k=4))  # noqa: E731
    osd = assert_resumes_bit_for_bit(_model, make, _batches(15), cut=7).saved
    assert osd["modopt"]["transforms"]["1:Lookahead"]["calls"] == 3


def test_a_skipped_kth_call_keeps_every_bit_and_the_count_starts_again():
    """The device decides the skip (no host sync); a NaN gradient on the k-th call leaves the parameters,
    the slow weights and the inner state as they were; the next pull comes k calls later."""
    k = 3
    a, b = _model(), _model()
    oa = mo.Modular(a.parameters(), mo.Lookahead(mo.Adam(lr=1e-2), k=k))
    ob = mo.Modular(b.parameters(), mo.Lookahead(mo.Adam(lr=1e-2), k=k))
    assert oa.plan.device_skip is True
    data = _batches(8)
    for x, y in data[:2]:
        for m, o in ((a, oa), (b, ob)):
            _backward(m, x, y)
            o.step()
    _backward(a, *data[2])
    for p in a.parameters():
        p.grad[0].fill_(float("nan"))
    before = [p.detach().clone() for p in a.parameters()], flat_state(oa.state_dict())
    syncs = Syncs()
    with syncs:
        oa.step()  # the k-th call, skipped on the device
    after = [p.detach().clone() for p in a.parameters()], flat_state(oa.state_dict())
    assert syncs.n == 0 and bool(oa.stats["skipped"])
    for p, q in zip(before[0], after[0]):
        assert torch.equal(p, q)
    changed = {k for k in before[1] if not _same(before[1][k], after[1][k])}
    # only the host's count (2 -> 0) and the skipped-step counter; param_groups[0] carries the same entry
    assert changed - {"/param_groups"} == {k for k in before[1] if k.endswith("Lookahead/calls")} | {"/modopt/skipped_steps"}
    # b never saw that call: it is one call behind in the count; a's next pull comes 3 calls later
    for x, y in data[3:6]:
        _backward(a, x, y)
        oa.step()
    for x, y in data[3:5]:
        _backward(b, x, y)
        ob.step()
    _backward(b, *data[5])
    for p in b.parameters():
        p.grad[0].fill_(float("nan"))
    ob.step()  # b's 3rd call after its pull... is its k-th: skipped, nothing changes, the count restarts
    assert int(oa.stats["skipped_steps"]) == 1 and int(ob.stats["skipped_steps"]) == 1


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_lookahead_must_come_last_and_cannot_be_masked_or_attached():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="must be the last transform"):
        mo.Modular([p], mo.Lookahead(mo.SGD(lr=0.1)), mo.ClipNorm(1.0))
    with pytest.raises(Exception, match="cannot run inside Masked"):
        mo.Masked(mo.Lookahead(mo.SGD(lr=0.1)), where=mo.Select(names=["*"]))
    with pytest.raises(ValueError, match="cannot be attached"):
        mo.attach(torch.optim.SGD([p], lr=0.1), mo.Lookahead(mo.SGD(lr=0.1)))
    with pytest.raises(Exception, match="alpha"):
        mo.Lookahead(mo.SGD(lr=0.1), alpha=1.5)


def test_lookahead_config_round_trip():
    cfg = mo.PipelineConfig(transforms=[mo.ClipNorm(1.0), mo.Lookahead(mo.Adam(lr=3e-4), k=6, alpha=0.6)])
    again = mo.PipelineConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert "Lookahead" in cfg.to_yaml()


def _spec_for(t: mo.Transform, params) -> SpecScheduleFree:
    common = dict(lr=t.lr, weight_decay=t.weight_decay, warmup_steps=t.warmup_steps, r=t.r,
                  weight_lr_power=t.weight_lr_power)
    if isinstance(t, mo.ScheduleFreeAdamW):
        return SpecScheduleFree(params, beta=t.betas[0], adam=True, beta2=t.betas[1], eps=t.eps, **common)
    return SpecScheduleFree(params, beta=t.momentum, **common)


SGD_CASES = [
    mo.ScheduleFreeSGD(lr=0.1),
    mo.ScheduleFreeSGD(lr=0.05, momentum=0.7, weight_decay=0.01, warmup_steps=4, r=1.0, weight_lr_power=1.0),
    mo.ScheduleFreeSGD(lr=0.2, momentum=0.95, weight_lr_power=0.0, r=0.5),
]
ADAMW_CASES = [
    mo.ScheduleFreeAdamW(),
    mo.ScheduleFreeAdamW(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, warmup_steps=5, r=0.5),
]


def _against_spec(t: mo.Transform) -> None:
    """float64: every step's parameters (y) and, at the end, the eval form (x) against the spec."""
    model = _model(dtype=torch.float64)
    opt = mo.Modular(model.parameters(), t)
    spec = _spec_for(t, list(model.parameters()))
    for x, y in _batches(12, dtype=torch.float64):
        mse_backward(model, x, y)
        want = spec.step([p.grad for p in model.parameters()])
        opt.step()
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-14)
    with opt.evaluating():
        for p, w in zip(model.parameters(), spec.x):
            torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("t", SGD_CASES, ids=repr)
def test_schedule_free_sgd_matches_spec(t):
    _against_spec(t)


@pytest.mark.parametrize("t", ADAMW_CASES, ids=repr)
def test_schedule_free_adamw_matches_spec(t):
    _against_spec(t)


# --- the package, bit for bit ---------------------------------------------------------------------------
def _package(t: mo.Transform, params):
    schedulefree = pytest.importorskip("schedulefree")
    if isinstance(t, mo.ScheduleFreeAdamW):
        if t == mo.ScheduleFreeAdamW():
            return schedulefree.AdamWScheduleFree(params)  # its own defaults
        return schedulefree.AdamWScheduleFree(params, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay,
                                              warmup_steps=t.warmup_steps, r=t.r, weight_lr_power=t.weight_lr_power)
    if t == mo.ScheduleFreeSGD():
        return schedulefree.SGDScheduleFree(params)
    return schedulefree.SGDScheduleFree(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay,
                                        warmup_steps=t.warmup_steps, r=t.r, weight_lr_power=t.weight_lr_power)


def _state(opt: mo.Modular, params, name: str) -> list[torch.Tensor]:
    key = opt.plan.swaps[0][0]
    return [opt.state[p][f"{key}.{name}"] for p in params]


@pytest.mark.parametrize("t", [mo.ScheduleFreeAdamW(), mo.ScheduleFreeSGD()] + SGD_CASES[1:] + ADAMW_CASES[1:], ids=repr)
def test_equals_the_schedulefree_package_bit_for_bit(t):
    """float32, through `Modular.step()` after a real backward, two param groups (the second one's lr moved
    by a scheduler), a bias that misses its gradient on some steps: the parameters (y), z and v equal the
    package's bit for bit after 25 steps; then the eval form (x) and the training form again after it."""
    a, b = _model(), _model()

    def groups(m):
        return [{"params": [m[0].weight, m[0].bias]}, {"params": [m[2].weight, m[2].bias], "lr": t.lr * 0.5}]

    ours = mo.Modular(groups(a), t)
    theirs = _package(t, groups(b))
    assert ours.defaults["lr"] == theirs.defaults["lr"]  # the same defaults
    theirs.train()
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 1.0, lambda s: 1.0 / (1 + s)]) for o in (ours, theirs)]
    for i, (x, y) in enumerate(_batches(25)):
        for m, o, s in ((a, ours, scheds[0]), (b, theirs, scheds[1])):
            mse_backward(m, x, y)
            if i % 3 == 1:
                m[2].bias.grad = None  # not stepped this time (its z is made when it first has a gradient)
            o.step()
            s.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    params_a, params_b = list(a.parameters()), list(b.parameters())
    for s, q in zip(_state(ours, params_a, "z"), params_b):
        assert torch.equal(s, theirs.state[q]["z"])
    if isinstance(t, mo.ScheduleFreeAdamW):
        for s, q in zip(_state(ours, params_a, "exp_avg_sq"), params_b):
            assert torch.equal(s, theirs.state[q]["exp_avg_sq"])
    store = ours.state_dict()["modopt"]["transforms"][ours.plan.swaps[0][0]]
    assert [float(store[f"k@group{i}"]) for i in (0, 1)] == [g["k"] for g in theirs.param_groups] == [25, 25]
    assert [float(store[f"weight_sum@group{i}"]) for i in (0, 1)] == [g["weight_sum"] for g in theirs.param_groups]
    assert [float(store[f"lr_max@group{i}"]) for i in (0, 1)] == [g["lr_max"] for g in theirs.param_groups]
    ours.eval()
    theirs.eval()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    ours.train()
    theirs.train()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


# --- train and eval --------------------------------------------------------------------------------------
def test_eval_holds_x_train_holds_y_and_a_step_in_eval_mode_is_refused():
    model = _model(dtype=torch.float64)
    t = mo.ScheduleFreeAdamW(lr=1e-2)
    opt = mo.Modular(model.parameters(), t)
    opt.eval()  # before any step: no z, nothing moves (as in the package)
    opt.train()
    spec = _spec_for(t, list(model.parameters()))
    for x, y in _batches(6, dtype=torch.float64):
        mse_backward(model, x, y)
        spec.step([p.grad for p in model.parameters()])
        opt.step()
    y_form = [p.detach().clone() for p in model.parameters()]
    opt.eval()
    opt.eval()  # a second call changes nothing
    for p, w in zip(model.parameters(), spec.x):
        torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-14)
    before = [p.detach().clone() for p in model.parameters()], flat_state(opt.state_dict())
    mse_backward(model, *_batches(1, seed=7, dtype=torch.float64)[0])
    with pytest.raises(RuntimeError, match=r"eval form.*opt.train\(\)"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(before[0], model.parameters()))
    after = flat_state(opt.state_dict())
    assert before[1].keys() == after.keys()
    assert all(torch.equal(before[1][k], after[k]) if isinstance(after[k], torch.Tensor) else before[1][k] == after[k]
               for k in after)
    opt.train()
    for p, w in zip(model.parameters(), y_form):
        torch.testing.assert_close(p.detach(), w, rtol=1e-14, atol=1e-15)  # back to y (a lerp each way)


def test_evaluating_swaps_in_and_back_as_the_package_does():
    schedulefree = pytest.importorskip("schedulefree")
    a, b = _model(), _model()
    ours = mo.Modular(a.parameters(), mo.ScheduleFreeSGD(lr=0.1))
    theirs = schedulefree.SGDScheduleFree(b.parameters(), lr=0.1)
    theirs.train()
    for x, y in _batches(5):
        for m, o in ((a, ours), (b, theirs)):
            mse_backward(m, x, y)
            o.step()
    theirs.eval()
    with ours.evaluating() as o:
        assert o is ours
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        with ours.evaluating():  # already in the eval form: inside and after, it stays there
            pass
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    theirs.train()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    ours.eval()
    with ours.evaluating():
        pass
    with pytest.raises(RuntimeError, match="eval form"):  # it was in the eval form before: it stays
        ours.step()


def test_a_pipeline_without_schedule_free_has_no_train_or_eval():
    """An AttributeError that says why, so that `hasattr(opt, "train")` is False: the Hugging Face Trainer
    and accelerate call `optimizer.train()` / `eval()` whenever they exist."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = mo.Modular([p], mo.ClipNorm(1.0), mo.AdamW(lr=1e-3))
    assert not hasattr(opt, "train") and not hasattr(opt, "eval")
    for what in ("train", "eval", "evaluating"):
        with pytest.raises(AttributeError, match=f"Modular.{what}: this pipeline has no transform .*Schedule-Free"):
            getattr(opt, what)()
    sf = mo.Modular([p], mo.ClipNorm(1.0), mo.ScheduleFreeAdamW())
    assert callable(sf.train) and callable(sf.eval)


# --- checkpoints -----------------------------------------------------------------------------------------
def test_resumes_bit_for_bit_and_the_state_carries_z_and_the_schedule():
    make = lambda m: mo.Modular(m.parameters(), mo.ClipNorm(1.0), mo.ScheduleFreeAdamW(lr=1e-2, warmup_steps=4))  # noqa: E731
    osd = assert_resumes_bit_for_bit(_model, make, _batches(12), cut=6).saved
    store = osd["modopt"]["transforms"]["1:ScheduleFreeAdamW"]
    assert store["k@group0"].dtype == torch.float64 and float(store["k@group0"]) == 6
    assert {"1:ScheduleFreeAdamW.z", "1:ScheduleFreeAdamW.exp_avg_sq"} <= set(osd["state"][0])
    make_sgd = lambda m: mo.Modular(m.parameters(), mo.ScheduleFreeSGD(lr=0.1, r=1.0))  # noqa: E731
    assert_resumes_bit_for_bit(_model, make_sgd, _batches(9), cut=4)


def test_a_checkpoint_taken_in_eval_mode_resumes_in_eval_mode():
    """The model saved with x in it and the optimizer in eval mode (as the package advises): a fresh optimizer
    loads the mode, `train()` brings y back, and training goes on as the run that never stopped."""
    data = _batches(10)
    make = lambda m: mo.Modular(m.parameters(), mo.ScheduleFreeSGD(lr=0.1))  # noqa: E731

    straight = _model()
    o = make(straight)
    for i, (x, y) in enumerate(data):
        if i == 5:
            o.eval()
            o.train()
        mse_backward(straight, x, y)
        o.step()

    model = _model()
    opt = make(model)
    for x, y in data[:5]:
        mse_backward(model, x, y)
        opt.step()
    opt.eval()
    buf = io.BytesIO()
    torch.save((model.state_dict(), opt.state_dict()), buf)
    buf.seek(0)
    msd, osd = torch.load(buf, weights_only=True)
    resumed = _model()
    resumed.load_state_dict(msd)
    opt2 = make(resumed)
    opt2.load_state_dict(osd)
    mse_backward(resumed, *data[5])
    with pytest.raises(RuntimeError, match="eval form"):
        opt2.step()
    opt2.train()
    for x, y in data[5:]:
        mse_backward(resumed, x, y)
        opt2.step()
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_a_damaged_train_mode_is_refused():
    m = _model()
    opt = mo.Modular(m.parameters(), mo.ScheduleFreeSGD(lr=0.1))
    mse_backward(m, *_batches(1)[0])
    opt.step()
    sd = opt.state_dict()
    sd["modopt"]["transforms"]["0:ScheduleFreeSGD"]["train_mode"] = 2
    with pytest.raises(ValueError, match="train_mode is 2"):
        mo.Modular(_model().parameters(), mo.ScheduleFreeSGD(lr=0.1)).load_state_dict(sd)


# --- a skipped step in the warm-up (the registry line: the rest of the skip, syncs, compile) -------------------
@pytest.mark.parametrize("t", [mo.ScheduleFreeAdamW(lr=1e-2, warmup_steps=3, r=0.5, weight_decay=0.1),
                               mo.ScheduleFreeSGD(lr=0.1, weight_decay=0.01, warmup_steps=4)], ids=repr)
def test_a_skipped_step_keeps_every_bit_with_no_sync(t):
    """Beyond the registry's skip (after the warm-up): NaN and inf steps before step 3, inside the warm-up, where
    the largest lr still grows, leave y, z, v and the schedule (count, weight sum, largest lr) as they were."""
    data = _batches(7)

    def make():
        m = _model()
        return m, mo.Modular(m.parameters(), t)

    _, opt = assert_bad_steps_change_nothing(make, lambda m, k: mse_backward(m, *data[k]), steps=7, at=(2,))
    store = opt.state_dict()["modopt"]["transforms"][f"0:{type(t).__name__}"]
    assert {f"{n}@group0" for n in ("k", "weight_sum", "lr_max")} <= set(store)  # (compared by the check)
    assert sum(k.endswith(f"{type(t).__name__}.z") for s in opt.state_dict()["state"].values() for k in s) == 4


# --- where it may sit ----------------------------------------------------------------------------------------
def test_it_comes_last_at_the_top_level_with_no_weight_stage_after_it():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    sf = mo.ScheduleFreeAdamW()
    with pytest.raises(ValueError, match="must be the last transform"):
        mo.Modular([p], sf, mo.ClipNorm(1.0))
    with pytest.raises(ValueError, match="cannot run inside Lookahead"):
        mo.Modular([p], mo.Lookahead(sf))
    with pytest.raises(Exception, match="cannot run inside Masked"):
        mo.Masked(sf, where=mo.Select(names=["*"]))
    with pytest.raises(ValueError, match="cannot be attached"):
        mo.attach(torch.optim.SGD([p], lr=0.1), sf)
    with pytest.raises(ValueError, match="leave the weight stage out"):
        mo.Modular([p], sf, mo.ProjectNorm())
    opt = mo.Modular([p], mo.Chain(mo.ClipNorm(1.0), sf))  # a plain Chain is fine
    assert [k for k, _ in opt.plan.swaps] == ["0:Chain/1:ScheduleFreeAdamW"]
    p.grad = torch.ones(2, 2)
    opt.step()
    assert "0:Chain/1:ScheduleFreeAdamW.z" in opt.state[p]
    opt.eval()
    with pytest.raises(RuntimeError, match="0:Chain/1:ScheduleFreeAdamW"):
        opt.step()


def test_fields_are_checked():
    with pytest.raises(Exception, match="betas.*interpolation momentum"):
        mo.ScheduleFreeAdamW(betas=(0.0, 0.999))
    with pytest.raises(Exception, match="momentum"):
        mo.ScheduleFreeSGD(momentum=1.0)
    with pytest.raises(Exception, match="warmup_steps"):
        mo.ScheduleFreeSGD(warmup_steps=-1)
    assert mo.ScheduleFreeSGD(0.5) == mo.ScheduleFreeSGD(lr=0.5)


def test_config_round_trip():
    cfg = mo.PipelineConfig(transforms=[mo.ClipNorm(1.0), mo.ScheduleFreeAdamW(lr=1e-3, betas=(0.95, 0.99), warmup_steps=10)])
    assert mo.PipelineConfig.from_dict(cfg.to_dict()) == cfg
    assert "ScheduleFreeAdamW" in cfg.to_yaml()


# --- the gate: values the swap reads, extreme schedule values, loaded counts ------------------------------
def _unchanged(opt, model, before) -> None:
    """The parameters and every state value (the form held included) as `before = _snapshot(...)`, bit for bit."""
    params, state = before
    assert all(torch.equal(p, q) for p, q in zip(params, model.parameters()))
    after = flat_state(opt.state_dict())
    assert after.keys() == state.keys()
    assert all(_same(state[k], after[k]) for k in after if k != "/param_groups")


def _snapshot(opt, model):
    return [p.detach().clone() for p in model.parameters()], flat_state(opt.state_dict())


def _two_groups(t):
    """Two param groups, five steps taken (x, y and z apart)."""
    model = _model()
    ps = list(model.parameters())
    opt = mo.Modular([{"params": ps[:2]}, {"params": ps[2:]}], t)
    for x, y in _batches(5):
        mse_backward(model, x, y)
        opt.step()
    return model, opt


_NAN = float("nan")
_BAD_SWAP_VALUES = [
    (mo.ScheduleFreeSGD(lr=0.1), "momentum", _NAN, "Input should be a finite number"),
    (mo.ScheduleFreeSGD(lr=0.1), "momentum", torch.tensor(_NAN), "Input should be a finite number"),
    (mo.ScheduleFreeSGD(lr=0.1), "momentum", np.float32(_NAN), "Input should be a finite number"),
    (mo.ScheduleFreeSGD(lr=0.1), "momentum", 0.0, "greater than 0"),
    (mo.ScheduleFreeSGD(lr=0.1), "momentum", torch.tensor(0.0), "greater than 0"),
    (mo.ScheduleFreeSGD(lr=0.1), "momentum", 1.0, "less than 1"),
    (mo.ScheduleFreeSGD(lr=0.1), "momentum", 1e-40, r"\[2\*\*-126, 1\)"),
    (mo.ScheduleFreeSGD(lr=0.1), "momentum", "0.9", "string"),
    (mo.ScheduleFreeAdamW(lr=1e-2), "betas", (_NAN, 0.999), "Input should be a finite number"),
    (mo.ScheduleFreeAdamW(lr=1e-2), "betas", (0.0, 0.999), "interpolation momentum"),
    (mo.ScheduleFreeAdamW(lr=1e-2), "betas", (np.float64(1e-300), 0.999), "interpolation momentum"),
]


@pytest.mark.parametrize("t,key,value,says", _BAD_SWAP_VALUES, ids=lambda v: repr(v) if not isinstance(v, mo.Transform) else type(v).__name__)
def test_the_swap_checks_every_group_first_and_a_refusal_changes_nothing(t, key, value, says):
    """A value the field refuses in param group 1: `opt.eval()` (then, from the eval form, `opt.train()`)
    is refused naming the door, the group and the key, before group 0 is swapped: the parameters, z and
    the form held keep every bit (unchecked, a NaN momentum writes NaN into every parameter, and a
    momentum of 0 divides by zero after group 0 was swapped)."""
    model, opt = _two_groups(t)
    good = opt.param_groups[1][key]
    for door, other in (("eval", "train"), ("train", "eval")):
        if door == "train":
            opt.param_groups[1][key] = good
            opt.eval()
        opt.param_groups[1][key] = value
        before = _snapshot(opt, model)
        with pytest.raises(ValueError, match=rf"opt\.{door}\(\): param group 1, as read by 0:{type(t).__name__}: "
                                             rf"'{key}'.*{says}.*Nothing was changed: the parameters still hold their "
                                             rf"{other} form"):
            getattr(opt, door)()
        _unchanged(opt, model, before)
        assert opt.plan.swaps[0][1].weights_mode(opt, opt.plan.swaps[0][0]) == other
    opt.param_groups[1][key] = good
    opt.train()
    mse_backward(model, *_batches(1, seed=3)[0])
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("value", [0.9, np.float32(0.9), np.float64(0.9), torch.tensor(0.9, dtype=torch.float64)],
                         ids=repr)
def test_the_swap_reads_a_numpy_or_tensor_momentum_as_its_number(value):
    """The same swap, bit for bit, whatever form the group's momentum takes (a host read, not a step)."""
    want_model, want = _two_groups(mo.ScheduleFreeSGD(lr=0.1))
    model, opt = _two_groups(mo.ScheduleFreeSGD(lr=0.1))
    beta = float(value)
    for o in (want, opt):
        o.param_groups[1]["momentum"] = beta if o is want else value
    for door in ("eval", "train"):
        getattr(want, door)()
        getattr(opt, door)()
        assert all(torch.equal(p, q) for p, q in zip(want_model.parameters(), model.parameters()))


def test_evaluating_refuses_a_bad_value_on_entry_and_on_exit_with_nothing_changed():
    model, opt = _two_groups(mo.ScheduleFreeSGD(lr=0.1))
    opt.param_groups[0]["momentum"] = _NAN
    before = _snapshot(opt, model)
    with pytest.raises(ValueError, match=r"opt\.eval\(\): param group 0.*'momentum'"):
        with opt.evaluating():
            raise AssertionError("not entered")
    _unchanged(opt, model, before)
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match=r"opt\.train\(\): param group 0.*'momentum'.*still hold their eval form"):
        with opt.evaluating():
            opt.param_groups[0]["momentum"] = -1.0
            before = _snapshot(opt, model)
    _unchanged(opt, model, before)


@pytest.mark.parametrize("cls,field,value", [
    (mo.ScheduleFreeSGD, "r", 1e300), (mo.ScheduleFreeSGD, "r", 8.5), (mo.ScheduleFreeAdamW, "r", 1e300),
    (mo.ScheduleFreeSGD, "lr", 1e300), (mo.ScheduleFreeAdamW, "lr", 2.0**64 * 1.01),
    (mo.ScheduleFreeSGD, "weight_lr_power", 9.0), (mo.ScheduleFreeAdamW, "weight_lr_power", 1e300),
    (mo.ScheduleFreeSGD, "momentum", 1e-40), (mo.ScheduleFreeAdamW, "betas", (1e-40, 0.999)),
])
def test_values_that_overflow_the_schedule_are_refused_at_construction(cls, field, value):
    """Unbounded, `ScheduleFreeSGD(r=1e300)` takes (k+1)**r = inf and makes the parameters NaN on step 2;
    lr 1e300 (or a weight_lr_power that large) overflows lr**weight_lr_power; a momentum below 2**-126
    makes the eval form's weight 1 - 1/beta overflow float32."""
    with pytest.raises(ValidationError, match=f"{cls.__name__}.{field}"):
        cls(**{field: value})
    bound = {"r": 8.0, "lr": 2.0**64, "weight_lr_power": 8.0, "momentum": 2.0**-126, "betas": (2.0**-126, 0.999)}[field]
    assert getattr(cls(**{field: bound}), field) == bound  # the bound itself is accepted


@pytest.mark.parametrize("cls", [mo.ScheduleFreeSGD, mo.ScheduleFreeAdamW])
def test_a_group_lr_past_the_bound_is_refused_by_every_group_door(cls):
    model = _model()
    with pytest.raises(ValueError, match=r"param group 0, as read by 0:\w+: 'lr' = 1e\+300"):
        mo.Modular(model.parameters(), cls(), lr=1e300)
    ps = list(model.parameters())
    opt = mo.Modular([{"params": ps[:2]}], cls())
    with pytest.raises(ValueError, match=r"param group 1.*'lr'"):
        opt.add_param_group({"params": ps[2:], "lr": 2.0**65})
    assert len(opt.param_groups) == 1
    mse_backward(model, *_batches(1)[0])
    opt.step()
    opt.param_groups[0]["lr"] = 1e300  # as a scheduler writes it: refused at the step, nothing changed
    mse_backward(model, *_batches(1, seed=2)[0])
    before = _snapshot(opt, model)
    with pytest.raises(ValueError, match=r"param group 0.*'lr' = 1e\+300"):
        opt.step()
    _unchanged(opt, model, before)


def _sf_checkpoint(t):
    model = _model()
    opt = mo.Modular(model.parameters(), t)
    for x, y in _batches(3):
        mse_backward(model, x, y)
        opt.step()
    return opt.state_dict()


@pytest.mark.parametrize("name,value,says", [
    ("lr_max@group0", torch.tensor(1e300, dtype=torch.float64), r"lr_max is 1e\+300.*\[0, 2\*\*64\]"),
    ("lr_max@group0", torch.tensor(2.0**64 * 1.01, dtype=torch.float64), r"lr_max is .*\[0, 2\*\*64\]"),
    ("k@group0", torch.tensor(2.5, dtype=torch.float64), r"k is 2\.5.*whole number"),
    ("k@group0", torch.tensor(2.0**60, dtype=torch.float64), r"k is .*\[0, 2\*\*53\]"),
    ("k@group0", torch.tensor(float("inf"), dtype=torch.float64), r"k is inf"),
    ("weight_sum@group0", torch.tensor(1e308, dtype=torch.float64), r"weight_sum is 1e\+308.*k = 3\.0"),
    ("train_mode", 1.0, r"train_mode is 1\.0"),
    ("train_mode", torch.tensor(1), r"train_mode is tensor\(1\)"),
])
@pytest.mark.parametrize("cls", [mo.ScheduleFreeSGD, mo.ScheduleFreeAdamW])
def test_a_loaded_schedule_past_its_bounds_is_refused_with_nothing_changed(cls, name, value, says):
    """A loaded lr_max of 1e300 is finite and >= 0, yet lr_max**2 overflows and the parameters become NaN:
    every saved value of the schedule is held to the bounds that keep it finite."""
    sd = _sf_checkpoint(cls(lr=1e-2))
    key = f"0:{cls.__name__}"
    sd["modopt"]["transforms"][key][name] = value
    sd["param_groups"][0]["modopt"]["transforms"][key][name] = value
    model = _model(seed=1)
    opt = mo.Modular(model.parameters(), cls(lr=1e-2))
    mse_backward(model, *_batches(1)[0])
    opt.step()
    before = _snapshot(opt, model)
    with pytest.raises(ValueError, match=f"transform {key}.*{says}"):
        opt.load_state_dict(sd)
    _unchanged(opt, model, before)


@pytest.mark.parametrize("cls", [mo.ScheduleFreeSGD, mo.ScheduleFreeAdamW])
def test_the_schedule_stays_finite_for_every_accepted_extreme(cls):
    """A grid of the extremes the bounds accept (0, the smallest float, tiny, 1, the largest lr; powers and
    r at 0, tiny and their bounds, r very negative), from a fresh state and from saved states at the largest
    count (2**53 - 1) with the largest lr_max and weight sum: the scheduled lr, the averaging weight c, the
    parameters and their eval form stay finite, and no step is skipped."""
    from modopt.transforms.wrappers import _WEIGHT_MAX, LR_MAX, POWER_MAX, R_MAX, STEPS_MAX

    saved = [None, (1.0, 1.0, LR_MAX), (STEPS_MAX - 1, 1.0, LR_MAX), (STEPS_MAX - 1, 0.0, 0.0), (5.0, 0.5, 5e-324)]
    for lr in (0.0, 5e-324, 1e-300, 1.0, LR_MAX):
        for power in (0.0, 1e-300, POWER_MAX):
            for r in (-1e30, 0.0, 1e-300, R_MAX):
                for state in saved:
                    key = f"0:{cls.__name__}"
                    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
                    opt = mo.Modular([p], cls(lr=lr, weight_lr_power=power, r=r, warmup_steps=2))
                    if state is not None:
                        p.grad = torch.ones(3, dtype=torch.float64)
                        opt.step()
                        sd = opt.state_dict()
                        k, frac, lr_max = state
                        for e in (sd["modopt"]["transforms"][key], sd["param_groups"][0]["modopt"]["transforms"][key]):
                            e["k@group0"] = torch.tensor(k, dtype=torch.float64)
                            e["lr_max@group0"] = torch.tensor(lr_max, dtype=torch.float64)
                            e["weight_sum@group0"] = torch.tensor(frac * k * _WEIGHT_MAX, dtype=torch.float64)
                        opt.load_state_dict(sd)
                    for i in range(3):
                        p.grad = torch.full((3,), (-0.5) ** i, dtype=torch.float64)
                        opt.step()
                        for v in (opt.stats[f"{key}.scheduled_lr"], opt.stats[f"{key}.ckp1"], p):
                            assert torch.isfinite(v).all(), (lr, power, r, state, i)
                    assert int(opt.stats["skipped_steps"]) == 0
                    with opt.evaluating():
                        assert torch.isfinite(p).all(), (lr, power, r, state)


@pytest.mark.parametrize("calls,says", [(2.5, r"'calls' is 2\.5"), (2.0, r"'calls' is 2\.0"),
                                        (torch.tensor(2), r"'calls' is tensor\(2\)"), (-1, r"-1"),
                                        (True, "counter must be a number")])
def test_a_loaded_lookahead_count_must_be_a_whole_number(calls, says):
    """A saved `calls` of 2.5 would never meet `k` on a whole call; a tensor would be read at every step."""
    make = lambda m: mo.Modular(m.parameters(), mo.Lookahead(mo.SGD(lr=0.1), k=4))  # noqa: E731
    src = _model()
    o = make(src)
    for x, y in _batches(2):
        mse_backward(src, x, y)
        o.step()
    sd = o.state_dict()
    assert sd["modopt"]["transforms"]["0:Lookahead"]["calls"] == 2
    for e in (sd["modopt"]["transforms"], sd["param_groups"][0]["modopt"]["transforms"]):
        e["0:Lookahead"]["calls"] = calls
    model = _model(seed=1)
    opt = make(model)
    mse_backward(model, *_batches(1)[0])
    opt.step()
    before = _snapshot(opt, model)
    with pytest.raises(ValueError, match=f"0:Lookahead.*{says}"):
        opt.load_state_dict(sd)
    _unchanged(opt, model, before)
    for e in (sd["modopt"]["transforms"], sd["param_groups"][0]["modopt"]["transforms"]):
        e["0:Lookahead"]["calls"] = 3
    opt.load_state_dict(sd)  # a whole count loads, and the next call pulls
    mse_backward(model, *_batches(1)[0])
    opt.step()
    assert opt.state_dict()["modopt"]["transforms"]["0:Lookahead"]["calls"] == 0
