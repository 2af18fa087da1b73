"""What one default step costs, counted: aten ops, host syncs and bytes do not
depend on the machine, so they are asserted here; times are measured by `benchmarks/bench.py`, never here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import modopt as mo
from modopt.lint import cancelled_scales

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import StepCounter, build_model, loss_fn, torch_clipnorm_adam, torch_mission  # noqa: E402


def counted(step, model, make, steps=4):
    g = torch.Generator().manual_seed(0)
    for k in range(steps):
        model.zero_grad()
        loss_fn(model, *make(g)).backward()
        if k == steps - 1:
            with StepCounter() as c:
                step()
            return c
        step()


def pbytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("model_name", ["mlp", "transformer"])
def test_the_default_clip_and_adam_step_issues_no_more_ops_than_the_careful_torch_loop(model_name):
    """`ClipNorm(1.0), Adam()`: the careful loop syncs once (its finite check); modopt decides on the
    device with the same number of aten ops or fewer, and moves the same bytes."""
    model, make = build_model(model_name, quick=True)
    ours = counted(mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam()).step, model, make)
    model2, make2 = build_model(model_name, quick=True)
    careful = counted(torch_clipnorm_adam(model2, check=True).step, model2, make2)
    assert (ours.syncs, careful.syncs) == (0, 1)
    assert ours.ops <= careful.ops, (ours.names, careful.names)
    assert abs(ours.bytes - careful.bytes) < 0.01 * pbytes(model)  # (0-d scalars aside)


def test_the_folded_clip_moves_one_pass_less_than_the_careful_loop_with_no_more_ops():
    """`Adam(fold_clip=True)` (a setting): the clip's scale is the fused kernel's `grad_scale`, so the
    gradients are not read and written by a multiply; the kernel writes them back (unscaled) instead:
    1P less than the careful loop's 10P."""
    model, make = build_model("mlp", quick=True)
    ours = counted(mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(fold_clip=True)).step, model, make)
    model2, make2 = build_model("mlp", quick=True)
    careful = counted(torch_clipnorm_adam(model2, check=True).step, model2, make2)
    assert ours.syncs == 0 and ours.ops <= careful.ops, (ours.names, careful.names)
    assert "aten._foreach_mul_" not in ours.names
    assert abs(careful.bytes - ours.bytes - pbytes(model)) < 0.01 * pbytes(model)  # (0-d scalars aside)


def test_the_mission_pipeline_moves_two_passes_more_than_the_careful_loop_and_no_sync():
    """`ClipNormByEMA(), Normalize(), Adam()`: the clip's multiply is cancelled by the Normalize (left out),
    Normalize reuses the gradients' norms; what remains over the careful loop is the cleaning that keeps
    the EMA on a step the device skips (one read and one write of the gradients, 2P), and for the small
    tensors cleaned together (`step.SMALL_CLEAN`: here the biases) their concatenation and copy back
    (5 more passes over them as the counter counts, which reads a copy's destination too: about 1% of P)."""
    from modopt.core.step import SMALL_CLEAN

    model, make = build_model("mlp", quick=True)
    ours = counted(mo.Modular(model.parameters(), mo.ClipNormByEMA(), mo.Normalize(), mo.Adam()).step, model, make)
    model2, make2 = build_model("mlp", quick=True)
    careful = counted(torch_mission(model2, check=True).step, model2, make2)
    assert (ours.syncs, careful.syncs) == (0, 1)
    small = [p for p in model.parameters() if p.numel() <= SMALL_CLEAN]
    assert len(small) >= 3  # (so that they are cleaned together)
    together = 5 * sum(p.numel() * p.element_size() for p in small)
    assert abs(ours.bytes - careful.bytes - 2 * pbytes(model) - together) < 0.01 * pbytes(model)  # (0-d scalars aside)
    assert ours.names["aten._foreach_norm"] == 2  # the gradients once (check, clip and Normalize), the EMA once


