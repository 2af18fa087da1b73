"""Bit for bit with torch where it can be (issue 9, item 7), and the default non-finite check (item 1)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, strategies as st

import modopt as mo
from checks import needs_the_host
from modopt.core.norms import combine_pnorms


@st.composite
def float32_grads(draw):
    n = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    shapes = [tuple(draw(st.lists(st.integers(1, 40), min_size=0, max_size=3))) for _ in range(n)]
    mag = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    return [torch.randn(s, generator=g) * mag * torch.rand((), generator=g) for s in shapes]


def params_with(grads):
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    return ps


@given(float32_grads())
def test_global_two_norm_equals_get_total_norm_bit_for_bit(grads):
    ref = torch.nn.utils.get_total_norm(grads, 2.0)
    # the functional layer, and ClipNorm's telemetry through Modular.step() with defaults
    assert torch.equal(mo.grad_norm(params_with(grads)), ref)
    ps = params_with(grads)
    opt = mo.Modular(ps, mo.ClipNorm(1.0), mo.Adam())
    opt.step()
    assert torch.equal(opt.stats["0:ClipNorm.norm"][0], ref)


@given(float32_grads(), st.sampled_from([0.1, 1.0, 100.0]))
def test_clip_grad_norm_equals_torch_bit_for_bit(grads, max_norm):
    a, b = params_with(grads), params_with(grads)
    na = mo.clip_grad_norm_(a, max_norm)
    nb = torch.nn.utils.clip_grad_norm_(b, max_norm)
    assert torch.equal(na, nb)
    for p, q in zip(a, b):
        assert torch.equal(p.grad, q.grad)


def test_combine_pnorms_falls_back_to_the_scaled_form_only_on_overflow():
    parts = torch.tensor([3e19, 4e19])  # their squares overflow float32, the norm does not
    assert torch.allclose(combine_pnorms(parts, 2.0), torch.tensor(5e19))
    parts = torch.tensor([3e12, 4e12, 1.0])
    assert torch.isfinite(combine_pnorms(parts, 3.0))
    assert torch.equal(combine_pnorms(torch.tensor([float("inf"), 1.0]), 2.0), torch.tensor(float("inf")))
    assert torch.isnan(combine_pnorms(torch.tensor([float("nan"), 1.0]), 2.0))


@pytest.mark.parametrize("kw", [dict(ord="inf"), dict(norm_type="inf"), dict(norm_type=float("inf"))])
def test_clip_grad_norm_accepts_inf_as_a_string(kw):
    g = [torch.tensor([3.0, -4.0]), torch.tensor([1.0])]
    a, b = params_with(g), params_with(g)
    norm_type = kw.get("ord", kw.get("norm_type"))
    assert torch.equal(mo.clip_grad_norm_(a, 1.0, **kw), torch.nn.utils.clip_grad_norm_(b, 1.0, norm_type=norm_type))
    for p, q in zip(a, b):
        assert torch.equal(p.grad, q.grad)


def test_clip_grad_norm_warns_on_an_empty_generator_like_torch():
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        n = mo.clip_grad_norm_((p for p in []), 1.0)
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs] != []
    assert ours[0].filename == __file__  # points at the caller
    assert float(n) == 0.0
    # an exhausted generator too
    gen = (p for p in params_with([torch.ones(2)]))
    list(gen)
    with pytest.warns(UserWarning, match="empty generator"):
        mo.clip_grad_norm_(gen, 1.0)


@pytest.mark.parametrize("norm_type", [2.0, "inf", 1.0])
def test_clip_grad_norm_nonfinite_error_text_matches_torch(norm_type):
    g = [torch.tensor([float("inf"), 1.0])]
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.utils.clip_grad_norm_(params_with(g), 1.0, norm_type=norm_type, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as ours:
        mo.clip_grad_norm_(params_with(g), 1.0, norm_type=norm_type, error_if_nonfinite=True)
    assert str(ours.value) == str(theirs.value)


def test_ord_and_norm_type_together_must_agree():
    with pytest.raises(TypeError, match="same argument"):
        mo.clip_grad_norm_(params_with([torch.ones(2)]), 1.0, ord=1.0, norm_type=2.0)


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
    from modopt.core import nonfinite, norms

    p = torch.nn.Parameter(torch.zeros(100))
    q = torch.nn.Parameter(torch.zeros(7))
    opt = mo.Modular([p, q], mo.ClipNorm(1.0), mo.Adam())
    calls = []
    real = norms.foreach_pnorm
    # the exact check calls it from modopt.core.nonfinite; every memoised norm goes through norms.pnorms
    monkeypatch.setattr(nonfinite, "foreach_pnorm", lambda ts, p: calls.append(("exact", p)) or real(ts, p))
    monkeypatch.setattr(norms, "foreach_pnorm", lambda ts, p: calls.append(("memo", p)) or real(ts, p))
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


def test_default_clipnorm_adam_follows_torch_bit_for_bit():
    """The default pipeline users write equals the careful torch loop exactly, over a run:
    `clip_grad_norm_(ps, 1.0, foreach=True)` + `if n.isfinite(): adam_fused.step()` (the clip scale is
    multiplied into the gradients as torch does, not folded into the fused kernel's grad_scale)."""
    import copy

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    m1 = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.nn.Linear(32, 4))
    m2 = copy.deepcopy(m1)
    opt = mo.Modular(m1.parameters(), mo.ClipNorm(1.0), mo.Adam())
    ref = torch.optim.Adam(m2.parameters(), fused=True)
    g = torch.Generator().manual_seed(1)
    clipped = 0
    for _ in range(30):
        x = torch.randn(4, 8, 32, generator=g) * 3.0
        for model, o in ((m1, opt), (m2, ref)):
            o.zero_grad()
            model(x).square().mean().mul(50.0).backward()
        opt.step()
        n = torch.nn.utils.clip_grad_norm_(list(m2.parameters()), 1.0, foreach=True)
        clipped += int(n > 1.0)
        if n.isfinite():
            ref.step()
    assert clipped > 10  # the clip bites on most steps
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
