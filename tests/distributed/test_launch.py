"""`launch.run_job` retries a job once when a rank dies in native code and never when the job's own code
fails: a real 2-rank gloo job whose rank 1 aborts (SIGABRT) or raises."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from launch import run_job

pytestmark = [
    pytest.mark.distributed,  # worker processes over gloo (the distributed lane)
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
    ),
]


def _runs(out) -> int:
    return len((out.parent / (out.name + ".runs")).read_text().splitlines())


def test_a_rank_that_aborts_once_is_run_again_and_the_job_passes(tmp_path):
    out = tmp_path / "out"
    run_job("crash_worker.py", "abort-once", out, 120)
    assert out.read_text() == "done"
    assert _runs(out) == 2


def test_a_rank_that_aborts_every_time_fails_after_the_second_run(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(AssertionError, match="terminated with signal"):
        run_job("crash_worker.py", "abort", out, 120)
    assert _runs(out) == 2


def test_a_python_error_in_a_rank_fails_at_once(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(AssertionError, match="the job's own error"):
        run_job("crash_worker.py", "raise", out, 120)
    assert _runs(out) == 1