def test_only_the_scale_right_before_a_normalization_is_left_out():
    norm = mo.Normalize()
    assert cancelled_scales([mo.ClipNormByEMA(), norm, mo.Adam()], "skip") == {"0:ClipNormByEMA"}
    # the EMA clip reads ClipNorm's output for its state: ClipNorm keeps its multiply
    assert cancelled_scales([mo.ClipNorm(1.0), mo.ClipNormByEMA(), norm, mo.Adam()], "skip") == {"1:ClipNormByEMA"}
    assert cancelled_scales([mo.Chain(mo.LR(0.5), norm), mo.SGD(0.1)], "skip") == {"0:Chain/0:LR"}
    assert cancelled_scales([mo.ClipNorm(1.0, scope="tensor"), mo.Normalize(scope="global"), mo.Adam()], "skip") == set()
    assert cancelled_scales([mo.ClipNorm(1.0), mo.Normalize(eps=1e-8), mo.Adam()], "skip") == set()
    assert cancelled_scales([mo.ClipNorm(1.0), norm, mo.Adam()], "ignore") == set()


@pytest.mark.parametrize("scale", [mo.ClipNorm(0.5), mo.ClipNormByEMA(beta=0.9), mo.ClipNormByRMS(0.1), mo.ClipNormGrowth()],
                         ids=lambda t: type(t).__name__)
def test_a_cancelled_scale_changes_the_parameters_only_by_rounding(scale):
    """The pipeline with the scale ends where `Normalize()` alone ends, up to rounding, and the scale's
    own telemetry and state are still kept."""
    ends = []
    for pipe in ([scale, mo.Normalize(), mo.Adam(lr=1e-2)], [mo.Normalize(), mo.Adam(lr=1e-2)]):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
        torch.manual_seed(1)
        opt = mo.Modular(m.parameters(), *pipe)
        for k in range(8):
            m.zero_grad()
            (m(torch.randn(4, 5)).pow(2).sum() * (1 + 30 * (k == 5))).backward()
            opt.step()
        ends.append((m, opt))
    (ma, oa), (mb, _) = ends
    assert oa.cancelled_scales == {f"0:{type(scale).__name__}"}
    for p, q in zip(ma.parameters(), mb.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert f"0:{type(scale).__name__}.scale" in oa.stats


def test_skipped_steps_of_an_earlier_step_keep_their_value():
    """The counter is a new tensor each step (one op, no clone): stats and state dicts taken earlier keep
    what they said."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = mo.Modular([p], mo.ClipNorm(1.0), mo.Adam())
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    opt.step()
    first, sd = opt.stats["skipped_steps"], opt.state_dict()
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    opt.step()
    assert int(first) == 1 and int(sd["modopt"]["skipped_steps"]) == 1
    assert int(opt.stats["skipped_steps"]) == 2


@pytest.mark.parametrize("pipe", __import__("bench").PIPELINES, ids=lambda p: p.name)
def test_every_benchmark_pipeline_makes_no_host_sync_on_finite_and_nan_steps(pipe):
    """Each benchmark pipeline with its defaults (the tiny models): no `.item()`/`bool()` in any step, the
    first (state creation), the steady ones and one whose gradients hold a NaN."""
    from checks import Syncs

    model, make = build_model("transformer", quick=True)
    opt = mo.Modular(model.parameters(), *pipe.modopt())
    g = torch.Generator().manual_seed(0)
    syncs = Syncs()
    for k in range(6):
        model.zero_grad()
        loss_fn(model, *make(g)).backward()
        if k == 3:
            next(iter(model.parameters())).grad.view(-1)[0] = float("nan")
        with syncs:
            opt.step()
    if all(mo.roles.skips_on_device(t) for t in opt.transforms):
        assert syncs.n == 0
    else:  # a declared setting (`AdamW(fused=False)`: the for-loop kernel, docs/modules/optimizers.md):
        # the host decides each skip (1 sync per finite step, 2 on the NaN step: the exact check,
        # modopt.core.runner._settle); on these CPU tensors modopt's for-loop (`kernels.loop_adam_`) reads
        # the CPU step counts in one list read (`tolist`, not a dispatcher call; torch's: an .item() each)
        assert syncs.n == 5 + 2
    assert int(opt.stats["skipped_steps"]) == 1
