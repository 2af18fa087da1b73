"""The recipe of docs/howto/distributed.md (examples/distributed_2d.py) runs on 4 gloo processes as written and
ends where one process ends: a 2x2 mesh, tensor parallel over "tp" and FSDP2 over "dp" (torchtitan's layout),
a global ClipNorm, Muon for the hidden matrices and AdamW for the rest, split by `mo.Masked`.

Tolerance: the sharded forward and backward sum the same float32 products in another order (matmuls split over
tp, gradients averaged over dp by reduce-scatter), a few float32 ulps a step; Muon's Newton-Schulz in float32
and AdamW's normalization pass them on at about that size (measured below 1e-6 after 3 steps; see the page).
A statistic of a shard alone or a matrix orthogonalized per shard moves the parameters by 1e-3 or more.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from launch import run_job
import recipe_worker as w

ATOL = 1e-5
TIMEOUT_S = 240

pytestmark = [
    pytest.mark.distributed,  # worker processes over gloo (the distributed lane)
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
    ),
]


@pytest.fixture(scope="module")
def single():
    return w.recipe.run_single(w.STEPS, w.NS_DTYPE)


@pytest.fixture(scope="module")
def owner(tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe") / "owner.pt"
    run_job("recipe_worker.py", "owner", out, TIMEOUT_S)
    return torch.load(out, weights_only=True)


def test_the_recipe_lays_out_2d_placements(owner):
    pl = owner["placements"]
    assert pl["layers.0.attn.wq.weight"] == ("_S(0, 2)", "S(0)")  # column-parallel
    assert pl["layers.0.mlp.w2.weight"] == ("S(0)", "S(1)")  # row-parallel
    assert pl["layers.0.mlp_norm.weight"] == ("S(0)", "R")  # sequence-parallel norm


def test_the_recipe_equals_one_process(owner, single):
    assert owner["params"].keys() == single["params"].keys()
    moved = 0.0
    for name, ref in single["params"].items():
        got = owner["params"][name]
        torch.testing.assert_close(got, ref, rtol=0, atol=ATOL, msg=lambda m: f"{name}: {m}")
        moved = max(moved, (ref - w.recipe.make_model().state_dict()[name]).abs().max().item())
    assert moved > 100 * ATOL  # the parameters did move: the comparison is not of two untrained models
