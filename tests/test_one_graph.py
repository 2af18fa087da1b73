"""One graph: a scheduler that changes hyperparameters reruns the compiled step, it does
not recompile it; every conformance example compiled to one graph, by `torch.compile` and by
`mo.compile_step`, equal to eager. One compile per case (compiles are slow on a CPU);
`tests/test_device_skip.py` checks that `fullgraph=True` equals eager for the benchmark pipelines."""

from __future__ import annotations

import pytest
import torch

import modopt as mo
from modopt.core.transform import walk

pytestmark = pytest.mark.compile  # the whole file compiles (the compile lane)


def test_onecycle_changing_lr_and_beta1_does_not_recompile_the_default_step():
    torch._dynamo.reset()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)))
    eager = mo.Modular(models[0].parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    comp = mo.Modular(models[1].parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    step = torch.compile(comp.step, fullgraph=True)  # before the scheduler wraps opt.step
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20) for o in (eager, comp)]
    betas = set()
    try:
        for k in range(10):
            for m in models:
                g = torch.Generator().manual_seed(k)
                m.zero_grad()
                m(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
                if k == 6:
                    m[0].weight.grad[0, 0] = float("nan")
            if k == 2:  # the first steps create the state (one recompile, on the state's existence)
                torch._dynamo.config.error_on_recompile = True
            eager.step()
            step()
            for s in scheds:
                s.step()
            betas.add(comp.param_groups[0]["betas"][0])
            for p, q in zip(*(m.parameters() for m in models)):
                torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert len(betas) == 10  # OneCycleLR moved beta1 every step
    assert int(comp.stats["skipped_steps"]) == 1


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _pipeline(t):
    if isinstance(t, mo.roles.WeightStage):  # (after the optimizer's write)
        return [mo.Adam(lr=1e-2), t]
    return [t] if isinstance(t, mo.roles.Optimizer) or isinstance(t, mo.roles.LastWriter) else [t, mo.Adam(lr=1e-2)]


def _backward(m, k):
    g = torch.Generator().manual_seed(k)
    m.zero_grad()
    # a batch of 8 gives every weight's gradient full rank: Newton-Schulz multiplies a rank-deficient
    # gradient's zero singular direction (rounding noise) by up to 3.4 per step (quintic's slope at 0), which
    # turns the compiled kernels' other rounding into 1e-4 differences after 7 steps
    (m(torch.randn(8, 6, generator=g)).pow(2).mean() * (1 + 20 * (k == 4))).backward()
    if k in (2, 5):
        m[2].weight.grad[0, 1] = float("nan")  # one element of one tensor


def _saved(opt):
    sd = opt.state_dict()
    return {"state": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for i, s in sd["state"].items()},
            "store": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                      for k, s in sd["modopt"]["transforms"].items()}}


def _examples():
    from examples import base_examples

    # TorchOptimizer runs outside the graph (below); an optimizer on torch's non-fused kernels (`fused=False`,
    # `foreach`) has the host decide the skip, a declared sync (tests/test_kernel_choice.py)
    return [(n, t) for n, t in base_examples() if n != "TorchOptimizer" and mo.roles.skips_on_device(t)]


@pytest.mark.parametrize("how", ["torch.compile", "compile_step"])
@pytest.mark.parametrize("name,t", _examples(), ids=[n for n, _ in _examples()])
def test_every_transform_compiles_to_one_graph_equal_to_eager(name, t, how):
    """`torch.compile(opt.step, fullgraph=True)` with the defaults, and `mo.compile_step(opt)` (the eager
    kernels kept as ops, each state by its position), for each conformance example: equal to eager within
    rounding over 8 steps with a StepLR scheduler, two NaN steps (one element of one tensor) skipped on
    the device, and a skipped step leaves the compiled optimizer's whole state bit for bit."""
    from checks import assert_same

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counts_every_call = any(isinstance(x, mo.roles.SeesHostSkips) for _, x in walk([t]))
    a, b = _model(), _model()
    eager = mo.Modular(list(a.named_parameters()), *_pipeline(t))
    comp = mo.Modular(list(b.named_parameters()), *_pipeline(t))
    step = torch.compile(comp.step, fullgraph=True) if how == "torch.compile" else mo.compile_step(comp)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (eager, comp)]
    for k in range(8):
        _backward(a, k)
        _backward(b, k)
        before = _saved(comp) if k in (2, 5) else None
        eager.step()
        step()
        for s in scheds:
            s.step()
        assert bool(comp.stats["skipped"]) == (k in (2, 5))
        if before is not None and not counts_every_call:  # (Accumulate counts a skipped call: its own tests)
            assert_same(before, _saved(comp))
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert int(comp.stats["skipped_steps"]) == 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # (a graph ran, not eager code)


def test_torch_optimizer_steps_outside_the_graph_and_says_so_under_fullgraph():
    torch._dynamo.reset()
    make = lambda: mo.TorchOptimizer(torch.optim.RMSprop, lr=1e-2)  # noqa: E731
    a, b = _model(), _model()
    eager, comp = mo.Modular(a.parameters(), make()), mo.Modular(b.parameters(), make())
    step = torch.compile(comp.step)  # plain: one graph break, at the wrapped optimizer
    for k in range(6):
        _backward(a, k)
        _backward(b, k)
        eager.step()
        step()
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert int(comp.stats["skipped_steps"]) == 2
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="TorchOptimizer runs the wrapped"):
        m = _model()
        opt = mo.Modular(m.parameters(), make())
        _backward(m, 0)
        torch.compile(opt.step, fullgraph=True)()
