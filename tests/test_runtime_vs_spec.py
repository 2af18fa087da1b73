"""Runtime == spec (float64 reference) for the core scoped transforms, on drawn shapes, dtypes, scopes and values."""

from __future__ import annotations

import math

import torch
from hypothesis import given, strategies as st

import modopt as mo
from modopt.spec import core as spec
from modopt.spec.scope import slice_dims
from harness import Harness

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
ORDS = [0.0, 1.0, 2.0, 3.0, math.inf, 0.5, "l0", "l1", "l2", "l3", "l4", "linf", "mad", "std", "var", "sum"]
# relative tolerance of a comparison in each dtype (the spec is float64 of the same inputs)
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

shapes = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors_and_groups(draw, dtype=None):
    dtype = dtype or draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 4))
    shp = [draw(shapes) for _ in range(n)]
    kind = draw(st.sampled_from(["normal", "zeros", "tiny", "huge", "mixed"]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    # "huge": near fp16's maximum; elsewhere as large as a p <= 4 norm can accumulate without
    # overflowing its float32 / float64 accumulator (torch's own norms overflow past that too)
    max_val = {torch.float16: 6e4, torch.float64: 1e60}.get(dtype, 1e8)
    out = []
    for s in shp:
        x = torch.randn(s, generator=g, dtype=torch.float64)
        if kind == "zeros":
            x = torch.zeros(s, dtype=torch.float64)
        elif kind == "tiny":
            x = x * 1e-6
        elif kind == "huge":
            x = (x / (x.abs().max() + 1e-12)) * max_val * 0.9 if x.numel() else x
        elif kind == "mixed" and x.numel():
            x.reshape(-1)[0] = 0.0
        out.append(x.to(dtype))
    cut = draw(st.integers(0, n))
    group_of = [0] * cut + [1] * (n - cut)
    return out, group_of


def scope_kwargs(draw, default_scope):
    scope = draw(st.sampled_from(["global", "group", "tensor"]))
    kw = {"scope": scope}
    if scope == "tensor" and draw(st.booleans()):
        kw["dim"] = draw(st.sampled_from([0, -1, 1, (0, 1), (-1, 0), 5]))
        kw["inverse_dims"] = draw(st.booleans())
    kw["min_size"] = draw(st.sampled_from([1, 1, 2, 4]))
    return kw


def check(out, ref, dtype, rel=None):
    rel = rel or TOL[dtype]
    for o, r in zip(out, ref):
        assert o.dtype == dtype and o.shape == r.shape
        o64 = o.to(torch.float64)
        # both sides rounded to the tensor's dtype before comparing
        r_rounded = r.to(dtype).to(torch.float64)
        scale = max(r.abs().max().item() if r.numel() else 0.0, 1e-30)
        # floor: a few subnormal steps (a scale applied to half-precision subnormals rounds there)
        fi = torch.finfo(dtype)
        assert torch.allclose(o64, r_rounded, rtol=rel, atol=max(rel * scale, 4 * fi.tiny * fi.eps)), (o, r)
        assert not torch.isnan(o).any() or torch.isnan(r).any()


def assert_close_to_inputs(out, ref, inputs):
    """Centralization subtracts nearly equal numbers: the error is relative to the inputs' magnitude
    (over all tensors, since a global mean mixes them), with a floor at the dtype's subnormal spacing."""
    dtype = inputs[0].dtype
    fi = torch.finfo(dtype)
    scale = max([x.double().abs().max().item() for x in inputs if x.numel()] + [0.0])
    atol = TOL[dtype] * scale * 4 + 2 * fi.tiny * fi.eps
    for o, r in zip(out, ref):
        assert o.dtype == dtype and o.shape == r.shape
        r = r.to(dtype).double()  # the spec's result in the tensor's dtype (it may overflow to inf there too)
        assert torch.allclose(o.double(), r, rtol=0, atol=atol, equal_nan=False), (o, r)


def params_for(ts):
    return [torch.zeros_like(t) for t in ts]


@given(data=st.data())
def test_clip_norm_matches_spec(data):
    ts, group_of = data.draw(tensors_and_groups())
    dtype = ts[0].dtype
    kw = scope_kwargs(data.draw, "global")
    ord = data.draw(st.sampled_from(ORDS))
    max_norm = data.draw(st.sampled_from([1e-3, 0.5, 1.0, 10.0]))
    eps = data.draw(st.sampled_from([0.0, 1e-6]))
    t = mo.ClipNorm(max_norm, ord=ord, eps=eps, **kw)
    out = Harness(t, params_for(ts), group_of).step(ts)
    ref = spec.clip_norm([x.double() for x in ts], group_of, max_norm, ord=ord, eps=eps, **kw)
    check(out, ref, dtype)


@given(data=st.data())
def test_normalize_matches_spec(data):
    ts, group_of = data.draw(tensors_and_groups())
    dtype = ts[0].dtype
    kw = scope_kwargs(data.draw, "tensor")
    ord = data.draw(st.sampled_from(ORDS))
    t = mo.Normalize(norm_value=data.draw(st.sampled_from([0.1, 1.0, 3.0])), ord=ord, eps=data.draw(st.sampled_from([0.0, 1e-8])), **kw)
    out = Harness(t, params_for(ts), group_of).step(ts)
    ref = spec.normalize([x.double() for x in ts], group_of, t.norm_value, ord=ord, eps=t.eps, **kw)
    check(out, ref, dtype)


@given(data=st.data())
def test_centralize_matches_spec(data):
    ts, group_of = data.draw(tensors_and_groups())
    dtype = ts[0].dtype
    kw = scope_kwargs(data.draw, "tensor")
    t = mo.Centralize(**kw)
    out = Harness(t, params_for(ts), group_of).step(ts)
    ref = spec.centralize([x.double() for x in ts], group_of, **kw)
    assert_close_to_inputs(out, ref, ts)


@given(data=st.data())
def test_gradient_centralization_matches_spec(data):
    ts, group_of = data.draw(tensors_and_groups())
    out = Harness(mo.GradientCentralization(), params_for(ts), group_of).step(ts)
    ref = spec.gradient_centralization([x.double() for x in ts], group_of)
    assert_close_to_inputs(out, ref, ts)


@given(data=st.data())
def test_clip_value_matches_spec(data):
    ts, group_of = data.draw(tensors_and_groups())
    v = data.draw(st.sampled_from([1e-3, 0.5, 2.0]))
    out = Harness(mo.ClipValue(v), params_for(ts), group_of).step(ts)
    check(out, spec.clip_value([x.double() for x in ts], v), ts[0].dtype)


# --- properties -------------------------------------------------------------


@given(data=st.data())
def test_clipped_norm_never_exceeds_max_norm(data):
    ts, group_of = data.draw(tensors_and_groups(dtype=torch.float32))
    kw = scope_kwargs(data.draw, "global")
    kw.pop("min_size")
    ord = data.draw(st.sampled_from([1.0, 2.0, 3.0, math.inf, "mad", "l4"]))
    max_norm = data.draw(st.sampled_from([1e-3, 0.5, 1.0]))
    t = mo.ClipNorm(max_norm, ord=ord, eps=0.0, **kw)
    out = Harness(t, params_for(ts), group_of).step(ts)
    after = spec.clip_norm([o.double() for o in out], group_of, math.inf, ord=ord, eps=0.0, **kw)  # identity
    from modopt.spec.scope import gather, segments
    from modopt.spec.stats import stat

    for seg in segments(after, group_of, kw["scope"], kw.get("dim"), kw.get("inverse_dims", False)):
        n = stat(gather(after, seg), ord).item()
        assert n <= max_norm * (1 + 1e-5) or math.isnan(n)


@given(data=st.data())
def test_zeros_stay_zero(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    shp = [data.draw(shapes) for _ in range(data.draw(st.integers(1, 3)))]
    ts = [torch.zeros(s, dtype=dtype) for s in shp]
    kw = scope_kwargs(data.draw, "tensor")
    ord = data.draw(st.sampled_from(ORDS))
    for t in [
        mo.ClipNorm(1.0, ord=ord, eps=0.0, **kw),
        mo.Normalize(ord=ord, **kw),
        mo.Centralize(**kw),
        mo.ClipValue(1.0),
    ]:
        out = Harness(t, params_for(ts), [0] * len(ts)).step(ts)
        for o in out:
            assert torch.equal(o, torch.zeros_like(o)), (t, o)


@given(data=st.data())
def test_scale_equivariance(data):
    """Normalize(c*u) == Normalize(u) and ClipNorm is positively homogeneous once both are clipped."""
    ts, group_of = data.draw(tensors_and_groups(dtype=torch.float64))
    kw = scope_kwargs(data.draw, "tensor")
    kw["min_size"] = 1  # segments left alone for their size are not rescaled
    c = data.draw(st.sampled_from([1e-3, 7.0, 1e3]))
    # (std is left out: a constant or one-element slice has std 0 and is left unscaled by design)
    ord = data.draw(st.sampled_from([1.0, 2.0, math.inf, "mad", "l3"]))
    t = mo.Normalize(ord=ord, **kw)
    a = Harness(t, params_for(ts), group_of).step(ts)
    b = Harness(t, params_for(ts), group_of).step([x * c for x in ts])
    for x, y, u in zip(a, b, ts):
        # a tensor with no slice dim left is left as it is (`slice_dims`): then y = c * x
        kept = "dim" in kw and slice_dims(u.dim(), kw["dim"], kw["inverse_dims"]) is None
        assert torch.allclose(x * c if kept else x, y, rtol=1e-9, atol=1e-12)
    # centralization commutes with scaling
    cz = mo.Centralize(**kw)
    a = Harness(cz, params_for(ts), group_of).step(ts)
    b = Harness(cz, params_for(ts), group_of).step([x * c for x in ts])
    mag = max([x.abs().max().item() for x in ts if x.numel()] + [0.0])
    for x, y in zip(a, b):
        assert torch.allclose(x * c, y, rtol=1e-9, atol=1e-12 * c * mag)


def test_fp16_near_max_does_not_overflow_norm():
    x = torch.full((1000,), 6.0e4, dtype=torch.float16)
    out = Harness(mo.ClipNorm(1.0), [torch.zeros_like(x)], [0]).step([x])
    n = torch.linalg.vector_norm(out[0].float())
    assert torch.isfinite(n) and n <= 1.0 + 1e-3 and n > 0.99


def test_zero_dim_and_one_element_tensors():
    ts = [torch.tensor(3.0), torch.tensor([4.0])]
    out = Harness(mo.ClipNorm(1.0, eps=0.0), params_for(ts), [0, 0]).step(ts)
    assert torch.allclose(out[0], torch.tensor(0.6)) and torch.allclose(out[1], torch.tensor([0.8]))
    out = Harness(mo.Centralize(), params_for(ts), [0, 0]).step(ts)  # min_size=2: left alone
    assert out[0] == 3.0 and out[1] == 4.0
    out = Harness(mo.Normalize(ord="std"), params_for(ts), [0, 0]).step(ts)  # std of one element: 0 -> unchanged
    assert out[0] == 3.0 and out[1] == 4.0
