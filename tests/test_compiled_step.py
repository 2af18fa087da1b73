"""`mo.compile_step`: the whole step compiled with torch's fused Adam kept as one op, the same bits as
the eager step on the CPU (a non-finite step in the middle skipped alike); and the
learning rate as a device tensor (`mo.tensor_hyperparams`): the same bits as the float, a scheduler
writing it in place without a recompile. `mo.cuda_graph_step` needs CUDA: here only its refusals."""

from __future__ import annotations

import warnings

import pytest
import torch

import modopt as mo

pytestmark = pytest.mark.compile  # the whole file compiles (the compile lane)

BAD_STEPS = (3,)  # a NaN gradient element: the step must be skipped


def _params(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(32, 16), (32,), (16, 32), (16,), (8, 16), (8,)][:n]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(ps, it):
    g = torch.Generator().manual_seed(1000 + it)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * (30.0 if it % 3 == 2 else 1.0)
    if it in BAD_STEPS:
        ps[2].grad[1, 1] = float("nan")


def _run(pipeline, how, steps=8, sched=False, lr_tensor=False):
    ps = _params()
    opt = mo.Modular([{"params": ps[:4]}, {"params": ps[4:], "lr": 3e-3}], *pipeline())
    if lr_tensor:
        mo.tensor_hyperparams(opt)
    step = mo.compile_step(opt) if how == "compile_step" else opt.step
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if sched else None
    for it in range(steps):
        _grads(ps, it)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step()
        if it in BAD_STEPS:
            assert bool(opt.stats["skipped"])
        if sch is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sch.step()
    return ps, opt


def _same_bits(a, b):
    _same_now(a, b)
    assert int(a[1].stats["skipped_steps"]) == len(BAD_STEPS)


