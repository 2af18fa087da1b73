"""Accumulate (modopt/transforms/accumulate.py): the mean over a cycle's calls, its spec, checkpoints
mid-cycle, sums that never leak into the next cycle, and the non-finite skip decided on the device.

Every `opt.step()` call is a call of the cycle, a skipped one too: the cycle ends on the host's
`steps`-th call (a Python counter, no sync), a skipped call adds nothing to the sums, and the
cycle's update is the mean over the calls that added (a device counter). A skipped final call
skips the cycle's step. The host-decided path (`SeesHostSkips.on_host_skip`) follows the same rules.
"""

from __future__ import annotations

import io

import pytest
import torch

import modopt as mo
from checks import Syncs, assert_resumes_bit_for_bit
from harness import Harness
from modopt.spec import guards as spec


def micro_grads(k, shapes):
    g = torch.Generator().manual_seed(100 + k)
    return [torch.randn(s, generator=g) for s in shapes]


@pytest.mark.parametrize("sgd", [dict(lr=0.1), dict(lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True)])
def test_accumulate_then_sgd_is_sgd_on_the_mean_gradient(sgd):
    shapes = [(3, 2), (4,)]
    torch.manual_seed(0)
    pa = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    acc = mo.Modular(pa, mo.Accumulate(4), mo.SGD(**sgd))
    ref = torch.optim.SGD(pb, **sgd)
    for k in range(16):
        for p, g in zip(pa, micro_grads(k, shapes)):
            p.grad = g
        before = [p.detach().clone() for p in pa]
        acc.step()
        if k % 4 != 3:  # non-final micro-steps: nothing moves
            assert all(torch.equal(b, p) for b, p in zip(before, pa))
        else:
            grads = [micro_grads(j, shapes) for j in range(k - 3, k + 1)]
            for i, p in enumerate(pb):
                p.grad = sum(gs[i] for gs in grads) / 4
            ref.step()
            for x, y in zip(pa, pb):
                assert torch.allclose(x, y, rtol=1e-6, atol=1e-7)


def test_accumulate_matches_spec_and_stops_the_chain():
    spec_acc = spec.Accumulate(3)
    h = Harness(mo.Accumulate(3), [torch.zeros(2)])
    for k in range(7):
        u = [torch.tensor([float(k), -2.0 * k])]
        out, ref = h.step(u), spec_acc.step(u)
        assert (out is None) == (ref is None) == (k % 3 != 2)
        if out is not None:
            assert torch.allclose(out[0].double(), ref[0])
    # later transforms do not run on the waiting calls: Adam creates no state
    p = torch.nn.Parameter(torch.zeros(2))
    opt = mo.Modular([p], mo.Accumulate(2), mo.Adam(lr=0.1))
    p.grad = torch.ones(2)
    opt.step()
    assert not any(k.startswith("1:Adam") for k in opt.state[p])
    p.grad = torch.ones(2)
    opt.step()
    assert any(k.startswith("1:Adam") for k in opt.state[p])


def test_accumulate_sums_half_precision_in_float32():
    h = Harness(mo.Accumulate(4), [torch.zeros(1, dtype=torch.float16)])
    outs = [h.step([torch.tensor([v], dtype=torch.float16)]) for v in (60000.0, 60000.0, -60000.0, -57984.0)]
    assert outs[-1][0].dtype == torch.float16 and float(outs[-1][0]) == 504.0  # no overflow of the sum


def test_accumulate_checkpoint_mid_cycle():
    """The cut falls after 2 calls of a 3-call cycle (the registry's Accumulate(2) is cut mid-cycle only because
    its run has an odd length): the sums of the calls before the cut travel, and the cycle's step is the mean of
    all three calls."""
    def step(m, opt, k):
        m[0].grad = torch.full((2,), (1.0, 2.0, 6.0)[k])
        opt.step()

    r = assert_resumes_bit_for_bit(lambda: torch.nn.ParameterList([torch.zeros(2)]),
                                   lambda m: mo.Modular(m.parameters(), mo.Accumulate(3), mo.SGD(lr=1.0)),
                                   step=step, steps=3, cut=2)
    assert torch.equal(r.model[0].detach(), torch.full((2,), -3.0))


def test_accumulate_cannot_be_attached_and_validates():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="cannot be attached"):
        mo.attach(opt, mo.Accumulate(2))
    for bad in (0, -1, 1.5):
        with pytest.raises(Exception):
            mo.Accumulate(bad)


