"""The non-finite policy (modopt/core/runner.py): skip, raise and zero with the stateful module families in
the pipeline, and the default check: huge but finite gradients, a 2-norm that overflows, every dtype, no host
sync when the device decides, one norm pass shared with `ClipNorm`. (The device's skip decision per
transform: tests/test_device_skip*.py.)"""

from __future__ import annotations

import pytest
import torch

import modopt as mo
from checks import needs_the_host


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def pipeline():
    return [
        mo.Accumulate(2),
        mo.ClipNormByEMA(),
        mo.HistClip(warmup_steps=3),
        mo.ZClip(warmup_steps=3, max_grad_norm=None, scope="tensor"),
        mo.AutoClip(window=6),
        mo.ClipNormGrowth(),
        mo.ClipValueGrowth(),
        mo.ClipValueByEMA(ema_init="update"),
        mo.NormalizeByEMA(),
        mo.Adam(lr=1e-2),
    ]


def set_grads(m, k, poison=False):
    g = torch.Generator().manual_seed(k)
    for i, p in enumerate(m.parameters()):
        p.grad = torch.randn(p.shape, generator=g) * (1 + 10 * (k == 7))
        if poison and i == 2:
            p.grad.view(-1)[0] = float("inf")


def flat_state(opt):
    sd = opt.state_dict()
    out = {}
    for idx, s in sd["state"].items():
        for k, v in s.items():
            out[f"p{idx}.{k}"] = v
    for key, s in sd["modopt"]["transforms"].items():
        for k, v in s.items():
            out[f"{key}.{k}"] = v
    return out


def run(inject_at=None, policy="skip", calls=1):
    m = model()
    opt = mo.Modular(m.parameters(), *pipeline(), nonfinite=policy)
    for k in range(20):
        if k == inject_at:
            for _ in range(calls):
                set_grads(m, 999, poison=True)
                opt.step()
                assert bool(opt.stats["skipped"])
        set_grads(m, k)
        opt.step()
    return m, opt


def test_skip_leaves_params_and_every_state_as_without_the_step():
    """A whole Accumulate(2) cycle of skipped calls (every call counts in the cycle, skipped or not,
    so one skipped call alone would move the cycle) leaves everything as without it."""
    ma, oa = run()
    mb, ob = run(inject_at=10, calls=2)
    for x, y in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(x, y)
    sa, sb = flat_state(oa), flat_state(ob)
    assert sa.keys() == sb.keys() and len(sa) > 20
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]), k
        else:
            assert sa[k] == sb[k], k
    assert int(oa.stats["skipped_steps"]) == 0 and int(ob.stats["skipped_steps"]) == 2
    assert int(ob.state_dict()["modopt"]["skipped_steps"]) == 2


def test_skip_counts_every_skipped_step():
    m = model()
    opt = mo.Modular(m.parameters(), mo.ClipNorm(1.0), mo.SGD(lr=0.1))
    for k in range(3):
        set_grads(m, k, poison=True)
        opt.step()
    assert int(opt.stats["skipped_steps"]) == 3


def test_raise_names_the_parameter():
    m = model()
    opt = mo.Modular(m.named_parameters(), mo.ClipNormByEMA(), mo.SGD(lr=0.1), nonfinite="raise")
    set_grads(m, 0, poison=True)
    with pytest.raises(FloatingPointError, match=r"2\.weight"):
        opt.step()


