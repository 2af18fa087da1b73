"""Three more transforms decide the default `nonfinite="skip"` on the device:
`SGD` with momentum and dampening, the EMAs with `ema_init="update"`, and `TorchOptimizer`.

Each keeps a first step that is special (torch's first momentum buffer is the gradient; the EMA
starts as the first update; a wrapped optimizer creates its state on its first step), so a NaN
first step must leave that state "not started". Checked here: no host sync on finite and NaN
steps; a NaN step, the first one included, leaves the parameters and every saved value bit for
bit as they were; a run with NaN steps inserted ends where the run without them ends; the device
path equals the host path bit for bit in float64, float32 and bfloat16; checkpoints written
before the `started` flags (and with them) load and continue identically.
"""

from __future__ import annotations

import copy

import pytest
import torch

import modopt as mo
from checks import Syncs, same, saved

class HostModular(mo.Modular):
    """The same optimizer with the host deciding every step (the path these transforms took before)."""

    @property
    def _skip_on_device(self):
        return False


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def groups(m, **second):
    ps = list(m.parameters())
    return [{"params": ps[:2]}, {"params": ps[2:], "lr": 5e-3, **second}]


def backward(m, k, poison=False):
    g = torch.Generator().manual_seed(k)
    m.zero_grad()
    x = torch.randn(5, 6, generator=g).to(next(m.parameters()).dtype)
    (m(x).float().pow(2).mean() * (1 + 20 * (k % 4 == 3))).backward()
    if poison:
        list(m.parameters())[2].grad.view(-1)[3] = float("nan")


MODOPT = {
    "SGD-dampening": lambda: [mo.SGD(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)],
    "SGD-dampening-followed": lambda: [mo.SGD(lr=0.05, momentum=0.9, dampening=0.3), mo.ClipValue(1e30)],
    "ClipNormByEMA-update": lambda: [mo.ClipNormByEMA(beta=0.9, ema_init="update"), mo.Adam(lr=1e-2)],
    "ClipNormByEMA-update-slices": lambda: [
        mo.ClipNormByEMA(beta=0.8, ema_init="update", scope="tensor", dim=0, max_ema_growth=1.1), mo.LR(0.1)],
    "NormalizeByEMA-update-group": lambda: [
        mo.NormalizeByEMA(beta=0.9, ema_init="update", scope="group", ord=3.0), mo.SGD(lr=0.05, momentum=0.9)],
    "ClipValueByEMA-update": lambda: [mo.ClipValueByEMA(beta=0.9, ema_init="update"), mo.LR(0.1)],
}
TORCH = {
    "RMSprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
    "Adagrad-fused": (torch.optim.Adagrad, dict(lr=1e-2, fused=True)),
    "NAdam": (torch.optim.NAdam, dict(lr=1e-2)),
    "SGD-momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    "SGD-nesterov-fused": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, fused=True)),
    "Adam-fused": (torch.optim.Adam, dict(lr=1e-2, fused=True)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2)),
    "ASGD": (torch.optim.ASGD, dict(lr=1e-2)),
    "Adadelta": (torch.optim.Adadelta, dict()),
    "Adafactor": (torch.optim.Adafactor, dict(lr=1e-2)),
    "Adamax": (torch.optim.Adamax, dict(lr=1e-2)),
    "RAdam": (torch.optim.RAdam, dict(lr=1e-2)),
    "Rprop": (torch.optim.Rprop, dict(lr=1e-2)),
}
PIPELINES = {**MODOPT, **{f"TorchOptimizer-{n}": (lambda c=c, kw=kw: [mo.TorchOptimizer(c, **kw)])
                          for n, (c, kw) in TORCH.items()}}
#: the wrapped classes that read their own CPU step counter with .item() (torch's code, not modopt's)
OWN_READS = {"TorchOptimizer-" + n for n in ("Adagrad", "NAdam", "AdamW", "ASGD", "Adafactor", "Adamax", "RAdam")}


def test_they_skip_on_the_device():
    for make in PIPELINES.values():
        assert all(mo.roles.skips_on_device(t) for t in make())
    assert mo.roles.skips_on_device(mo.SGD(momentum=0.9), [{"momentum": 0.9, "dampening": 0.5}])
    # the host decides for a wrapped class outside torch.optim's tensor-state ones, and for torch's SGD
    # with momentum and dampening (its first buffer is g, which the wrapper cannot reproduce)

    class MySGD(torch.optim.SGD):
        pass

    assert not mo.roles.skips_on_device(mo.TorchOptimizer(MySGD, lr=0.1))
    assert not mo.roles.skips_on_device(mo.TorchOptimizer(torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.1))
    assert not mo.roles.skips_on_device(mo.TorchOptimizer(torch.optim.SGD, momentum=0.9), [{"momentum": 0.9, "dampening": 0.1}])
    assert mo.roles.skips_on_device(mo.TorchOptimizer(torch.optim.SGD, lr=0.1, dampening=0.1))  # no momentum: no buffer
    m = model()
    opt = mo.Modular(m.parameters(), mo.TorchOptimizer(MySGD, lr=0.1, momentum=0.9))
    syncs = Syncs()
    for k in range(3):
        backward(m, k)
        with syncs:
            opt.step()
    assert syncs.n == 3  # one host decision per step


