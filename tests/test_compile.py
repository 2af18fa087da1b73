"""No host synchronisation in a step, and ``torch.compile(opt.step, fullgraph=True)``.

A host sync on CPU or GPU goes through ``aten::_local_scalar_dense`` (``.item()``,
``bool(tensor)``, ``if tensor:``, ``float(tensor)``); a dispatch mode counts them.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import modopt as mo
from checks import needs_the_host


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def _pipelines():
    have = set(mo.available())
    out = {
        "ClipNorm+Adam": lambda: [mo.ClipNorm(1.0), mo.Adam(lr=1e-2)],
        "ClipValue+SGD": lambda: [mo.ClipValue(0.5), mo.SGD(lr=1e-2, momentum=0.9)],
        "Centralize+Normalize+Adam": lambda: [mo.Centralize(), mo.Normalize(), mo.Adam(lr=1e-2)],
        "ClipNorm+Normalize+AdamW(groups)": lambda: [mo.ClipNorm(1.0, scope="group"), mo.Normalize(), mo.AdamW(lr=1e-2)],
    }
    if "ClipNormByEMA" in have:
        out["ClipNormByEMA+Normalize+Adam"] = lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(lr=1e-2)]
    if "ZClip" in have:
        out["ZClip+AdamW"] = lambda: [mo.ZClip(warmup_steps=3), mo.AdamW(lr=1e-2)]
    if "Accumulate" in have:
        out["Accumulate+ClipNorm+Adam"] = lambda: [mo.Accumulate(2), mo.ClipNorm(1.0), mo.Adam(lr=1e-2)]
    return out


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (16,), (4, 16), (4,), (1,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _set_grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * (5.0 if step % 3 == 2 else 1.0)


def _groups(params):
    return [{"params": params[:2]}, {"params": params[2:], "lr": 5e-3}]


@pytest.mark.parametrize("name", sorted(_pipelines()))
def test_step_has_no_host_sync(name, device_path):
    """On the device path (a GPU's: on a CPU a step may read values where that only reads memory)."""
    params = _params()
    opt = mo.Modular(_groups(params), *_pipelines()[name](), nonfinite="ignore")
    counter = SyncCounter()
    for step in range(8):  # covers state creation, warm-ups and steady state
        _set_grads(params, step)
        with counter:
            opt.step()
            _ = dict(opt.stats)  # telemetry stays on the device
    assert counter.syncs == 0


@pytest.mark.parametrize("policy,make,syncs", [
    ("skip", lambda: [mo.ClipNorm(1.0), mo.Adam(lr=1e-2)], 0),  # decided on the device
    ("skip", lambda: [mo.ClipNorm(1.0), mo.SGD(lr=1e-2, momentum=0.9)], 0),  # SGD without dampening: on the device
    ("skip", lambda: [mo.ClipNorm(1.0), mo.SGD(lr=1e-2, momentum=0.9, dampening=0.1)], 0),  # with dampening too
    ("skip", lambda: [needs_the_host(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2)], 4),  # a transform that needs the host
    ("raise", lambda: [mo.ClipNorm(1.0), mo.Adam(lr=1e-2)], 4),  # it must raise: one sync a step
])
def test_host_syncs_per_step_by_policy(policy, make, syncs, device_path):
    params = _params()
    opt = mo.Modular(params, *make(), nonfinite=policy)
    counter = SyncCounter()
    for step in range(4):
        _set_grads(params, step)
        with counter:
            opt.step()
    assert counter.syncs == syncs


@pytest.mark.parametrize("name", ["ClipNorm+Adam", "ClipValue+SGD"])
@pytest.mark.compile
def test_compiled_step_fullgraph_matches_eager(name):
    torch._dynamo.reset()
    make = _pipelines()[name]
    a, b = _params(), _params()
    eager = mo.Modular(_groups(a), *make(), nonfinite="ignore")
    compiled = mo.Modular(_groups(b), *make(), nonfinite="ignore")
    step = torch.compile(compiled.step, fullgraph=True)  # compile before the scheduler wraps .step
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (eager, compiled)]
    counters = torch._dynamo.utils.counters
    counters.clear()
    for i in range(5):
        _set_grads(a, i)
        _set_grads(b, i)
        eager.step()
        step()
        for s in scheds:
            s.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # a graph for the first step (state is created) and one for the rest: a changing lr does not recompile
    assert counters["stats"]["unique_graphs"] <= 2


