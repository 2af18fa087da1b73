"""`modopt/transforms/optimizers.py`: one kernel plan per optimizer and layout (`modopt.core.kernels`; the
`Planned` role: Adam, AdamW and SGD, and ADOPT, Muon, AdaMuon and Schedule-Free through `GroupPlan`).

Every eager step runs the layout's plan, the first step included, and the plan is built again only when
the state no longer holds its tensors; each param group's values are read once per step; a param group
whose parameters take different kernels (a dtype torch's fused kernel is wrong for) steps as each part
would alone. The kernels' bits against torch are tests/test_torch_equivalence.py and
tests/test_optimizer_dtypes.py; the skip on the device tests/test_device_skip_optimizers.py.
"""

from __future__ import annotations

import collections

import pytest
import torch

import modopt as mo
from modopt.core import kernels


def _params(dtypes=(torch.float32, torch.float64)):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3 + i, dtype=dt)) for i, dt in enumerate(dtypes * 2)]


def _grads(ps, step):
    g = torch.Generator().manual_seed(step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


OPTIMIZERS = {
    "Adam": lambda: mo.Adam(1e-2),
    "AdamW-amsgrad": lambda: mo.AdamW(1e-2, amsgrad=True),
    "Adam-torch-kernel": lambda: mo.Adam(1e-2, fused=False),
    "SGD-momentum": lambda: mo.SGD(0.1, momentum=0.9),
    "SGD-foreach": lambda: mo.SGD(0.1, momentum=0.9, foreach=True),
    # the optimizers that run modopt's own formulas: the general plan (`kernels.GroupPlan`)
    "ADOPT": lambda: mo.ADOPT(1e-2),
    "Muon": lambda: mo.Muon(1e-2),
    "AdaMuon": lambda: mo.AdaMuon(1e-2),
    "ScheduleFreeSGD": lambda: mo.ScheduleFreeSGD(0.1),
    "ScheduleFreeAdamW": lambda: mo.ScheduleFreeAdamW(1e-2),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_eager_step_runs_the_plan_built_once(name, monkeypatch):
    """The first step runs the plan it builds, as every later one does; it is built again after a load
    (new state tensors), and not otherwise."""
    plan_cls = (kernels.SGDPlan if name.startswith("SGD") else kernels.AdamPlan if name.startswith("Adam")
                else kernels.GroupPlan)
    built, runs = [], []
    init, run = plan_cls.__init__, plan_cls.run

    def counting_init(self, *a, **k):
        built.append(self)
        init(self, *a, **k)

    def counting_run(self, *a, **k):
        runs.append(self)
        return run(self, *a, **k)

    monkeypatch.setattr(plan_cls, "__init__", counting_init)
    monkeypatch.setattr(plan_cls, "run", counting_run)
    ps = _params()
    opt = mo.Modular(ps, OPTIMIZERS[name]())
    for step in range(4):
        _grads(ps, step)
        opt.step()
    # SGD's first step starts its momentum buffers (torch's first step), so its plan is built once more
    first = 2 if name.startswith("SGD") else 1
    assert len(built) == first
    assert runs[0] is built[0] and all(r is built[-1] for r in runs[first:])
    assert len(runs) == 4 + (first - 1)
    opt.load_state_dict(opt.state_dict())
    _grads(ps, 9)
    opt.step()
    assert len(built) == first + 1 and runs[-1] is built[-1]


class _Counting(dict):
    """A param group that counts the reads of each key."""

    reads: collections.Counter = collections.Counter()

    def __getitem__(self, k):
        _Counting.reads[k] += 1
        return super().__getitem__(k)


@pytest.mark.parametrize("make, keys", [
    (lambda: mo.Adam(1e-2), ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")),
    (lambda: mo.SGD(0.1, momentum=0.9), ("lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize")),
    (lambda: mo.ADOPT(1e-2), ("lr", "betas", "eps", "weight_decay", "maximize")),
    (lambda: mo.Muon(1e-2), ("lr", "momentum", "weight_decay", "nesterov")),
    (lambda: mo.AdaMuon(1e-2), ("lr", "betas", "weight_decay")),
    (lambda: mo.ScheduleFreeSGD(0.1), ("lr", "momentum", "weight_decay")),
    (lambda: mo.ScheduleFreeAdamW(1e-2), ("lr", "betas", "eps", "weight_decay")),
])
def test_group_values_are_read_once_per_step(make, keys):
    """One param group whose parameters take two kernel calls (float32 and float64): each of its values is
    read once per step, not once per call (a scheduler's value is then the same for every call)."""
    ps = _params()
    opt = mo.Modular(ps, make())
    opt.param_groups[0] = _Counting(opt.param_groups[0])
    for step in range(3):
        _grads(ps, step)
        _Counting.reads.clear()
        opt.step()
    assert {k: _Counting.reads[k] for k in keys} == dict.fromkeys(keys, 1)


@pytest.mark.parametrize("make", [lambda: mo.SGD(0.1), lambda: mo.SGD(0.1, momentum=0.5, nesterov=True),
                                  lambda: mo.Adam(1e-2)])
def test_a_group_of_two_kernels_steps_as_each_part_alone(make):
    """float32 takes torch's fused kernel and float16 SGD its foreach kernel on a CPU (`kernels.KNOWN_BAD`,
    before torch 2.14): in one param group each part moves exactly as it would alone. (SGD without
    momentum raised an IndexError here before the plan.)"""
    ps = _params((torch.float32, torch.float16))
    alone = [[torch.nn.Parameter(p.detach().clone()) for p in ps[i::2]] for i in (0, 1)]
    opt = mo.Modular(ps, make())
    opts = [mo.Modular(a, make()) for a in alone]
    for step in range(3):
        _grads(ps, step)
        for i, a in enumerate(alone):
            for p, q in zip(a, ps[i::2]):
                p.grad = q.grad.clone()
        opt.step()
        for o in opts:
            o.step()
    for i, a in enumerate(alone):
        for p, q in zip(a, ps[i::2]):
            assert torch.equal(p, q)


@pytest.mark.parametrize(
    "make, make_torch, key, fill",
    [
        (lambda: mo.Adam(1e-2), lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True), "exp_avg", 0.0),
        # a plan of modopt's own formulas (kernels.GroupPlan)
        (lambda: mo.Muon(1e-2), lambda ps: torch.optim.Muon(ps, lr=1e-2), "momentum_buffer", 0.5),
    ],
    ids=["Adam", "Muon"],
)
def test_a_replaced_state_tensor_rebuilds_the_plan(make, make_torch, key, fill):
    """A moment or momentum buffer replaced by hand is the one the next step reads and writes (the plan holds
    tensors by identity and is built again), as torch.optim reads `state[p]` afresh."""
    ps = _params((torch.float32,))
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    tr = make()
    opt, topt = mo.Modular(ps, tr), make_torch(ref)
    for step in range(4):
        _grads(ps, step)
        for p, q in zip(ref, ps):
            p.grad = q.grad.clone()
        opt.step()
        topt.step()
        if step == 1:
            for p, q in zip(ps, ref):
                opt.state[p][f"0:{type(tr).__name__}.{key}"] = torch.full_like(p, fill)
                topt.state[q][key] = torch.full_like(q, fill)
    for p, q in zip(ps, ref):
        assert torch.equal(p, q)


def test_sgd_without_momentum_leaves_the_state_empty_as_torch_does():
    """torch's SGD with momentum 0 keeps no per-parameter state; the plan reads `opt.state` only for a group with
    buffers (a read of `state[p]` would leave an empty entry per parameter). With momentum it holds buffers."""
    for kw, has in (({}, False), ({"momentum": 0.9}, True)):
        model = torch.nn.Linear(3, 2)
        opt = mo.Modular(model.parameters(), mo.SGD(0.1, **kw))
        ref = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1, **kw)
        for o, m in ((opt, model), (ref, None)):
            for p in (m.parameters() if m is not None else o.param_groups[0]["params"]):
                p.grad = torch.ones_like(p)
            o.step()
            o.step()
        assert (len(opt.state) > 0) is has and (len(ref.state) > 0) is has
        assert all(len(s) > 0 for s in opt.state.values())
