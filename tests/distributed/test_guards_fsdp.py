"""`SkipNorm` and `max_consecutive_skips` over FSDP2 (issue 56 item 4): a real 2-process run (gloo on
127.0.0.1) against the same run in one process; see ``guard_worker.py`` for the run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import guard_worker as W
from launch import run_job

TIMEOUT_S = 150

pytestmark = [
    pytest.mark.distributed,  # worker processes over gloo (the distributed lane)
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
    ),
]

PATHS = ["cpu", "device_path"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("guards") / "guards"
    run_job("guard_worker.py", "fsdp", out, TIMEOUT_S)
    got = [torch.load(f"{out}.{r}", weights_only=False) for r in range(W.WORLD)]
    for r, res in enumerate(got):
        assert res["failure"] is None, f"rank {r}:\n{res['failure']}"
    return got


@pytest.fixture(scope="module")
def single():
    return {"cpu": W.run("single"), "device_path": W.run("single", device_path=True)}


@pytest.mark.parametrize("path", PATHS)
def test_every_rank_skips_the_steps_of_the_single_process_run(ranks, single, path):
    """Both ranks skip exactly the spikes, as one process does, from the full gradients' norm (the same on
    both ranks, the single process's to 1e-6), although no rank's own shards exceed the threshold."""
    want = [c["skipped"] for c in single[path]["calls"]]
    assert want == [k in W.SPIKES for k in range(len(want))]
    for r, res in enumerate(ranks):
        got = res[path]
        assert got["sharded"] == 6, "every parameter must be a DTensor, or FSDP2 was not exercised"
        assert [c["skipped"] for c in got["calls"]] == want, f"rank {r}"
        for c, s in zip(got["calls"], single[path]["calls"]):
            assert c["norm"] == pytest.approx(s["norm"], rel=1e-6), f"rank {r}"
            if c["skipped"]:  # a decision from this rank's shards alone would have let the step through
                assert c["local_norm"] < W.TAU < c["norm"], f"rank {r}: {c}"


@pytest.mark.parametrize("path", PATHS)
def test_every_rank_stops_at_the_same_call_after_the_limit(ranks, single, path):
    """The last LIMIT spikes are in a row: every rank raises `SkipLimitError` at the same call, the last of
    them on the CPU's path and the next one on the device path (the count read a step late)."""
    last = W.SPIKES[-1]
    want = last if path == "cpu" else last + 1
    assert single[path]["raised_at"] == want
    for r, res in enumerate(ranks):
        got = res[path]
        assert got["raised_at"] == want, f"rank {r}"
        assert (got["error"]["limit"], got["error"]["skipped"], got["error"]["by_rule"]) == (W.LIMIT,) * 3, f"rank {r}"
