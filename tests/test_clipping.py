"""The clipping family (modopt/transforms/clipping.py: `ClipNorm`, `ClipValue`, `ClipNormByRMS`) and its
functional forms (`mo.clip_grad_norm_`, `mo.clip_grad_value_`, `mo.grad_norm`), against torch's
`clip_grad_norm_` / `clip_grad_value_` / `get_total_norm`: the global 2-norm and the clip bit for bit in
float32, torch's spellings, warnings and error texts. (Runtime == spec on drawn shapes and scopes:
tests/test_runtime_vs_spec.py and tests/test_production_path.py; every registered transform's generic
checks: tests/test_conformance.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, strategies as st

import modopt as mo
from modopt.core.reduce import combine_pnorms


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


# --- ClipNorm and the functional layer against torch's clip_grad_norm_ -------------------------------
@pytest.mark.parametrize("max_norm", [0.01, 0.5, 100.0])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
def test_clip_norm_equals_torch_clip_grad_norm(max_norm, norm_type):
    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 2, 4), ()]
    grads = [torch.randn(s) * 3 for s in shapes]
    a = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    b = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p, q, g in zip(a, b, grads):
        p.grad, q.grad = g.clone(), g.clone()
    total = torch.nn.utils.clip_grad_norm_(a, max_norm, norm_type=norm_type)
    opt = mo.Modular(b, mo.ClipNorm(max_norm, ord=norm_type), mo.LR(1.0))
    opt.step()
    for p, q in zip(a, b):  # q = 0 - clipped grad
        torch.testing.assert_close(-q.detach(), p.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(opt.stats["0:ClipNorm.norm"][0], total, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_functional_clip_grad_norm_returns_torch_total_norm(norm_type):
    torch.manual_seed(1)
    grads = [torch.randn(4, 4) * 5, torch.randn(3)]
    a = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    b = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, q, g in zip(a, b, grads):
        p.grad, q.grad = g.clone(), g.clone()
    ta = torch.nn.utils.clip_grad_norm_(a, 1.0, norm_type=norm_type)
    tb = mo.clip_grad_norm_(b, 1.0, ord=norm_type)
    torch.testing.assert_close(ta, tb)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)
    torch.testing.assert_close(mo.grad_norm(b, ord=norm_type), torch.nn.utils.get_total_norm([q.grad for q in b], norm_type))


def test_functional_clip_value_and_normalize():
    g = torch.tensor([-3.0, 0.25, 2.0])
    p = torch.nn.Parameter(torch.zeros(3))
    q = torch.nn.Parameter(torch.zeros(3))
    p.grad, q.grad = g.clone(), g.clone()
    torch.nn.utils.clip_grad_value_([p], 1.0)
    mo.clip_grad_value_([q], 1.0)
    assert torch.equal(p.grad, q.grad)
    mo.normalize_grads_([q], norm_value=2.0)
    torch.testing.assert_close(q.grad.norm(), torch.tensor(2.0))


def test_clip_grad_norm_error_if_nonfinite():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([float("inf"), 1.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        mo.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("device_path", [False, True])
def test_clip_value_sweeps_large_tensors_one_by_one_on_a_cpu_and_together_on_the_device_path(device_path):
    """`ClipValue` clamps a large tensor in one sweep where a call is cheap (a CPU) and every tensor with the
    foreach pair where a launch is what costs (a GPU: `device_path()`); the same values either way, torch's
    `clip_grad_value_`'s."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from modopt.core import runner

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    shapes = [(300, 300), (300, 300), (10,), (20,)]  # two of them at least 64K elements
    grads = [torch.randn(s) * 0.1 for s in shapes]
    p = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = mo.Modular(p, mo.ClipValue(0.05), mo.LR(1.0), nonfinite="ignore")
    for q, g in zip(p, grads):
        q.grad = g.clone()
    ops = Ops()
    with runner.device_path() if device_path else contextlib.nullcontext(), ops:
        opt.step()
    clamps = [n for n in ops.names if "clamp" in n]
    if device_path:
        assert clamps == ["aten._foreach_clamp_min_", "aten._foreach_clamp_max_"]
    else:
        assert clamps == ["aten.clamp_", "aten.clamp_", "aten._foreach_clamp_min_", "aten._foreach_clamp_max_"]
    ref = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    torch.nn.utils.clip_grad_value_(ref, 0.05)
    for q, r in zip(p, ref):
        assert torch.equal(q.detach(), -r.grad)
