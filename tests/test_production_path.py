"""Runtime == spec through the path users run (`Modular.step()`).

Every example goes through ``Modular.step()`` with default settings after a real
backward pass: the cached layout, the non-finite check and its norm memo, and the
optimizer's fused final write all take part. The
harness tests (``test_runtime_vs_spec.py``) check ``apply`` alone; these check
what a training loop gets.

The last transform is ``SGD(lr=1.0)`` (fused write) for float32/float64, and ``LR(1.0)`` for
float16/bfloat16 (the CPU ``_fused_sgd_`` of torch 2.4-2.13 is wrong for half precision:
modopt/core/kernels.py routes around that kernel). Parameters start at 0, so after the
step ``-p`` is the update the chain produced.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, strategies as st

import modopt as mo
from modopt.spec import core as spec
from modopt.spec import ema as spec_ema
from test_runtime_vs_spec import ORDS, TOL, scope_kwargs, tensors_and_groups

HALF = (torch.float16, torch.bfloat16)


def check(out, ref, dtype, rel=None):
    """``out`` equals the float64 spec rounded to ``dtype``, up to the dtype's relative tolerance
    (with a floor of a few subnormal steps: a scale applied in half precision rounds there)."""
    rel = rel or TOL[dtype]
    fi = torch.finfo(dtype)
    for o, r in zip(out, ref):
        assert o.dtype == dtype and o.shape == r.shape
        r_rounded = r.to(dtype).to(torch.float64)
        scale = max(r.abs().max().item() if r.numel() else 0.0, 1e-30)
        atol = max(rel * scale, 4 * fi.tiny * fi.eps)
        assert torch.allclose(o.to(torch.float64), r_rounded, rtol=rel, atol=atol), (o, r)


def build(ts, group_of, *transforms):
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in ts]
    groups = []
    for g in sorted(set(group_of)):
        groups.append({"params": [p for p, k in zip(params, group_of) if k == g]})
    last = mo.LR(1.0) if ts[0].dtype in HALF else mo.SGD(lr=1.0)
    return params, mo.Modular(groups, *transforms, last)


def backward(params, grads):
    """A real backward pass whose gradients are exactly ``grads``: d/dp sum(p * c) = c."""
    for p in params:
        p.grad = None
    with torch.enable_grad():
        loss = sum((p * c).sum().float() for p, c in zip(params, grads))
        loss.backward()
    for p, c in zip(params, grads):
        assert torch.equal(p.grad, c)


def step_updates(opt, params, grads):
    backward(params, grads)
    opt.step()
    assert not bool(opt.stats["skipped"])
    out = [-p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.zero_()
    return out


@given(data=st.data())
def test_clip_norm_through_step(data):
    ts, group_of = data.draw(tensors_and_groups())
    dtype = ts[0].dtype
    kw = scope_kwargs(data.draw, "global")
    ord = data.draw(st.sampled_from(ORDS))
    max_norm = data.draw(st.sampled_from([1e-3, 0.5, 10.0]))
    params, opt = build(ts, group_of, mo.ClipNorm(max_norm, ord=ord, **kw))
    for _ in range(2):  # the second step runs on the cached layout
        out = step_updates(opt, params, ts)
        check(out, spec.clip_norm([x.double() for x in ts], group_of, max_norm, ord=ord, **kw), dtype)


@given(data=st.data())
def test_normalize_through_step(data):
    ts, group_of = data.draw(tensors_and_groups())
    dtype = ts[0].dtype
    kw = scope_kwargs(data.draw, "tensor")
    ord = data.draw(st.sampled_from(ORDS))
    params, opt = build(ts, group_of, mo.Normalize(ord=ord, **kw))
    out = step_updates(opt, params, ts)
    check(out, spec.normalize([x.double() for x in ts], group_of, ord=ord, **kw), dtype)


@given(data=st.data())
def test_clip_then_normalize_through_step(data):
    """A clip, then a normalization: each scales the updates itself."""
    ts, group_of = data.draw(tensors_and_groups())
    dtype = ts[0].dtype
    ckw = scope_kwargs(data.draw, "global")
    nkw = scope_kwargs(data.draw, "tensor")
    ord = data.draw(st.sampled_from([1.0, 2.0, math.inf, "mad", "std", "l3"]))
    params, opt = build(ts, group_of, mo.ClipNorm(0.5, **ckw), mo.Normalize(ord=ord, **nkw))
    out = step_updates(opt, params, ts)
    mid = spec.clip_norm([x.double() for x in ts], group_of, 0.5, **ckw)
    ref = spec.normalize(mid, group_of, ord=ord, **nkw)
    # two scalings in the runtime's dtype: twice the tolerance
    check(out, ref, dtype, rel=2 * TOL[dtype])


@given(data=st.data())
def test_centralize_through_step(data):
    ts, group_of = data.draw(tensors_and_groups(dtype=data.draw(st.sampled_from([torch.float32, torch.float64]))))
    kw = scope_kwargs(data.draw, "tensor")
    params, opt = build(ts, group_of, mo.Centralize(**kw))
    out = step_updates(opt, params, ts)
    ref = spec.centralize([x.double() for x in ts], group_of, **kw)
    mag = max([x.double().abs().max().item() for x in ts if x.numel()] + [0.0])
    for o, r in zip(out, ref):
        assert torch.allclose(o.double(), r, rtol=0, atol=4 * TOL[ts[0].dtype] * mag + 1e-300)


@given(data=st.data())
def test_norm_ema_through_step(data):
    """ClipNormByEMA / NormalizeByEMA, stateful: three steps with different gradients, state carried by Modular."""
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    ts, group_of = data.draw(tensors_and_groups(dtype=dtype))
    kw = scope_kwargs(data.draw, "global")
    init = data.draw(st.sampled_from(["zeros", "update"]))
    name = data.draw(st.sampled_from(["ClipNormByEMA", "NormalizeByEMA"]))
    then_normalize = data.draw(st.booleans())  # the mission pipeline's shape
    chain = [getattr(mo, name)(beta=0.5, ema_init=init, **kw)] + ([mo.Normalize()] if then_normalize else [])
    params, opt = build(ts, group_of, *chain)
    ref_t = getattr(spec_ema, name)(group_of, beta=0.5, ema_init=init, **kw)
    for k, c in enumerate([1.0, 3.0, 0.5]):
        grads = [x * c for x in ts]
        out = step_updates(opt, params, grads)
        ref = ref_t.step([g.double() for g in grads])
        if then_normalize:
            ref = spec.normalize(ref, group_of)
        # the EMA compounds float32 rounding over the steps
        check(out, ref, dtype, rel=4 * TOL[dtype])


# --- Identity() inserted anywhere changes nothing ------------------------------------------

PIPELINES = [
    lambda: [mo.ClipNorm(1.0), mo.Adam(lr=1e-2)],
    lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(lr=1e-2)],
    lambda: [mo.ClipNorm(0.5, scope="group"), mo.Normalize(), mo.SGD(lr=0.1, momentum=0.9)],
    lambda: [mo.ClipNorm(0.3), mo.ClipNorm(1.0, scope="tensor"), mo.AdamW(lr=1e-2)],
    lambda: [mo.ClipValue(0.1), mo.ClipNorm(1.0), mo.LR(0.1)],
    lambda: [mo.Accumulate(2), mo.ClipNorm(1.0), mo.Adam(lr=1e-2)],
    lambda: [mo.ZClip(warmup_steps=2), mo.HistClip(warmup_steps=2), mo.Normalize(scope="global"), mo.Adam(lr=1e-2)],
    lambda: [mo.AutoClip(), mo.ClipNormByEMA(scope="group"), mo.SGD(lr=0.1)],
]


def run_model(transforms, steps=4, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]
    opt = mo.Modular(groups, *transforms)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=g) * 3
        opt.zero_grad()
        with torch.enable_grad():
            model(x).square().sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


@given(st.sampled_from(range(len(PIPELINES))), st.data())
def test_inserting_identity_changes_nothing_bit_for_bit(which, data):
    """Identity neither reads nor writes the updates (``update_access = "none"``): the norm memo
    passes by it, so the parameters are the same bit for bit wherever it goes."""
    base = PIPELINES[which]()
    where = data.draw(st.integers(0, len(base)))
    many = data.draw(st.integers(1, 2))
    seed = data.draw(st.integers(0, 100))
    with_id = base[:where] + [mo.Identity() for _ in range(many)] + base[where:]
    ref, _ = run_model(base, seed=seed)
    got, _ = run_model(with_id, seed=seed)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
