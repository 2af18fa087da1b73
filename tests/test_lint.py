"""cfg.lint(): flagged transforms provably change nothing (modopt/lint.py)."""

from __future__ import annotations

import pytest
import torch

import modopt as mo


def _train(transforms, steps=40, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = mo.Modular(model.parameters(), *transforms)
    g = torch.Generator().manual_seed(seed + 1)
    for k in range(steps):
        x = torch.randn(16, 6, generator=g) * (30.0 if k % 7 == 3 else 1.0)  # spikes
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _removed(transforms, key):
    idx = int(key.split(":")[0])
    return [t for i, t in enumerate(transforms) if i != idx]


CASES = [
    [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(1e-2)],  # the mission pipeline
    [mo.ClipNorm(0.5), mo.Normalize(), mo.SGD(0.1)],
    [mo.ClipNormGrowth(1.2), mo.ClipNorm(0.3, scope="tensor"), mo.Normalize(norm_value=0.5), mo.Adam(1e-2)],
    [mo.ClipNorm(0.5), mo.ClipNorm(1.0), mo.Adam(1e-2)],
    [mo.NormalizeByEMA(0.9, scope="group"), mo.Normalize(scope="group"), mo.LR(0.05)],
    [mo.Normalize(), mo.ClipNorm(2.0, scope="tensor"), mo.Adam(1e-2)],  # a clip after a normalizer of its norm
]


def test_flagged_transforms_train_identically_when_removed():
    for transforms in CASES:
        findings = mo.PipelineConfig(transforms=transforms).lint()
        assert findings, transforms
        base = _train(transforms)
        for f in findings:
            other = _train(_removed(transforms, f.key))
            for a, b in zip(base, other):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # float32 rounding through Adam


def test_mission_pipeline_is_flagged_and_the_working_order_is_not():
    f = mo.PipelineConfig(transforms=[mo.ClipNormByEMA(), mo.Normalize(), mo.Adam()]).lint()
    assert [x.key for x in f] == ["0:ClipNormByEMA"]
    assert "put Normalize first" in str(f[0]) and "drop ClipNormByEMA" in str(f[0])
    assert mo.PipelineConfig(transforms=[mo.Normalize(), mo.ClipNormByEMA(), mo.Adam()]).lint() == []


def test_not_flagged_when_not_provably_cancelled():
    quiet = [
        [mo.ClipNormByEMA(), mo.Normalize(eps=1e-8), mo.Adam()],          # eps: the scale leaks through
        [mo.ClipNormByEMA(eps=0.0), mo.Normalize(), mo.Adam()],           # the EMA clip may zero the update
        [mo.ClipNorm(1.0, scope="tensor"), mo.Normalize(scope="global"), mo.Adam()],  # finer scale, coarser norm
        [mo.ClipNorm(1.0), mo.Normalize(ord="std"), mo.Adam()],           # std is 0 for constant nonzero updates
        [mo.ClipNorm(1.0), mo.Normalize(min_size=4), mo.Adam()],          # small tensors are not normalized
        [mo.ClipNorm(1.0), mo.ClipValue(0.1), mo.Normalize(), mo.Adam()],  # a clamp in between
        [mo.ClipNorm(1.0), mo.Adam(), mo.Normalize()],                    # an optimizer in between
        [mo.LR(0.1), mo.Normalize(scope="global")],                       # groups may have different lr
        [mo.ClipNorm(1.0), mo.ClipNorm(1.0), mo.Adam()],                  # eps: the second still scales a little
        [mo.ClipNorm(1.0), mo.ClipNorm(2.0, ord=1), mo.Adam()],            # another norm
        [mo.ClipNorm(1.0, scope="tensor"), mo.ClipNorm(2.0), mo.Adam()],   # another scope
        [mo.Normalize(), mo.ClipNorm(0.5, scope="tensor"), mo.Adam()],     # the clip binds below norm_value
        [mo.Normalize(), mo.ClipNorm(1.0, scope="tensor"), mo.Adam()],     # at norm_value: rounding may bind
        [mo.Normalize(), mo.ClipNorm(2.0), mo.Adam()],                     # global norm of unit tensors can exceed 2
        [mo.Normalize(ord=1), mo.ClipNorm(2.0, scope="tensor"), mo.Adam()],  # another norm
    ]
    for transforms in quiet:
        assert mo.PipelineConfig(transforms=transforms).lint() == [], transforms
    ignore = mo.PipelineConfig(transforms=[mo.ClipNorm(1.0), mo.Normalize(), mo.Adam()], nonfinite="ignore")
    assert ignore.lint() == []


def test_chains_are_looked_through_and_undeclared_subclasses_are_not_trusted():
    f = mo.PipelineConfig(transforms=[mo.Chain(mo.ClipNorm(1.0)), mo.Normalize(), mo.Adam()]).lint()
    assert [x.key for x in f] == ["0:Chain/0:ClipNorm"]

    class MyClip(mo.ClipNorm):  # the same step: it inherits ClipNorm's declaration
        pass

    assert [x.key for x in mo.PipelineConfig(transforms=[MyClip(1.0), mo.Normalize(), mo.Adam()]).lint()] == [
        "0:MyClip"]

    class OtherClip(mo.ClipNorm):  # a new step that declares nothing: not trusted
        def apply(self, ctx, st, updates):
            return super().apply(ctx, st, updates)

    assert mo.PipelineConfig(transforms=[OtherClip(1.0), mo.Normalize(), mo.Adam()]).lint() == []


def test_the_unflagged_order_really_differs():
    a = _train([mo.Normalize(), mo.ClipNormByEMA(), mo.Adam(1e-2)])
    b = _train([mo.Normalize(), mo.Adam(1e-2)])
    assert max(float((x - y).abs().max()) for x, y in zip(a, b)) > 1e-3


def test_validate_prints_lint_warnings(tmp_path, capsys):
    from modopt.cli import main

    path = tmp_path / "mission.yaml"
    path.write_text("transforms: [{type: ClipNormByEMA}, {type: Normalize}, {type: Adam}]\n")
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning" in out and "0:ClipNormByEMA has no effect" in out and "put Normalize first" in out


def test_building_warns_once_what_the_lint_finds_and_lint_false_builds_silently():
    import warnings

    p = torch.nn.Parameter(torch.randn(3, 2))
    with pytest.warns(mo.LintWarning, match=r"0:ClipNormByEMA has no effect.*Fix: put Normalize first") as got:
        mo.Modular([p], mo.ClipNormByEMA(), mo.Normalize(), mo.Adam())
    assert len(got) == 1 and got[0].filename == __file__  # points at the user's line
    with pytest.warns(mo.LintWarning, match="no optimizer transform"):
        mo.Modular([p], mo.ClipNorm(1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mo.Modular([p], mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(), lint=False)
        mo.Modular([p], mo.Normalize(), mo.ClipNormByEMA(), mo.Adam())  # the order that acts: nothing to say
        mo.Modular([p], mo.ClipNorm(1.0), mo.LR(1.0))


def test_telemetry_says_a_cancelled_scale_is_cancelled():
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = mo.Modular([p], mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(), lint=False)
    p.grad = torch.randn(3, 2)
    opt.step()
    assert bool(opt.stats["0:ClipNormByEMA.cancelled"])
    opt = mo.Modular([p], mo.Normalize(), mo.ClipNormByEMA(), mo.Adam())
    opt.step()
    assert "1:ClipNormByEMA.cancelled" not in opt.stats