PIPELINES = {
    "ClipNorm+Adam": lambda: [mo.ClipNorm(1.0), mo.Adam(lr=1e-2)],
    "ClipNorm+AdamW(amsgrad)": lambda: [mo.ClipNorm(0.5), mo.AdamW(lr=1e-2, amsgrad=True, weight_decay=0.1)],
    "Adam": lambda: [mo.Adam(lr=1e-2, weight_decay=0.01)],
    "ClipValue+Adam": lambda: [mo.ClipValue(0.5), mo.Adam(lr=1e-2)],
    "Normalize+Adam": lambda: [mo.Normalize(), mo.Adam(lr=1e-2)],
    "ClipNormByRMS+AdamW": lambda: [mo.ClipNormByRMS(1.0), mo.AdamW(lr=1e-2)],
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_compile_step_same_bits_as_eager(name):
    _same_bits(_run(PIPELINES[name], "eager"), _run(PIPELINES[name], "compile_step"))


def test_compile_step_with_a_scheduler_and_a_tensor_lr():
    pipe = PIPELINES["ClipNorm+Adam"]
    eager = _run(pipe, "eager", sched=True)
    _same_bits(eager, _run(pipe, "eager", sched=True, lr_tensor=True))
    _same_bits(eager, _run(pipe, "compile_step", sched=True, lr_tensor=True))


def test_no_recompile_when_a_scheduler_writes_a_tensor_lr():
    ps = _params()
    opt = mo.Modular(ps, mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    mo.tensor_hyperparams(opt)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float64
    step = mo.compile_step(opt)
    sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for it in range(3):
            _grads(ps, it + 10)
            step()
            sch.step()
        assert opt.param_groups[0]["lr"] is lr  # written in place
        torch._dynamo.config.error_on_recompile = True
        try:
            for it in range(3):
                _grads(ps, it + 20)
                step()  # (a dispatch mode would make dynamo run the step eagerly: syncs are not counted here)
                sch.step()
        finally:
            torch._dynamo.config.error_on_recompile = False


def test_cuda_graph_step_refuses_cpu_parameters():
    ps = _params()
    opt = mo.Modular(ps, mo.ClipNorm(1.0), mo.Adam())
    with pytest.raises(RuntimeError, match="CUDA device"):
        mo.cuda_graph_step(opt)


def test_compile_step_refuses_unknown_guards():
    opt = mo.Modular(_params(), mo.Adam())
    with pytest.raises(ValueError, match="guards"):
        mo.compile_step(opt, guards="none")


def _kernel_callers(monkeypatch) -> list[str]:
    """The names of the functions that call `kernels.fused_adam_` from now on (`_op`: the graph's op)."""
    import inspect

    from modopt.core import kernels

    callers: list[str] = []
    real = kernels.fused_adam_

    def spy(*a, **k):
        callers.append(inspect.stack()[1].function)
        return real(*a, **k)

    monkeypatch.setattr(kernels, "fused_adam_", spy)
    return callers


def test_the_compiled_graph_calls_the_fused_kernel_through_its_op(monkeypatch):
    """After the eager warm-up, Adam's update comes from the custom op inside the graph (its body is
    the only caller of `kernels.fused_adam_` then), once per param group and call, never from the
    eager path (`kernels.AdamPlan.run`) nor replaced by inductor's own loops."""
    callers = _kernel_callers(monkeypatch)
    ps = _params()
    opt = mo.Modular([{"params": ps[:4]}, {"params": ps[4:], "lr": 3e-3}], mo.ClipNorm(1.0), mo.Adam())
    step = mo.compile_step(opt)
    for it in range(4):
        _grads(ps, it if it != 3 else 4)
        callers.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step()
        if it == 0:  # the eager warm-up step: the fused kernel from the eager path
            assert len(callers) == 2 and "_op" not in callers, callers
        else:
            assert callers == ["_op", "_op"], (it, callers)


DEFERRED = {
    "ClipNorm+Adam": (PIPELINES["ClipNorm+Adam"], "0:ClipNorm"),
    "ZClip+AdamW": (lambda: [mo.ZClip(warmup_steps=2), mo.AdamW(lr=1e-2)], "0:ZClip"),
    "per-tensor ClipNorm+Adam": (lambda: [mo.ClipNorm(1.0, scope="tensor"), mo.Adam(lr=1e-2)], "0:ClipNorm"),
    "mission": (lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(lr=1e-2)], "1:Normalize"),
    "ClipNormByEMA+Adam": (lambda: [mo.ClipNormByEMA(max_ema_growth=None), mo.Adam(lr=1e-2)], "0:ClipNormByEMA"),
    "Accumulate+ClipNorm+Adam": (lambda: [mo.Accumulate(2), mo.ClipNorm(1.0), mo.Adam(lr=1e-2)], "1:ClipNorm"),
}
#: the eager stepping call writes the accumulated mean into `.grad`; the traced one sums out of place
#: and leaves `.grad` as backward left it
OWN_BUFFER = {"Accumulate+ClipNorm+Adam"}


@pytest.mark.parametrize("name", sorted(DEFERRED))
def test_the_graph_scales_the_gradients_in_place_inside_the_op(monkeypatch, name):
    """The global or per-tensor scale right before the fused Adam (`Plan.deferred`) is multiplied inside
    the op: the kernel reads each parameter's own `.grad` (the graph makes no copy of the scaled
    gradients), after every step that goes ahead the gradients hold the eager step's scaled values, bit
    for bit, and a skipped step leaves them as they came, as the eager step does. Every state tensor
    stays the eager step's: a state the graph writes back after the op must not read the gradients the
    op has scaled, bit for bit (the EMAs' lerp is aten's, as eager: `modopt::lerp_`)."""
    from modopt.core import kernels

    seen = []
    real = kernels.fused_adam_

    def spy(params, grads, *a, **k):
        seen.append(all(g.data_ptr() == p.grad.data_ptr() for p, g in zip(params, grads)))
        return real(params, grads, *a, **k)

    monkeypatch.setattr(kernels, "fused_adam_", spy)
    pipeline, key = DEFERRED[name]
    assert _quiet(mo.Modular, _params(), *pipeline()).plan.deferred == key
    eager, comp = _params(), _params()
    oe, oc = _quiet(mo.Modular, eager, *pipeline()), _quiet(mo.Modular, comp, *pipeline())
    step = mo.compile_step(oc)
    for it in range(6):
        _grads(eager, it)
        _grads(comp, it)
        came = [p.grad.clone() for p in comp]
        _quiet(oe.step)
        _quiet(step)
        if it in BAD_STEPS or name in OWN_BUFFER:
            assert all(_bitwise(g, q.grad) for g, q in zip(came, comp)), it
        if name not in OWN_BUFFER:
            assert all(_bitwise(p.grad, q.grad) for p, q in zip(eager, comp)), it
        assert all(_bitwise(p, q) for p, q in zip(eager, comp)), it
        se, sc = oe.state_dict()["state"], oc.state_dict()["state"]
        for i in se:
            for k, v in se[i].items():
                if isinstance(v, torch.Tensor):
                    assert _bitwise(sc[i][k], v), (it, i, k, sc[i][k], v)
    assert int(oc.stats["skipped_steps"]) == int(oe.stats["skipped_steps"]) == len(BAD_STEPS)
    scale = oc.stats[f"{key}.scale"]
    assert float(scale.min()) != 1.0  # (the scale was not 1 on the last step: the multiply mattered)
    assert seen and (all(seen) or name in OWN_BUFFER), seen  # (there the op scales the graph's own sums)


@pytest.mark.parametrize("name", ["mission", "ClipNormByEMA+Adam"])
def test_the_device_path_keeps_the_eager_bits_of_the_ema(name):
    """On the device path (what a GPU runs: the skip decided on the device, `hostdata.device_path`) the
    EMA's op (`modopt::lerp_`) reads a skipped step's inf/NaN elements as 0, as the eager device path's
    cleaning does: parameters and every state tensor bit for bit with eager, the NaN step included."""
    from modopt.core import hostdata

    pipeline, _ = DEFERRED[name]
    eager, comp = _params(), _params()
    oe, oc = _quiet(mo.Modular, eager, *pipeline()), _quiet(mo.Modular, comp, *pipeline())
    step = mo.compile_step(oc)
    with hostdata.device_path():
        for it in range(6):
            _grads(eager, it)
            _grads(comp, it)
            _quiet(oe.step)
            _quiet(step)
            assert all(_bitwise(p, q) for p, q in zip(eager, comp)), it
            se, sc = oe.state_dict()["state"], oc.state_dict()["state"]
            for i in se:
                for k, v in se[i].items():
                    if isinstance(v, torch.Tensor):
                        assert _bitwise(sc[i][k], v), (it, i, k)
    assert int(oc.stats["skipped_steps"]) == int(oe.stats["skipped_steps"]) == len(BAD_STEPS)


@pytest.mark.parametrize("guards", ["full", "own", "tensors"])
def test_the_compiled_step_counts_on_from_a_replaced_or_loaded_step_count(monkeypatch, guards):
    """The graph advances the step counts the eager step packed into one tensor. A step tensor replaced by
    hand and a loaded state dict (new tensors, no longer views of the packed one): the compiled step
    counts on from the new values, parameters and counts bit for bit with eager, under each kind of
    guard (`CompiledStep` runs such a call eagerly, which packs them again), and the calls after run
    the graph again."""
    import copy

    callers = _kernel_callers(monkeypatch)

    def grads(ps, it):
        g = torch.Generator().manual_seed(100 + it)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)

    eager, comp, other = _params(3), _params(3), _params(3)
    oe, oc, ox = (_quiet(mo.Modular, ps, mo.ClipNorm(1.0), mo.Adam(lr=1e-2)) for ps in (eager, comp, other))
    step = mo.compile_step(oc, guards=guards)
    for it in range(7):
        grads(other, it)
        _quiet(ox.step)
    graph = []
    for it in range(8):
        if it == 4:
            saved = ox.state_dict()
            oe.load_state_dict(copy.deepcopy(saved))
            oc.load_state_dict(copy.deepcopy(saved))
        if it == 2:
            for o, ps in ((oe, eager), (oc, comp)):
                key = next(k for k in o.state[ps[0]] if k.endswith("step"))
                o.state[ps[0]][key] = torch.tensor(20.0)
        grads(eager, it)
        grads(comp, it)
        _quiet(oe.step)
        callers.clear()
        _quiet(step)
        assert all(_bitwise(p, q) for p, q in zip(eager, comp)), it
        graph.append("_op" in callers)
    # (the warm-up and the calls right after the state changed run eagerly; every other call the graph)
    assert graph == [False, True, False, True, False, True, True, True], graph
    counts = [oc.state[p][k] for p in comp for k in oc.state[p] if k.endswith("step")]
    assert [float(c) for c in counts] == [7.0 + 4.0] * 3


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu", "device_path"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["mission", "NormalizeByEMA+Adam", "ClipValueByEMA+Adam",
                                  "ClipNormByEMA(ema_init='update')+Adam"])