def test_accumulate_clears_a_sum_whose_parameter_has_no_grad_on_the_final_call():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2))
    opt = mo.Modular([a, b], mo.Accumulate(2), mo.SGD(lr=1.0))
    # cycle 1: b has a gradient on the first call only
    a.grad, b.grad = torch.ones(2), torch.full((2,), 10.0)
    opt.step()
    a.grad, b.grad = torch.ones(2), None
    opt.step()
    assert torch.equal(b.detach(), torch.zeros(2))  # no grad on the final call: b does not move
    assert torch.equal(a.detach(), -torch.ones(2))
    # cycle 2: zero gradients for both. Nothing of cycle 1 may come back.
    for _ in range(2):
        a.grad, b.grad = torch.zeros(2), torch.zeros(2)
        opt.step()
    assert torch.equal(b.detach(), torch.zeros(2)), b
    assert torch.equal(a.detach(), -torch.ones(2)), a
    key = "0:Accumulate.sum"
    for p in (a, b):
        assert torch.equal(opt.state[p][key], torch.zeros(2))


# --- the non-finite skip decided on the device ----------------------------------------------------
class _HostDecidesForAccumulate(mo.Transform):
    """Changes nothing and declares that it needs the host (`device_skip = False`; stateless, it would be
    inferred True): a pipeline with it decides on the host."""

    positional = None
    device_skip = False

    def apply(self, ctx, st, updates):
        return updates


#: in front of a pipeline: changes no value, and makes the host decide the skip
HOST_IDENTITY = [_HostDecidesForAccumulate()]


SHAPES = [(5, 3), (5,), (2, 5)]


def params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def grads(k, dtype=torch.float32, nan=False):
    g = torch.Generator().manual_seed(100 + k)
    out = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    if nan:
        out[1][2] = float("nan")
    return out


def set_grads(ps, gs):
    for p, g in zip(ps, gs):
        p.grad = g.clone()


def acc_state(opt):
    """Accumulate's transform-wide values (the host's call counter and the device's count)."""
    key = next(k for k in opt._keys if k.endswith(":Accumulate"))
    return dict(opt._store.get(key, {}))


def test_accumulate_skips_on_the_device():
    assert mo.roles.skips_on_device(mo.Accumulate(3))
    ps = params()
    assert mo.Modular(ps, mo.Accumulate(3), mo.ClipNorm(1.0), mo.Adam())._skip_on_device
    assert not mo.Modular(ps, *HOST_IDENTITY, mo.Accumulate(3), mo.Adam())._skip_on_device


