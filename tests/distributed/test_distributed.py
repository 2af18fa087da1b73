"""Real 2-process runs (gloo on 127.0.0.1): DDP and FSDP2 match the single-process trajectory.

Each mode runs every case of ``dist_worker.CASES`` in one 2-rank job (one
process-group start per mode keeps CI time low); the single-process reference
runs here. Under FSDP2 every parameter is a DTensor sharded on dim 0, several
unevenly (rank 1 holds an empty shard of the last layer), so a statistic taken
on the local shard alone would differ from the single-process one: matching
to 1e-5 over 10 steps shows the statistics are those of the full tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dist_worker
from launch import run_job
import modopt as mo

TIMEOUT_S = 150

pytestmark = [
    pytest.mark.distributed,  # worker processes over gloo (the distributed lane)
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
    ),
]


def run_mode(mode: str, tmp: Path) -> dict:
    """Run the 2-process job (`launch.run_job`); rank 0's results."""
    out = tmp / f"{mode}.pt"
    run_job("dist_worker.py", mode, out, TIMEOUT_S)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return dist_worker.run_all("single", 0)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return run_mode("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return run_mode("fsdp", tmp_path_factory.mktemp("fsdp"))


CASES = list(dist_worker.cases())


def check(results: dict, reference: dict, case: str) -> None:
    ref, got = reference[case], results[case]
    assert ref["error"] is None, ref["error"]
    assert got["error"] is None, got["error"]
    if not case.startswith(("Centralize", "Muon")):  # these record no scale; they always act
        assert ref["clipped"], f"{case}: the reference run never clipped/rescaled; the case would test nothing"
    assert got["clipped"] == ref["clipped"]
    assert got["plain_state"], "statistics kept by the transforms must be plain tensors, the same on every rank"
    for i, (a, b) in enumerate(zip(ref["params"], got["params"])):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case}, parameter {i}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_ddp_matches_single_process(ddp, reference, case):
    check(ddp, reference, case)


@pytest.mark.parametrize("case", CASES)
def test_fsdp2_matches_single_process(fsdp, reference, case):
    check(fsdp, reference, case)


