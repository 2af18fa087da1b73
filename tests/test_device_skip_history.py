"""AutoClip and ClipValueGrowth under the device's skip decision (adaptive.py's AutoClip, growth.py's ClipValueGrowth).

Both used to need the host: AutoClip grew its history with `torch.cat` and ClipValueGrowth
asked the host whether a parameter had its first step. Now a skipped step (NaN gradients) leaves
AutoClip's norms and length and ClipValueGrowth's `prev` and `started` as they were, the very
first step included, with no host sync: a run with NaN steps inserted ends where the run without
them ends, bit for bit. Checkpoints written before `length` and `started` existed load and
continue as they would have.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math

import pytest
import torch

import modopt as mo
from modopt.core import hostdata
from checks import Syncs

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def groups(m):
    ps = list(m.parameters())
    return [{"params": ps[:2]}, {"params": ps[2:], "lr": 5e-3}]


def set_grads(m, k):
    """Seeded gradients for step `k` (a spike every fifth step); `k is None`: a NaN in one of them."""
    g = torch.Generator().manual_seed(0 if k is None else k)
    for i, p in enumerate(m.parameters()):
        p.grad = torch.randn(p.shape, generator=g) * (1 + 9 * (k is not None and k % 5 == 3))
        if k is None and i == 2:
            p.grad.view(-1)[1] = float("nan")


NAN = None
SCHEDULES = {
    "first": [NAN, 0, 1, 2, 3, 4, 5, 6, 7],  # the very first step is skipped: no state from it
    "middle": [0, 1, 2, 3, NAN, 4, 5, 6, 7],
    "window": [0, 1, NAN, 2, NAN, NAN, 3, 4, NAN, 5, 6, 7, NAN],  # several inside a window of 3
}
MAKES = {
    "AutoClip": lambda: mo.AutoClip(),
    "AutoClip-window": lambda: mo.AutoClip(window=3),
    "AutoClip-window-tensor": lambda: mo.AutoClip(percentile=50, window=3, scope="tensor"),
    "AutoClip-group": lambda: mo.AutoClip(percentile=25, window=5, ord="l1", eps=0.0, scope="group"),
    "ClipValueGrowth": lambda: mo.ClipValueGrowth(),
    "ClipValueGrowth-add": lambda: mo.ClipValueGrowth(add=0.1, mul=None, min_value=1e-3, max_decay=None),
}


def run(make, schedule, m=None, opt=None, syncs=None):
    """Run `schedule` (seeds, or NAN) on a new model and `make()` + Adam, or on `m` with `opt`;
    returns them and every step's AutoClip norms with whether the step went ahead."""
    if m is None:
        m = model()
        opt = mo.Modular(groups(m), make(), mo.Adam(lr=1e-2))
    norms = []
    for k in schedule:
        set_grads(m, k)
        with syncs if syncs is not None else contextlib.nullcontext():
            opt.step()
        assert bool(opt.stats["skipped"]) == (k is NAN)
        if "0:AutoClip.norm" in opt.stats:
            norms.append((opt.stats["0:AutoClip.norm"].clone(), k is not NAN))
    return m, opt, norms


def autoclip_histories(opt):
    """Every segment's history as a list (its first `length` entries), in segment order."""
    sd = opt.state_dict()
    store = sd["modopt"]["transforms"].get("0:AutoClip", {})
    out = []
    if "history" in store:  # global scope
        out.append(store["history"][: int(store["length"])].tolist())
    for g in range(len(opt.param_groups)):
        if f"history@group{g}" in store:
            out.append(store[f"history@group{g}"][: int(store[f"length@group{g}"])].tolist())
    for i in sorted(sd["state"]):
        e = sd["state"][i]
        if "0:AutoClip.history" in e:
            out.append(e["0:AutoClip.history"]["history"][: int(e["0:AutoClip.length"])])
    return out


def reference_histories(norms, window, start=None):
    """The history as modopt kept it before (a list per segment): each step that goes ahead appends
    its norm (+inf when not finite), the last `window` kept; a skipped step appends nothing."""
    hists = [list(h) for h in start] if start is not None else None
    for g, ahead in norms:
        if hists is None:
            hists = [[] for _ in range(g.numel())]
        if not ahead:
            continue
        for h, x in zip(hists, g.tolist()):
            h.append(x if math.isfinite(x) else math.inf)
            if window is not None:
                del h[: max(0, len(h) - window)]
    return hists


