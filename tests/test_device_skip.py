"""The default `nonfinite="skip"` decided on the device (modopt/core/runner.py, modopt/core/plan.py).

A pipeline whose every transform declares `skips_on_device()` runs each step with `ctx.skip`, a
0-d bool tensor, instead of asking the host: no host sync on finite or non-finite steps, and a
skipped step leaves the parameters and every saved value bit for bit as they were. A pipeline
with a transform that does not declare it decides on the host, one sync per step, as before.
"""

from __future__ import annotations

import copy

import pytest
import torch

import modopt as mo
from checks import Syncs, assert_same, needs_the_host, same, saved
from modopt.core.transform import walk
from examples import base_examples

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def groups(m):
    named = list(m.named_parameters())  # names: AGC's exclude and Masked select by them
    return [{"params": [p for _, p in named[:2]], "param_names": [n for n, _ in named[:2]]},
            {"params": [p for _, p in named[2:]], "param_names": [n for n, _ in named[2:]], "lr": 5e-3}]


def backward(m, k, poison=False):
    g = torch.Generator().manual_seed(k)
    m.zero_grad()
    (m(torch.randn(5, 6, generator=g)).pow(2).mean() * (1 + 20 * (k % 4 == 3))).backward()
    if poison:
        list(m.parameters())[2].grad.view(-1)[3] = float("nan")


def pipeline_of(t):
    if isinstance(t, mo.roles.WeightStage):  # (after the optimizer's write)
        return [mo.Adam(lr=1e-2), t]
    return [t] if isinstance(t, mo.roles.Optimizer) or isinstance(t, mo.roles.LastWriter) else [t, mo.Adam(lr=1e-2)]


#: the conformance examples, and the defaults of the transforms whose examples set a field that needs the host
EXAMPLES = base_examples() + [
    ("ClipNormByEMA-default", mo.ClipNormByEMA()),
    ("NormalizeByEMA-default", mo.NormalizeByEMA()),
    ("ClipValueByEMA-default", mo.ClipValueByEMA(beta=0.9)),
    ("ClipNormByEMA-slices", mo.ClipNormByEMA(beta=0.9, scope="tensor", dim=0, max_ema_growth=1.1)),
    ("ZClip-group", mo.ZClip(warmup_steps=2, scope="group")),
    ("SGD-momentum", mo.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3)),
]


HOST_IDENTITY = [needs_the_host(), mo.ClipValue(1e30)]  # changes nothing, needs the host


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("make", [
    lambda: [mo.Adam(lr=1e-2, weight_decay=1e-3), mo.ClipValue(1e30)],  # not last: the multi-tensor formulas
    lambda: [mo.AdamW(lr=1e-2, amsgrad=True), mo.ClipValue(1e30)],
    lambda: [mo.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3), mo.ClipValue(1e30)],
    lambda: [mo.SGD(lr=0.05, momentum=0.9, nesterov=True), mo.ClipValue(1e30)],
    lambda: [mo.Adam(lr=1e-2, amsgrad=True)],  # last: torch's fused kernels with found_inf
    lambda: [mo.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3)],
    lambda: [mo.ClipValueByEMA(beta=0.9), mo.LR(0.1)],
    lambda: [mo.ClipNormByEMA(beta=0.9, scope="tensor"), mo.NormalizeByEMA(beta=0.8), mo.LR(0.1)],
], ids=["Adam", "AdamW-amsgrad", "SGD-momentum", "SGD-nesterov", "Adam-fused", "SGD-fused", "ClipValueByEMA",
        "NormEMAs"])
def test_the_device_path_equals_the_host_path_bit_for_bit(make, dtype):
    """The optimizers' skip-aware formulas round as the plain ones in every dtype: a run decided on the
    device ends where the same run decided on the host ends, NaN steps included."""
    ends = []
    for on_device in (True, False):
        m = model().to(dtype)
        ps = list(m.parameters())
        opt = mo.Modular(ps, *(make() if on_device else HOST_IDENTITY + make()))
        assert opt._skip_on_device == on_device
        for k in range(7):
            g = torch.Generator().manual_seed(k)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(dtype)
            if k in (0, 4):
                ps[1].grad[0] = float("nan")
            opt.step()
        ends.append([p.detach().clone() for p in ps])
    for a, b in zip(*ends):
        assert torch.equal(a, b)