def test_the_ema_op_gives_the_eager_bits_in_every_dtype(name, dtype, device_path):
    """`modopt::lerp_` (the EMA of `ClipNormByEMA` / `NormalizeByEMA` / `ClipValueByEMA`, and an EMA that starts
    at the first update) in float32, float64 and bfloat16, on the CPU's path and the device path:
    parameters and every state tensor equal to eager's, the NaN step skipped alike. One exception, within
    bfloat16's rounding instead: `ClipValueByEMA` in bfloat16, whose eager lerp takes its weight as a float
    that a 0-d bfloat16 weight cannot hold, so the compiled step keeps inductor's lerp there."""
    import contextlib

    from modopt.core import hostdata

    exact = not (name == "ClipValueByEMA+Adam" and dtype == torch.bfloat16)
    same = torch.equal if exact else (lambda a, b: torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-4))
    pipelines = {"mission": DEFERRED["mission"][0],
                 "NormalizeByEMA+Adam": lambda: [mo.NormalizeByEMA(), mo.Adam(lr=1e-2)],
                 "ClipValueByEMA+Adam": lambda: [mo.ClipValueByEMA(), mo.Adam(lr=1e-2)],
                 "ClipNormByEMA(ema_init='update')+Adam": lambda: [mo.ClipNormByEMA(ema_init="update"),
                                                                   mo.Adam(lr=1e-2)]}
    sides = []
    for compiled in (False, True):
        ps = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params()]
        opt = _quiet(mo.Modular, ps, *pipelines[name]())
        step = mo.compile_step(opt) if compiled else opt.step
        with hostdata.device_path() if device_path else contextlib.nullcontext():
            for it in range(6):
                like = _params()
                _grads(like, it)  # (float32, then each parameter's dtype: NaN at the same place)
                for p, q in zip(ps, like):
                    p.grad = q.grad.to(dtype)
                _quiet(step)
        sides.append((ps, opt))
    (pe, oe), (pc, oc) = sides
    assert all(same(a, b) for a, b in zip(pe, pc))
    se, sc = oe.state_dict()["state"], oc.state_dict()["state"]
    for i in se:
        for k, v in se[i].items():
            if isinstance(v, torch.Tensor):
                assert same(sc[i][k], v), (i, k)
    assert int(oc.stats["skipped_steps"]) == int(oe.stats["skipped_steps"]) == len(BAD_STEPS)