# --- a clip and what follows it: each transform writes its own result --------------------


def _run(transforms, params_fn, steps=6, **kw):
    params = params_fn()
    opt = mo.Modular(_groups(params), *transforms, **kw)
    for i in range(steps):
        _set_grads(params, i)
        opt.step()
    return params


@pytest.mark.parametrize(
    "make",
    [
        lambda: [mo.ClipNorm(1.0), mo.Adam(lr=1e-2)],
        lambda: [mo.ClipNorm(1.0, scope="group"), mo.AdamW(lr=1e-2)],
        lambda: [mo.ClipNorm(1.0), mo.SGD(lr=1e-2, momentum=0.9, nesterov=True)],
        lambda: [mo.ClipNorm(1.0), mo.Normalize(), mo.Adam(lr=1e-2)],
        lambda: [mo.ClipNorm(1.0, scope="group"), mo.Normalize(scope="global"), mo.Adam(lr=1e-2)],
        lambda: [mo.ClipNorm(1.0), mo.Normalize(min_size=10), mo.Adam(lr=1e-2)],  # inactive slices
        lambda: [mo.Chain(mo.ClipNorm(1.0), mo.Adam(lr=1e-2))],
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_identity_after_every_clip_changes_nothing(make, dtype):
    """The same pipeline with an Identity after every clip moves the same, bit for bit: no transform
    hands work to the next one (issue 17 removed the deferred scale that an Identity used to block)."""

    def blocked(ts):
        out = []
        for t in ts:
            if isinstance(t, mo.Chain):
                out.append(mo.Chain(*blocked(list(t.transforms))))
                continue
            out.append(t)
            if isinstance(t, mo.ClipNorm):
                out.append(mo.Identity())
        return out

    def params_fn():
        return [torch.nn.Parameter(p.detach().to(dtype)) for p in _params()]

    a = _run(make(), params_fn)
    b = _run(blocked(make()), params_fn)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_clip_leaves_the_clipped_gradient_in_grad():
    """As with torch's clip_grad_norm_, ``p.grad`` holds the clipped gradient after the step."""
    a, b = _params(), _params()
    opt = mo.Modular(a, mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    ref = torch.optim.Adam(b, lr=1e-2)
    for i in range(3):
        _set_grads(a, i)
        _set_grads(b, i)
        opt.step()
        torch.nn.utils.clip_grad_norm_(b, 1.0)
        ref.step()
        for p, q in zip(a, b):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_attach_applies_a_clip_before_the_torch_optimizer():
    a, b = _params(), _params()
    opt = torch.optim.Adam(a, lr=1e-2)
    handle = mo.attach(opt, mo.ClipNorm(1.0), mo.Normalize(scope="global"))
    ref = torch.optim.Adam(b, lr=1e-2)
    for i in range(3):
        _set_grads(a, i)
        _set_grads(b, i)
        opt.step()
        torch.nn.utils.clip_grad_norm_(b, 1.0)
        total = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in b]))
        for q in b:
            q.grad.div_(total)
        ref.step()
    handle.remove()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# --- every optimizer transform under compile, its lr driven by a scheduler ---------------------

#: (modopt transform, the torch optimizer it must follow), both built from the same keywords
_VS_TORCH = {
    "SGD": (lambda: mo.SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False)),
    "SGD-momentum-dampening-wd": (
        lambda: mo.SGD(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.05),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.05, foreach=False),
    ),
    "SGD-nesterov-wd": (
        lambda: mo.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05, foreach=False),
    ),
    "Adam-wd-amsgrad": (
        lambda: mo.Adam(lr=1e-2, weight_decay=0.1, amsgrad=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=False),
    ),
    "AdamW": (
        lambda: mo.AdamW(lr=1e-2, weight_decay=0.5),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.5, foreach=False),
    ),
    "AdamW-amsgrad": (
        lambda: mo.AdamW(lr=1e-2, weight_decay=0.5, amsgrad=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.5, amsgrad=True, foreach=False),
    ),
    "LR": (lambda: mo.LR(0.1), lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False)),
}