def saved_state(opt):
    """The parameters' state (histories as their used entries), by key."""
    sd = opt.state_dict()
    out = {}
    for i, e in sd["state"].items():
        for k, v in e.items():
            out[f"{i}.{k}"] = v
    for k, s in sd["modopt"]["transforms"].items():
        for n, v in s.items():
            out[f"{k}.{n}"] = v
    for k in [k for k in out if k.endswith("length")]:  # the room after the history is no state
        h = k[: -len("length")] + "history"
        v = out[h]["history"] if isinstance(out[h], dict) else out[h].tolist()
        out[h] = v[: int(out[k])]
    return out


def assert_same_state(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), k
        else:
            assert x == y, k


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", list(MAKES))
def test_nan_steps_change_nothing_and_no_step_syncs(name, schedule):
    clean = [k for k in SCHEDULES[schedule] if k is not NAN]
    ma, oa, _ = run(MAKES[name], clean)
    syncs = Syncs()
    mb, ob, norms = run(MAKES[name], SCHEDULES[schedule], syncs=syncs)
    assert ob._skip_on_device and syncs.n == 0
    assert int(ob.stats["skipped_steps"]) == len(SCHEDULES[schedule]) - len(clean)
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(p, q)
    assert_same_state(saved_state(oa), saved_state(ob))
    if name.startswith("AutoClip"):  # the history is the one modopt kept before, entry for entry
        assert autoclip_histories(ob) == reference_histories(norms, MAKES[name]().window)


@pytest.mark.parametrize("host", [False, True], ids=["device", "host-on-cpu"])
def test_a_first_step_that_is_skipped_leaves_clip_value_growth_unstarted(host, monkeypatch):
    monkeypatch.setattr(hostdata.Host, "device_path", not host)
    m = model()
    opt = mo.Modular(m.parameters(), mo.ClipValueGrowth(mul=2.0), mo.LR(1.0))
    set_grads(m, NAN)
    opt.step()
    for p in m.parameters():
        st = {k.split(".")[-1]: v for k, v in opt.state[p].items()}
        if host:  # the chain did not run: nothing was made
            assert st == {}
        else:  # made by the skipped step, unstarted
            assert float(st["started"]) == 0.0 and torch.equal(st["prev"], torch.full_like(p, 1e-4))
    set_grads(m, 1)
    grads = [p.grad.clone() for p in m.parameters()]
    before = [p.detach().clone() for p in m.parameters()]
    opt.step()  # the first step that goes ahead passes through, unclipped
    for p, b, g in zip(m.parameters(), before, grads):
        assert torch.equal(p.detach(), b - g)