def _bitwise(a, b):
    """Bit for bit, NaNs included (float32)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


# --- guards="own": modopt's own key instead of dynamo's guards ------------------------------------------
OWN_PIPELINES = {
    "ClipNorm + Adam": lambda: [mo.ClipNorm(1.0), mo.Adam()],
    "mission": lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam()],
    "ZClip + AdamW": lambda: [mo.ZClip(), mo.AdamW()],
}


def _quiet(fn, *a):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a)


def _same_now(a, b):
    """Parameters, every state tensor and the skip count bit for bit (at any step)."""
    (pa, oa), (pb, ob) = a, b
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    assert int(oa.stats["skipped_steps"]) == int(ob.stats["skipped_steps"])


def _twins(pipeline, lr_tensor=True, n=2):
    """The same optimizer `n` times on copies of the same params; the last under `compile_step(guards="own")`."""
    out = []
    for _ in range(n):
        ps = _params()
        opt = _quiet(mo.Modular, [{"params": ps[:4]}, {"params": ps[4:], "lr": 3e-3}], *pipeline())
        if lr_tensor:
            mo.tensor_hyperparams(opt)
        out.append((ps, opt))
    return out, mo.compile_step(out[-1][1], guards="own")


@pytest.mark.parametrize("name", list(OWN_PIPELINES))
def test_own_guards_give_the_guarded_bits_and_run_guard_free_graphs(name):
    """Every step bit for bit with `compile_step(opt)` under dynamo's guards, and for ClipNorm + Adam with
    eager `opt.step()` too (the other two round their EMAs in inductor's loops: within 1e-5 of eager), a
    NaN step in the middle skipped alike; once the key is stable the calls run one guard-free graph."""
    (eager, full, own), step = _twins(OWN_PIPELINES[name], n=3)
    full_step = mo.compile_step(full[1])
    for it in range(8):
        for ps, _ in (eager, full, own):
            _grads(ps, it)
        _quiet(eager[1].step)
        _quiet(full_step)
        _quiet(step)
        _same_now(full, own)
        if name == "ClipNorm + Adam":
            _same_now(eager, own)
        else:
            for p, q in zip(eager[0], own[0]):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert int(own[1].stats["skipped_steps"]) == len(BAD_STEPS)
    assert len(step._fast) == 1


def test_own_guards_never_run_a_stale_graph():
    """What the guard-free graph took as constants changes: a float learning rate (rebound, as a scheduler
    does), the betas, a loaded state dict (new state tensors), a new param group, a step hook. Each
    time the compiled step matches the eager one bit for bit: a changed key goes to dynamo's guards."""
    (eager, comp), step = _twins(OWN_PIPELINES["ClipNorm + Adam"], lr_tensor=False)
    seen = []
    extra = [[torch.nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(7)))] for _ in range(2)]

    def change(it, opt, which):
        if it == 4:
            opt.param_groups[0]["lr"] = 0.5  # a float: the traced graph had 1e-3
        if it == 6:
            opt.param_groups[1]["betas"] = (0.5, 0.9)
        if it == 8:
            opt.load_state_dict(eager[1].state_dict() if which else opt.state_dict())
        if it == 10:
            opt.add_param_group({"params": extra[which]})
        if it == 12:
            opt.register_step_post_hook(lambda o, a, k: seen.append(which))

    for it in range(16):
        for which, (ps, opt) in enumerate((eager, comp)):
            _grads(ps + extra[which], it)
            change(it, opt, which)
        _quiet(eager[1].step)
        _quiet(step)
        _same_now(eager, comp)
        for p, q in zip(extra[0], extra[1]):
            assert torch.equal(p, q)
    assert seen.count(0) == seen.count(1) == 4  # the hook ran in every compiled step too
    assert 1 <= len(step._fast) <= 4  # (new keys got graphs of their own, up to the limit)


