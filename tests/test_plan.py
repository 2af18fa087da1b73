"""modopt/core/plan.py: what is decided once, when the optimizer is built, and read by every step."""

from __future__ import annotations

import pytest
import torch

import modopt as mo
from examples import all_examples, pipeline_for
from modopt.core import plan as plan_mod
from modopt.core.plan import make_plan

#: the transforms whose examples let the host decide a skip (one sync a step), with the words of their
#: docstring that say so and when. Every other registered transform decides on the device in every example:
#: a new transform that forgets `device_skip = True` fails below instead of costing users a sync a step
HOST_DECIDES = {
    "Adam": "the host decides a skip",  # fused=False / foreach: torch's non-fused kernels read the step count
    "AdamW": "the host decides a skip",  # (its docstring is Adam's)
    "SGD": "the host decides a skip",
    "TorchOptimizer": "The host decides",  # answered per wrapped class and param group (skip_reads_groups)
}

EXAMPLES = all_examples()


@pytest.mark.parametrize("name,t", EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_every_example_decides_the_skip_on_the_device_or_says_why_not(name, t):
    pipe = pipeline_for(t.model_copy(deep=True))
    plan = make_plan(pipe, "skip")
    p = torch.nn.Parameter(torch.zeros(3, 2))
    answer = plan.skips_on_device([{"params": [p]}])
    if answer:
        return
    from modopt.core.transform import walk

    host = [x for _, x in walk(pipe) if not mo.roles.skips_on_device(x, [{"params": [p]}]) and not x.children()]
    assert host, f"{name}: the plan says the host decides, but no transform says so"
    for x in host:
        cls = type(x).__name__
        assert cls in HOST_DECIDES, (
            f"{name}: {cls} makes the host decide every skip (one sync a step): declare `device_skip = True` "
            "if it keeps its state on a step the device skips (ctx.skip), or add it to HOST_DECIDES with "
            "its docstring saying when and what it costs"
        )
        doc = " ".join((type(x).__doc__ or "").split()) + " " + " ".join((mo.Adam.__doc__ or "").split())
        assert HOST_DECIDES[cls] in doc, f"{cls}'s docstring does not say when the host decides"


def test_the_host_decided_list_is_not_stale():
    registered = set(mo.available())
    assert set(HOST_DECIDES) <= registered


def test_the_plan_is_made_once_and_the_step_only_reads_it(monkeypatch):
    """After the build, stepping works nothing out again: the analyses refuse to run during steps."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = mo.Modular([p], mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(fold_clip=False))
    assert opt.plan.cancelled == {"0:ClipNormByEMA"} and opt.plan.device_skip is True

    def refuse(*a, **k):
        raise AssertionError("worked out during a step")

    for name in ("make_plan", "cancelled_scales", "folded_scale", "flatten", "_check_last", "_check_skip_first"):
        monkeypatch.setattr(plan_mod, name, refuse)
    import modopt.core.modular as modular

    monkeypatch.setattr(modular, "make_plan", refuse)
    for _ in range(3):
        p.grad = torch.randn(4, 3)
        opt.step()
    assert int(opt.stats["skipped_steps"]) == 0


def test_the_plan_refuses_a_pipeline_that_cannot_run_before_anything_is_built():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="must be the last transform"):
        mo.Modular([p], mo.TorchOptimizer(torch.optim.SGD, lr=0.1), mo.ClipNorm(1.0))
    with pytest.raises(ValueError, match="fold_clip"):
        mo.Modular([p], mo.Normalize(), mo.Adam(fold_clip=True))
    with pytest.raises(ValueError, match="SkipStep comes after"):
        mo.Modular([p], mo.ClipNormByEMA(), mo.SkipStep(), mo.Adam())


def test_lint_and_the_step_agree_on_what_is_cancelled():
    """The linter tells what the plan acts on: the same keys for the scale-before-normalization rule."""
    pipes = [
        [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam()],
        [mo.ClipNorm(1.0), mo.ClipNormByEMA(), mo.Normalize(), mo.Adam()],
        [mo.Chain(mo.LR(0.5), mo.Normalize()), mo.SGD(0.1)],
        [mo.ClipNorm(1.0, scope="tensor"), mo.Normalize(scope="global"), mo.Adam()],
        [mo.ClipNorm(1.0), mo.Normalize(eps=1e-8), mo.Adam()],
    ]
    for pipe in pipes:
        cfg = mo.PipelineConfig(transforms=pipe)
        scale_findings = {f.key for f in cfg.lint() if "has no effect" in f.message}
        assert make_plan(pipe, "skip").cancelled <= scale_findings
        assert bool(make_plan(pipe, "skip").cancelled) == bool(scale_findings)


def test_a_subclass_that_rewrites_apply_without_declaring_again_says_nothing():
    class Louder(mo.Normalize, abstract=True):  # (abstract: not registered, so no other test sees it)
        def apply(self, ctx, st, updates):
            return [u * 2 for u in super().apply(ctx, st, updates)]

    assert plan_mod.sets_norm(mo.Normalize()) is not None
    assert plan_mod.sets_norm(Louder()) is None
    assert make_plan([mo.ClipNorm(1.0), Louder(), mo.Adam()], "skip").cancelled == frozenset()
    assert make_plan([mo.ClipNorm(1.0), mo.Normalize(), mo.Adam()], "skip").cancelled == {"0:ClipNorm"}


def test_a_transform_with_nothing_to_keep_decides_the_skip_on_the_device_without_declaring_it():
    """Forgetting `device_skip` on a stateless transform would cost every pipeline holding it a sync a
    step: the contract infers it. A transform that saves values, may stop the step or declares the
    answer itself is left as it says."""

    class Halve(mo.Transform, abstract=True):  # (abstract: not registered)
        positional = None

        def apply(self, ctx, st, updates):
            return [u * 0.5 for u in updates]

    class Counting(Halve, abstract=True):
        state_buffers = {"n": "counter"}

    class Declared(Halve, abstract=True):
        device_skip = False

    assert mo.roles.skips_on_device(Halve()) and not mo.roles.skips_on_device(Counting())
    assert not mo.roles.skips_on_device(Declared())
    p = torch.nn.Parameter(torch.zeros(3))
    assert make_plan([Halve(), mo.Adam()], "skip").skips_on_device([{"params": [p]}])
    assert not make_plan([Declared(), mo.Adam()], "skip").skips_on_device([{"params": [p]}])


@pytest.mark.parametrize("pipeline,deferred", [
    ([mo.ClipNorm(1.0), mo.Adam()], "0:ClipNorm"),
    ([mo.ClipNormByEMA(), mo.AdamW()], "0:ClipNormByEMA"),
    ([mo.ClipNorm(1.0), mo.Identity(), mo.Adam()], "0:ClipNorm"),  # (looked through: it touches no update)
    ([mo.ClipNorm(1.0, scope="tensor"), mo.Adam()], "0:ClipNorm"),  # (one factor per tensor)
    ([mo.ClipNorm(1.0, scope="tensor", dim=0), mo.Adam()], None),  # (per slice: not one factor per tensor)
    ([mo.ClipNorm(1.0, scope="group"), mo.Adam()], None),  # (one factor per group)
    ([mo.ClipNormByEMA(), mo.Normalize(), mo.Adam()], "1:Normalize"),  # (a scale fact, per tensor)
    ([mo.Normalize(dim=0), mo.Adam()], None),
    ([mo.ClipNorm(1.0), mo.Normalize(), mo.SGD(lr=0.1)], None),
    ([mo.ZClip(), mo.AdamW()], "0:ZClip"),  # (a scale fact: its factor can be 0, not a positive scale)
    ([mo.HistClip(), mo.AdamW()], None),  # (it declares neither)
    ([mo.ClipNorm(1.0), mo.SGD(lr=0.1)], None),  # (its traced step is the runner's write: nothing to take it)
    ([mo.ClipNorm(1.0), mo.Lookahead(mo.Adam())], None),  # (a wrapper last: the runner's multiply)
    ([mo.ClipNorm(1.0), mo.Chain(mo.Adam())], "0:ClipNorm"),  # (a chain runs on the same updates)
    ([mo.Adam()], None),
])
def test_the_plan_defers_only_a_global_or_per_tensor_scale_right_before_the_optimizer(pipeline, deferred):
    """`Plan.deferred`: the scale `compile_step`'s fused op multiplies in place (one factor for all
    parameters or one per tensor, declared, right before the last transform); the eager step never reads it."""
    assert make_plan(pipeline, "skip").deferred == deferred
