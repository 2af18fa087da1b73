"""PNG plots of runs (matplotlib, optional: without it the plots are skipped with a message)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NO_MATPLOTLIB = "plots skipped: matplotlib is not installed (pip install 'modopt[plot]')"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_run(out: Path, metrics: list[dict[str, Any]], title: str) -> str | None:
    """`loss.png` and `grad_norm.png` in `out`; returns a message when skipped."""
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(steps, [m["loss"] for m in metrics], lw=0.9, label="train loss")
    ev = [(m["step"], m["eval_loss"]) for m in metrics if m.get("eval_loss") is not None]
    if ev:
        ax.plot(*zip(*ev), "o-", ms=3, lw=1.2, label="eval loss")
    clipped = [(m["step"], m["loss"]) for m in metrics if m["clipped"] and m["loss"] is not None]
    if clipped:
        ax.plot(*zip(*clipped), "x", color="tab:red", ms=4, label="clipped step")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(steps, [m["grad_norm"] for m in metrics], lw=0.9, label="pre-clip grad norm")
    ax.plot(steps, [m["post_clip_norm"] for m in metrics], lw=0.9, label="post-clip norm")
    cl = [(m["step"], m["grad_norm"]) for m in metrics if m["clipped"] and m["grad_norm"] is not None]
    if cl:
        ax.plot(*zip(*cl), "x", color="tab:red", ms=4, label="clipped step")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("global L2 norm")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "grad_norm.png", dpi=100)
    plt.close(fig)
    return None


def plot_compare(path: Path, runs: dict[str, list[dict[str, Any]]], dpi: int = 100) -> str | None:
    """Overlay of the loss and gradient-norm curves of several runs in one PNG."""
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6.4), sharex=True)
    for label, metrics in runs.items():
        steps = [m["step"] for m in metrics]
        a1.plot(steps, [m["loss"] for m in metrics], lw=0.8, label=label)
        a2.plot(steps, [m["grad_norm"] for m in metrics], lw=0.8, label=label)
    a1.set_yscale("log")
    a1.set_ylabel("train loss")
    a2.set_yscale("log")
    a2.set_ylabel("pre-clip grad norm")
    a2.set_xlabel("step")
    a1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return None
