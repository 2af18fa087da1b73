"""Expert parallelism: a mixture-of-experts model with its dense layers under FSDP2 and its expert stack on an
expert-parallel mesh, in ONE `mo.Modular`, run on 4 gloo processes (``ep_worker.py``), matches the
single-process run on the full tensors.

The parameters lie on two meshes: the dense ones `(Shard(0),)` on a 1-D mesh of the 4 ranks ("fsdp"), the expert
stack `(E, D, D)` `(Replicate(), Shard(0))` on a 2x2 mesh ("dp", "ep"): each rank holds E/2 whole experts, the
same as its dp partner; the router stays a plain tensor on every rank, its gradient averaged as DDP does, so
three kinds of parameter share the optimizer. One optimizer over them needs two things: each statistic summed per tensor over the
groups of the mesh dims that split it ("fsdp" for the dense, "ep" alone for the stack: `groups_of`, right by
design), and each multi-tensor op split per mesh (DTensor refuses a `_foreach_*` op over tensors of two meshes:
every pipeline failed at its first step before `distributed.per_mesh_mode`; the control below keeps that so).

Tolerance: 1e-6 absolute on parameters of size ~0.1-1 after 4 steps. The sharded forward and backward sum the
same float32 products in another order (the dense gradients reduce-scattered over 4 ranks, the experts' summed
over them): plain SGD with no statistic already ends 3e-8 away; with the statistics the cases end at most 6e-8
away (measured). The bug the control stands for (the stack's norm counted once per dp rank) moves them by 7e-5
(measured), 70 times the tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ep_worker as w
from launch import run_job

TIMEOUT_S = 240
ATOL = 1e-6

pytestmark = [
    pytest.mark.distributed,  # worker processes over gloo (the distributed lane)
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
    ),
]


@pytest.fixture(scope="module")
def ep(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "ep.pt"
    run_job("ep_worker.py", "ep", out, TIMEOUT_S, env_drop=("EP_ONLY",))
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return w.run_all("single", None)


def assert_params_close(got, ref, what):
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=0, atol=ATOL, msg=lambda m: f"{what}, parameter {i}: {m}")


def test_the_layout_mixes_two_meshes(ep):
    got = ep["SGD"]
    assert got["error"] is None, got["error"]
    assert got["placements"] == [(("dp", "ep"), ("R", "S(0)")), (("fsdp",), ("S(0)",))]


@pytest.mark.parametrize("case", list(w.cases()))
def test_expert_parallel_matches_single_process(ep, reference, case):
    ref, got = reference[case], ep[case]
    assert ref["error"] is None, ref["error"]
    assert got["error"] is None, got["error"]
    assert got["agree"], "the 4 ranks must end with the same full parameters"
    assert got["acted"] == ref["acted"]
    if case != "SGD":  # the case must do something, or it would test nothing
        moved = max((a - b).abs().max().item() for a, b in zip(ref["params"], reference["SGD"]["params"]))
        assert moved > 1e-3, f"{case}: the pipeline changed nothing against plain SGD"
    assert_params_close(got["params"], ref["params"], case)


def test_muon_orthogonalizes_each_ranks_experts_where_they_are(ep):
    """Each rank holds whole experts (the stack is split on its batch dim only): `Muon(batch_dims=1)` runs
    Newton-Schulz on them in place, with no owner-rank exchange (`owner_apply` never called), and still matches
    the single-process run (the test above)."""
    got = ep["Muon-experts-AdamW-dense"]
    assert got["error"] is None, got["error"]
    assert got["owner_calls"] == 0


def test_nan_in_one_ranks_expert_shard_skips_on_every_rank(ep, reference):
    """Rank 3 alone puts a NaN in its shard of the expert stack's gradient at step 2: every rank skips that step
    (decided on the device), each rank's state and parameter shards are bit for bit what they were before it,
    and the run ends where the single-process run without that step ends."""
    got = ep[w.SKIP_CASE]
    assert got["error"] is None, got["error"]
    assert got["on_device"]
    assert got["skipped"] == [k == w.NAN_STEP for k in range(w.SKIP_STEPS)]
    assert got["skips_agree"] and got["agree"]
    assert got["unchanged_everywhere"]
    assert_params_close(got["params"], reference[w.SKIP_CASE]["params"], "skip")


@pytest.mark.parametrize("case", list(w.DCP_PIPELINES))
def test_dcp_resume_is_bit_for_bit(ep, case):
    """Muon (or Orthogonalize + NorMuon) on the expert stack, AdamW on the dense layers, a global clip: saved after
    2 steps with torch.distributed.checkpoint and loaded into a fresh model and optimizer, the next 2 steps are
    those of the uninterrupted run, bit for bit. The state of both meshes' parameters are sharded DTensors."""
    got = ep[case]
    assert got["error"] is None, got["error"]
    assert got["sharded_buffers"] > 0
    for a, b in zip(got["straight"], got["resumed"]):
        assert torch.equal(a, b)