def _cyclic(step: int) -> float:
    """A schedule whose lr changes at every step and comes back (a constant baked in at compile
    time shows as a mismatch within four steps, a decaying lr would hide it)."""
    return (1 + step % 4) / 4


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("name", list(_VS_TORCH))
@pytest.mark.compile
def test_compiled_optimizer_with_scheduler_matches_torch_over_20_steps(name):
    """Every optimizer transform, compiled with fullgraph, follows torch's optimizer under the same
    LR scheduler, and a changing lr does not recompile (it is read as a tensor, not a constant).

    The scheduler is created after ``torch.compile(opt.step)``: it wraps ``opt.step`` in a
    function that counts calls, and the compiled step calls the method it was given. torch then
    warns that ``lr_scheduler.step()`` came first (it never sees the wrapped step called).
    """
    make, make_ref = _VS_TORCH[name]
    torch._dynamo.reset()
    a, b = _params(), _params()
    ref = make_ref(a)
    opt = mo.Modular(_groups(b), make(), nonfinite="ignore")
    ref.param_groups[:] = []
    for g in _groups(a):  # the same two groups, the second one with its own lr
        ref.add_param_group(g)
    step = torch.compile(opt.step, fullgraph=True)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, _cyclic) for o in (ref, opt)]
    counters = torch._dynamo.utils.counters
    counters.clear()
    lrs = set()
    for i in range(20):
        _set_grads(a, i)
        _set_grads(b, i)
        ref.step()
        step()
        lrs.add(opt.param_groups[1]["lr"])
        for s in scheds:
            s.step()
        for p, q in zip(a, b):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i}: {m}")
    assert len(lrs) == 4
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    # one graph for the first step (state is created), one for the others, whatever the lr
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


# --- telemetry and the non-finite policies under compile ---------------------------------------


def _stats(opt):
    return {k: v.clone() for k, v in opt.stats.items()}


def _assert_same_stats(got, want, step):
    assert sorted(got) == sorted(want), f"step {step}"
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=0, msg=lambda m: f"step {step}, {k}: {m}")


@pytest.mark.compile
def test_compiled_step_keeps_its_stats():
    """`opt.stats` under ``torch.compile(opt.step, fullgraph=True)`` holds what eager holds.

    It used to stay empty: dynamo dropped the step's ``self.stats = ...`` (an attribute set on an
    optimizer object); the step now stores its dict on a plain holder object.
    """
    torch._dynamo.reset()
    a, b = _params(), _params()
    eager = mo.Modular(a, mo.ClipNorm(1.0), mo.Adam(lr=1e-2), nonfinite="ignore")
    compiled = mo.Modular(b, mo.ClipNorm(1.0), mo.Adam(lr=1e-2), nonfinite="ignore")
    step = torch.compile(compiled.step, fullgraph=True)
    earlier = []
    for i in range(4):
        _set_grads(a, i)
        _set_grads(b, i)
        eager.step()
        step()
        assert "0:ClipNorm.norm" in compiled.stats
        _assert_same_stats(compiled.stats, eager.stats, i)
        earlier.append((compiled.stats, _stats(compiled)))
    # a new dict each step: one kept from an earlier step still holds that step's values
    assert len({id(s) for s, _ in earlier}) == 4
    for i, (kept, copy) in enumerate(earlier):
        _assert_same_stats(kept, copy, i)


@pytest.mark.parametrize("policy", ["skip", "raise"])
@pytest.mark.compile
def test_fullgraph_with_a_host_policy_says_why_and_what_to_do(policy):
    torch._dynamo.reset()
    params = _params()
    # a transform that does not declare skips_on_device() needs the host's decision; raise always does
    opt = mo.Modular(params, needs_the_host(), mo.ClipNorm(1.0), mo.SGD(lr=1e-2, momentum=0.9), nonfinite=policy)
    _set_grads(params, 0)
    with pytest.raises(torch._dynamo.exc.Unsupported) as err:
        torch.compile(opt.step, fullgraph=True)()
    text = str(err.value)
    for words in ("decides on the host", "skips_on_device", "nonfinite='ignore'", "nonfinite='zero'",
                  "without fullgraph=True"):
        assert words in text, text


