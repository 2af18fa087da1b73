"""Write tests/data/trajectories.pt: parameters after 12 steps of pinned pipelines, recorded before a refactor.

How it was made: ``python tests/data/make_trajectories.py`` on main at a73d81a (before issue 17's
rewrite of the core), torch 2.13.0 CPU. Each pipeline trains the same small model through
``Modular.step()`` after a real ``backward()``, defaults unless the row says otherwise, and the
file holds every parameter after each of the 12 steps. tests/test_pinned_trajectories.py re-runs
the pipelines with the current code and compares bit for bit (the clip-before-`Normalize`
pipelines to rounding: the refactor is allowed to change their last bits, see that test).
Never regenerate it to make that test pass: it stands for what the code computed before.

``ClipNormByEMA-slices-min_size2+Adam`` was added later, recorded the same way at c984f1c (the
code before the one-D rule, see ``SINCE_ONE_D_RULE``); the other rows were not re-recorded.
"""

from __future__ import annotations

from pathlib import Path

import torch

import modopt as mo

OUT = Path(__file__).with_name("trajectories.pt")
STEPS = 12


def pipelines() -> dict[str, tuple[list, dict]]:
    """name -> (transforms, Modular keywords); names say what each one covers."""
    return {
        "ClipNorm+Adam": ([mo.ClipNorm(1.0), mo.Adam()], {}),
        "ClipNormByEMA+Normalize+Adam": ([mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(lr=1e-3)], {}),
        "ZClip+AdamW": ([mo.ZClip(warmup_steps=3), mo.AdamW()], {}),
        "ZClip-default+AdamW": ([mo.ZClip(), mo.AdamW()], {}),
        "AutoClip+Adam": ([mo.AutoClip(), mo.Adam()], {}),
        "Normalize+Adam": ([mo.Normalize(), mo.Adam()], {}),
        "ClipNorm-tensor-dim0+SGD": ([mo.ClipNorm(0.05, scope="tensor", dim=0), mo.SGD(lr=0.1, momentum=0.9)], {}),
        "ClipNormByEMA-slices+Adam": ([mo.ClipNormByEMA(scope="tensor", dim=0, inverse_dims=True), mo.Adam()], {}),
        "ClipNormByEMA-slices-min_size2+Adam": (
            [mo.ClipNormByEMA(scope="tensor", dim=0, inverse_dims=True, min_size=2), mo.Adam()], {}),
        "NormalizeByEMA+AdamW": ([mo.NormalizeByEMA(beta=0.9), mo.AdamW(lr=1e-2)], {}),
        "ClipNormGrowth+SGD": ([mo.ClipNormGrowth(), mo.SGD(lr=0.05)], {}),
        "ClipNormGrowth-group+SGD": ([mo.ClipNormGrowth(scope="group", mul=1.1), mo.SGD(lr=0.05)], {}),
        "ClipValueGrowth+LR": ([mo.ClipValueGrowth(), mo.LR(0.05)], {}),
        "HistClip-zstat+Adam": ([mo.HistClip(mo.ZStatCriterion(), warmup_steps=3), mo.Adam()], {}),
        "HistClip-ema-slices+Adam": (
            [mo.HistClip(mo.EMACriterion(), warmup_steps=2, scope="tensor", dim=0), mo.Adam()], {}),
        "AutoClip-window-tensor+SGD": ([mo.AutoClip(percentile=50, window=4, scope="tensor"), mo.SGD(lr=0.05)], {}),
        "ZScoreNormalize+SGD": ([mo.ZScoreNormalize(), mo.SGD(lr=0.01)], {}),
        "Centralize+GC+Adam": ([mo.Centralize(), mo.GradientCentralization(), mo.Adam()], {}),
        "ClipValue+ClipValueByEMA+SGD": ([mo.ClipValue(0.05), mo.ClipValueByEMA(beta=0.5), mo.SGD(lr=0.1)], {}),
        "ClipValueByPercentile+Adam": ([mo.ClipValueByPercentile(90), mo.Adam()], {}),
        "AGC+SGD": ([mo.AGC(clipping=0.05), mo.SGD(lr=0.1, momentum=0.9, nesterov=True)], {}),
        "ClipNorm-linf-group+LR": ([mo.ClipNorm(0.1, ord="linf", scope="group"), mo.LR(0.1)], {}),
        "Normalize-std-global+Adam": ([mo.Normalize(ord="std", scope="global"), mo.Adam()], {}),
        "Chain+Accumulate+Adam": ([mo.Chain(mo.ClipNorm(0.5), mo.Accumulate(2)), mo.Adam(amsgrad=True)], {}),
        "Masked+SGD": ([mo.Masked(mo.ClipNorm(0.1), mo.Normalize(), where="*.weight"), mo.SGD(lr=0.05)], {}),
        "Masked-routing": (
            [mo.ClipNorm(1.0), mo.Masked(mo.SGD(lr=0.1), where="0.*"), mo.Masked(mo.Adam(), where="2.*")], {}),
        "ClipNorm+Adam-zero": ([mo.ClipNorm(1.0), mo.Adam()], {"nonfinite": "zero"}),
        "ClipNorm+Adam-ignore": ([mo.ClipNorm(1.0), mo.Adam()], {"nonfinite": "ignore"}),
    }


