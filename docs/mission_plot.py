"""Measure the mission pipeline: writes docs/img/mission-pipeline.png (python docs/mission_plot.py)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import modopt as mo  # noqa: E402

PIPELINES = {
    "ClipNormByEMA, Normalize, Adam": lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(3e-3)],
    "Normalize, Adam": lambda: [mo.Normalize(), mo.Adam(3e-3)],
    "Normalize, ClipNormByEMA, Adam": lambda: [mo.Normalize(), mo.ClipNormByEMA(), mo.Adam(3e-3)],
}


def train(transforms, steps=300, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    teacher = torch.nn.Linear(8, 1)
    opt = mo.Modular(model.parameters(), *transforms)
    g = torch.Generator().manual_seed(seed + 1)
    losses, params = [], []
    for k in range(steps):
        x = torch.randn(32, 8, generator=g)
        y = teacher(x).detach() + (torch.randn(32, 1, generator=g) * (20.0 if k % 25 == 7 else 0.1))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return losses, params


def main() -> None:
    runs = {name: train(make()) for name, make in PIPELINES.items()}
    names = list(PIPELINES)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name in names:
        a.plot(runs[name][0], label=name, lw=1)
    a.set_yscale("log"); a.set_xlabel("step"); a.set_ylabel("training loss (spiky targets every 25 steps)")
    a.legend(fontsize=8)
    for other in names[1:]:
        d = [float((p - q).norm()) for p, q in zip(runs[names[0]][1], runs[other][1])]
        b.plot([max(x, 1e-12) for x in d], label=f"vs {other}", lw=1)
    b.set_yscale("log"); b.set_xlabel("step"); b.set_ylabel("parameter distance to the mission pipeline")
    b.legend(fontsize=8)
    fig.tight_layout()
    out = Path(__file__).resolve().parent / "img" / "mission-pipeline.png"
    fig.savefig(out, dpi=110)
    print(out, "max distance to Normalize, Adam:", max(float((p - q).norm()) for p, q in zip(runs[names[0]][1], runs[names[1]][1])))


if __name__ == "__main__":
    main()
