"""One graph (issue 18 item 3): a scheduler that changes hyperparameters reruns the compiled step, it does
not recompile it. One compile here (compiles are slow on a CPU); `tests/test_device_skip.py` checks that
`fullgraph=True` equals eager for the benchmark pipelines."""

from __future__ import annotations

import torch

import modopt as mo


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