def test_own_key_changes_with_what_the_graph_reads():
    ps = _params()
    opt = _quiet(mo.Modular, ps, mo.ClipNorm(1.0), mo.Adam())
    _grads(ps, 0)
    opt.step()
    from modopt.core.compiled import own_key

    k0 = own_key(opt)
    assert own_key(opt) == k0  # stable while nothing changes
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = lr * 2
    assert own_key(opt) != k0
    opt.param_groups[0]["lr"] = lr
    assert own_key(opt) == k0
    ps[0].grad = None
    assert own_key(opt) != k0  # which parameters have a gradient
    _grads(ps, 1)
    ps[0].grad = ps[0].grad.t().contiguous().t() if ps[0].dim() == 2 else ps[0].grad
    assert own_key(opt) != k0  # a non-contiguous gradient
    _grads(ps, 1)
    opt.state[ps[0]]["extra"] = torch.zeros(())
    assert own_key(opt) != k0  # a new state entry
    del opt.state[ps[0]]["extra"]
    # what inductor's size asserts would check, which the guard-free graphs leave out: a parameter given another
    # shape or layout through `.data` (the same object), a state tensor resized in place
    data = ps[0].data
    ps[0].data = data.reshape(-1)
    assert own_key(opt) != k0
    ps[0].data = data.t().contiguous().t()
    assert own_key(opt) != k0
    ps[0].data = data
    assert own_key(opt) == k0
    moment = next(v for v in opt.state[ps[0]].values() if v.dim() > 0)
    kept = moment.clone()
    moment.resize_(moment.numel() + 1)
    assert own_key(opt) != k0
    moment.resize_(kept.shape).copy_(kept)
    assert own_key(opt) == k0
    assert own_key(opt, loss=torch.tensor(1.0)) != own_key(opt)
    # numbers count by value, never by id: a freed float's id can come back as another value's
    opt.param_groups[0]["lr"] = float(repr(lr))  # another object, the same value
    assert own_key(opt) == k0
    opt.param_groups[0]["lr"] = lr * 3
    k3 = own_key(opt)
    opt.param_groups[0]["lr"] = lr * 5
    assert own_key(opt) != k3
    opt.param_groups[0]["lr"] = 1  # an int traces as its own value and type
    k1 = own_key(opt)
    opt.param_groups[0]["lr"] = 1.0
    assert own_key(opt) != k1