def test_zero_policy_equals_zeroing_the_gradient_first():
    ma, mb = model(), model()
    oa = mo.Modular(ma.parameters(), mo.HistClip(warmup_steps=2), mo.SGD(lr=0.1), nonfinite="zero")
    ob = mo.Modular(mb.parameters(), mo.HistClip(warmup_steps=2), mo.SGD(lr=0.1), nonfinite="ignore")
    for k in range(5):
        set_grads(ma, k, poison=True)
        set_grads(mb, k, poison=True)
        for p in mb.parameters():
            p.grad = torch.nan_to_num(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
        oa.step()
        ob.step()
    for x, y in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("seed", range(4))
def test_small_tensors_are_cleaned_together_to_the_same_values(seed):
    """`Step.clean_`'s grouping (`step._clean_small_together`): small plain tensors of one dtype and device
    are cleaned as one concatenation and copied back. Every tensor ends up as its own `nan_to_num_` would
    leave it (NaN, +inf, -inf to 0; -0.0 and every finite value kept, as bits), strided 1-D ones included;
    large tensors, tensors of more dimensions that are not contiguous and groups of fewer than three are left
    to clean one by one."""
    from modopt.core import step as stepapi

    g = torch.Generator().manual_seed(seed)
    ts = []
    for i in range(12):
        n = [3, 40, 700, stepapi.SMALL_CLEAN, stepapi.SMALL_CLEAN + 1][i % 5]
        dt = [torch.float32, torch.bfloat16, torch.float64][i % 3] if i < 9 else torch.float16
        t = torch.randn(n, generator=g).to(dt)
        t[torch.randint(0, n, (3,), generator=g)] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dt)
        t[0] = -0.0
        ts.append(t)
    ts.append(torch.randn(6, 4, generator=g).T)  # non-contiguous, float32
    ts[-1][1, 2] = float("nan")
    ts.append(torch.randn(5, 3, generator=g))  # contiguous, float32
    ts[-1][4, 0] = float("inf")
    ts.append(torch.randn(40, generator=g)[::2])  # 1-D, strided, float32
    ts[-1][7] = float("nan")
    want = [torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in ts]
    rest = stepapi._clean_small_together(ts)
    for t in rest:
        torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)
    for t, w in zip(ts, want):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        assert torch.equal(t.contiguous().view(bits), w.contiguous().view(bits))
    # grouped: the three small 1-D float32 tensors, the 2-D contiguous one, and the three small float64 ones;
    # left: the large ones, the 2-D non-contiguous one (no 1-D alias) and the small bfloat16 and float16 pairs
    # (two of a dtype: not worth a group)
    assert {id(t) for t in rest} == {id(t) for t in ts if t.numel() > stepapi.SMALL_CLEAN
                                     or t.dtype in (torch.bfloat16, torch.float16)
                                     or (t.dim() > 1 and not t.is_contiguous())}


