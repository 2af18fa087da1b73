"""`Rewind` over FSDP2 (issue 38 item 8): a real 2-process run (gloo on 127.0.0.1), against the same run in one process.

One job (``rewind_worker.py fsdp``) does everything on both ranks; the single-process run happens
here. See the worker's docstring for the run: a tiny MLP, ``ClipNorm -> Adam``, parameters and
moments sharded unevenly on dim 0, a loss spike in rank 1's batch alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import rewind_worker as W
from launch import run_job

TIMEOUT_S = 150

pytestmark = [
    pytest.mark.distributed,  # worker processes over gloo (the distributed lane)
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
    ),
]


def launch(tmp: Path) -> list[dict]:
    """Run the 2-rank job (`launch.run_job`); each rank's results."""
    out = tmp / "rewind"
    run_job("rewind_worker.py", "fsdp", out, TIMEOUT_S)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(W.WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    got = launch(tmp_path_factory.mktemp("rewind_fsdp"))
    for r, res in enumerate(got):
        assert res["error"] is None, f"rank {r}:\n{res['error']}"
    return got


@pytest.fixture(scope="module")
def single():
    return W.run_single()


EXPECTED = [{"step": 6, "batch": 6, "trigger": "loss spike", "checked_at": 6, "restored_to": 4, "skipped": [5, 6],
             "attempt": 1}]


def test_the_single_process_run_rewinds_once_at_the_planted_spike(single):
    assert single["events"] == EXPECTED


def test_a_spike_in_one_ranks_loss_rewinds_every_rank_to_the_same_snapshot(ranks):
    for r, res in enumerate(ranks):
        assert res["sharded"] == 6, "every parameter must be a DTensor, or FSDP2 was not exercised"
        assert res["events"] == EXPECTED, f"rank {r}"


def test_the_restored_shards_and_optimizer_state_are_the_snapshots_bit_for_bit(ranks):
    for r, res in enumerate(ranks):
        assert res["restored_bit_exact"], f"rank {r}: after the rewind the shards or the optimizer state differ " \
                                          "from this rank's copy taken with the snapshot"


def test_a_snapshot_keeps_each_ranks_shards_only(ranks):
    """The parameters' snapshot on each rank is as large as its shards (rank 1 holds fewer rows), not the full tensors."""
    for res in ranks:
        assert res["snapshot_param_bytes"] == res["local_param_bytes"] < res["full_param_bytes"]
    assert ranks[0]["local_param_bytes"] + ranks[1]["local_param_bytes"] == ranks[0]["full_param_bytes"]


def test_fsdp2_run_with_a_rewind_matches_the_single_process_run(ranks, single):
    """Right after the rewind and at the end, the full parameters are the single-process run's (to float
    rounding: the gradients are all-reduced in another order)."""
    for res in ranks:
        for key in ("after_rewind_full", "params"):
            for i, (a, b) in enumerate(zip(single[key], res[key])):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}, parameter {i}: {m}")


def test_the_guard_state_dict_holds_dtensors_for_sharded_tensors(ranks):
    """So that torch.distributed.checkpoint saves each rank's shard (a plain tensor counts as replicated)."""
    for res in ranks:
        assert res["sd_sharded_entries"] == 6


@pytest.mark.parametrize("how", ["dcp", "torch.save"])
def test_a_resume_from_the_guards_state_dict_ends_where_the_straight_run_ends(ranks, how):
    """The guard's state_dict, saved with dcp.save next to the model and optimizer (or per rank with
    torch.save and loaded with weights_only=True), loads into a fresh sharded model's guard; the resumed run
    rewinds as the straight one and ends at the same parameters, bit for bit."""
    for r, res in enumerate(ranks):
        got = res[f"resume-{how}"]
        assert got["error"] is None, f"rank {r}:\n{got['error']}"
        assert got["events"] == EXPECTED and got["rewinds_equal"] and got["params_equal"], f"rank {r}"


def test_another_ranks_guard_state_is_refused(ranks):
    for r, res in enumerate(ranks):
        msg = res["other_rank_refused"]
        assert msg is not None and "this rank's shard has shape" in msg and "another rank's state" in msg, f"rank {r}"