def test_plain_per_rank_expert_tensors_give_a_rank_local_norm(ep):
    """The documented limit: experts given as plain per-rank tensors (each rank its E/2 experts, Megatron's
    layout) cannot be told apart from replicated ones, so a global norm counts this rank's experts alone and the
    ep ranks disagree on it (docs/howto/distributed.md: give them as DTensors, `DTensor.from_local`)."""
    got = ep[w.PLAIN_CASE]
    assert got["error"] is None, got["error"]
    norms = got["norms"].reshape(-1)
    assert not got["norms_agree"] and norms.unique().numel() == 2


def test_summing_the_stack_over_its_replicate_dim_would_not_match(ep, reference):
    got = ep[w.DOUBLE_COUNT_CASE]
    assert got["error"] is None, got["error"]
    diff = max((a - b).abs().max().item() for a, b in zip(got["params"], reference["ClipNorm-global-SGD"]["params"]))
    assert diff > 20 * ATOL


def test_without_the_per_mesh_split_the_step_fails(ep):
    got = ep[w.NO_SPLIT_CASE]
    assert got["error"] is None, got["error"]
    # (DTensor's refusal: tensors of two meshes, or plain tensors beside DTensors, in one multi-tensor op)
    assert got["failed"] is not None and ("mesh" in got["failed"] or "mixed torch.Tensor and DTensor" in got["failed"]), \
        got["failed"]


def test_normuon_keeps_each_experts_moments_where_the_expert_lies(ep, reference):
    """`NorMuon(batch_dims=1)` on the stack split on its expert dim: its per-row second moments are a DTensor laid
    out as the stack (each rank the moments of its own experts, replicated over dp), equal to the single process's
    on the full tensor (the parameters match in the parametrized case above)."""
    ref, got = reference["NorMuon-experts"], ep["NorMuon-experts"]
    assert got["error"] is None, got["error"]
    assert got["moment_placements"] == [("R", "S(0)")]
    assert [m.shape for m in got["moments"]] == [m.shape for m in ref["moments"]] == [torch.Size((w.E, w.DIM, 1))]
    for a, b in zip(got["moments"], ref["moments"]):
        assert bool((a > 0).all())  # (every expert's row moved: a moment left at zero would be a rank's missed step)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("name", list(w.REFUSING))
def test_a_stack_split_inside_its_matrices_is_refused_when_built(ep, name):
    """MuonEq, MuonPlus, ShapeScale, NorMuon and AdaMuon compute each rank's experts where they lie (the cases
    above); a stack split inside its matrices (some rows of every expert on each rank) is refused when the
    optimizer is built, before any state exists, naming the parameter, its placements and the transform."""
    got = ep[w.REFUSED_CASE]
    assert got["error"] is None, got["error"]
    failed = got[name]["failed"]
    transform = name.split("-")[0]
    assert failed is not None and f"{transform}(batch_dims=1) takes each matrix's statistics" in failed, failed
    assert "'stack'" in failed and "S(1)" in failed


def test_a_split_stack_in_an_added_group_is_refused_and_the_owner_path_takes_it(ep):
    """`add_param_group` checks the new group as the build does (the group is not added); `Orthogonalize` on its
    owner path gathers each matrix on one rank, so it is built over the same stack."""
    got = ep[w.REFUSED_CASE]
    assert got["added"]["failed"] is not None and "NorMuon(batch_dims=1)" in got["added"]["failed"]
    assert got["added"]["groups"] == 1
    assert got["owner-built"] == 1


def test_an_attached_clip_steps_over_both_meshes_as_modular_does(ep, reference):
    """`mo.attach(torch.optim.SGD(...), mo.ClipNorm(0.05))` over the dense FSDP2 parameters and the expert stack:
    the 4 ranks agree and end where the single process ends, which is where `Modular`'s ClipNorm + SGD ends."""
    ref, got = reference[w.ATTACH_CASE], ep[w.ATTACH_CASE]
    assert ref["error"] is None, ref["error"]
    assert got["error"] is None, got["error"]
    assert got["agree"]
    assert_params_close(got["params"], ref["params"], w.ATTACH_CASE)
    assert_params_close(ref["params"], reference["ClipNorm-global-SGD"]["params"], "attach vs Modular")