# --- the default non-finite check -----------------------------------------------------
def count_syncs(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    n = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                n[0] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return n[0]


@pytest.mark.parametrize(
    "dtype,value",
    [(torch.float32, 1e30), (torch.float32, 3e38), (torch.float16, 65504.0), (torch.bfloat16, 3e38), (torch.float64, 1e300)],
)
def test_finite_but_huge_gradients_are_not_skipped_when_the_host_decides(dtype, value):
    """Their squares overflow the 2-norm's accumulator; the host's exact fallback calls them finite.
    (`needs_the_host()` makes this pipeline decide on the host.)"""
    p = torch.nn.Parameter(torch.zeros(1000, dtype=dtype))
    p.grad = torch.full((1000,), value, dtype=dtype)
    opt = mo.Modular([p], needs_the_host(), mo.SGD(lr=1e-40 if dtype != torch.float16 else 1e-8, momentum=0.5, dampening=0.1))
    assert not opt._skip_on_device
    opt.step()
    assert not bool(opt.stats["skipped"]) and not bool(opt.stats["nonfinite"])


@pytest.mark.parametrize("dtype,value", [(torch.float32, 1e30), (torch.bfloat16, 3e38), (torch.float64, 1e300)])
def test_a_2_norm_that_overflows_skips_the_step_when_the_device_decides(dtype, value):
    """On the device there is no second, exact look: a step whose 2-norm overflows is skipped, as the
    careful torch loop (`if clip_grad_norm_(...).isfinite(): opt.step()`) skips it."""
    p = torch.nn.Parameter(torch.zeros(1000, dtype=dtype))
    p.grad = torch.full((1000,), value, dtype=dtype)
    opt = mo.Modular([p], mo.ClipNorm(1.0), mo.Adam())
    assert opt._skip_on_device
    opt.step()
    assert bool(opt.stats["skipped"]) and torch.equal(p.detach(), torch.zeros(1000, dtype=dtype))
    ref = torch.nn.Parameter(torch.zeros(1000, dtype=dtype))
    ref.grad = torch.full((1000,), value, dtype=dtype)
    assert not torch.isfinite(torch.nn.utils.clip_grad_norm_([ref], 1.0))  # what the careful loop checks


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_nonfinite_gradients_are_skipped_in_every_dtype(bad, dtype):
    p = torch.nn.Parameter(torch.ones(50, dtype=dtype))
    q = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    opt = mo.Modular([p, q], mo.ClipNorm(1.0), mo.Adam())
    p.grad = torch.ones(50, dtype=dtype)
    q.grad = torch.ones(3, dtype=dtype)
    q.grad[1] = bad
    opt.step()
    assert bool(opt.stats["skipped"]) and bool(opt.stats["nonfinite"])
    assert torch.equal(p.detach(), torch.ones(50, dtype=dtype))
    # decided on the device, a skipped first step leaves Adam's state at its initial values (zero moments,
    # step 0): the next step is a first step, bit for bit the same as a fresh optimizer's
    for s in opt.state.values():
        assert all(not bool(v.any()) for v in s.values()), s
    fresh_p, fresh_q = torch.nn.Parameter(torch.ones(50, dtype=dtype)), torch.nn.Parameter(torch.ones(3, dtype=dtype))
    fresh = mo.Modular([fresh_p, fresh_q], mo.ClipNorm(1.0), mo.Adam())
    for x, y in ((p, fresh_p), (q, fresh_q)):
        x.grad = torch.linspace(-1, 1, x.numel(), dtype=dtype)
        y.grad = x.grad.clone()
    opt.step()
    fresh.step()
    assert torch.equal(p.detach(), fresh_p.detach()) and torch.equal(q.detach(), fresh_q.detach())


def test_default_check_needs_no_sync_and_its_norms_serve_clipnorm(monkeypatch, device_path):
    from modopt.core import reduce, runner

    p = torch.nn.Parameter(torch.zeros(100))
    q = torch.nn.Parameter(torch.zeros(7))
    opt = mo.Modular([p, q], mo.ClipNorm(1.0), mo.Adam())
    calls = []
    real = reduce.foreach_pnorm
    # the exact check calls it from modopt.core.runner; every memoised norm goes through reduce.pnorms
    monkeypatch.setattr(runner, "foreach_pnorm", lambda ts, p: calls.append(("exact", p)) or real(ts, p))
    monkeypatch.setattr(reduce, "foreach_pnorm", lambda ts, p: calls.append(("memo", p)) or real(ts, p))
    p.grad, q.grad = torch.randn(100), torch.randn(7)
    assert count_syncs(opt.step) == 0  # decided on the device
    assert calls == [("memo", 2.0)]  # one 2-norm pass over the gradients, no inf-norm, no second pass
    # a non-finite step: the same single pass, still no sync
    calls.clear()
    p.grad, q.grad = torch.randn(100), torch.full((7,), float("nan"))
    assert count_syncs(opt.step) == 0
    assert calls == [("memo", 2.0)] and bool(opt.stats["skipped"])
    # decided on the host (a transform that needs it): one sync, the exact check only on a bad step
    opt = mo.Modular([p, q], needs_the_host(), mo.ClipNorm(1.0), mo.SGD(momentum=0.9, dampening=0.1))
    calls.clear()
    p.grad, q.grad = torch.randn(100), torch.randn(7)
    assert count_syncs(opt.step) == 1 and calls == [("memo", 2.0)]
    calls.clear()
    p.grad, q.grad = torch.randn(100), torch.full((7,), float("nan"))
    assert count_syncs(opt.step) == 2
    assert calls == [("memo", 2.0), ("exact", float("inf"))]


def test_zero_policy_records_what_it_zeroed():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = mo.Modular([p], mo.LR(1.0), nonfinite="zero")
    p.grad = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    opt.step()
    assert int(opt.stats["zeroed"]) == 3 and bool(opt.stats["nonfinite"])
    assert torch.equal(p.detach(), torch.tensor([-1.0, 0.0, 0.0, 0.0]))
    p.grad = torch.ones(4)
    opt.step()
    assert int(opt.stats["zeroed"]) == 0 and not bool(opt.stats["nonfinite"])