def test_sgd_in_half_precision_skips_on_the_device_too():
    """bfloat16 SGD on the CPU runs torch's foreach formulas (the fused kernel is wrong there): the
    device path keeps them op for op, so a step that goes ahead is bit for bit the host path's."""
    ends = []
    for on_device in (True, False):
        m = model().to(torch.bfloat16)
        ps = list(m.parameters())
        pipe = [mo.SGD(lr=0.05, momentum=0.9)]
        if not on_device:  # the same step with the host deciding: an identity that needs the host in front
            pipe = HOST_IDENTITY + pipe
        opt = mo.Modular(ps, *pipe)
        assert opt._skip_on_device == on_device
        for k in range(6):
            g = torch.Generator().manual_seed(k)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            if k == 3:
                ps[1].grad[0] = float("nan")
            opt.step()
        ends.append([p.detach().clone() for p in ps])
    for a, b in zip(*ends):
        assert torch.equal(a, b)
DEVICE = [(n, t) for n, t in EXAMPLES if mo.roles.skips_on_device(t)]
HOST = [(n, t) for n, t in EXAMPLES if not mo.roles.skips_on_device(t)]
#: every built-in transform skips on the device: a transform that does not declare it stands for the rest
HOST = HOST or [("needs-the-host", needs_the_host())]


def test_the_benchmark_pipelines_and_most_transforms_skip_on_device():
    for make in ([mo.ClipNorm(1.0), mo.Adam()], [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam()],
                 [mo.ZClip(), mo.AdamW()], [mo.ClipValue(0.01), mo.SGD(0.01, momentum=0.9)]):
        assert all(mo.roles.skips_on_device(t) for t in make)
    # dampening too, in the transform or in a param group (its buffers' "started" flags: the first buffer is g)
    assert mo.roles.skips_on_device(mo.SGD(momentum=0.9, dampening=0.1))
    assert mo.roles.skips_on_device(mo.SGD(momentum=0.9), [{"momentum": 0.9, "dampening": 0.1}])
    assert mo.roles.skips_on_device(mo.SGD(momentum=0.9), [{"momentum": 0.9, "dampening": 0.0}])
    names = {n.split("-")[0] for n, _ in DEVICE}
    assert {"ClipNorm", "Normalize", "ZClip", "HistClip", "ClipNormGrowth", "Adam", "AdamW", "LR", "SGD",
            "ClipNormByRMS", "Masked", "Chain"} <= names


@pytest.mark.parametrize("name,t", DEVICE, ids=[n for n, _ in DEVICE])
def test_no_host_sync_and_a_skipped_step_changes_nothing(name, t):
    m = model()
    opt = mo.Modular(groups(m), *pipeline_of(t))
    syncs = Syncs()
    for k in range(6):  # warm-ups and created state first
        backward(m, k)
        with syncs:
            opt.step()
    before = saved(opt, m)
    for _ in range(calls_per_cycle(t)):  # Accumulate counts a skipped call too: skip a whole cycle
        backward(m, 99, poison=True)
        with syncs:
            opt.step()
    assert syncs.n == 0, f"{syncs.n} host syncs in default steps"
    assert bool(opt.stats["skipped"]) and bool(opt.stats["nonfinite"])
    same(before, saved(opt, m))
    assert int(opt.stats["skipped_steps"]) == calls_per_cycle(t)


def calls_per_cycle(t) -> int:
    """1, or the cycle of a transform in `t` that counts every call, skipped or not: an `Accumulate`'s
    `steps`, a `Lookahead`'s `k` (a whole skipped cycle leaves the phase as it was)."""
    for _, x in walk([t]):
        if isinstance(x, mo.Accumulate):
            return x.steps
        if isinstance(x, mo.Lookahead):
            return x.k
    return 1


@pytest.mark.parametrize("name,t", DEVICE, ids=[n for n, _ in DEVICE])
def test_a_skipped_step_leaves_the_trajectory_as_without_it(name, t):
    """Steps 0..9 with a NaN step (a whole cycle of them for Accumulate) inserted after step 5 end where
    steps 0..9 alone end, bit for bit."""
    ends = []
    for poison in (False, True):
        m = model()
        opt = mo.Modular(groups(m), *pipeline_of(t))
        for k in range(10):
            if poison and k == 6:
                for _ in range(calls_per_cycle(t)):
                    backward(m, 99, poison=True)
                    opt.step()
            backward(m, k)
            opt.step()
        ends.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*ends):
        assert torch.equal(a, b)


