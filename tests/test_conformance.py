"""The conformance suite: every registered transform through the same checks.

A new transform gets these by adding an instance to ``tests/examples.py``:
checkpoint round trip through ``torch.save`` / ``torch.load(weights_only=True)``
(bit-exact resume), zero / None / non-finite gradients, bf16 / fp16 parameters,
several param groups. (Config round trips of every field: tests/test_config.py.)
"""

from __future__ import annotations

import io
from contextlib import nullcontext
from unittest import mock
import math

import pytest
import torch

import modopt as mo
from examples import all_examples, pipeline_for
from modopt.core.transform import walk

EXAMPLES = all_examples()
IDS = [e[0] for e in EXAMPLES]


def test_every_registered_transform_has_a_conformance_example():
    from modopt.core.registry import get_transform

    from examples import NON_DEFAULT

    # the package's own transforms (tests register throwaway ones in the same process)
    shipped = {n for n in mo.available() if get_transform(n).__module__.startswith("modopt.")}
    missing = sorted(shipped - set(NON_DEFAULT))
    assert not missing, (
        f"registered transform(s) {missing} have no entry in tests/examples.py: add "
        + ", ".join(f'"{n}": mo.{n}(...)' for n in missing)
        + " to NON_DEFAULT there, with every field set away from its default "
        "(a list of instances when fields exclude each other); see docs/contributing.md"
    )


def make_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    m.register_parameter("scale", torch.nn.Parameter(torch.tensor(1.0)))  # a 0-d parameter
    return m.to(dtype)


def loss_of(model, x):
    return (model(x) * model.scale).pow(2).mean()


def groups(model):
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named[:2]], "param_names": [n for n, _ in named[:2]]},
        {"params": [p for n, p in named[2:]], "param_names": [n for n, _ in named[2:]]},
    ]


def build(t, model, **kw):
    return mo.Modular(groups(model), *pipeline_for(t), **kw)


def steps(opt, model, n, seed, dtype=torch.float32, grad_hook=None):
    g = torch.Generator().manual_seed(seed)
    for k in range(n):
        x = torch.randn(6, 4, generator=g).to(dtype)
        opt.zero_grad()
        loss_of(model, x).backward()
        if grad_hook is not None:
            grad_hook(k, model)
        opt.step()


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def state_snapshot(opt):
    """Every tensor of the state dict, cloned, by path."""
    out = {}

    def walk(prefix, v):
        if isinstance(v, torch.Tensor):
            out[prefix] = v.detach().clone()
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}/{i}", x)
        else:
            out[prefix] = v

    walk("", opt.state_dict())
    return out


def assert_snapshots_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]) or (a[k].isnan().any() and torch.equal(a[k].isnan(), b[k].isnan())), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("name,t", EXAMPLES, ids=IDS)
def test_checkpoint_round_trip_resumes_bit_exactly(name, t):
    model = make_model()
    opt = build(t, model)
    steps(opt, model, 5, seed=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    steps(opt, model, 6, seed=2)
    expected = params_of(model)

    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    model2 = make_model(seed=99)
    model2.load_state_dict(ck["model"])
    opt2 = build(t, model2)
    opt2.load_state_dict(ck["opt"])
    steps(opt2, model2, 6, seed=2)
    for a, b in zip(expected, params_of(model2)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name,t", EXAMPLES, ids=IDS)
def test_zero_gradients_keep_parameters_finite(name, t):
    model = make_model()
    opt = build(t, model)
    before = params_of(model)
    for _ in range(4):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    for a, b in zip(before, params_of(model)):
        assert torch.isfinite(b).all()
    every = [x for _, x in walk(pipeline_for(t))]  # masked optimizers too
    # (weight decay moves weights with a zero gradient; so does a projection onto a fixed radius)
    moves = any(isinstance(x, (mo.SGD, mo.Adam, mo.Muon, mo.AdaMuon, mo.ADOPT, mo.WeightDecay, mo.ScheduleFreeSGD,
                               mo.ScheduleFreeAdamW)) and getattr(x, "weight_decay", 0) for x in every) \
        or any(isinstance(x, mo.ProjectNorm) and x.radius is not None for x in every)
    if not moves and name not in ("AdamW", "TorchOptimizer"):
        for a, b in zip(before, params_of(model)):
            assert torch.equal(a, b), "a zero gradient must not move parameters"


@pytest.mark.parametrize("name,t", EXAMPLES, ids=IDS)
def test_params_without_grad_are_skipped(name, t):
    model = make_model()
    opt = build(t, model)
    frozen = model[2].weight

    def drop(k, m):
        m[2].weight.grad = None

    before = frozen.detach().clone()
    steps(opt, model, 4, seed=3, grad_hook=drop)
    assert torch.equal(before, frozen.detach())
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name,t", EXAMPLES, ids=IDS)
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_nonfinite_gradient_skips_the_step_and_keeps_state(name, t, bad):
    """A skipped step leaves the parameters and every state as they were; a transform that counts every
    call (`on_host_skip`: Accumulate's cycle) leaves its state as the host's skip of the same call does."""
    ends = []
    for host in (False, True):
        model = make_model()
        opt = build(t, model)
        with mock.patch.object(type(opt), "_skip_on_device", property(lambda self: False)) if host else nullcontext():
            steps(opt, model, 3, seed=4)
            before_params, before_state = params_of(model), state_snapshot(opt)
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            model[0].weight.grad[0, 0] = bad
            opt.step()
        assert bool(opt.stats["skipped"]) and int(opt.stats["skipped_steps"]) == 1
        for a, b in zip(before_params, params_of(model)):
            assert torch.equal(a, b)
        after = state_snapshot(opt)
        for k in ("/modopt/skipped_steps", "/param_groups/0/modopt/skipped_steps"):  # the counter and its DCP copy
            after.pop(k)
            before_state.pop(k)
        ends.append((before_state, after))
        if not counts_every_call(t):
            assert_snapshots_equal(before_state, after)
            return  # (the host path keeps everything by not running: nothing to compare)
    assert_snapshots_equal(ends[0][1], ends[1][1])  # the device's skip and the host's count the call alike


def counts_every_call(t) -> bool:
    """Whether `t` (or a transform inside it) keeps state that counts skipped calls too (`on_host_skip`)."""
    return any(isinstance(x, mo.roles.SeesHostSkips) for _, x in walk([t]))


@pytest.mark.parametrize("name,t", EXAMPLES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters(name, t, dtype):
    model = make_model(dtype)
    opt = build(t, model)
    steps(opt, model, 4, seed=5, dtype=dtype)
    for p in model.parameters():
        assert p.dtype == dtype and torch.isfinite(p).all()
    # statistics and buffers never lose the parameter's precision, unless a field asks for it (Adam's
    # state_dtype="bfloat16": its moments, by choice)
    from modopt.core.transform import walk

    chosen = tuple(getattr(torch, x.state_dtype) for _, x in walk((t,)) if getattr(x, "state_dtype", "param") != "param")
    for s in opt.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                assert v.dtype in (dtype, torch.float32, torch.float64) + chosen


@pytest.mark.parametrize("name,t", EXAMPLES, ids=IDS)
def test_nonfinite_policies_zero_and_raise(name, t):
    model = make_model()
    opt = build(t, model, nonfinite="zero")

    def poison(k, m):
        m[0].bias.grad[0] = math.nan

    steps(opt, model, 3, seed=6, grad_hook=poison)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt = build(t, model, nonfinite="raise")
    with pytest.raises(FloatingPointError, match="0.bias"):
        steps(opt, model, 1, seed=6, grad_hook=poison)