@pytest.mark.compile
def test_plain_compile_with_a_host_decision_skips_like_eager():
    """``torch.compile(opt.step)`` with ``nonfinite="skip"`` and a pipeline that needs the host's
    decision (a transform that does not declare `skips_on_device()`): one graph break per step, at that decision; a non-finite step, the
    first one included, leaves parameters and state untouched."""
    torch._dynamo.reset()
    a, b = _params(), _params()
    eager = mo.Modular(a, needs_the_host(), mo.ClipNorm(1.0), mo.SGD(lr=1e-2, momentum=0.9, dampening=0.1))
    compiled = mo.Modular(b, needs_the_host(), mo.ClipNorm(1.0), mo.SGD(lr=1e-2, momentum=0.9, dampening=0.1))
    step = torch.compile(compiled.step)
    for i in range(5):
        _set_grads(a, i)
        _set_grads(b, i)
        if i in (0, 3):
            a[1].grad[2] = b[1].grad[2] = float("nan")
        before = [q.detach().clone() for q in b]
        state_before = {k: v.clone() for s in compiled.state.values() for k, v in s.items()}
        eager.step()
        step()
        _assert_same_stats(compiled.stats, eager.stats, i)
        if i in (0, 3):
            assert bool(compiled.stats["skipped"])
            assert all(torch.equal(q, r) for q, r in zip(b, before))
            state_after = {k: v for s in compiled.state.values() for k, v in s.items()}
            assert state_after.keys() == state_before.keys()
            assert all(torch.equal(state_after[k], state_before[k]) for k in state_before)
        for p, q in zip(a, b):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert int(compiled.stats["skipped_steps"]) == 2
    assert len(compiled.state) == len(b) and len(eager.state) == len(a)
    explained = torch._dynamo.explain(compiled.step)()
    assert explained.graph_break_count == 1
    assert "decides on the host" in explained.break_reasons[0].reason


@pytest.mark.compile
def test_plain_compile_with_raise_names_the_parameter():
    torch._dynamo.reset()
    params = _params()
    opt = mo.Modular(params, mo.ClipNorm(1.0), mo.Adam(lr=1e-2), nonfinite="raise")
    step = torch.compile(opt.step)
    _set_grads(params, 0)
    step()
    _set_grads(params, 1)
    params[3].grad[0] = float("inf")
    before = [p.detach().clone() for p in params]
    with pytest.raises(FloatingPointError, match=r"parameter\(s\) #3 \(nonfinite='raise'\)"):
        step()
    assert all(torch.equal(p, q) for p, q in zip(params, before))


@pytest.mark.compile
def test_slice_scopes_compile_with_fullgraph():
    """A slice-wise scope (`dim`) builds its layout inside the compiled step: no generator may reach
    dynamo there (`math.prod` of one failed to trace before issue 17), and the result equals eager."""
    make = lambda: [mo.ClipNormByEMA(beta=0.5, scope="tensor", dim=0), mo.ClipNorm(0.5, scope="tensor", dim=-1),
                    mo.Adam(lr=1e-2)]
    eager_p, comp_p = _params(), _params()
    eager = mo.Modular(_groups(eager_p), *make(), nonfinite="ignore")
    comp = mo.Modular(_groups(comp_p), *make(), nonfinite="ignore")
    step = torch.compile(comp.step, fullgraph=True)
    for i in range(4):
        _set_grads(eager_p, i)
        _set_grads(comp_p, i)
        eager.step()
        step()
        for p, q in zip(eager_p, comp_p):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert comp.stats["0:ClipNormByEMA.norm"].shape == eager.stats["0:ClipNormByEMA.norm"].shape


def test_on_a_cpu_the_default_step_reads_its_decision_once():
    """Without the device path forced (`device_path`), a step on the CPU reads the device's decision back:
    one sync a step (on a GPU: none, the test above); a compiled step keeps the device path."""
    params = _params()
    opt = mo.Modular(params, mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
    counter = SyncCounter()
    for step in range(4):
        _set_grads(params, step)
        with counter:
            opt.step()
    assert counter.syncs == 4