#: pipelines whose recorded trajectory the one-D rule changed (docs/concepts.md, "Slices"), and the
#: recorded pipeline they now reproduce bit for bit. "ClipNormByEMA-slices+Adam" clipped each element
#: of the biases as a slice of its own (dim=0, inverse_dims=True leaves a 1-D tensor no dim); now
#: the biases are left alone, which the code before the rule did for slices under `min_size=2`
#: (the weights' slices have 8 and 16 elements, the same either way)
SINCE_ONE_D_RULE = {"ClipNormByEMA-slices+Adam": "ClipNormByEMA-slices-min_size2+Adam"}
#: pipelines that put a clip before `Normalize`: their last bits may change (issue 17)
CLIP_BEFORE_NORMALIZE = ("ClipNormByEMA+Normalize+Adam", "Masked+SGD")
#: pipelines of several routed branches: since c056489 every branch's optimizer writes its own parameters
#: with its kernel (torch's SGD for "0.*" here), where before only the last did and `p -= u` wrote the
#: others; their last bits may change. tests/test_pinned_trajectories.py checks the new trajectory bit for
#: bit against torch's own optimizers
ROUTED_WRITES = ("Masked-routing",)
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return m.to(dtype)


def groups(m: torch.nn.Module) -> list[dict]:
    named = list(m.named_parameters())
    return [
        {"params": [p for _, p in named[:2]], "param_names": [n for n, _ in named[:2]]},
        {"params": [p for _, p in named[2:]], "param_names": [n for n, _ in named[2:]]},
    ]


def trajectory(name: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every parameter after each step, flattened and concatenated (one row per step)."""
    transforms, kw = pipelines()[name]
    m = model(dtype)
    opt = mo.Modular(groups(m), *transforms, **kw)
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(STEPS):
        x = torch.randn(16, 8, generator=g).to(dtype)
        y = torch.randn(16, 3, generator=g).to(dtype)
        scale = 20.0 if step in (5, 9) else 1.0  # two loss spikes for the statistical clips
        opt.zero_grad()
        loss = (m(x) - y).pow(2).mean() * scale
        loss.backward()
        opt.step()
        rows.append(torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()]))
    return rows


def record() -> dict[str, torch.Tensor]:
    out = {}
    for name in pipelines():
        for dtype in DTYPES:
            out[f"{name}/{str(dtype).split('.')[-1]}"] = torch.stack(trajectory(name, dtype))
    return out


if __name__ == "__main__":
    data = record()
    torch.save(data, OUT)
    print(f"wrote {OUT} ({len(data)} trajectories)")
