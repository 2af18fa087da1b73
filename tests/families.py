"""Shared helpers of the module-family tests: 50-step update sequences and comparisons."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from harness import Harness

shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)


def sequence(shp, dtype, seed, steps=50, spike_at=20, alt=(30, 40)):
    """``steps`` lists of update tensors: all zeros first, a huge spike, a stretch of alternating signs."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=g, dtype=torch.float64) for s in shp]
    out = []
    for k in range(steps):
        if k == 0:
            us = [torch.zeros(s, dtype=torch.float64) for s in shp]
        elif k == spike_at:
            us = [torch.randn(s, generator=g, dtype=torch.float64) * 1e4 for s in shp]
        elif alt[0] <= k < alt[1]:
            us = [b * (-1) ** k * (1 + 0.1 * (k - alt[0])) for b in base]
        else:
            us = [torch.randn(s, generator=g, dtype=torch.float64) * (0.5 + k / 25) for s in shp]
        out.append([u.to(dtype) for u in us])
    return out


@st.composite
def layouts(draw, dtypes=(torch.float32, torch.float64)):
    n = draw(st.integers(1, 3))
    shp = [draw(shapes) for _ in range(n)]
    cut = draw(st.integers(0, n))
    return shp, [0] * cut + [1] * (n - cut), draw(st.sampled_from(list(dtypes))), draw(st.integers(0, 2**16))


def scope_kw(draw, dims=True):
    scope = draw(st.sampled_from(["global", "group", "tensor"]))
    kw = {"scope": scope}
    if dims and scope == "tensor" and draw(st.booleans()):
        kw["dim"] = draw(st.sampled_from([0, -1, (0, 1)]))
        kw["inverse_dims"] = draw(st.booleans())
    kw["min_size"] = draw(st.sampled_from([1, 1, 2]))
    return kw


TOL = {torch.float64: 1e-9, torch.float32: 1e-4}


#: rounding a running statistic carries: a few ulps of the largest value it has seen
FLOOR = {torch.float64: 1e-13, torch.float32: 1e-6}


def close(out, ref, dtype, rel=None, floor=0.0):
    """Runtime output ``out`` equals the float64 spec ``ref`` to the dtype's tolerance (relative to the
    tensor's scale), plus ``floor``: the absolute rounding a running statistic carries from the past."""
    rel = rel or TOL[dtype]
    for o, r in zip(out, ref):
        assert o.dtype == dtype and o.shape == r.shape
        scale = max(r.abs().max().item() if r.numel() else 0.0, 1e-30)
        assert torch.allclose(o.to(torch.float64), r, rtol=rel, atol=rel * scale + floor), (o, r)


def run_vs_spec(t, spec, shp, group_of, dtype, seed, rel=None, **seq_kw):
    params = [torch.zeros(s, dtype=dtype) for s in shp]
    h = Harness(t, params, group_of)
    seen = 0.0  # the largest update magnitude so far: rounding of running statistics scales with it
    for k, us in enumerate(sequence(shp, dtype, seed, **seq_kw)):
        seen = max([seen] + [u.abs().max().item() for u in us if u.numel()])
        out = h.step(us)
        ref = spec.step(us)
        try:
            close(out, ref, dtype, rel, floor=FLOOR[dtype] * seen)
        except AssertionError as e:
            raise AssertionError(f"step {k}: {e}") from None
    return h


def snapshot(h: Harness) -> dict:
    """Every saved tensor/number of a harness (per-parameter buffers and the transform store)."""
    snap = {}
    for i, p in enumerate(h.params):
        for k, v in h.state[p].items():
            snap[f"p{i}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    for key, d in h._store.items():
        for k, v in d.items():
            snap[f"{key}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return snap


def same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape and torch.equal(x, y), (k, x, y)
        else:
            assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), (k, x, y)
