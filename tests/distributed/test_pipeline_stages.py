"""`Modular(..., stage_group=)`: two pipeline stages, each an optimizer over its own parameters, take the
global statistics (a global ClipNorm's 2-norm and inf-norm, ClipNormByEMA's and ZClip's norms, a global
mean, a global RMS's element count) and the non-finite decision over every stage's parameters: each stage
ends where one process over all the parameters ends, and a NaN in one stage's gradient skips the step on
both. Two gloo processes on 127.0.0.1 (stage_worker.py), on the CPU's host path and on the device path.

Tolerance: a stage's total combines the stage totals (sums of per-tensor norms in another grouping than one
process's), a few float32 ulps; Adam's normalization passes them on (measured below 1e-6 after 6 steps).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import modopt as mo

from launch import run_job
import stage_worker as w

pytestmark = [
    pytest.mark.distributed,  # worker processes over gloo (the distributed lane)
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
    ),
]

ATOL = 2e-6


@pytest.fixture(scope="module", params=["host", "device"])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("stages") / "run"
    run_job("stage_worker.py", request.param, out, 300)
    return [torch.load(f"{out}.{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("pipeline", list(w.PIPELINES))
def test_each_stage_ends_where_one_process_ends(ranks, pipeline):
    for rank, result in enumerate(ranks):
        r = result[pipeline]
        for got, ref, start in zip(r["got"], r["ref"], r["start"]):
            torch.testing.assert_close(got, ref, rtol=0, atol=ATOL, msg=lambda m: f"stage {rank}: {m}")
            assert (ref - start).abs().max() > 100 * ATOL  # the parameters moved
        # the NaN was in stage 1's gradient only: both stages skipped that step, as one process did
        assert r["skipped"] == r["ref_skipped"] == len(w.NAN_AT), (rank, r["skipped"], r["ref_skipped"])


def test_without_the_stage_group_a_stage_clips_by_its_own_norm():
    """The failure the option prevents: stage 0 alone, clipping by its own parameters' norm, moves away
    from one process (so the test above would see a missing all-gather)."""
    ps = [w.params()[i] for i in (0, 1)]
    got, _ = w.train(ps, [0, 1], "ClipNorm+Adam", None)
    every = w.params()
    ref, _ = w.train(every, [0, 1, 2, 3], "ClipNorm+Adam", None)
    assert max((g - r).abs().max().item() for g, r in zip(got, ref[:2])) > 100 * ATOL


def test_a_global_percentile_over_stages_is_refused_when_built():
    """Refused with the transform's key before anything is built (a step would have half run); a
    per-tensor percentile is fine (each stage's own elements)."""
    pg = dist.ProcessGroup(dist.HashStore(), 0, 1)  # (a group object: nothing is communicated here)
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="0:ClipValueByPercentile: a global percentile over pipeline stages"):
        mo.Modular([p], mo.ClipValueByPercentile(90, scope="global"), mo.SGD(lr=0.1), stage_group=pg)
    assert p.grad is None and torch.equal(p.detach(), torch.zeros(3))
    mo.Modular([p], mo.ClipValueByPercentile(90, scope="tensor"), mo.SGD(lr=0.1), stage_group=pg)