def test_local_shard_statistics_would_not_match(reference):
    """The cases are sensitive: clipping on one rank's shard alone gives another trajectory."""
    model = dist_worker.make_model()
    import modopt as mo

    # the statistic of half of each tensor (what a rank holds) instead of the full tensor
    opt = mo.Modular(dist_worker.param_groups(model), mo.ClipNorm(0.05), mo.SGD(lr=0.1))
    for step in range(dist_worker.STEPS):
        x, y = dist_worker.batch(step)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        for p in model.parameters():
            p.grad[p.shape[0] // 2 + p.shape[0] % 2 :] = 0  # rank 0's rows only
        opt.step()
    diff = max((p.detach() - r).abs().max().item() for p, r in zip(model.parameters(), reference["ClipNorm-global"]["params"]))
    assert diff > 1e-3


def test_cautious_counts_of_one_shard_would_not_match(reference, monkeypatch):
    """The Cautious cases are sensitive: counting the kept elements of rank 0's rows alone (scaled up to the
    tensor's size) instead of the full tensor's gives another trajectory."""
    from modopt.transforms import caution

    make = caution.tensor_segments

    class Halves:
        def __init__(self, seg):
            self.seg = seg

        def __getattr__(self, name):
            return getattr(self.seg, name)

        def reduce(self, masks, stat):  # rank 0's rows, the way FSDP2 shards dim 0
            halves = [m[: m.shape[0] // 2 + m.shape[0] % 2] if m.dim() else m for m in masks]
            frac = torch.stack([h.sum(dtype=torch.float32) / max(h.numel(), 1) for h in halves])
            return frac * self.seg.element_counts(frac)

    monkeypatch.setattr(caution, "tensor_segments", lambda ctx: Halves(make(ctx)))
    model = dist_worker.make_model()
    opt = mo.Modular(dist_worker.param_groups(model), *dist_worker.cases()["Cautious-Adam"])
    for step in range(dist_worker.STEPS):
        x, y = dist_worker.batch(step)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
    diff = max((p.detach() - r).abs().max().item() for p, r in zip(model.parameters(), reference["Cautious-Adam"]["params"]))
    assert diff > 1e-4


def test_fsdp2_skips_a_step_on_the_device_on_every_rank(fsdp):
    """The default nonfinite="skip" under FSDP2 decides on the device from all-reduced norms: a NaN in
    one rank's shard skips the step on both ranks, with no host sync, and the run ends where the
    single-process run without that step ends."""
    got = fsdp[dist_worker.SKIP_CASE]
    assert got["error"] is None, got["error"]
    assert got["on_device"] and got["syncs"] == 0
    assert got["skipped"] == [k == dist_worker.NAN_STEP for k in range(dist_worker.SKIP_STEPS)]
    _ends_where_one_process_without_the_nan_step_ends(dist_worker.skip_pipeline(), got["params"])


def _ends_where_one_process_without_the_nan_step_ends(pipeline, params) -> None:
    model = dist_worker.make_model()
    opt = mo.Modular(dist_worker.param_groups(model), *pipeline)
    for step in range(dist_worker.SKIP_STEPS):
        if step == dist_worker.NAN_STEP:
            continue
        x, y = dist_worker.batch(step)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
    for i, (a, b) in enumerate(zip(model.parameters(), params)):
        torch.testing.assert_close(b, a.detach(), rtol=1e-5, atol=1e-5, msg=lambda m: f"parameter {i}: {m}")


def test_ddp_skipstep_on_one_ranks_loss_spike_skips_on_every_rank(ddp):
    """SkipStep(watch="loss") under DDP tests the mean of the ranks' losses: a spike in rank 1's loss
    alone skips the step on both ranks (it skipped on rank 1 only, and the replicas diverged)."""
    got = ddp[dist_worker.LOSS_CASE]
    assert got["error"] is None, got["error"]
    assert got["skipped"] == [k == dist_worker.LOSS_SPIKE_STEP for k in range(dist_worker.LOSS_STEPS)]
    assert got["skips_agree"] and got["replicas_equal"]


def test_ddp_rewind_on_one_ranks_nan_loss_rewinds_every_rank(ddp):
    """Rewind under DDP decides on the mean of the ranks' losses: a NaN loss on rank 1 alone rewinds
    both ranks at the same check (it rewound rank 1 alone)."""
    got = ddp[dist_worker.REWIND_CASE]
    assert got["error"] is None, got["error"]
    assert got["rewinds"] == 1 and got["rewinds_agree"] and got["replicas_equal"]


@pytest.mark.parametrize("case", list(dist_worker.ERROR_CASES))
def test_fsdp2_per_slice_scope_of_sharded_parameter_is_a_clear_error(fsdp, case):
    err = fsdp[case]["error"]
    assert err is not None and err.startswith("ValueError"), err
    assert "parameter 0.weight" in err and "sharded on dim(s) [0]" in err and "not supported" in err


@pytest.fixture(scope="module")
def fsdp_dcp(tmp_path_factory):
    return run_mode("fsdp-dcp", tmp_path_factory.mktemp("fsdp_dcp"))


@pytest.mark.parametrize("case", list(dist_worker.DCP_CASES))
def test_fsdp2_dcp_save_load_resumes_bit_exactly(fsdp_dcp, case):
    """FSDP2 on 2 ranks: dcp.save / dcp.load through get/set_state_dict; the resumed run equals the straight one."""
    got = fsdp_dcp[case]
    assert got["error"] is None, got["error"]
    assert got["sharded_buffers"] > 0, "the per-parameter buffers must be DTensors (sharded), or FSDP2 was not exercised"
    for i, (a, b) in enumerate(zip(got["straight"], got["resumed"])):
        assert torch.equal(a, b), f"{case}, parameter {i}: max diff {(a - b).abs().max().item()}"


@pytest.fixture(scope="module")
def fsdp_compiled(tmp_path_factory):
    return run_mode("fsdp-compiled", tmp_path_factory.mktemp("fsdp-compiled"))


@pytest.mark.parametrize("how", ["torch.compile", "compile_step"])
@pytest.mark.parametrize("case", list(dist_worker.COMPILED_CASES))
def test_fsdp2_compiled_step_skips_on_every_rank_and_matches_eager(fsdp_compiled, case, how):
    """The step compiled under FSDP2 (a DTensor's gradient: its sharded statistics and the device-side skip
    traced into the graph): a NaN in one rank's shard skips that step on both ranks, and the run ends, within
    rounding, where the single-process eager run without that step ends."""
    got = fsdp_compiled[f"{case}/{how}"]
    assert got["error"] is None, got["error"]
    assert got["graphs"] >= 1  # (a graph ran, not the eager step)
    assert got["skipped"] == [k == dist_worker.NAN_STEP for k in range(dist_worker.SKIP_STEPS)]
    _ends_where_one_process_without_the_nan_step_ends(dist_worker.COMPILED_CASES[case](), got["params"])