def test_a_nonfinite_norm_that_goes_ahead_takes_a_slot_as_before():
    """With nonfinite="ignore" an inf norm enters the window (and never the percentile), as it did."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = mo.Modular([p], mo.AutoClip(percentile=100.0, window=2, eps=0.0), mo.LR(1.0), nonfinite="ignore")
    out = []
    for g in (2.0, math.inf, 3.0, 1.0):
        p.grad = torch.tensor([g])
        opt.step()
        out.append(float(opt.stats["0:AutoClip.threshold"][0]))
    assert out == [2.0, 2.0, 3.0, 3.0]  # windows {2}, {2, inf}, {inf, 3}, {3, 1}
    assert autoclip_histories(opt) == [[3.0, 1.0]]


# --- checkpoints written before `length` and `started` -----------------------------------------


def old_format(sd):
    """`sd` as modopt wrote it before: AutoClip's history holds its used entries only and there is no
    `length`; ClipValueGrowth has no `started`."""
    sd = copy.deepcopy(sd)

    def strip(d):
        for k in [k for k in d if isinstance(k, str) and ("length" in k or k.endswith("started"))]:
            if "length" in k:
                h = k.replace("length", "history")
                n = int(d[k])
                d[h] = {**d[h], "history": d[h]["history"][:n]} if isinstance(d[h], dict) else d[h][:n].clone()
            del d[k]

    for e in sd["state"].values():
        strip(e)
    for s in sd["modopt"]["transforms"].values():
        strip(s)
    carried = sd["param_groups"][0]["modopt"]
    for s in carried["transforms"].values():
        strip(s)
    carried["inventory"] = [k for k in carried["inventory"] if not ("length" in k or k.endswith("started"))]
    del carried["param_keys"]  # (written since; an old checkpoint has no per-parameter inventory)
    return sd


@pytest.mark.parametrize("make,before", [
    (lambda: mo.AutoClip(), 5),
    (lambda: mo.AutoClip(window=4, scope="tensor"), 2),  # saved before the window fills
    (lambda: mo.AutoClip(window=4, scope="group"), 7),  # and after
    (lambda: mo.ClipValueGrowth(), 4),
    (lambda: [mo.AutoClip(percentile=50, window=3), mo.ClipValueGrowth(mul=2.0)], 6),
], ids=["AutoClip", "AutoClip-window-early", "AutoClip-window-full", "ClipValueGrowth", "both"])
def test_an_old_checkpoint_loads_and_continues_identically(make, before):
    def build(m):
        ts = make()
        return mo.Modular(groups(m), *(ts if isinstance(ts, list) else [ts]), mo.Adam(lr=1e-2))

    ma = model()
    oa = build(ma)
    first = [0, 1, NAN, 2, 3, 4, 5, 6, 7][:before]
    run(None, first, ma, oa)
    buf = io.BytesIO()
    torch.save(old_format(oa.state_dict()), buf)
    buf.seek(0)
    mb = model()
    with torch.no_grad():
        for p, q in zip(ma.parameters(), mb.parameters()):
            q.copy_(p)
    ob = build(mb)
    ob.load_state_dict(torch.load(buf, weights_only=True))
    rest = [10, 11, NAN, 12, 13, 14, NAN, 15]
    run(None, rest, ma, oa)
    run(None, rest, mb, ob)
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(p, q)
    assert_same_state(saved_state(oa), saved_state(ob))


def test_a_smaller_window_than_the_checkpoints_keeps_the_newest_norms():
    """A window may change across a checkpoint (it is a hyperparameter): the newest norms stay."""
    ma = model()
    oa = mo.Modular(groups(ma), mo.AutoClip(window=6), mo.Adam(lr=1e-2))
    _, _, norms = run(None, [0, 1, 2, 3, NAN, 4, 5], ma, oa)
    saved = autoclip_histories(oa)
    assert saved == reference_histories(norms, 6)
    for sd in (oa.state_dict(), old_format(oa.state_dict())):
        mb = model()
        ob = mo.Modular(groups(mb), mo.AutoClip(window=3), mo.Adam(lr=1e-2))
        with pytest.warns(UserWarning, match="window"):
            ob.load_state_dict(sd)
        _, _, after = run(None, [6, NAN, 7, 8], mb, ob)
        assert autoclip_histories(ob) == reference_histories(after, 3, start=saved)


# --- torch.compile(opt.step, fullgraph=True) ------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: mo.AutoClip(), lambda: mo.ClipValueGrowth()],
                         ids=["AutoClip", "ClipValueGrowth"])
@pytest.mark.compile
def test_fullgraph_compile_equals_eager_with_nan_steps(make):
    torch._dynamo.reset()
    a, b = model(), model()
    eager = mo.Modular(groups(a), make(), mo.Adam(lr=1e-2))
    comp = mo.Modular(groups(b), make(), mo.Adam(lr=1e-2))
    step = torch.compile(comp.step, fullgraph=True)
    schedule = [NAN, 0, 1, 2, NAN, 3, 4, 5]
    for k in schedule:
        set_grads(a, k)
        set_grads(b, k)
        eager.step()
        step()
        assert bool(comp.stats["skipped"]) == (k is NAN)
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert int(comp.stats["skipped_steps"]) == 2


@pytest.mark.parametrize("scope", ["global", "group", "tensor"])
def test_a_history_length_beyond_its_buffer_is_refused_and_nothing_changes(scope):
    """`length` says how many entries of `history` are norms: more than the buffer holds is a damaged
    checkpoint (`Transform.check_loaded`), refused with a message naming the values, state unchanged."""
    import copy

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = mo.Modular(m.parameters(), mo.AutoClip(window=5, scope=scope), mo.Adam())
    for _ in range(3):
        m.zero_grad()
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for s in [*sd["state"].values(), *sd["modopt"]["transforms"].values()]:
        for k in list(s):
            if k.split(".")[-1].split("@")[0] == "length":
                s[k] = s[k] + 100
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="'length' is 103, more than the 5 entries of its 'history'"):
        opt.load_state_dict(sd)
    from checks import assert_same

    assert_same(before, opt.state_dict())
