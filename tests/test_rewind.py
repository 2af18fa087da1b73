"""`mo.Rewind` (modopt/rewind.py): snapshots, the trigger rule, bit-exact restores, skipped batches,
the learning-rate cut, giving up, its state dict, host syncs, and `modopt run` with `train.rewind`."""

from __future__ import annotations

import copy
import io
import json
import math
import statistics

import pydantic
import pytest
import torch

import modopt as mo

from checks import Syncs, flat_state
from modopt.cli import run as run_mod
from modopt.cli.experiment import experiment_from_data
from modopt.cli.tasks import make_task
from modopt.config import ConfigError


# --- a small training loop ----------------------------------------------------------------------------
def make(kind: str = "modular", seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    if kind == "modular":
        opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(lr=0.01))
    elif kind == "zclip":  # a transform with its own global state (running mean and variance)
        opt = mo.Modular(model.parameters(), mo.ZClip(warmup_steps=3), mo.Adam(lr=0.01))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def batch(t: int):
    """The batch number `t`, from `t` alone."""
    g = torch.Generator().manual_seed(1000 + t)
    x = torch.randn(16, 4, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def train_step(model, opt, t: int) -> torch.Tensor:
    x, y = batch(t)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def same_state(a: dict, b: dict) -> bool:
    fa, fb = flat_state(a), flat_state(b)
    if fa.keys() != fb.keys():
        return False
    return all(torch.equal(fa[k], fb[k]) if isinstance(fa[k], torch.Tensor) else fa[k] == fb[k] for k in fa)


def optimizer_math(sd: dict) -> dict:
    """What a `Modular` state dict holds for the step's math: per-parameter state, transform state, skipped
    steps and the group hyperparameters (not telemetry a run keeps in its groups)."""
    groups = [{k: v for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay", "params")} for g in sd["param_groups"]]
    return {"state": sd["state"], "transforms": sd["modopt"]["transforms"], "skipped": sd["modopt"]["skipped_steps"],
            "groups": groups}


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same_params(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# --- no trigger: nothing changes ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["modular", "zclip", "torch"])
def test_without_a_trigger_the_run_is_bit_identical_to_one_without_the_guard(kind):
    model_a, opt_a = make(kind)
    model_b, opt_b = make(kind)
    guard = mo.Rewind(opt_b, model=model_b, every=4, min_count=3, window=6)
    for t in range(1, 26):
        train_step(model_a, opt_a, t)
        assert guard.step(train_step(model_b, opt_b, t)) is None
    assert guard.rewinds == [] and guard.steps_done == guard.batches_seen == 25 and guard.snapshot_step == 24
    assert same_params(params_of(model_a), params_of(model_b))
    assert same_state(opt_a.state_dict(), opt_b.state_dict())


# --- a non-finite loss: back to the snapshot, bit for bit ---------------------------------------------
@pytest.mark.parametrize("kind", ["modular", "zclip", "torch"])
@pytest.mark.parametrize("where", ["cpu", "device"])
def test_a_non_finite_loss_restores_the_snapshot_bit_for_bit(kind, where):
    model, opt = make(kind)
    guard = mo.Rewind(opt, model=model, every=5, where=where)
    saved = None
    for t in range(1, 11):
        loss = train_step(model, opt, t)
        if t == 5:
            saved = (params_of(model), flat_state(opt.state_dict()))
        event = guard.step(torch.tensor(float("nan")) if t == 7 else loss)
        assert (event is None) == (t != 10)
    assert event == mo.RewindEvent(step=7, batch=7, trigger="non-finite loss", checked_at=10, restored_to=5,
                                   skipped=(6, 10), attempt=1)
    assert guard.rewinds == [event] and guard.steps_done == 5 and guard.batches_seen == 10
    assert same_params(params_of(model), saved[0])
    now = flat_state(opt.state_dict())
    assert now.keys() == saved[1].keys()
    assert all(torch.equal(now[k], saved[1][k]) if isinstance(now[k], torch.Tensor) else now[k] == saved[1][k] for k in now)


@pytest.mark.parametrize("kind", ["zclip", "torch"])
def test_continuing_after_a_rewind_equals_a_run_that_never_saw_the_skipped_batches(kind):
    """Batches 6-10 are rewound; the guarded run then feeds 11, 12, ...: a plain run fed 1-5, 11, 12, ... matches."""
    model, opt = make(kind)
    guard = mo.Rewind(opt, model=model, every=5)
    for t in range(1, 21):
        loss = train_step(model, opt, guard.batches_seen + 1)
        guard.step(torch.tensor(math.inf) if guard.batches_seen == 7 else loss)
    assert [(e.restored_to, e.skipped) for e in guard.rewinds] == [(5, (6, 10))]
    assert guard.steps_done == 15
    plain_model, plain_opt = make(kind)
    for t in [*range(1, 6), *range(11, 21)]:
        train_step(plain_model, plain_opt, t)
    assert same_params(params_of(model), params_of(plain_model))
    assert same_state(opt.state_dict(), plain_opt.state_dict())


def test_the_state_of_a_step_zero_snapshot_is_empty_again_after_the_rewind():
    model, opt = make("modular")
    guard = mo.Rewind(opt, model=model, every=3)
    start = params_of(model)
    for t in range(1, 4):
        train_step(model, opt, t)
        event = guard.step(torch.tensor(float("nan")) if t == 1 else torch.tensor(1.0))
    assert event is not None and event.restored_to == 0
    assert same_params(params_of(model), start)
    assert len(opt.state) == 0 and opt.state_dict()["modopt"]["transforms"] == mo.Modular(
        make("modular")[0].parameters(), mo.ClipNorm(1.0), mo.Adam(lr=0.01)).state_dict()["modopt"]["transforms"]


# --- the spike rule ---------------------------------------------------------------------------------------
def first_spike(values, z, window, min_count, floor):
    """The 1-based index of the first value above mean + z * max(stdev, floor * |mean|) of the last `window`
    accepted values (with at least `min_count` of them), or of the first non-finite one; None if none."""
    held: list[float] = []
    for i, x in enumerate(values, 1):
        if not math.isfinite(x):
            return i
        if len(held) >= min_count:
            mean = statistics.fmean(held)
            if x > mean + z * max(statistics.stdev(held), floor * abs(mean)):
                return i
        held = (held + [x])[-window:]
    return None


def spike_series(seed: int, n: int, at: int | None, height: float):
    g = torch.Generator().manual_seed(seed)
    base = (2.0 * torch.exp(-torch.arange(n) / 30.0) + 0.05 * torch.randn(n, generator=g) + 1.0).tolist()
    if at is not None:
        base[at - 1] += height
    return base


@pytest.mark.parametrize("seed,at,height,z,window,min_count,floor,expect", [
    (0, 40, 5.0, 6.0, 50, 20, 0.01, 40),     # the defaults: a clear spike after the window filled
    (1, 40, 0.3, 2.0, 10, 5, 0.0, 40),       # a small spike, a short window, no floor
    (2, 6, 3.0, 4.0, 8, 5, 0.0, 6),          # 5 values held: the rule is on ...
    (2, 6, 3.0, 4.0, 8, 8, 0.0, None),       # ... and with min_count=8 not yet
    (3, 60, 1.0, 3.0, 30, 10, 0.0, 60),      # above mean + 3 std ...
    (3, 60, 1.0, 3.0, 30, 10, 0.5, None),    # ... but not above the floor's 3 x 0.5 x |mean|
    (4, None, 0.0, 2.0, 5, 3, 0.0, None),    # noise on a falling loss: nothing
])
def test_the_spike_rule_fires_where_an_independent_computation_says(seed, at, height, z, window, min_count, floor, expect):
    values = spike_series(seed, 80, at, height)
    assert first_spike(values, z, window, min_count, floor) == expect
    model, opt = make("modular")
    guard = mo.Rewind(opt, model=model, every=len(values), loss_z=z, window=window, min_count=min_count,
                      rel_std_floor=floor)
    for v in values:
        event = guard.step(torch.tensor(v))
    assert (event.step if event else None) == expect
    assert event is None or (event.trigger, event.batch, event.restored_to) == ("loss spike", expect, 0)


def test_a_grad_norm_spike_is_its_own_trigger_and_loss_z_none_turns_the_loss_rule_off():
    model, opt = make("modular")
    guard = mo.Rewind(opt, model=model, every=30, loss_z=None, grad_norm_z=5.0, window=10, min_count=5)
    norms = spike_series(5, 30, 25, 3.0)
    losses = spike_series(6, 30, 10, 50.0)  # a loss spike the guard is told to ignore
    for x, g in zip(losses, norms):
        event = guard.step(torch.tensor(x), grad_norm=torch.tensor(g))
    assert event is not None and (event.step, event.trigger) == (25, "grad-norm spike")
    assert first_spike(norms, 5.0, 10, 5, 0.01) == 25


# --- giving up --------------------------------------------------------------------------------------------
def test_it_gives_up_after_max_tries_rewinds_to_the_same_snapshot_naming_step_and_trigger():
    model, opt = make("modular")
    guard = mo.Rewind(opt, model=model, every=4, max_tries=2)
    events = []
    with pytest.raises(mo.RewindError) as err:
        for t in range(1, 100):
            loss = train_step(model, opt, guard.batches_seen + 1)
            events.append(guard.step(torch.tensor(float("nan")) if guard.batches_seen >= 5 else loss))
    assert [(e.attempt, e.restored_to, e.skipped) for e in events if e] == [(1, 4, (5, 8)), (2, 4, (9, 12))]
    msg = str(err.value)
    assert "gave up at step 8" in msg and "non-finite loss at step 5 (batch 13" in msg
    assert "2 rewind(s) to the snapshot of step 4 (max_tries=2)" in msg


def test_a_clean_check_resets_the_tries():
    model, opt = make("modular")
    guard = mo.Rewind(opt, model=model, every=2, max_tries=1)
    bad = {3, 7, 11}  # batches: each window after a rewind is clean once, so max_tries=1 never runs out
    for t in range(1, 20):
        loss = train_step(model, opt, guard.batches_seen + 1)
        guard.step(torch.tensor(math.nan) if guard.batches_seen + 1 in bad else loss)
    assert [e.batch for e in guard.rewinds] == [3, 7, 11] and all(e.attempt == 1 for e in guard.rewinds)


# --- the learning-rate cut --------------------------------------------------------------------------------
def test_the_learning_rate_is_lowered_for_lr_steps_steps_after_a_rewind_then_restored():
    model, opt = make("modular")
    opt.param_groups[0]["lr"] = 0.02
    guard = mo.Rewind(opt, model=model, every=3, lr_factor=0.25, lr_steps=4)
    seen = []  # the lr each step ran with (a hook registered after the guard's sees the cut)
    opt.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    between = []
    for t in range(1, 13):
        loss = train_step(model, opt, guard.batches_seen + 1)
        guard.step(torch.tensor(math.nan) if t == 2 else loss)
        between.append(opt.param_groups[0]["lr"])
    assert seen == [0.02] * 3 + [0.02 * 0.25] * 4 + [0.02] * 5
    assert between == [0.02] * 12 and guard.lowered_steps_left == 0
    # the cut steps equal a plain run at the lowered lr from the snapshot (step 0) on batches 4-7
    plain_model, plain_opt = make("modular")
    plain_opt.param_groups[0]["lr"] = 0.02 * 0.25
    for t in range(4, 8):
        train_step(plain_model, plain_opt, t)
    plain_opt.param_groups[0]["lr"] = 0.02
    for t in range(8, 13):
        train_step(plain_model, plain_opt, t)
    assert same_params(params_of(model), params_of(plain_model))


def test_a_scheduler_in_also_is_restored_with_the_optimizer():
    model, opt = make("torch")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    guard = mo.Rewind(opt, model=model, also=[sched], every=4)
    for t in range(1, 7):
        loss = train_step(model, opt, t)
        sched.step()
        if t == 4:
            at4 = (sched.state_dict(), opt.param_groups[0]["lr"])
        guard.step(torch.tensor(math.nan) if t == 5 else loss)
    for t in range(7, 9):
        train_step(model, opt, t)
        sched.step()
        event = guard.step(torch.tensor(1.0))
    assert event is not None and event.restored_to == 4
    assert sched.state_dict() == at4[0] and opt.param_groups[0]["lr"] == at4[1]


# --- memory -------------------------------------------------------------------------------------------------
def test_snapshot_bytes_are_the_parameters_and_the_optimizer_state():
    model, opt = make("torch")  # torch's AdamW: exp_avg, exp_avg_sq (parameter-sized) and a 0-d step per parameter
    guard = mo.Rewind(opt, model=model, every=2)
    n_params = sum(p.numel() for p in model.parameters())
    assert guard.snapshot_bytes() == {"params": 4 * n_params, "optimizer": 0, "total": 4 * n_params}
    for t in range(1, 3):
        guard.step(train_step(model, opt, t))
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state_dict()["state"].values() for v in s.values())
    assert state_bytes == 4 * (2 * n_params + len(list(model.parameters())))
    assert guard.snapshot_bytes() == {"params": 4 * n_params, "optimizer": state_bytes, "total": 4 * n_params + state_bytes}


# --- state_dict -------------------------------------------------------------------------------------------
def test_state_dict_round_trip_resumes_as_the_uninterrupted_run_would():
    def loop(model, opt, guard, upto):
        while guard.batches_seen < upto:
            loss = train_step(model, opt, guard.batches_seen + 1)
            guard.step(torch.tensor(math.nan) if guard.batches_seen + 1 in (7, 23) else loss)

    model, opt = make("zclip")
    guard = mo.Rewind(opt, model=model, every=5, loss_z=3.0, window=8, min_count=4)
    loop(model, opt, guard, 13)  # one rewind (batch 7) made; saved between two checks
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "guard": guard.state_dict()}, buf)
    loop(model, opt, guard, 40)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, opt2 = make("zclip", seed=1)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    guard2 = mo.Rewind(opt2, model=model2, every=5, loss_z=3.0, window=8, min_count=4)
    guard2.load_state_dict(ckpt["guard"])
    assert guard2.rewinds == guard.rewinds[: len(guard2.rewinds)] and len(guard2.rewinds) == 1
    loop(model2, opt2, guard2, 40)
    assert guard2.rewinds == guard.rewinds and len(guard.rewinds) == 2
    assert (guard2.steps_done, guard2.batches_seen) == (guard.steps_done, guard.batches_seen)
    assert same_params(params_of(model2), params_of(model))
    assert same_state(opt2.state_dict(), opt.state_dict())


def test_a_pending_trigger_survives_the_state_dict():
    model, opt = make("modular")
    guard = mo.Rewind(opt, model=model, every=10)
    for t in range(1, 5):
        guard.step(torch.tensor(math.nan) if t == 3 else train_step(model, opt, t))
    sd = guard.state_dict()
    model2, opt2 = make("modular")
    guard2 = mo.Rewind(opt2, model=model2, every=10)
    guard2.load_state_dict(sd)
    for t in range(5, 11):
        event = guard2.step(train_step(model2, opt2, t))
    assert event is not None and (event.step, event.restored_to) == (3, 0)


def test_load_state_dict_refuses_what_does_not_fit_and_changes_nothing():
    model, opt = make("modular")
    guard = mo.Rewind(opt, model=model, every=2)
    good = guard.state_dict()
    other_model = torch.nn.Linear(3, 3)
    other = mo.Rewind(mo.Modular(other_model.parameters(), mo.Adam()), model=other_model, every=2)
    with pytest.raises(ValueError, match="the snapshot holds 4 tensors, this guard keeps 2"):
        other.load_state_dict(good)
    with pytest.raises(ValueError, match=r"'steps_done' must be an int in \[0, 2\*\*62\), got -1"):
        guard.load_state_dict({**good, "steps_done": -1})
    with pytest.raises(ValueError, match=r"windows.loss.buf must be a tensor of shape \(50,\)"):
        guard.load_state_dict({**good, "windows": {**good["windows"], "loss": {"buf": torch.zeros(3), "count": torch.tensor(0)}}})
    with pytest.raises(ValueError, match="no 'rewinds'"):
        guard.load_state_dict({k: v for k, v in good.items() if k != "rewinds"})
    assert guard.steps_done == 0 and guard.rewinds == []


def _edited(sd: dict, edit) -> dict:
    """A deep copy of a guard's state dict with `edit(copy)` applied."""
    out = copy.deepcopy(sd)
    edit(out)
    return out


def _moment(sd: dict, name: str, i: int = 0) -> dict:
    """The snapshot entry of parameter `i`'s state value whose key ends with `name`."""
    state = sd["snapshot"]["state"][i]
    return state[next(k for k in state if str(k).endswith(name))]


@pytest.mark.parametrize("kind", ["modular", "torch"])
@pytest.mark.parametrize("case, match", [
    ("moment shape", "shape|exp_avg_sq"), ("moment nan", "not finite|free of NaN"), ("moment negative", ">= 0|not finite"),
    ("param nan", "not finite"), ("lr nan", "lr"), ("lr string", "lr"), ("device", "names no device"),
    ("steps_done huge", "2\\*\\*62"),
])
def test_load_state_dict_checks_the_snapshots_values_and_changes_nothing(kind, case, match):
    model, opt = make(kind)
    guard = mo.Rewind(opt, model=model, every=2)
    for t in range(3):
        guard.step(train_step(model, opt, t))
    good = guard.state_dict()
    edits = {
        "moment shape": lambda sd: _moment(sd, "exp_avg_sq").update({"__rewind_tensor__": torch.zeros(3)}),
        "moment nan": lambda sd: _moment(sd, "exp_avg")["__rewind_tensor__"].fill_(float("nan")),
        "moment negative": lambda sd: _moment(sd, "exp_avg_sq")["__rewind_tensor__"].fill_(-1.0),
        "param nan": lambda sd: sd["snapshot"]["tensors"][0]["__rewind_tensor__"].fill_(float("nan")),
        "lr nan": lambda sd: sd["snapshot"]["groups"][0].update(lr=float("nan")),
        "lr string": lambda sd: sd["snapshot"]["groups"][0].update(lr="0.1"),
        "device": lambda sd: _moment(sd, "exp_avg").update(device="nowhere:7"),
        "steps_done huge": lambda sd: sd.update(steps_done=10**30, batches_seen=10**30),
    }
    bad = _edited(good, edits[case])
    before = copy.deepcopy(guard.state_dict())
    with pytest.raises(ValueError, match=match):
        guard.load_state_dict(bad)
    after = guard.state_dict()
    assert after["steps_done"] == before["steps_done"] and flat_state(after["snapshot"]).keys() == flat_state(before["snapshot"]).keys()
    assert all(torch.equal(a, b) for a, b in zip(flat_state(after["snapshot"]).values(), flat_state(before["snapshot"]).values())
               if isinstance(a, torch.Tensor))


def test_a_snapshot_of_an_sgd_pipeline_is_refused_by_an_adam_guard():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    sgd = mo.Modular(model.parameters(), mo.SGD(lr=0.1, momentum=0.9))
    g1 = mo.Rewind(sgd, model=model, every=1)
    x = torch.randn(8, 4)
    sgd.zero_grad(); model(x).pow(2).mean().backward(); sgd.step(); g1.step(torch.tensor(1.0))
    adam = mo.Modular(model.parameters(), mo.Adam())
    g2 = mo.Rewind(adam, model=model, every=1)
    with pytest.raises(ValueError, match="belongs to no transform|differs|snapshot"):
        g2.load_state_dict(g1.state_dict())


T = "__rewind_tensor__"
META_INT = lambda: torch.zeros((), dtype=torch.int64, device="meta")  # noqa: E731
TAMPERED = {  # a damaged or edited guard state, and what its refusal names
    "pending code complex": (lambda sd: sd["pending"].update(code=torch.tensor(1 + 1j)), "pending.code"),
    "pending code float": (lambda sd: sd["pending"].update(code=torch.tensor(5.5)), "pending.code"),
    "pending code not a trigger": (lambda sd: sd["pending"].update(code=torch.tensor(7 * 4)), "pending.code 28 is no trigger"),
    "pending value on meta": (lambda sd: sd["pending"].update(value=torch.empty((), device="meta")), "pending.value"),
    "window buf complex": (lambda sd: sd["windows"]["loss"].update(buf=torch.zeros(50, dtype=torch.complex64)),
                           "windows.loss.buf must be a floating-point"),
    "window buf on meta": (lambda sd: sd["windows"]["loss"].update(buf=torch.zeros(50, device="meta")), "windows.loss.buf"),
    "window buf nan": (lambda sd: sd["windows"]["loss"]["buf"].fill_(float("nan")), "windows.loss.buf holds a value"),
    "window count on meta": (lambda sd: sd["windows"]["grad_norm"].update(count=META_INT()), "windows.grad_norm.count"),
    "window count bool": (lambda sd: sd["windows"]["loss"].update(count=torch.tensor(True)), "windows.loss.count"),
    "window count negative": (lambda sd: sd["windows"]["loss"].update(count=torch.tensor(-5)), "count must be >= 0"),
    "snapshot window on meta": (lambda sd: sd["snapshot"]["windows"]["loss"].update(buf=torch.zeros(50, device="meta")),
                                "snapshot.windows.loss.buf"),
    "snapshot skipped_steps on meta": (lambda sd: sd["snapshot"].update(skipped_steps=META_INT()), "snapshot.skipped_steps"),
    "snapshot skipped_steps float": (lambda sd: sd["snapshot"].update(skipped_steps=torch.tensor(1.5)),
                                     "snapshot.skipped_steps"),
    "snapshot parameter on meta": (lambda sd: sd["snapshot"]["tensors"][0].update({T: torch.empty(8, 4, device="meta")}),
                                   "snapshot entry tensors.0"),
    "snapshot step a bool": (lambda sd: sd["snapshot"].update(step=True), "snapshot.step"),
    "snapshot lr negative": (lambda sd: sd["snapshot"]["groups"][0].update(lr=-1.0),
                             "Rewind.load_state_dict: snapshot param group 0.*'lr' = -1.0"),
    "rewind record": (lambda sd: sd["rewinds"].append({"step": "3", "batch": 1, "trigger": "boom", "checked_at": 1,
                                                      "restored_to": 0, "skipped": [1, 2], "attempt": 1}), "rewinds\\[1\\]"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_tampered_state_is_refused_whole_and_the_guard_goes_on(case):
    """Every part is checked before the first assignment: a refused load leaves the guard as it was and
    usable (no "interrupted partway" afterwards), its state dict bit for bit."""
    model, opt = make("zclip")
    guard = mo.Rewind(opt, model=model, every=2)
    for t in range(1, 4):
        guard.step(torch.tensor(math.nan) if t == 2 else train_step(model, opt, t))
    edit, match = TAMPERED[case]
    bad = _edited(guard.state_dict(), edit)
    before = leaves(guard.state_dict())
    with pytest.raises(ValueError, match=match):
        guard.load_state_dict(bad)
    after = leaves(guard.state_dict())  # (raises when the guard was left holding parts of two states)
    assert_same_values(after, before)
    guard.step(train_step(model, opt, 4))


def leaves(v, path: str = "") -> dict:
    """Every value of a nested state (dicts, lists, tuples), by path; tensors cloned."""
    if isinstance(v, dict):
        return {k: x for key, item in v.items() for k, x in leaves(item, f"{path}/{key}").items()}
    if isinstance(v, (list, tuple)):
        return {k: x for i, item in enumerate(v) for k, x in leaves(item, f"{path}/{i}").items()}
    return {path: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)}


def assert_same_values(after: dict, before: dict) -> None:
    """Two `leaves` hold the same keys and values, bit for bit (NaN where NaN was)."""
    assert after.keys() == before.keys()
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(after[k], v, rtol=0, atol=0, equal_nan=True, msg=k)
        else:
            assert after[k] == v, k


@pytest.mark.parametrize("where", ["closure", "pre-hook"])
def test_a_step_that_raises_leaves_the_learning_rate_uncut(where):
    """The cut is undone as the exception leaves `opt.step()`: a scheduler stepping between the failed step
    and the next reads the lr it set, and the failed step is not one of the lowered ones."""
    model, opt = make("modular")
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    guard = mo.Rewind(opt, model=model, every=2, lr_factor=0.25, lr_steps=2)
    for t in range(1, 5):  # a rewind at step 4 (batch 3 was non-finite)
        train_step(model, opt, t)
        sched.step()
        event = guard.step(torch.tensor(math.nan) if t == 3 else torch.tensor(1.0))
    assert event is not None and guard.lowered_steps_left == 2
    lr = opt.param_groups[0]["lr"]
    if where == "pre-hook":
        handle = opt.register_step_pre_hook(lambda *_: 1 / 0)  # (runs after the guard's cut)
    with pytest.raises(ZeroDivisionError):
        opt.step(lambda: 1 / 0) if where == "closure" else opt.step()
    if where == "pre-hook":
        handle.remove()
    assert opt.param_groups[0]["lr"] == lr and guard.lowered_steps_left == 2
    sched.step()
    assert opt.param_groups[0]["lr"] == lr * 0.5
    seen = []
    opt.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    train_step(model, opt, 5)
    assert seen == [lr * 0.5 * 0.25] and opt.param_groups[0]["lr"] == lr * 0.5 and guard.lowered_steps_left == 1


def test_the_step_wrapper_keeps_schedulers_working_pickles_and_is_removed():
    model, opt = make("modular")
    guard = mo.Rewind(opt, model=model, every=2, lr_factor=0.5, lr_steps=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # wraps the guard's step in turn
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")  # no "optimizer.step() has been overridden" warning
        train_step(model, opt, 1)
        sched.step()
    copy.deepcopy(opt)
    other_model, other = make("modular")
    g2 = mo.Rewind(other, model=other_model, lr_factor=0.5, lr_steps=2)
    assert "step" in other.__dict__
    again = __import__("pickle").loads(__import__("pickle").dumps(other))  # (a scheduler's wrapper does not pickle)
    again.step()
    g2.remove()
    assert "step" not in other.__dict__


@pytest.mark.parametrize("loss, error, match", [
    (torch.tensor(1 + 1j), TypeError, "complex64"),
    (1j, TypeError, "got complex"),
    (True, TypeError, "got a bool"),
    (10**400, ValueError, "int of 401 digits, which cannot be represented as a finite float64"),
    ("1.0", TypeError, "got str"),
], ids=["complex tensor", "complex", "bool", "10**400", "str"])
def test_a_loss_that_is_not_one_real_number_is_refused_before_anything_changes(loss, error, match):
    import numpy as np

    model, opt = make("modular")
    guard = mo.Rewind(opt, model=model, every=2)
    guard.step(train_step(model, opt, 1))
    before = leaves(guard.state_dict())
    with pytest.raises(error, match="Rewind.step: the loss .*" + match):
        guard.step(loss)
    with pytest.raises(error, match="Rewind.step: the grad norm .*" + match):
        guard.step(torch.tensor(1.0), grad_norm=loss)
    assert guard.steps_done == 1
    assert_same_values(leaves(guard.state_dict()), before)
    for ok in (np.float32(1.0), np.array([2.0]), np.int64(3), np.float64(1.5)):  # real NumPy values count
        guard.step(ok)
    assert guard.steps_done == 5


# --- doors -----------------------------------------------------------------------------------------------------
def test_settings_are_validated_naming_the_field():
    model, opt = make("modular")
    with pytest.raises(pydantic.ValidationError, match="every"):
        mo.Rewind(opt, every=0)
    with pytest.raises(pydantic.ValidationError, match="min_count \\(30\\) must be <= window \\(10\\)"):
        mo.Rewind(opt, window=10, min_count=30)
    with pytest.raises(pydantic.ValidationError, match="lr_factor"):
        mo.Rewind(opt, lr_factor=2.0)
    with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
        mo.Rewind(opt, evry=3)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        mo.Rewind(model)
    guard = mo.Rewind(opt)
    with pytest.raises(TypeError, match="pass the step's loss"):
        guard.step(None)
    with pytest.raises(ValueError, match="loss must be a single number, got a tensor of shape \\(2,\\)"):
        guard.step(torch.ones(2))


# --- host syncs ------------------------------------------------------------------------------------------------
def test_one_host_read_per_check_and_none_between():
    model, opt = make("modular")
    guard = mo.Rewind(opt, model=model, every=4, grad_norm_z=6.0, min_count=2, window=4)
    counts = []
    for t in range(1, 17):
        loss = train_step(model, opt, guard.batches_seen + 1)
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        with Syncs() as s:
            guard.step(torch.tensor(math.nan) if t == 6 else loss, grad_norm=norm)
        counts.append(s.n)
    assert len(guard.rewinds) == 1  # the check at step 8 rewound (and read once, like the others)
    assert counts == [0, 0, 0, 1] * 4


# --- modopt run: train.rewind -----------------------------------------------------------------------------------
SPIKE_BATCH = 23


def experiment(rewind: dict | None, steps: int = 40):
    train = {"steps": steps, "batch_size": 16, "checkpoint_every": 0}
    if rewind is not None:
        train["rewind"] = rewind
    return experiment_from_data({
        "name": "rewind-test",
        "task": {"name": "teacher_student", "options": {"noise_df": 100.0}},  # near-Gaussian noise: no natural spikes
        "optimizer": {"transforms": [{"type": "ClipNorm", "max_norm": 5.0}, {"type": "Adam", "lr": 0.01}]},
        "train": train, "output": {"plots": False},
    }, "test")


def planted(schedule=None):
    """`make_task` whose batch number SPIKE_BATCH has its targets x 1000; with `schedule`, step t gets batch
    schedule[t - 1] (a run that never sees the batches left out of it)."""
    def make(name, options, seed, trust_imports=False):
        task = make_task(name, options, seed, trust_imports)
        clean = task.get_batch

        def get_batch(step, batch_size):
            n = schedule[step - 1] if schedule is not None else step
            x, y = clean(n, batch_size)
            return (x, y * 1000.0) if n == SPIKE_BATCH else (x, y)

        task.get_batch = get_batch
        return task
    return make


def run(tmp_path, name, exp, monkeypatch, make, **kw):
    monkeypatch.setattr(run_mod, "make_task", make)
    logs = []
    summary = run_mod.run_experiment(exp, tmp_path / name, progress=False, log=logs.append, **kw)
    ckpt = torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return summary, ckpt, rows, logs


def test_modopt_run_rewinds_past_a_planted_spike_and_equals_a_run_that_never_saw_those_batches(tmp_path, monkeypatch):
    rewind = {"every": 10, "window": 10, "min_count": 5}
    summary, ckpt, rows, logs = run(tmp_path, "guarded", experiment(rewind), monkeypatch, planted())
    assert summary["rewinds"] == [{"step": 23, "batch": 23, "trigger": "loss spike", "checked_at": 30, "restored_to": 20,
                                   "skipped": [21, 30], "attempt": 1}]
    assert "rewind: loss spike at step 23 (batch 23), back to step 20, batches 21-30 skipped" in logs
    assert [r["step"] for r in rows] == list(range(1, 41))
    schedule = [*range(1, 21), *range(31, 51)]
    assert [r["batch"] for r in rows] == schedule and SPIKE_BATCH not in schedule
    assert ckpt["rewind"]["rewinds"] == summary["rewinds"]

    # the same run without the guard, fed the batches the guarded run kept: the same parameters, bit for bit
    plain, plain_ckpt, plain_rows, _ = run(tmp_path, "plain", experiment(None), monkeypatch, planted(schedule))
    assert "rewinds" not in plain
    assert plain_ckpt["model"].keys() == ckpt["model"].keys()
    assert all(torch.equal(plain_ckpt["model"][k], ckpt["model"][k]) for k in ckpt["model"])
    assert same_state(optimizer_math(plain_ckpt["optimizer"]), optimizer_math(ckpt["optimizer"]))
    assert [r["loss"] for r in plain_rows] == [r["loss"] for r in rows]

    # and without the guard the spike goes into the parameters
    spiked, spiked_ckpt, _, _ = run(tmp_path, "spiked", experiment(None), monkeypatch, planted())
    assert not all(torch.equal(spiked_ckpt["model"][k], ckpt["model"][k]) for k in ckpt["model"])


def test_modopt_run_resumed_across_a_rewind_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    rewind = {"every": 10, "window": 10, "min_count": 5}
    whole, whole_ckpt, whole_rows, _ = run(tmp_path, "whole", experiment(rewind), monkeypatch, planted())
    exp = experiment(rewind).model_copy(update={"train": experiment(rewind).train.model_copy(update={"checkpoint_every": 5})})
    monkeypatch.setattr(run_mod, "make_task", planted())
    with pytest.raises(run_mod.RunInterrupted):  # killed after step 25: the spike (23) seen, the check (30) not yet run
        run_mod.run_experiment(exp, tmp_path / "cut", progress=False, log=lambda *_: None, stop_after=25)
    assert torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["rewind"]["pending"]["code"] == 23 * 4 + 2
    summary, ckpt, rows, _ = run(tmp_path, "cut", exp, monkeypatch, planted(), resume=True)
    assert summary["rewinds"] == whole["rewinds"] and len(whole["rewinds"]) == 1
    assert all(torch.equal(ckpt["model"][k], whole_ckpt["model"][k]) for k in ckpt["model"])
    assert [r["loss"] for r in rows] == [r["loss"] for r in whole_rows]


def test_modopt_run_refuses_a_bad_rewind_config_naming_the_field():
    with pytest.raises(ConfigError, match="train.rewind.every"):
        experiment({"every": 0})
    with pytest.raises(ConfigError, match="train.rewind.wehre"):
        experiment({"wehre": "cpu"})


def test_a_resume_without_the_guards_checkpoint_entry_is_refused(tmp_path, monkeypatch):
    run(tmp_path, "r", experiment(None, steps=6), monkeypatch, planted())
    exp = experiment({"every": 3}, steps=12)
    (tmp_path / "r" / "config.yaml").write_text(exp.to_yaml())
    with pytest.raises(ConfigError, match="checkpoint.pt: no 'rewind' entry, and config.yaml sets train.rewind"):
        run_mod.run_experiment(exp, tmp_path / "r", resume=True, progress=False, log=lambda *_: None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", ["cpu", "device"])
def test_cuda_snapshots_restore_bit_for_bit_with_one_read_per_check(where):  # pragma: no cover - CPU CI
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).cuda()
    opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(lr=0.01))
    guard = mo.Rewind(opt, model=model, every=3, where=where)
    counts = []
    for t in range(1, 7):
        opt.zero_grad()
        loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
        if t == 3:
            saved = (params_of(model), flat_state(opt.state_dict()))
        with Syncs() as s:
            guard.step(torch.tensor(math.nan, device="cuda") if t == 5 else loss.detach())
        counts.append(s.n)
    assert counts == [0, 0, 1, 0, 0, 1] and guard.steps_done == 3
    assert same_params(params_of(model), saved[0])
    now = flat_state(opt.state_dict())
    assert all(torch.equal(now[k], saved[1][k]) if isinstance(now[k], torch.Tensor) else now[k] == saved[1][k] for k in now)


def test_the_terminal_summary_lists_the_rewinds():
    from modopt.cli import _format_summary

    base = {"run_dir": "r", "steps": 50, "final_loss": 1.0, "final_loss_window": 20, "best_loss": 0.5,
            "loss_spikes": 0, "clipped_pct": 0.0, "skipped_steps": 0, "time_per_step_ms": 1.0}
    rewinds = [{"step": 23 + i, "batch": 23 + i, "trigger": "loss spike", "checked_at": 30, "restored_to": 20,
                "skipped": [21 + 10 * i, 30 + 10 * i], "attempt": 1 + i} for i in range(7)]
    assert "rewinds" not in _format_summary(base)
    line = _format_summary({**base, "rewinds": rewinds}).splitlines()[-1]
    assert line.startswith("rewinds:      7 (70 batches skipped): step 23 (loss spike) -> back to 20, batches 21-30")
    assert line.endswith("; ... (+2 more, all in summary.json)")
    assert _format_summary({**base, "rewinds": []}).splitlines()[-1] == "rewinds:      0 (0 batches skipped)"


# --- a step interrupted partway (issue 38 item 10; docs/reliability.md, "A step that is interrupted") ------------
class _InterruptAt:
    """Raise KeyboardInterrupt at the `k`-th in-place (mutating) tensor op while active, as a Ctrl-C would
    land between two ops (Python delivers SIGINT between any two bytecodes); `n` counts the ops seen."""

    def __init__(self, k: int | None):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func._schema.is_mutable:
                    outer.n += 1
                    if outer.n == outer.k:
                        raise KeyboardInterrupt
                return func(*args, **(kwargs or {}))

        self.k, self.n, self.mode = k, 0, Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def everything(model, opt) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})