def torch_reads(t, m) -> int:
    """The host reads torch.optim's own step makes over 4 steps, for an Adam/AdamW/SGD transform in `t`
    that runs torch's non-fused kernel (0 otherwise)."""
    opts = [x for _, x in walk([t]) if isinstance(x, (mo.Adam, mo.SGD)) and x.torch_kernel()]
    if not opts:
        return 0
    x = opts[0]
    if isinstance(x, mo.Adam) and x.foreach is not True:
        # on these CPU tensors modopt's own for-loop runs (`kernels.loop_adam_`): it reads the CPU step
        # counts in one list read (`tolist`, no dispatcher call) where torch's makes an .item() per tensor
        return 0
    cls = torch.optim.SGD if isinstance(x, mo.SGD) else torch.optim.Adam
    kw = {k: getattr(x, k) for k in (*x.group_keys, "foreach", "fused")}
    if isinstance(x, mo.Adam):
        kw["decoupled_weight_decay"] = x.decoupled
    ps = [torch.nn.Parameter(p.detach().clone()) for p in m.parameters()]
    ref, syncs = cls(ps, **kw), Syncs()
    for _ in range(4):
        for p in ps:
            p.grad = torch.randn_like(p)
        with syncs:
            ref.step()
    return syncs.n


@pytest.mark.parametrize("name,t", HOST, ids=[n for n, _ in HOST])
def test_the_others_decide_on_the_host_once_a_step(name, t):
    m = model()
    opt = mo.Modular(groups(m), *pipeline_of(t))
    syncs = Syncs()
    for k in range(4):
        backward(m, k)
        with syncs:
            opt.step()
    # an optimizer on torch's non-fused kernels (`fused=False`, `foreach`): torch's own step reads its
    # CPU step counts with .item() (no device wait on a GPU): counted by running torch the same way
    assert syncs.n == 4 + torch_reads(t, m)


