"""Real 4-process runs on a 2x2 mesh (gloo on 127.0.0.1): tensor parallel over "tp" and FSDP2 over "dp",
laid out as torchtitan lays out a transformer, match the single-process trajectory.

One 4-rank job (``mesh2d_worker.py``) runs every case; the single-process reference runs here. The
parameters are DTensors with two placements: ``(_StridedShard(0), Shard(0))`` (column-parallel, sharded
twice on dim 0), ``(Shard(0), Shard(1))`` (row-parallel weights) and ``(Shard(0), Replicate())`` (row-parallel
biases, sequence-parallel norms). A statistic summed over a Replicate dim counts those tensors twice; one
that misses the _StridedShard dim sees half of the column-parallel tensors (both were measured to move the
parameters by 1e-3 in 4 steps, before the fix).

Tolerance: 2e-6 absolute on parameters of size ~0.1-1 after 4 steps. The sharded forward and backward sum
the same float32 products in another order (matmuls split over tp, gradients reduce-scattered over dp):
plain SGD with no statistic already ends up to 1.2e-7 away (a few float32 ulps); a statistic computed on the
full tensors adds rounding of that order (measured: at most 6e-7, ZClip + per-tensor EMA clipping + AdamW).
The bugs this guards against move the parameters by 1e-4 to 1e-3 (the control case below).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

import mesh2d_worker as w
import modopt as mo
from launch import run_job

TIMEOUT_S = 240
ATOL = 2e-6

pytestmark = [
    pytest.mark.distributed,  # worker processes over gloo (the distributed lane)
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
    ),
]


@pytest.fixture(scope="module")
def mesh2d(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh2d") / "mesh2d.pt"
    run_job("mesh2d_worker.py", "mesh2d", out, TIMEOUT_S, env_drop=("MESH2D_ONLY",))
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return w.run_all("single", None)


def assert_params_close(got, ref, what):
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=0, atol=ATOL, msg=lambda m: f"{what}, parameter {i}: {m}")


def test_the_layout_mixes_shard_and_replicate(mesh2d):
    got = mesh2d["SGD"]
    assert got["error"] is None, got["error"]
    assert got["placements"] == [("S(0)", "R"), ("S(0)", "S(1)"), ("_S(0, 2)", "S(0)")]


@pytest.mark.parametrize("case", list(w.cases()))
def test_2d_mesh_matches_single_process(mesh2d, reference, case):
    ref, got = reference[case], mesh2d[case]
    assert ref["error"] is None, ref["error"]
    assert got["error"] is None, got["error"]
    assert got["agree"], "the 4 ranks must end with the same full parameters"
    assert got["plain_state"], "statistics kept by the transforms must be plain tensors, the same on every rank"
    assert got["acted"] == ref["acted"]
    if case != "SGD":  # the case must do something, or it would test nothing
        moved = max((a - b).abs().max().item() for a, b in zip(ref["params"], reference["SGD"]["params"]))
        assert ref["acted"] or moved > 1e-3, f"{case}: the pipeline changed nothing against plain SGD"
    assert_params_close(got["params"], ref["params"], case)


def test_nan_in_one_ranks_shard_skips_on_every_rank(mesh2d, reference):
    """The default policy decides on the device: a NaN planted by one rank in its shard of a Replicate-over-tp
    bias (step 1), then of a column-parallel weight (step 3), skips that step on all 4 ranks, and the run ends
    where the single-process run without those steps ends."""
    got = mesh2d[w.SKIP_CASE]
    assert got["error"] is None, got["error"]
    assert got["on_device"]
    assert got["skipped"] == [k in w.NAN_PLANTS for k in range(w.SKIP_STEPS)]
    assert got["skips_agree"] and got["agree"]
    assert_params_close(got["params"], reference[w.SKIP_CASE]["params"], "skip")


def test_skipstep_on_one_ranks_loss_spike_skips_on_every_rank(mesh2d):
    got = mesh2d[w.LOSS_CASE]
    assert got["error"] is None, got["error"]
    assert got["skipped"] == [k == w.LOSS_SPIKE_STEP for k in range(w.LOSS_STEPS)]
    assert got["skips_agree"] and got["agree"]
    model = w.make_model()  # the single-process run without the spiking step
    opt = mo.Modular(w.param_groups(model), mo.SGD(lr=0.05))
    for step in range(w.LOSS_STEPS):
        if step == w.LOSS_SPIKE_STEP:
            continue
        opt.zero_grad()
        w.loss_of(model, *w.batch(step)).backward()
        opt.step()
    assert_params_close(got["params"], [p.detach() for p in model.parameters()], "SkipStep(loss)")


def test_world_mean_is_the_data_parallel_mean_and_spreads_nan(mesh2d):
    """SkipStep's and Rewind's decisions read `world_mean` of the loss: on the 2x2 mesh it is the full-batch
    loss (each tp pair holds the same value), the same on every rank, and one rank's NaN reaches all."""
    got = mesh2d[w.WORLD_MEAN_CASE]
    assert got["error"] is None, got["error"]
    full = w.loss_of(w.make_model(), *w.batch(0)).detach()
    torch.testing.assert_close(got["mean"], full, rtol=1e-6, atol=0)
    assert got["mean_agrees"] and got["nan_everywhere"]


def test_summing_over_replicate_dims_would_not_match(mesh2d, reference):
    """The control: the same global clip with partial sums also summed over Replicate dims (an all-reduce
    over the whole world) ends elsewhere, so the matching cases above would catch that bug."""
    got = mesh2d[w.DOUBLE_COUNT_CASE]
    assert got["error"] is None, got["error"]
    diff = max((a - b).abs().max().item() for a, b in zip(got["params"], reference["ClipNorm-global"]["params"]))
    assert diff > 1e-4