def test_no_host_sync_over_two_cycles_with_a_nan_micro_batch():
    ps = params()
    opt = mo.Modular(ps, mo.Accumulate(3), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    start = [p.detach().clone() for p in ps]
    syncs = Syncs()
    for k in range(6):
        set_grads(ps, grads(k, nan=k == 4))
        with syncs:
            opt.step()
            _ = dict(opt.stats)
    assert syncs.n == 0, f"{syncs.n} host syncs in two cycles"
    assert int(opt.stats["skipped_steps"]) == 1
    assert acc_state(opt)["calls"] == 0 and int(acc_state(opt)["count"]) == 0
    assert all(not torch.equal(a, p) for a, p in zip(start, ps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_nan_micro_batch_gives_the_mean_of_the_finite_ones(dtype):
    ps = params(dtype)
    start = [p.detach().clone() for p in ps]
    opt = mo.Modular(ps, mo.Accumulate(4), mo.SGD(lr=1.0))
    gs = [grads(k, dtype, nan=k == 1) for k in range(4)]
    for k, g in enumerate(gs):
        set_grads(ps, g)
        opt.step()
        if k < 3:
            assert all(torch.equal(a, p) for a, p in zip(start, ps))
        assert bool(opt.stats["skipped"]) == (k == 1)
    for i, p in enumerate(ps):  # by hand: the three finite micro-batches, summed in order, divided by 3
        mean = ((gs[0][i] + gs[2][i]) + gs[3][i]) / 3
        assert torch.equal(p.detach(), start[i] - mean), i
    assert int(opt.stats["skipped_steps"]) == 1


def test_a_nan_final_call_skips_the_cycle_and_drops_its_sums():
    ps = params()
    start = [p.detach().clone() for p in ps]
    opt = mo.Modular(ps, mo.Accumulate(2), mo.SGD(lr=1.0))
    set_grads(ps, grads(0))
    opt.step()
    set_grads(ps, grads(1, nan=True))
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(start, ps))
    assert acc_state(opt)["calls"] == 0 and int(acc_state(opt)["count"]) == 0
    key = next(k for k in opt._keys if k.endswith(":Accumulate")) + ".sum"
    assert all(not opt.state[p][key].any() for p in ps)
    gs = [grads(2), grads(3)]  # the next cycle knows nothing of the dropped one
    for g in gs:
        set_grads(ps, g)
        opt.step()
    for i, p in enumerate(ps):
        assert torch.equal(p.detach(), start[i] - (gs[0][i] + gs[1][i]) / 2)


#: calls of Accumulate(3) cycles: a NaN in a cycle's middle, a NaN final call, a cycle of NaN only
NAN_CALLS = (1, 5, 6, 7, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_host_path_has_the_same_semantics_bit_for_bit(dtype):
    ends = []
    for on_device in (True, False):
        ps = params(dtype)
        pipe = [mo.Accumulate(3), mo.ClipNorm(1.0), mo.Adam(lr=1e-2)]
        opt = mo.Modular(ps, *(pipe if on_device else HOST_IDENTITY + pipe))
        assert opt._skip_on_device == on_device
        for k in range(15):
            set_grads(ps, grads(k, dtype, nan=k in NAN_CALLS))
            opt.step()
            assert bool(opt.stats["skipped"]) == (k in NAN_CALLS)
            st = acc_state(opt)
            assert st["calls"] == (k + 1) % 3
        assert int(opt.stats["skipped_steps"]) == len(NAN_CALLS)
        ends.append(([p.detach().clone() for p in ps], int(st["count"])))
    (a, na), (b, nb) = ends
    assert na == nb
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_a_nested_accumulate_counts_the_calls_the_host_skips():
    ps = params()
    opt = mo.Modular(ps, *HOST_IDENTITY, mo.Chain(mo.Accumulate(2)), mo.SGD(lr=1.0))
    key = next(k for k in opt._keys if k.endswith(":Accumulate"))
    assert "/" in key
    set_grads(ps, grads(0, nan=True))
    opt.step()
    assert opt._store[key]["calls"] == 1 and int(opt._store[key]["count"]) == 0
    start = [p.detach().clone() for p in ps]
    g = grads(1)
    set_grads(ps, g)
    opt.step()  # the cycle's end: the mean over its one finite call
    for i, p in enumerate(ps):
        assert torch.equal(p.detach(), start[i] - g[i])


def test_zero_and_ignore_count_every_call_as_one_that_added():
    """Under "zero" and "ignore" no step is skipped: every call adds (zeroed, or as it is)."""
    for policy in ("zero", "ignore"):
        ps = params()
        start = [p.detach().clone() for p in ps]
        opt = mo.Modular(ps, mo.Accumulate(2), mo.SGD(lr=1.0), nonfinite=policy)
        gs = [grads(0), grads(1, nan=True)]
        for g in gs:
            set_grads(ps, g)
            opt.step()
        assert int(opt.stats["skipped_steps"]) == 0
        for i, p in enumerate(ps):
            second = torch.nan_to_num(gs[1][i], nan=0.0) if policy == "zero" else gs[1][i]
            torch.testing.assert_close(p.detach(), start[i] - (gs[0][i] + second) / 2, rtol=0, atol=0, equal_nan=True)


def test_an_old_checkpoint_without_the_device_counter_loads_and_continues():
    """A checkpoint written when a skipped call was no call has "calls" and "sum" only: every call it
    counted was finite, so the count starts at "calls"."""

    def make():
        ps = params()
        return ps, mo.Modular(ps, mo.Accumulate(3), mo.Adam(lr=1e-2))

    pa, oa = make()
    set_grads(pa, grads(0))
    oa.step()
    sd = oa.state_dict()
    key = next(k for k in oa._keys if k.endswith(":Accumulate"))
    for where in (sd["modopt"]["transforms"], sd["param_groups"][0]["modopt"]["transforms"]):
        where[key] = {k: v for k, v in where[key].items() if k != "count"}
    entry = sd["param_groups"][0]["modopt"]  # (nor did its inventory list it)
    entry["inventory"] = [k for k in entry["inventory"] if k != f"{key}/count"]
    assert set(sd["modopt"]["transforms"][key]) == {"calls"}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    pb, ob = make()
    ob.load_state_dict(torch.load(buf, weights_only=True))
    assert "count" not in ob._store[key]
    for k in (1, 2, 3, 4, 5):  # a NaN call in the resumed cycle, then a full cycle
        for p, o in ((pa, oa), (pb, ob)):
            set_grads(p, grads(k, nan=k == 1))
            o.step()
        for x, y in zip(pa, pb):
            assert torch.equal(x, y)
        assert acc_state(oa)["calls"] == acc_state(ob)["calls"]
        assert int(acc_state(oa)["count"]) == int(acc_state(ob)["count"])  # (a number where the host counted)
    ob.load_state_dict(oa.state_dict())  # the new format round-trips
    assert int(acc_state(ob)["count"]) == int(acc_state(oa)["count"])


@pytest.mark.compile
def test_fullgraph_compile_equals_eager_over_two_cycles_with_a_nan_call():
    torch._dynamo.reset()
    pa, pb = params(), params()
    eager = mo.Modular(pa, mo.Accumulate(3), mo.ClipNorm(1.0), mo.Adam())
    comp = mo.Modular(pb, mo.Accumulate(3), mo.ClipNorm(1.0), mo.Adam())
    step = torch.compile(comp.step, fullgraph=True)
    for k in range(6):
        g = grads(k, nan=k == 4)
        set_grads(pa, g)
        set_grads(pb, g)
        eager.step()
        step()
        assert bool(comp.stats["skipped"]) == (k == 4)
        for p, q in zip(pa, pb):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert int(comp.stats["skipped_steps"]) == 1
    assert acc_state(comp)["calls"] == 0 and int(acc_state(comp)["count"]) == 0
