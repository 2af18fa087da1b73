"""The telemetry history (modopt.telemetry): rows against values computed
independently, the ring buffer, checkpoints, per-module norms, summaries, bad input, and the host
syncs of N steps (exactly one transfer per read-back, none in between)."""

from __future__ import annotations

import io
import math

import pytest
import torch

import modopt as mo
from modopt.telemetry import History, JsonlSink

from checks import _sync_ops


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batches(n, seed=1, spike_at=(), nan_at=()):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        x = torch.randn(7, 5, generator=g)
        if i in spike_at:
            x = x * 50
        yield i, x, i in nan_at


def train(model, opt, n, history=None, seed=1, spike_at=(), nan_at=(), keep=None):
    """n steps; `keep` collects what an independent observer sees of each step's gradients."""
    for i, x, bad in batches(n, seed, spike_at, nan_at):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        if bad:
            next(model.parameters()).grad[0, 0] = float("nan")
        if keep is not None:
            keep.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        if history is not None:
            history.note(loss=loss.detach())
        opt.step()


# --- what a row holds -----------------------------------------------------------------------------


def test_rows_equal_an_independent_computation():
    model = make_model()
    max_norm = 0.5
    opt = mo.Modular(model.named_parameters(), mo.ClipNorm(max_norm), mo.Adam(lr=1e-2))
    h = History.attach(opt, capacity=32)
    seen: list = []
    train(model, opt, 8, h, spike_at=(3, 6), keep=seen)
    rows = h.read()
    assert [r["step"] for r in rows] == list(range(1, 9))
    clipped_so_far = 0
    for r, grads in zip(rows, seen):
        ref = torch.nn.utils.get_total_norm(list(grads.values()), 2.0)  # torch's own total norm
        assert r["grad_norm"] == float(ref)
        assert r["0:ClipNorm/norm"] == float(ref)  # the clip saw the same norm
        scale = min(1.0, max_norm / (float(ref) + 1e-6))
        assert r["clip_scale"] == pytest.approx(scale, rel=1e-6)
        assert r["post_clip_norm"] == pytest.approx(float(ref) * scale, rel=1e-6)
        assert r["clipped"] == float(scale < 1) == r["0:ClipNorm/clipped"]
        clipped_so_far += scale < 1
        assert r["clipped_steps"] == clipped_so_far
        assert r["skipped"] == r["nonfinite"] == 0.0 and r["skipped_steps"] == 0.0
    assert clipped_so_far >= 2  # the two spikes at least