def same_everything(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and same_state(a["optimizer"], b["optimizer"])


def backward(model, opt, t: int) -> None:
    x, y = batch(t)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _raises_in(where: str, opt):
    """Make the next `opt.step()` raise KeyboardInterrupt from `where`: `(closure to pass or None, handle or None)`."""
    def interrupt(*_):
        raise KeyboardInterrupt
    if where == "closure":
        return interrupt, None
    return None, {"pre-hook": opt.register_step_pre_hook, "tap": opt.add_step_tap}[where](interrupt)


@pytest.mark.parametrize("where", ["closure", "pre-hook", "tap"])
def test_an_interrupt_before_the_transforms_run_changes_nothing(where):
    """Raised by the closure, a step pre-hook or a step tap (telemetry): parameters and every state value as
    before, so the step can simply be taken again; it then equals the uninterrupted step bit for bit."""
    model, opt = make("zclip")
    for t in range(4):
        train_step(model, opt, t)
    straight_model, straight_opt = make("zclip")
    for t in range(5):
        train_step(straight_model, straight_opt, t)
    backward(model, opt, 4)
    before = everything(model, opt)
    closure, handle = _raises_in(where, opt)
    with pytest.raises(KeyboardInterrupt):
        opt.step(closure)
    assert same_everything(everything(model, opt), before)
    if handle is not None:
        handle.remove()
    backward(model, opt, 4)
    opt.step()
    assert same_everything(everything(model, opt), everything(straight_model, straight_opt))


def test_an_interrupt_between_two_transforms_leaves_half_a_step():
    """What is not promised, pinned so the docs stay true: interrupted after Momentum and before SGD writes
    the parameters (at the step's last in-place op, SGD's write), the momentum buffers have advanced and the
    parameters have not moved."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = mo.Modular(model.parameters(), mo.Momentum(0.9), mo.SGD(lr=0.1))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()
    opt.zero_grad()
    model(torch.randn(4, 3)).pow(2).mean().backward()
    before = everything(model, opt)
    with _InterruptAt(None) as count:  # the in-place ops of one step
        opt.step()
    model.load_state_dict(before["model"])
    opt.load_state_dict(before["optimizer"])
    with pytest.raises(KeyboardInterrupt), _InterruptAt(count.n):
        opt.step()
    after = everything(model, opt)
    assert all(torch.equal(after["model"][k], before["model"][k]) for k in before["model"])
    assert not same_state(after["optimizer"], before["optimizer"])


def test_an_interrupt_at_any_op_of_a_step_is_undone_by_reloading_the_last_checkpoint():
    """Interrupted at each in-place op of a ZClip -> Adam step in turn: some leave half a step (not promised
    whole-or-nothing), and loading the checkpoint taken before the step (model and optimizer, into the same
    objects) and taking the step again always gives the uninterrupted step, bit for bit."""
    model, opt = make("zclip")
    for t in range(4):
        train_step(model, opt, t)
    checkpoint = everything(model, opt)
    backward(model, opt, 4)
    with _InterruptAt(None) as count:
        opt.step()
    want = everything(model, opt)
    half = 0
    for k in range(1, count.n + 1):
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        backward(model, opt, 4)
        with pytest.raises(KeyboardInterrupt), _InterruptAt(k):
            opt.step()
        half += not same_everything(everything(model, opt), checkpoint)
        model.load_state_dict(checkpoint["model"])  # the recovery the docs give
        opt.load_state_dict(checkpoint["optimizer"])
        train_step(model, opt, 4)
        assert same_everything(everything(model, opt), want), f"interrupted at op {k} of {count.n}"
    assert 0 < half < count.n  # the first ops write nothing the optimizer keeps; later ones leave half a step


def test_modopt_run_interrupted_in_the_middle_of_a_step_resumes_to_the_uninterrupted_run(tmp_path, monkeypatch):
    """Ctrl-C inside step 27's optimizer step (after the planted spike at 23, before the guard's check at 30;
    checkpoints every 5 steps): exit 130, and --resume redoes steps 26.. from the checkpoint of step 25. The
    run directory then equals the uninterrupted run's: metrics.jsonl byte for byte, the parameters and the
    rewind bit for bit."""
    from modopt.cli import main
    from modopt.core import runner as driver  # (the step driver: Modular.step runs the chain through it)

    rewind = {"every": 10, "window": 10, "min_count": 5}
    base = experiment(rewind)
    exp = base.model_copy(update={"train": base.train.model_copy(update={"checkpoint_every": 5})})
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(exp.to_yaml())
    monkeypatch.setattr(run_mod, "make_task", planted())
    flags = ["--quiet", "--no-plots"]
    assert main(["run", str(cfg), "--out", str(tmp_path / "whole"), *flags]) == 0

    calls, real = [0], driver.run_step

    def interrupted(*a, **kw):
        calls[0] += 1
        if calls[0] != 27:
            return real(*a, **kw)
        with _InterruptAt(3):  # gradients clipped, Adam's step count advanced, its moments and the parameters not
            return real(*a, **kw)

    monkeypatch.setattr(driver, "run_step", interrupted)
    assert main(["run", str(cfg), "--out", str(tmp_path / "cut"), *flags]) == 130
    assert calls[0] == 27
    assert torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["step"] == 25
    monkeypatch.setattr(driver, "run_step", real)
    assert main(["run", "--resume", str(tmp_path / "cut"), *flags]) == 0
    assert (tmp_path / "cut" / "metrics.jsonl").read_bytes() == (tmp_path / "whole" / "metrics.jsonl").read_bytes()
    whole, cut = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=True) for d in ("whole", "cut"))
    assert all(torch.equal(cut["model"][k], whole["model"][k]) for k in whole["model"])
    assert cut["rewind"]["rewinds"] == whole["rewind"]["rewinds"] and len(whole["rewind"]["rewinds"]) == 1


def test_a_snapshot_cut_short_stops_the_guard_until_a_checkpoint_is_reloaded():
    """An exception (here KeyboardInterrupt) while a snapshot is refilled leaves its buffers holding two steps:
    the guard then refuses to step or be saved (a rewind to that mix would corrupt the model silently); after
    the checkpoint is reloaded the run goes on as the uninterrupted one, bit for bit."""
    def run(steps, model, opt, guard, start=0, cut=None):
        for t in range(start, steps):
            loss = train_step(model, opt, t)
            if t == cut:
                return guard.step(loss)
            guard.step(loss)

    straight = make("zclip")
    straight_guard = mo.Rewind(straight[1], model=straight[0], every=3)
    run(9, *straight, straight_guard)

    model, opt = make("zclip")
    guard = mo.Rewind(opt, model=model, every=3)
    run(4, model, opt, guard)
    checkpoint = everything(model, opt), guard.state_dict()
    put = guard._bufs.put

    def cut_short(path, src):
        if path == ("tensors", 2):
            raise KeyboardInterrupt
        return put(path, src)

    guard._bufs.put = cut_short
    with pytest.raises(KeyboardInterrupt):
        run(6, model, opt, guard, start=4, cut=5)  # the check of step 6 refreshes the snapshot
    bufs = guard._bufs.bufs
    assert torch.equal(bufs[("tensors", 0)], model[0].weight) and not torch.equal(bufs[("tensors", 2)], model[2].weight)
    with pytest.raises(RuntimeError, match="the last snapshot was interrupted partway .the snapshot's buffers hold parts"):
        run(7, model, opt, guard, start=6)
    with pytest.raises(RuntimeError, match="Rewind.state_dict: the last snapshot was interrupted"):
        guard.state_dict()
    guard._bufs.put = put
    model.load_state_dict(checkpoint[0]["model"])
    opt.load_state_dict(checkpoint[0]["optimizer"])
    guard.load_state_dict(checkpoint[1])
    run(9, model, opt, guard, start=4)
    assert same_everything(everything(model, opt), everything(*straight))
    assert guard.snapshot_step == straight_guard.snapshot_step == 9


def test_a_rewind_cut_short_stops_the_guard(monkeypatch):
    """Cut short while it puts the optimizer state back (the parameters already restored), a rewind leaves
    a model of one step and an optimizer of another: the guard refuses to go on and names the recovery."""
    from modopt import rewind as rewind_mod

    model, opt = make()
    guard = mo.Rewind(opt, model=model, every=2)
    for t in range(3):
        guard.step(train_step(model, opt, t))

    def interrupted(v):
        raise KeyboardInterrupt

    monkeypatch.setattr(rewind_mod, "_live_value", interrupted)
    train_step(model, opt, 3)
    with pytest.raises(KeyboardInterrupt):
        guard.step(torch.tensor(math.nan))  # the check of step 4 rewinds to step 2
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=r"Rewind.step: the last rewind was interrupted partway .*reload the last checkpoint"):
        guard.step(train_step(model, opt, 4))
