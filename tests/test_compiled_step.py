"""`mo.compile_step`: the whole step compiled with torch's fused Adam kept as one op, the same bits as
the eager step on the CPU (a non-finite step in the middle skipped alike); and the
learning rate as a device tensor (`mo.tensor_hyperparams`): the same bits as the float, a scheduler
writing it in place without a recompile. `mo.cuda_graph_step` needs CUDA: here only its refusals."""

from __future__ import annotations

import warnings

import pytest
import torch

import modopt as mo

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
    (pa, oa), (pb, ob) = a, b
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    assert int(oa.stats["skipped_steps"]) == int(ob.stats["skipped_steps"]) == len(BAD_STEPS)


PIPELINES = {
    "ClipNorm+Adam": lambda: [mo.ClipNorm(1.0), mo.Adam(lr=1e-2)],
    "ClipNorm+AdamW(amsgrad)": lambda: [mo.ClipNorm(0.5), mo.AdamW(lr=1e-2, amsgrad=True, weight_decay=0.1)],
    "Adam": lambda: [mo.Adam(lr=1e-2, weight_decay=0.01)],
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


def test_the_compiled_graph_calls_the_fused_kernel_through_its_op(monkeypatch):
    """After the eager warm-up, Adam's update comes from the custom op inside the graph (its body is
    the only caller of `kernels.fused_adam_` then), once per param group and call, never from the
    eager path (`_run_fused_adam`) nor replaced by inductor's own loops."""
    import inspect

    from modopt.core import kernels

    callers = []
    real = kernels.fused_adam_

    def spy(*a, **k):
        callers.append(inspect.stack()[1].function)
        return real(*a, **k)

    monkeypatch.setattr(kernels, "fused_adam_", spy)
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