def test_a_nonfinite_step_is_flagged_counted_and_has_no_post_clip_norm():
    model = make_model()
    opt = mo.Modular(model.named_parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    h = History.attach(opt, capacity=8)
    train(model, opt, 5, h, nan_at=(1, 3))
    rows = h.read()
    assert [r["skipped"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert [r["nonfinite"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert [r["nonfinite_steps"] for r in rows] == [0.0, 1.0, 1.0, 2.0, 2.0]
    assert [r["skipped_steps"] for r in rows] == [0.0, 1.0, 1.0, 2.0, 2.0]
    assert math.isnan(rows[1]["grad_norm"]) and rows[1]["post_clip_norm"] == 0.0


def test_a_step_the_host_skips_has_no_transform_columns():
    """With a transform that needs the host's decision, a skipped step runs no transform: its row holds
    the step's own values and not the transforms' (no made-up NaNs)."""
    from checks import needs_the_host

    model = make_model()
    opt = mo.Modular(model.named_parameters(), needs_the_host(), mo.ClipNorm(1.0), mo.SGD(lr=0.1))
    h = History.attach(opt, capacity=8)
    train(model, opt, 3, h, nan_at=(1,))
    rows = h.read()
    assert "1:ClipNorm/norm" in rows[0] and "1:ClipNorm/norm" not in rows[1] and "1:ClipNorm/norm" in rows[2]
    assert rows[1]["skipped"] == 1.0 and rows[1]["skipped_steps"] == 1.0


def test_per_segment_telemetry_becomes_one_column_per_segment():
    model = make_model()
    opt = mo.Modular(model.named_parameters(), mo.ClipNorm(0.1, scope="tensor"), mo.SGD(lr=0.1))
    h = History.attach(opt, capacity=4)
    seen: list = []
    train(model, opt, 2, h, keep=seen)
    row = h.read()[-1]
    norms = [row[f"0:ClipNorm/norm[{i}]"] for i in range(4)]
    assert norms == [float(torch.linalg.vector_norm(g)) for g in seen[-1].values()]
    assert "0:ClipNorm/norm" not in row


def test_noted_values_land_in_their_step_row():
    model = make_model()
    opt = mo.Modular(model.named_parameters(), mo.SGD(lr=0.1))
    h = History.attach(opt, capacity=4)
    for i in range(3):
        opt.zero_grad()
        model(torch.ones(2, 5)).sum().backward()
        h.note(loss=torch.tensor(float(i)), tokens=10 * i)
        opt.step()
    assert [(r["loss"], r["tokens"]) for r in h.read()] == [(0.0, 0.0), (1.0, 10.0), (2.0, 20.0)]


# --- per-module norms --------------------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Linear(8, 8))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.enc(x)))


@pytest.mark.parametrize("depth,modules", [(1, ["enc", "head"]), (2, ["enc.0", "enc.1", "head"])])
@pytest.mark.parametrize("nonfinite", ["skip", "ignore"])
def test_module_norms_equal_the_norm_of_the_modules_gradients(depth, modules, nonfinite):
    model = Net()
    opt = mo.Modular(model.named_parameters(), mo.ClipNorm(1.0), mo.SGD(lr=0.1), nonfinite=nonfinite)
    h = History.attach(opt, capacity=4, module_depth=depth)
    seen: list = []
    train(model, opt, 2, h, keep=seen)
    row = h.read()[-1]
    assert sorted(k for k in row if k.startswith("module_norm/")) == [f"module_norm/{m}" for m in modules]
    for m in modules:
        mine = [g.reshape(-1).double() for n, g in seen[-1].items() if mo.telemetry.module_of(n, depth) == m]
        assert row[f"module_norm/{m}"] == pytest.approx(float(torch.linalg.vector_norm(torch.cat(mine))), rel=1e-6)


def test_module_norms_reuse_the_steps_norms(monkeypatch):
    """Under the default non-finite check the per-tensor norms come from the step's memo: one norm
    pass a step with the history on, as without it; under nonfinite='ignore' one pass, which the
    following global ClipNorm reads from the memo in turn."""
    from modopt.core import reduce

    calls = []
    real = reduce.any_pnorms
    monkeypatch.setattr(reduce, "any_pnorms", lambda *a: calls.append(1) or real(*a))
    for nonfinite in ("skip", "ignore"):
        for on in (False, True):
            model = Net()
            opt = mo.Modular(model.named_parameters(), mo.ClipNorm(1.0), mo.SGD(lr=0.1), nonfinite=nonfinite)
            if on:
                History.attach(opt, capacity=4, module_depth=1)
            calls.clear()
            train(model, opt, 3)
            assert len(calls) == 3, (nonfinite, on)


def test_module_depth_needs_names():
    opt = mo.Modular(make_model().parameters(), mo.SGD(lr=0.1))
    with pytest.raises(ValueError, match="module_depth.*named_parameters"):
        History.attach(opt, module_depth=1)
    model = make_model()
    opt = mo.Modular(model.parameters(), mo.SGD(lr=0.1))
    h = History.attach(opt, module_depth=1, names=model.named_parameters())  # names given apart (HF Trainer)
    train(model, opt, 1, h)
    assert sorted(k for k in h.read()[0] if k.startswith("module_norm/")) == ["module_norm/0", "module_norm/2"]


# --- the ring buffer, windows and summaries ------------------------------------------------------


def run_rows(capacity, n=11, **kw):
    model = make_model()
    opt = mo.Modular(model.named_parameters(), mo.ClipNorm(0.3), mo.Adam(lr=1e-2))
    h = History.attach(opt, capacity=capacity, **kw)
    train(model, opt, n, h, spike_at=(4, 8))
    return h


def test_the_ring_keeps_the_last_capacity_rows():
    full, ring = run_rows(32).read(), run_rows(4)
    assert ring.read() == full[-4:]
    assert ring.read(since=9) == full[-2:]
    want = torch.tensor([r["grad_norm"] for r in full], dtype=torch.float64)
    assert torch.equal(ring.window("grad_norm"), want[-4:])  # across the wrap, oldest first
    assert torch.equal(ring.window("grad_norm", 3), want[-3:])
    assert ring.last()["grad_norm"].item() == full[-1]["grad_norm"]
    assert ring.nbytes == 4 * len(ring.columns) * 8


def test_summary_is_computed_from_the_window():
    import numpy as np

    h = run_rows(32)
    rows = h.read()[-6:]
    s = h.summary(window=6)
    assert s["steps"] == 6
    assert s["clip_fraction"] == sum(r["clipped"] for r in rows) / 6
    norms = np.array([r["grad_norm"] for r in rows])
    for q in (0.5, 0.9, 0.99):
        assert s["grad_norm_q"][q] == pytest.approx(float(np.quantile(norms, q)), rel=1e-12)
    assert s["grad_norm_max"] == norms.max()


def test_flush_delivers_each_row_once_every_n_steps():
    got = []

    class Sink:
        def write(self, rows):
            got.append([r["step"] for r in rows])

    h = run_rows(4, n=10, every=4, sinks=[Sink()])
    assert got == [[1, 2, 3, 4], [5, 6, 7, 8]]
    h.flush()
    assert got[-1] == [9, 10] and h.flush() == []


def test_rows_overwritten_before_a_flush_warn():
    h = run_rows(4, n=6)
    with pytest.warns(UserWarning, match="2 rows were overwritten"):
        assert [r["step"] for r in h.flush()] == [3, 4, 5, 6]


# --- checkpoints -----------------------------------------------------------------------------------


def resumed_rows(tmp_path, attach_first: bool):
    model = make_model()
    opt = mo.Modular(model.named_parameters(), mo.ClipNorm(0.3), mo.Adam(lr=1e-2))
    h = History.attach(opt, capacity=8, every=3, module_depth=1)
    train(model, opt, 5, h, spike_at=(2,))
    h.flush()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ck.pt")
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    model2 = make_model(seed=5)
    model2.load_state_dict(ck["model"])
    opt2 = mo.Modular(model2.named_parameters(), mo.ClipNorm(0.3), mo.Adam(lr=1e-2))
    got = []

    class Sink:
        def write(self, rows):
            got.extend(rows)

    if attach_first:
        h2 = History.attach(opt2, capacity=8, every=3, module_depth=1, sinks=[Sink()])
        opt2.load_state_dict(ck["opt"])
    else:  # the load first (HF Trainer, Lightning): the entry waits in param_groups[0]
        opt2.load_state_dict(ck["opt"])
        h2 = History.attach(opt2, capacity=8, every=3, module_depth=1, sinks=[Sink()])
    assert "modopt_telemetry" not in opt2.param_groups[0]
    train(model2, opt2, 5, h2, seed=2)
    return h2, got


@pytest.mark.parametrize("attach_first", [True, False])
def test_a_resumed_history_reports_the_rows_of_an_uninterrupted_one(tmp_path, attach_first):
    model = make_model()
    opt = mo.Modular(model.named_parameters(), mo.ClipNorm(0.3), mo.Adam(lr=1e-2))
    h = History.attach(opt, capacity=8, every=3, module_depth=1)
    train(model, opt, 5, h, spike_at=(2,))
    train(model, opt, 5, h, seed=2)
    h2, delivered = resumed_rows(tmp_path, attach_first)
    assert h2.read() == h.read()  # the last 8 rows, steps 3..10, bit for bit
    assert [r["step"] for r in delivered] == [6, 7, 8, 9]  # the cadence continues: every 3 steps of the run
    assert h2.summary(window=5) == h.summary(window=5)
    assert h2.state_dict()["count"] == 10


def test_history_state_dict_alone_round_trips(tmp_path):
    h = run_rows(4)
    torch.save(h.state_dict(), tmp_path / "h.pt")
    fresh = History(capacity=4)
    fresh.load_state_dict(torch.load(tmp_path / "h.pt", weights_only=True))
    assert fresh.read() == h.read() and fresh.columns == h.columns


def test_a_bad_history_entry_refuses_the_whole_load():
    model = make_model()
    opt = mo.Modular(model.named_parameters(), mo.SGD(lr=0.1))
    h = History.attach(opt, capacity=4)
    train(model, opt, 2, h)
    sd = opt.state_dict()
    sd["param_groups"][0]["modopt_telemetry"]["count"] = -1
    before = h.read()
    with pytest.raises(ValueError, match=r"count must be an integer in \[0, 2\*\*62\), got -1 \(nothing was changed\)"):
        opt.load_state_dict(sd)
    assert h.read() == before
    other = History(capacity=5)
    with pytest.raises(ValueError, match="capacity 4 in the checkpoint, 5 here"):
        other.load_state_dict(h.state_dict())


TAMPERED = {  # a damaged or edited history state, and what its refusal names
    "values None": (lambda sd: sd.update(values=None), r"values is None, but the history has \d+ columns and 3 rows"),
    "values on meta": (lambda sd: sd.update(values=torch.empty_like(sd["values"], device="meta")), "values must be"),
    "count 10**30": (lambda sd: sd.update(count=10**30), r"count must be an integer in \[0, 2\*\*62\)"),
    "totals inf": (lambda sd: sd["totals"].fill_(math.inf), r"totals must be whole counts in \[0, count=3\], got \[inf"),
    "totals nan": (lambda sd: sd["totals"].fill_(math.nan), "totals must be whole counts"),
    "totals negative": (lambda sd: sd["totals"].fill_(-1.0), "totals must be whole counts"),
    "totals past count": (lambda sd: sd["totals"].fill_(4.0), "totals must be whole counts"),
    "totals complex": (lambda sd: sd.update(totals=torch.zeros(2, dtype=torch.complex128)), "totals must be a floating"),
    "a held row never recorded": (lambda sd: sd["slot_plan"].__setitem__(0, -1), "the rows of steps 1..1 are held"),
    "a column twice": (lambda sd: sd["columns"].__setitem__(1, sd["columns"][0]), "columns must be a list of distinct"),
    "a column twice in a plan": (lambda sd: sd["plans"][0].__setitem__(1, sd["plans"][0][0]), "plans must be lists of distinct"),
    "a bool count": (lambda sd: sd.update(delivered=True), "delivered must be an integer"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_tampered_history_is_refused_at_the_load_with_nothing_changed(case):
    """Each of these loaded and then failed (or read wrong rows) at a later read, summary or step."""
    model = make_model()
    opt = mo.Modular(model.named_parameters(), mo.ClipNorm(0.3), mo.Adam(lr=1e-2))
    h = History.attach(opt, capacity=4)
    train(model, opt, 3, h, spike_at=(1,))
    sd = opt.state_dict()
    edit, match = TAMPERED[case]
    edit(sd["param_groups"][0]["modopt_telemetry"])
    train(model, opt, 1, h, seed=3)
    before_rows, before_opt = h.read(), opt.state_dict()
    with pytest.raises(ValueError, match=f"History.load_state_dict: {match}.*nothing was changed"):
        opt.load_state_dict(sd)
    assert h.read() == before_rows and h.count == 4
    after_opt = opt.state_dict()
    for a, b in zip(after_opt["state"].values(), before_opt["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in b)
    fresh = History(capacity=4)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(sd["param_groups"][0]["modopt_telemetry"])
    assert fresh.count == 0 and fresh.columns == [] and fresh.read() == []


@pytest.mark.parametrize("attach_first", [True, False])
def test_two_histories_on_one_optimizer_each_round_trip_their_own_state(attach_first):
    model = make_model()
    opt = mo.Modular(model.named_parameters(), mo.ClipNorm(0.3), mo.Adam(lr=1e-2))
    a = History.attach(opt, capacity=4)
    train(model, opt, 3, a)
    b = History.attach(opt, capacity=8)  # from step 4 on
    train(model, opt, 2, a, seed=2)
    assert (a.count, b.count) == (5, 2)
    sd = opt.state_dict()
    assert {"modopt_telemetry", "modopt_telemetry.1"} <= set(sd["param_groups"][0])
    m2 = make_model()
    o2 = mo.Modular(m2.named_parameters(), mo.ClipNorm(0.3), mo.Adam(lr=1e-2))
    if attach_first:
        a2, b2 = History.attach(o2, capacity=4), History.attach(o2, capacity=8)
        o2.load_state_dict(sd)
    else:  # the load first: each entry waits in param_groups[0] for its history
        o2.load_state_dict(sd)
        a2, b2 = History.attach(o2, capacity=4), History.attach(o2, capacity=8)
    assert (a2.count, b2.count) == (5, 2)
    assert a2.read() == a.read() and b2.read() == b.read()
    assert not any(k.startswith("modopt_telemetry") for k in o2.param_groups[0])
    b.detach()
    c = History.attach(opt, capacity=2)  # takes the slot b left
    assert c._entry == "modopt_telemetry.1"


# --- doors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,match", [
    ({"capacity": 0}, "capacity must be an integer >= 1"),
    ({"capacity": 2.5}, "capacity must be an integer"),
    ({"every": 0}, "every must be an integer >= 1"),
    ({"capacity": 4, "every": 5}, r"every \(5\) must be at most capacity \(4\)"),
    ({"module_depth": 0}, "module_depth must be an integer >= 1"),
])
def test_bad_settings_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        History(**kw)


def test_bad_attachments_are_refused():
    with pytest.raises(TypeError, match="has no write"):
        History(sinks=[object()])
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match="expected a modopt.Modular, got SGD"):
        History.attach(torch.optim.SGD([p], lr=0.1))
    opt = mo.Modular([p], mo.SGD(lr=0.1))
    h = History.attach(opt)
    with pytest.raises(RuntimeError, match="already attached"):
        h.attach_to(opt)
    with pytest.raises(TypeError, match="loss must be a tensor or a number"):
        h.note(loss="high")
    with pytest.raises(KeyError, match="no column 'nope'"):
        h.window("nope")


def test_detach_stops_recording():
    model = make_model()
    opt = mo.Modular(model.named_parameters(), mo.SGD(lr=0.1))
    h = History.attach(opt)
    train(model, opt, 2, h)
    h.detach()
    train(model, opt, 2)
    assert h.count == 2 and "grad_norm" not in opt.stats


# --- zero syncs between reads (item 6) -----------------------------------------------------------


class Transfers(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts what is a device-to-host sync on an accelerator: `.item()`/`bool()` (the repo's
    `checks._sync_ops`) and copies to the CPU that name it (`aten._to_copy(device=cpu)`: `.cpu()`,
    `.to("cpu")` of a device tensor). On the CPU `.tolist()`, `.numpy()` and `.cpu()` of a CPU tensor
    dispatch nothing, so those methods are counted where they are called (`count_methods`)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        self.n += func in _sync_ops() or (func is torch.ops.aten._to_copy.default and dev is not None
                                          and torch.device(dev).type == "cpu")
        return func(*args, **kwargs)


@pytest.fixture
def count_methods(monkeypatch):
    calls = []
    for name in ("tolist", "numpy", "cpu", "item", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def wrapped(self, *a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return calls


def test_one_transfer_per_read_back_and_none_in_between(tmp_path, count_methods, device_path):
    """N steps of `modopt run`'s default pipeline (ZClip, Adam) with the history, per-module norms
    and a sink on: each step whose row count reaches `every` makes exactly one transfer, the
    read-back (the buffer's copy to the host; its `.tolist()` is of that host copy), and every
    other step none, of any kind."""
    from modopt.cli.experiment import default_experiment

    model = Net()
    opt = default_experiment().optimizer.build(list(model.named_parameters()))
    sink = JsonlSink(tmp_path / "t.jsonl")
    h = History.attach(opt, capacity=8, every=4, module_depth=1, sinks=[sink])
    per_step = []
    for i, x, _ in batches(12):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        count_methods.clear()
        with Transfers() as t:
            h.note(loss=loss.detach())
            opt.step()
        per_step.append((t.n, list(count_methods)))
    flushes = [(1, ["tolist"])]
    assert per_step == [flushes[0] if s % 4 == 0 else (0, []) for s in range(1, 13)]
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 12
    # the counter sees what it claims to: a read on demand is one transfer
    with Transfers() as t:
        h.read()
    assert t.n == 1


# --- sinks that fail, notes and sizes that cannot be recorded --------------------------------------


class _FlakySink:
    """A sink whose writes raise (a full disk) while `broken`; it keeps what it was given otherwise."""

    def __init__(self):
        self.broken, self.rows, self.calls = False, [], 0

    def write(self, rows):
        self.calls += 1
        if self.broken:
            raise OSError(28, "No space left on device")
        self.rows.extend(rows)


def test_a_failing_sink_never_fails_the_step_and_loses_no_row():
    model = make_model()
    opt = mo.Modular(model.parameters(), mo.ClipNorm(0.5), mo.Adam(lr=1e-2))
    flaky, good = _FlakySink(), _FlakySink()
    h = History.attach(opt, capacity=16, every=2, sinks=[flaky, good])
    train(model, opt, 2, h)
    flaky.broken = True
    with pytest.warns(UserWarning, match="No space left on device") as caught:
        train(model, opt, 4, h, seed=2)  # two automatic flushes fail; the steps go on
    assert len([w for w in caught if "sink" in str(w.message)]) == 1  # reported once, not every flush
    assert [r["step"] for r in good.rows] == [1, 2, 3, 4, 5, 6]  # the healthy sink is not held back
    assert [r["step"] for r in flaky.rows] == [1, 2]
    with pytest.raises(RuntimeError, match="No space left on device.*written again"):
        h.flush()  # an explicit flush says so
    flaky.broken = False
    h.flush()
    assert [r["step"] for r in flaky.rows] == [1, 2, 3, 4, 5, 6]  # nothing lost, nothing twice
    assert [r["step"] for r in good.rows] == [1, 2, 3, 4, 5, 6]
    assert h.delivered == 6


@pytest.mark.parametrize("name", ["step", "grad_norm", "clipped_steps", "module_norm/x"])
def test_note_refuses_the_columns_the_history_fills(name):
    opt = mo.Modular(make_model().parameters(), mo.Adam())
    h = History.attach(opt, capacity=4)
    with pytest.raises(ValueError, match="fills itself"):
        h.note(**{name: 1.0})


@pytest.mark.parametrize("value, match", [
    (True, "tensor or a number"), ("1", "tensor or a number"),
    (torch.zeros(20_000), "at most 1024"), (torch.zeros(2, 2), "0-d or 1-D"), (torch.zeros(2, dtype=torch.complex64), "real"),
])
def test_note_refuses_what_it_cannot_record_before_the_step(value, match):
    model = make_model()
    opt = mo.Modular(model.parameters(), mo.Adam())
    h = History.attach(opt, capacity=4)
    with pytest.raises((TypeError, ValueError), match=match):
        h.note(x=value)
    train(model, opt, 1, h)  # the refused value was not kept: the next step records as usual
    assert "x" not in h.read()[-1]


def test_capacity_beyond_the_limit_is_a_clear_error():
    with pytest.raises(ValueError, match="capacity must be at most"):
        History(capacity=2**62)
