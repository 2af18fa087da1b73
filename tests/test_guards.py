"""The guards (modopt/transforms/guards.py): `ZeroNonFinite` against its float64 spec and in a pipeline
whose non-finite policy is `ignore`. (`Identity` changes nothing: tests/test_production_path.py.)"""

from __future__ import annotations

import torch

import modopt as mo
from harness import Harness
from modopt.spec import guards as spec


def test_zero_nonfinite_matches_spec():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        u = torch.tensor([[1.0, float("inf")], [float("-inf"), float("nan")], [-2.5, 0.0]]).to(dtype)
        h = Harness(mo.ZeroNonFinite(), [torch.zeros_like(u)])
        out = h.step([u])[0]
        assert out.dtype == dtype
        assert torch.equal(out, spec.zero_nonfinite([u])[0].to(dtype))
        assert int(h.stats["0:ZeroNonFinite.zeroed"]) == 3


def test_zero_nonfinite_in_a_pipeline_with_ignore():
    p = torch.nn.Parameter(torch.ones(3))
    opt = mo.Modular([p], mo.ZeroNonFinite(), mo.SGD(lr=1.0), nonfinite="ignore")
    p.grad = torch.tensor([1.0, float("nan"), float("inf")])
    opt.step()
    assert torch.equal(p.detach(), torch.tensor([0.0, 1.0, 1.0]))