@pytest.mark.parametrize("make", [
    lambda: [mo.ClipNorm(1.0), mo.Adam(lr=1e-2)],
    lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(lr=1e-2)],
    lambda: [mo.ZClip(warmup_steps=3), mo.AdamW(lr=1e-2)],
], ids=["ClipNorm+Adam", "mission", "ZClip+AdamW"])
@pytest.mark.compile
def test_fullgraph_with_the_defaults_equals_eager_with_nan_steps_and_a_scheduler(make):
    torch._dynamo.reset()
    a, b = model(), model()
    eager, comp = mo.Modular(groups(a), *make()), mo.Modular(groups(b), *make())
    step = torch.compile(comp.step, fullgraph=True)
    sa = torch.optim.lr_scheduler.StepLR(eager, step_size=3, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(comp, step_size=3, gamma=0.5)
    for k in range(12):
        for m in (a, b):
            backward(m, k, poison=k in (2, 7))
        eager.step()
        step()
        sa.step()
        sb.step()
        assert bool(comp.stats["skipped"]) == (k in (2, 7))
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert int(comp.stats["skipped_steps"]) == 2


@pytest.mark.parametrize("name,t", DEVICE, ids=[n for n, _ in DEVICE])
def test_on_a_cpu_the_host_reads_the_decision_and_ends_where_the_device_path_ends(name, t, monkeypatch):
    """On a CPU the step reads the device's decision back (a sync that only reads memory) and runs the
    plain chain: every parameter, every saved value and the skip count equal the device path's, bit for
    bit, with NaN steps (a whole cycle of them for Accumulate and Lookahead)."""
    from modopt.core import hostdata

    ends, hosts = [], []
    for host in (True, False):
        monkeypatch.setattr(hostdata.Host, "device_path", not host)
        m = model()
        opt = mo.Modular(groups(m), *pipeline_of(t))
        for k in range(9):
            if k in (3, 6):
                for _ in range(calls_per_cycle(t)):
                    backward(m, 99, poison=True)
                    opt.step()
            backward(m, k)
            opt.step()
        ends.append((saved(opt, m), int(opt.stats["skipped_steps"])))
        hosts.append(opt.plan.host_on_cpu)
    assert hosts[0] == (not any(isinstance(x, mo.roles.SkipDecider) for _, x in walk([t]))), name  # (SkipStep: the device's count)
    host, device = ends[0][0], ends[1][0]
    for k in set(device) - set(host):  # the device path's "started" flags: a value with no flag has started
        assert k.endswith(".started") and bool(device.pop(k).all()), k
    same(host, device)
    assert ends[0][1] == ends[1][1] == 2 * calls_per_cycle(t)


def test_on_a_cpu_an_overflowing_norm_skips_as_on_the_device(monkeypatch):
    """Finite gradients whose total 2-norm overflows float32 skip the step on both paths (the device's
    rule, the careful loop's `if clip_grad_norm_(...).isfinite()`), not only where the host decided alone."""
    from modopt.core import hostdata

    for host in (True, False):
        monkeypatch.setattr(hostdata.Host, "device_path", not host)
        p = torch.nn.Parameter(torch.ones(4))
        opt = mo.Modular([p], mo.ClipNorm(1.0), mo.Adam(lr=0.1))
        p.grad = torch.tensor([1e30, 1.0, -1.0, 0.0])
        opt.step()
        assert torch.equal(p.detach(), torch.ones(4)), host
        assert bool(opt.stats["skipped"]) and int(opt.stats["skipped_steps"]) == 1


def test_the_device_path_is_each_optimizers_own():
    """`opt.device_path = True` puts that optimizer, and no other, on the device path (what a GPU runs: no
    host read of any value in the step), ending where the host path ends, bit for bit; the step reads the
    switch once, when it is made (`Step.host_reads`, `Step.cpu_kernels`), so nothing in the step reads a
    process-wide flag: setting the class default after the step began changes nothing in it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from modopt.core import hostdata

    reads = {"n": 0}

    class HostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            reads["n"] += func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)
            return func(*args, **(kwargs or {}))

    def run(device_path):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
        opt = mo.Modular(ps, mo.ZClip(), mo.ClipNormByEMA(scope="tensor"), mo.Adam(lr=1e-2))
        if device_path:
            opt.device_path = True
        reads["n"] = 0
        for k in range(6):
            g = torch.Generator().manual_seed(k)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g) * (1e3 if k == 3 else 1.0)
            if k == 4:
                ps[0].grad[0, 0] = float("nan")
            with HostReads():
                opt.step()
        return [p.detach().clone() for p in ps], reads["n"], opt

    host_params, host_n, host_opt = run(False)
    dev_params, dev_n, dev_opt = run(True)
    assert host_n > 0 and dev_n == 0, (host_n, dev_n)
    assert all(torch.equal(a, b) for a, b in zip(host_params, dev_params))
    assert host_opt.device_path is False and hostdata.Host.device_path is False  # (the other, and the default)
    # inside `hostdata.device_path()` (the default every host without its own setting reads) an optimizer that
    # set `device_path = False` keeps the host path, and the others take the device path
    with hostdata.device_path():
        _, own_n, _ = run(False)  # (a new optimizer: the default, the device path)
        host_opt.device_path = False
        reads["n"] = 0
        with HostReads():
            host_opt.step()
    assert own_n == 0 and reads["n"] > 0


@pytest.mark.parametrize("value", ["False", 1, None, torch.tensor(True)])
@pytest.mark.parametrize("host", ["Modular", "attach"])
def test_a_device_path_that_is_not_a_bool_is_refused_before_anything_moves(host, value):
    """`opt.device_path` is True or False: the string "False" (truthy) or a tensor set by hand is refused with
    a `TypeError` naming it, the parameters and the state as they were; True then steps."""
    p = torch.nn.Parameter(torch.randn(4))
    if host == "Modular":
        opt = handle = mo.Modular([p], mo.ClipNorm(0.5), mo.Adam(lr=0.1))
    else:
        opt = torch.optim.Adam([p], lr=0.1)
        handle = mo.attach(opt, mo.ClipNorm(0.5))
    p.grad = torch.ones(4)
    opt.step()
    before, state = p.detach().clone(), copy.deepcopy(opt.state_dict())
    handle.device_path = value
    with pytest.raises(TypeError, match=r"device_path is .*True .* or False"):
        opt.step()
    assert torch.equal(p, before)
    assert_same(opt.state_dict(), state)
    handle.device_path = True
    opt.step()
    assert not torch.equal(p, before)