@pytest.mark.parametrize("guards", ["full", "own"])
def test_the_graph_takes_each_state_by_its_position(guards):
    """The traced step reaches a parameter's state through the rows `CompiledStep` fills before each call
    (`step.STATE_ROWS`): one index each, where `opt.state[p]` made dynamo walk the state dict's keys to
    p's position on every call (`dict_keys_getitem`, quadratic in the parameters). Counted with a profile
    hook over the compiled calls; bit for bit with eager along the way."""
    import sys

    (eager, comp), step = _twins(OWN_PIPELINES["mission"], lr_tensor=False)
    if guards == "full":
        step = mo.compile_step(comp[1])
    walks = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "dict_keys_getitem":
            walks.append(1)

    for it in range(5):
        for ps, _ in (eager, comp):
            _grads(ps, it)
        _quiet(eager[1].step)
        sys.setprofile(hook)
        try:
            _quiet(step)
        finally:
            sys.setprofile(None)
        _same_now(eager, comp)
    assert walks == []


@pytest.mark.parametrize("guards", ["full", "own"])
def test_compile_step_with_parameters_without_a_gradient_and_a_state_replaced(guards):
    """Parameters without a gradient on some steps (the traced step's states are taken by their position
    among all the parameters) and a parameter's state dict replaced by a copy by hand: bit for bit with
    eager, state included."""
    (eager, comp), step = _twins(OWN_PIPELINES["mission"], lr_tensor=False)
    if guards == "full":
        step = mo.compile_step(comp[1])
    for it in range(9):
        for ps, opt in (eager, comp):
            _grads(ps, it)
            if it % 3 == 1:
                ps[1].grad = ps[4].grad = None
            if it == 5:
                opt.state[ps[2]] = {k: v.clone() for k, v in opt.state[ps[2]].items()}
        _quiet(eager[1].step)
        _quiet(step)
        _same_now(eager, comp)


@pytest.mark.parametrize("guards", ["full", "own"])
def test_compile_step_with_a_masked_selection(guards):
    """A `Masked` selection (the 1-D parameters, which do not stand first) runs a sub-step over its own
    layout: the traced sub-step takes its parameters' states by their positions among all the
    parameters, bit for bit with eager, state included."""
    pipeline = lambda: [mo.Masked(mo.ClipValueByEMA(), mo.ClipNormByEMA(), where=mo.Select(max_ndim=1)),
                        mo.ClipNorm(1.0), mo.Adam(lr=1e-2)]  # noqa: E731
    (eager, comp), step = _twins(pipeline, lr_tensor=False)
    if guards == "full":
        step = mo.compile_step(comp[1])
    for it in range(6):
        for ps, _ in (eager, comp):
            _grads(ps, it)
        _quiet(eager[1].step)
        _quiet(step)
        _same_now(eager, comp)