def own_reads(name, steps):
    """The host reads a wrapped torch class makes of its own CPU step counter in `steps` steps."""
    if name not in OWN_READS:
        return 0
    cls, kw = TORCH[name.removeprefix("TorchOptimizer-")]
    m = model()
    opt = cls(m.parameters(), **kw)
    syncs = Syncs()
    for k in range(steps):
        backward(m, k)
        with syncs:
            opt.step()
    return syncs.n


@pytest.mark.parametrize("name", list(PIPELINES))
def test_no_host_sync_and_a_nan_step_changes_nothing(name):
    m = model()
    opt = mo.Modular(groups(m), *PIPELINES[name]())
    assert opt._skip_on_device
    syncs = Syncs()
    for k in range(5):
        backward(m, k)
        with syncs:
            opt.step()
    before = saved(opt, m)
    backward(m, 99, poison=True)
    with syncs:
        opt.step()
    assert bool(opt.stats["skipped"])
    same(before, saved(opt, m))
    backward(m, 5)
    with syncs:
        opt.step()
    # none of modopt's; a wrapped class's own reads of its CPU step counter are the bare class's count
    assert syncs.n == own_reads(name, 7), syncs.n


@pytest.mark.parametrize("name", list(PIPELINES))
def test_nan_steps_first_included_leave_the_trajectory_as_without_them(name):
    ends = []
    for poison in ((), (0, 5), (0, 1, 7)):
        m = model()
        opt = mo.Modular(groups(m), *PIPELINES[name]())
        for k in range(9):
            if k in poison:
                before = saved(opt, m)
                backward(m, 99, poison=True)
                opt.step()
                assert bool(opt.stats["skipped"])
                if k == 0:  # the state a first NaN step creates is the "not started" one; nothing moves
                    assert all(torch.equal(p, before[f"param{i}"]) for i, p in enumerate(m.parameters()))
                else:
                    same(before, saved(opt, m))
            backward(m, k)
            opt.step()
        ends.append((saved(opt, m), int(opt.stats["skipped_steps"])))
    for end, skipped in ends[1:]:
        assert skipped in (2, 3)
        a, b = ends[0][0], end
        same(a, b)


def test_a_nan_first_step_leaves_the_flags_unstarted(device_path):
    m = model()
    opt = mo.Modular(m.parameters(), mo.ClipValueByEMA(ema_init="update"), mo.SGD(lr=0.1, momentum=0.9,
                                                                                   dampening=0.5))
    backward(m, 0, poison=True)
    opt.step()
    for s in opt.state.values():
        assert not s["0:ClipValueByEMA.started"] and not s["1:SGD.started"]
        assert not s["0:ClipValueByEMA.ema"].any() and not s["1:SGD.momentum_buffer"].any()
    backward(m, 1)
    opt.step()
    for s in opt.state.values():
        assert s["0:ClipValueByEMA.started"] and s["1:SGD.started"]


# --- the device path is the host path ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MODOPT) + ["SGD-dampening-in-a-group", "TorchOptimizer-RMSprop",
                                                 "TorchOptimizer-SGD-momentum", "TorchOptimizer-Adam-fused"])
def test_the_device_path_equals_the_host_path_bit_for_bit(name, dtype):
    """NaN steps included (the first one too): the skipped steps leave nothing behind on either path."""
    make = PIPELINES.get(name, lambda: [mo.SGD(lr=0.05, momentum=0.9)])
    ends = []
    for cls in (mo.Modular, HostModular):
        m = model(dtype)
        second = {"dampening": 0.2, "weight_decay": 1e-2} if name == "SGD-dampening-in-a-group" else {}
        opt = cls(groups(m, **second), *make())
        assert opt._skip_on_device == (cls is mo.Modular)
        for k in range(8):
            backward(m, k, poison=k in (0, 4))
            opt.step()
        ends.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*ends):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_sgd_with_dampening_is_torch_sgd_with_nan_steps_left_out(dtype):
    """As the last transform: torch's fused SGD where modopt uses its kernel (float32/64 on the CPU),
    torch's foreach SGD elsewhere; a NaN first step leaves the buffer to start on the next."""
    fused = mo.core.kernels.fused_ok("sgd", torch.device("cpu"), dtype)
    hyper = dict(lr=0.05, momentum=0.9, dampening=0.25, weight_decay=1e-2)
    a, b = model(dtype), model(dtype)
    ours = mo.Modular(a.parameters(), mo.SGD(**hyper))
    ref = torch.optim.SGD(b.parameters(), **hyper, **({"fused": True} if fused else {"foreach": True}))
    for k in range(8):
        if k in (0, 3):
            backward(a, 99, poison=True)
            ours.step()
        backward(a, k)
        ours.step()
        backward(b, k)
        ref.step()
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q), k
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(ours.state[p]["0:SGD.momentum_buffer"], ref.state[q]["momentum_buffer"])


