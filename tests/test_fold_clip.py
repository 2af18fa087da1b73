"""`Adam(fold_clip=True)` / `AdamW(fold_clip=True)` (modopt/transforms/optimizers.py): the global clip's scale goes into
torch's fused kernel as its `grad_scale` instead of a multiply of its own.

Checked against torch (`clip_grad_norm_` then `torch.optim.Adam(fused=True)`): the clipped gradients
agree to 2 ulp and differ somewhere (so the fold did run), the trajectories stay within rounding; no
`_foreach_mul_` runs and the bytes fall by one pass (read and write) over the gradients; a NaN step
leaves everything bit-identical with no host sync; where the kernel is not used (float64) the clip
multiplies, bit for bit the default; a fold without a global clip before it is refused, naming the field.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import modopt as mo
from checks import assert_bad_steps_change_nothing


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _models(n, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5)).to(dtype)
    return [copy.deepcopy(m) for _ in range(n)]


def _backward(models, k, dtype=torch.float32):
    x = torch.randn(8, 20, generator=torch.Generator().manual_seed(k), dtype=dtype)
    for m in models:
        m.zero_grad()
        (m(x).pow(2).mean() * 10).backward()


@pytest.mark.parametrize("cls", [mo.Adam, mo.AdamW])
def test_fold_matches_clip_grad_norm_and_torch_fused_kernel_to_rounding(cls):
    folded, plain, ref = _models(3)
    fo = mo.Modular(folded.parameters(), mo.ClipNorm(0.1), cls(lr=1e-2, fold_clip=True))
    po = mo.Modular(plain.parameters(), mo.ClipNorm(0.1), cls(lr=1e-2))
    assert fo.folded_scale == "0:ClipNorm" and po.folded_scale is None
    torch_cls = torch.optim.AdamW if cls is mo.AdamW else torch.optim.Adam
    ps = list(ref.parameters())
    to = torch_cls(ps, lr=1e-2, fused=True)
    differs = False
    for k in range(25):
        _backward([folded, plain, ref], k)
        raw = [p.grad.clone() for p in folded.parameters()]
        fo.step()
        po.step()
        torch.nn.utils.clip_grad_norm_(ps, 0.1)
        to.step()
        # the kernel writes the clipped gradients back: g / (1/c) against clip_grad_norm_'s g * c
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(raw)))
        coef = torch.clamp(0.1 / (total + 1e-6), max=1.0)
        for p, g in zip(folded.parameters(), raw):
            expected = g * coef
            assert ((p.grad - expected).abs() <= expected.abs() * 2**-22).all()
            differs |= not torch.equal(p.grad, expected)
        for p, q in zip(plain.parameters(), ref.parameters()):
            assert torch.equal(p, q)  # the default stays bit for bit torch's
    assert differs  # the fold ran (a multiply would give torch's bits)
    for p, q in zip(folded.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fold_leaves_out_the_clip_multiply():
    (m,) = _models(1)
    opt = mo.Modular(m.parameters(), mo.ClipNorm(0.1), mo.Adam(fold_clip=True))
    counts = []
    for k in range(3):
        _backward([m], k)
        with _Ops() as ops:
            opt.step()
        counts.append(ops.names)
    assert "aten._foreach_mul_" not in counts[-1] and "aten._fused_adam_" in counts[-1]
    (m,) = _models(1)
    opt = mo.Modular(m.parameters(), mo.ClipNorm(0.1), mo.Adam())
    _backward([m], 0)
    with _Ops() as ops:
        opt.step()
    assert "aten._foreach_mul_" in ops.names  # (the default multiplies)


def test_fold_nan_step_keeps_everything_without_a_sync():
    """A folded clip (not in the registry: it needs a global clip before the optimizer) on NaN and inf steps."""
    def make():
        (m,) = _models(1)
        return m, mo.Modular(m.parameters(), mo.ClipNorm(0.1), mo.Adam(fold_clip=True))

    assert_bad_steps_change_nothing(make, lambda m, k: _backward([m], k), steps=6, at=(3,))


def test_float64_and_foreach_paths_multiply_as_the_default():
    folded, plain = _models(2, torch.float64)
    fo = mo.Modular(folded.parameters(), mo.ClipNorm(0.1), mo.Adam(fold_clip=True))
    po = mo.Modular(plain.parameters(), mo.ClipNorm(0.1), mo.Adam())
    for k in range(5):
        _backward([folded, plain], k, torch.float64)
        fo.step()
        po.step()
    for p, q in zip(folded.parameters(), plain.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


def test_fold_after_an_ema_clip_and_through_a_config():
    folded, ref = _models(2)
    cfg = mo.PipelineConfig(transforms=[mo.ClipNormByEMA(), mo.AdamW(fold_clip=True)])
    again = mo.PipelineConfig.from_dict(cfg.to_dict())
    assert again.transforms[1].fold_clip is True
    fo = mo.Modular(folded.parameters(), config=again)
    ro = mo.Modular(ref.parameters(), mo.ClipNormByEMA(), mo.AdamW())
    assert fo.folded_scale == "0:ClipNormByEMA"
    for k in range(10):
        _backward([folded, ref], k)
        fo.step()
        ro.step()
    for p, q in zip(folded.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pipeline, culprit", [
    ([mo.ClipNorm(1.0, scope="tensor"), mo.Adam(fold_clip=True)], "0:ClipNorm"),
    ([mo.ClipNorm(1.0), mo.Normalize(), mo.Adam(fold_clip=True)], "1:Normalize"),
    ([mo.Adam(fold_clip=True)], None),
])
def test_fold_without_a_global_clip_before_it_is_refused(pipeline, culprit):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="fold_clip") as e:
        mo.Modular([p], *pipeline)
    if culprit:
        assert culprit in str(e.value)
