"""Owner-rank Newton-Schulz under FSDP2 (`Orthogonalize`/`Muon`, `sharded="owner"`), against one process.

One 2-rank job (FSDP2 on a 1-D mesh), one 4-rank job (HSDP on a 2x2 mesh: each matrix split over one
mesh dim, replicated over the other) and one 4-rank job on a 2x2 ("dp", "tp") mesh (tensor parallel, then FSDP2:
matrices split over both mesh dims, gathered in two stages) run every case of ``owner_worker.cases()`` with both paths; the
single-process reference runs here. The model has three 8x8 matrices (batched on one owner), 8x6, 5x8
(uneven shards) and 1x5 (empty shards).

* gradients *given* (each rank its shard of the single-process gradient): the owner path is the
  single-process step bit for bit (the full matrix is reassembled exactly, the same kernels run on it);
  the case with a ClipNorm after it sums its norm over the ranks, so it is within float32 rounding there.
  The per-matrix DTensor path is not bit for bit (its products are summed over the shards).
* gradients *trained* (FSDP2 averages them in another order): within 1e-5 after 4 steps, both paths.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import owner_worker as w
from modopt.core.distributed import _chunk_sizes
from modopt.transforms.orthogonal import NS_COEFFICIENTS, coefficient_steps, newton_schulz, newton_schulz_batched
from launch import run_job

TIMEOUT_S = 240
#: cases whose chain sums a statistic over the ranks after the orthogonalization (not bit for bit)
REDUCED = ("Orthogonalize-bf16-ClipNorm-SGD", "Orthogonalize-NorMuon-SGD", "Orthogonalize-NorMuon-larger-SGD",
           "AdaMuon-float32")

#: cases without a DTensor path to compare
OWNER_ONLY: tuple[str, ...] = ()

pytestmark = [
    pytest.mark.distributed,  # worker processes over gloo (the distributed lane)
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
    ),
]


def _run(mode: str, tmp: Path) -> dict:
    out = tmp / f"{mode}.pt"
    run_job("owner_worker.py", mode, out, TIMEOUT_S)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return w.run_all("single")


@pytest.fixture(scope="module", params=["fsdp", "hsdp", "tp2d"])
def job(request, tmp_path_factory):
    return request.param, _run(request.param, tmp_path_factory.mktemp(request.param))


CASES = list(w.cases())


def _params(results: dict, key: str) -> list[torch.Tensor]:
    assert results[key]["error"] is None, results[key]["error"]
    return results[key]["params"]


@pytest.mark.parametrize("case", CASES)
def test_owner_path_is_the_single_process_step(job, reference, case):
    """Given the single-process gradients, the owner path ends where one process ends: bit for bit (within
    float32 rounding where a later transform sums over the ranks); the DTensor path only close."""
    mode, results = job
    ref = _params(reference, f"{case}/given")
    got = _params(results, f"{case}/given/owner")
    for i, (a, b) in enumerate(zip(ref, got)):
        if case in REDUCED:
            torch.testing.assert_close(b, a, rtol=0, atol=1e-7, msg=lambda m: f"{mode} {case} #{i}: {m}")
        else:
            assert torch.equal(a, b), f"{mode} {case}, parameter {i}: max diff {(a - b).abs().max().item():.3g}"
    if case in OWNER_ONLY:
        return
    old = _params(results, f"{case}/given/dtensor")
    tol = 1e-2 if "bf16" in case or case in REDUCED else 1e-5  # bfloat16 products summed over the shards
    for i, (a, b) in enumerate(zip(ref, old)):
        torch.testing.assert_close(b, a, rtol=0, atol=tol, msg=lambda m: f"{mode} {case} dtensor #{i}: {m}")


@pytest.mark.parametrize("case", [c for c in CASES if "bf16" not in c])
def test_trained_matches_single_process(job, reference, case):
    """A real FSDP2 forward and backward (gradients averaged in another order): both paths within 1e-5."""
    mode, results = job
    ref = _params(reference, f"{case}/train")
    for path in ("owner",) if case in OWNER_ONLY else ("owner", "dtensor"):
        for i, (a, b) in enumerate(zip(ref, _params(results, f"{case}/train/{path}"))):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"{mode} {case} {path} #{i}: {m}")


def test_every_matrix_takes_the_owner_path(job):
    """No matrix falls back to the DTensor path: on the ("dp", "tp") mesh the column-parallel weights
    (`_StridedShard` over dp: dp is the inner split) and the row-parallel ones (split on both tensor dims)
    are gathered in two stages, dp first."""
    mode, results = job
    layouts = results["__layouts__"]
    assert all(stages for _, stages in layouts.values()), layouts
    if mode == "tp2d":
        assert layouts["0.weight"] == (("_S(0, 2)", "S(0)"), ((0, 0), (1, 0)))
        assert layouts["2.weight"] == (("S(0)", "S(1)"), ((0, 0), (1, 1)))
        assert layouts["8.weight"] == (("S(0)", "R"), ((0, 0),))


def test_skipped_step_changes_nothing_without_a_sync(job):
    """A NaN in one rank's shard: every rank skips that step (decided on the device), the parameters and the
    sharded momentum buffers stay bit for bit, no host sync in any step; the owner and DTensor paths agree."""
    mode, results = job
    for path in ("owner", "dtensor"):
        got = results[f"__skip__/{path}"]
        assert got["error"] is None, got["error"]
        assert got["skipped"] == [False, False, True, False]
        assert got["unchanged"] and got["on_device"] and got["syncs"] == 0
    for a, b in zip(results["__skip__/owner"]["params"], results["__skip__/dtensor"]["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2)  # (bfloat16 Newton-Schulz: see above)


@pytest.mark.parametrize("pipeline", list(w.DCP_PIPELINES))
def test_dcp_resume_is_bit_for_bit(job, pipeline):
    """The state buffers of Muon (momentum), NorMuon (momentum and per-row second moments) and AdaMuon
    (momentum and elementwise second moments) are sharded DTensors: saved and loaded with
    torch.distributed.checkpoint, the resumed run takes the same steps as the straight one, bit for bit."""
    mode, results = job
    got = results[f"__dcp__/{pipeline}"]
    assert got["error"] is None, got["error"]
    assert got["sharded_buffers"] > 0
    for a, b in zip(got["straight"], got["resumed"]):
        assert torch.equal(a, b)


def test_chunk_sizes_are_torch_chunk():
    for n in range(0, 12):
        for world in (1, 2, 3, 4):
            pieces = [c.shape[0] for c in torch.arange(n).chunk(world)] if n else []
            assert _chunk_sizes(n, world) == pieces + [0] * (world - len(pieces))


@pytest.mark.parametrize("shape", [(16, 12), (12, 40), (40, 12)])
def test_batched_newton_schulz_is_the_single_one(shape):
    """Same-shape matrices batched on an owner: the per-matrix result (bit for bit in bfloat16 on a CPU; float32
    here to rounding, small float32 products may take another kernel)."""
    steps = coefficient_steps(NS_COEFFICIENTS, 5)
    ms = list(torch.randn(3, *shape, generator=torch.Generator().manual_seed(0)).unbind(0))
    for dtype in (torch.bfloat16, torch.float32):
        got = newton_schulz_batched(ms, steps, 1e-7, dtype)
        for m, o in zip(ms, got):
            ref = newton_schulz(m, steps, 1e-7, dtype)
            assert o.shape == ref.shape and o.dtype == ref.dtype
            if dtype == torch.bfloat16:
                assert torch.equal(o, ref)
            else:
                torch.testing.assert_close(o, ref, rtol=0, atol=1e-5)