# --- checkpoints ------------------------------------------------------------------------------------
def _resume(name, strip):
    """Steps 0..3, a checkpoint, then 4..9 (a NaN step at 6) in the same optimizer and in a new one
    loaded from the checkpoint (without its `started` flags when `strip`)."""
    ends = []
    m = model()
    opt = mo.Modular(groups(m), *PIPELINES[name]())
    for k in range(4):
        backward(m, k)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    if strip:
        for s in sd["state"].values():
            for k in [k for k in s if k.endswith(".started")]:
                del s[k]
        assert not any(k.endswith(".started") for s in sd["state"].values() for k in s)
    m2 = model()
    with torch.no_grad():
        for p, q in zip(m2.parameters(), m.parameters()):
            p.copy_(q)
    opt2 = mo.Modular(groups(m2), *PIPELINES[name]())
    opt2.load_state_dict(sd)
    for mm, o in ((m, opt), (m2, opt2)):
        syncs = Syncs()
        for k in range(4, 10):
            backward(mm, k, poison=k == 6)
            with syncs:
                o.step()
        assert syncs.n == 0
        ends.append([p.detach().clone() for p in mm.parameters()])
    for a, b in zip(*ends):
        assert torch.equal(a, b)
    return opt2


@pytest.mark.parametrize("name", [n for n in MODOPT])
def test_a_checkpoint_from_before_the_flags_loads_and_continues_identically(name):
    """A buffer without a flag has started (before the flags these pipelines decided on the host,
    which creates a buffer only on a step that goes ahead)."""
    opt2 = _resume(name, strip=True)
    assert not any(k.endswith(".started") for s in opt2.state.values() for k in s)  # none made: all started


@pytest.mark.parametrize("name", [n for n in MODOPT])
def test_a_checkpoint_with_the_flags_loads_and_continues_identically(name):
    _resume(name, strip=False)  # (loaded flags are not known to be equal: one pair of kernel calls each)


def test_a_checkpoint_taken_after_a_nan_first_step_starts_on_the_next_finite_one():
    runs = []
    for resume in (False, True):
        m = model()
        opt = mo.Modular(m.parameters(), mo.ClipNormByEMA(ema_init="update"), mo.SGD(lr=0.1, momentum=0.9,
                                                                                      dampening=0.5))
        backward(m, 0, poison=True)
        opt.step()
        if resume:
            sd = copy.deepcopy(opt.state_dict())
            opt = mo.Modular(m.parameters(), mo.ClipNormByEMA(ema_init="update"), mo.SGD(lr=0.1, momentum=0.9,
                                                                                          dampening=0.5))
            opt.load_state_dict(sd)
        for k in range(1, 5):
            backward(m, k)
            opt.step()
        runs.append([p.detach().clone() for p in m.parameters()])
    ref = model()
    opt = HostModular(ref.parameters(), mo.ClipNormByEMA(ema_init="update"), mo.SGD(lr=0.1, momentum=0.9,
                                                                                     dampening=0.5))
    for k in range(1, 5):
        backward(ref, k)
        opt.step()
    for a, b, c in zip(*runs, ref.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.filterwarnings("ignore:load_state_dict")  # (nonfinite differs from the checkpoint's: intended)
def test_the_host_path_drops_the_flags_it_finds():
    """A checkpoint of the device path loaded where the host decides (nonfinite="raise"): the
    flags are honoured once (an unstarted buffer starts as torch's), then dropped."""
    m = model()
    make = lambda: [mo.ClipValueByEMA(ema_init="update"), mo.SGD(lr=0.1, momentum=0.9, dampening=0.5)]  # noqa: E731
    opt = mo.Modular(m.parameters(), *make())
    backward(m, 0, poison=True)
    opt.step()  # flags False, zero buffers
    host = mo.Modular(m.parameters(), *make(), nonfinite="raise")
    host.load_state_dict(copy.deepcopy(opt.state_dict()))
    ref = model()
    fresh = mo.Modular(ref.parameters(), *make(), nonfinite="raise")
    for k in range(1, 4):
        backward(m, k)
        host.step()
        backward(ref, k)
        fresh.step()
        assert not any(k.endswith(".started") for s in host.state.values() for k in s)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)


# --- torch.compile(fullgraph=True) ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["SGD-dampening", "ClipNormByEMA-update"])
@pytest.mark.compile
def test_fullgraph_equals_eager_with_nan_steps(name):
    make = {"SGD-dampening": lambda: [mo.SGD(lr=0.05, momentum=0.9, dampening=0.1)],
            "ClipNormByEMA-update": lambda: [mo.ClipNormByEMA(ema_init="update"), mo.Adam(lr=1e-2)]}[name]
    torch._dynamo.reset()
    a, b = model(), model()
    eager, comp = mo.Modular(groups(a), *make()), mo.Modular(groups(b), *make())
    step = torch.compile(comp.step, fullgraph=True)
    for k in range(8):
        for m in (a, b):
            backward(m, k, poison=k in (0, 4))
        eager.step()
        step()
        assert bool(comp.stats["skipped"]) == (k in (0, 4))
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert int(comp.stats["skipped_steps"]) == 2
