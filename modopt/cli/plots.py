"""PNG plots of runs (matplotlib, optional: without it the plots are skipped with a message).

`loss.png` and `grad_norm.png` of one run mark the loss spikes (the count the
summary reports), the eval loss and the clipped steps; `compare.png` of several
runs has one panel per metric, each curve smoothed with the raw values faint
behind it, or over several seeds the mean curve with its interval as a band;
`sweep-<field>.png` is a metric against a swept field's values, with interval
bars. Legends sit outside the axes, so they never cover the data.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

NO_MATPLOTLIB = "plots skipped: matplotlib is not installed (pip install 'torch-modopt[plot]')"

SERIES_NAMES = {"loss": "train loss", "eval_loss": "eval loss"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, path: Path, dpi: int) -> None:
    """Write `fig` as a PNG to `path` without following a link there (`outfiles.open_out`), and close it."""
    from .outfiles import open_out

    try:
        with open_out(path, "wb") as f:
            fig.savefig(f, format="png", dpi=dpi)
    finally:
        plt.close(fig)


def smooth(values: Sequence[float | None], window: int) -> list[float | None]:
    """Centered moving average of `log(values)` over `window` steps, back in linear units.

    Missing (None) or non-positive values are left out of each average; a point
    with no value in its window is None. Averaging logarithms suits curves drawn
    on a log axis (one huge value does not lift its whole window).
    """
    logs = [math.log(v) if v is not None and v > 0 else None for v in values]
    half = max(0, window // 2)
    out: list[float | None] = []
    for i in range(len(logs)):
        part = [x for x in logs[max(0, i - half) : i + half + 1] if x is not None]
        out.append(math.exp(sum(part) / len(part)) if part else None)
    return out


def _window(n: int) -> int:
    return max(3, n // 30)


def _xy(steps: Sequence[int], values: Sequence[float | None]) -> tuple[list[int], list[float]]:
    pairs = [(s, v) for s, v in zip(steps, values) if v is not None and v > 0]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _legend_below(ax, ncol: int) -> None:
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol, fontsize=8, frameon=False)


def _clipped_rug(ax, steps: list[int], label: str = "clipped step") -> None:
    """Clipped steps as short ticks along the bottom edge (off the curves)."""
    if steps:
        ax.plot(steps, [0.015] * len(steps), "|", color="tab:red", ms=7, alpha=0.6,
                transform=ax.get_xaxis_transform(), label=label, clip_on=False)


def plot_run(
    out: Path,
    metrics: list[dict[str, Any]],
    title: str,
    *,
    pipeline: str | None = None,
    summary: dict[str, Any] | None = None,
) -> str | None:
    """`loss.png` and `grad_norm.png` in `out`; returns a message when skipped.

    `pipeline` (e.g. `"ZClip -> Adam"`) goes in the title; `summary` (from
    `summarize`) gives the loss-spike steps and the series they are counted on.
    """
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    summary = summary or {}
    spikes = list(summary.get("spike_steps") or [])
    series = summary.get("spike_series", "loss")
    steps = [m["step"] for m in metrics]
    by_step = {m["step"]: m for m in metrics}
    heading = f"{title}: {pipeline}" if pipeline else title
    n_spikes = f"{len(spikes)} loss spike{'s' if len(spikes) != 1 else ''} (on the {SERIES_NAMES.get(series, series)})"
    clipped = [m["step"] for m in metrics if m["clipped"]]

    fig, ax = plt.subplots(figsize=(8, 4.4))
    losses = [m["loss"] for m in metrics]
    ax.plot(*_xy(steps, losses), lw=0.6, alpha=0.35, color="tab:blue", label="train loss")
    ax.plot(*_xy(steps, smooth(losses, _window(len(steps)))), lw=1.6, color="tab:blue",
            label=f"train loss, smoothed ({_window(len(steps))} steps)")
    ev = _xy(*zip(*[(m["step"], m["eval_loss"]) for m in metrics if "eval_loss" in m])) if any(
        "eval_loss" in m for m in metrics) else ([], [])
    if ev[0]:
        if len(ev[0]) > 50:
            ax.plot(*ev, lw=0.6, alpha=0.35, color="tab:orange")
            ax.plot(*_xy(ev[0], smooth(ev[1], _window(len(ev[0])))), lw=1.6, color="tab:orange", label="eval loss, smoothed")
        else:
            ax.plot(*ev, "o-", ms=4, lw=1.4, color="tab:orange", label="eval loss")
    for i, s in enumerate(spikes):
        ax.axvline(s, color="tab:red", lw=0.8, ls="--", alpha=0.5, label="loss spike start" if i == 0 else None)
    sp = _xy(spikes, [by_step[s].get(series) for s in spikes])
    if sp[0]:
        ax.plot(*sp, "v", color="tab:red", ms=6)
    _clipped_rug(ax, clipped)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{heading}\n{n_spikes}, {len(clipped)} of {len(steps)} steps clipped", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    _legend_below(ax, 3)
    fig.tight_layout()
    _save(plt, fig, out / "loss.png", 100)

    fig, ax = plt.subplots(figsize=(8, 4.4))
    pre = [m["grad_norm"] for m in metrics]
    post = [m["post_clip_norm"] for m in metrics]
    ax.plot(*_xy(steps, pre), lw=0.7, alpha=0.6, color="tab:gray", label="pre-clip grad norm")
    ax.plot(*_xy(steps, post), lw=0.9, color="tab:green", label="post-clip norm (what the optimizer saw)")
    for i, s in enumerate(spikes):
        ax.axvline(s, color="tab:red", lw=0.8, ls="--", alpha=0.5, label="loss spike start" if i == 0 else None)
    _clipped_rug(ax, clipped)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("global L2 norm")
    ax.set_title(f"{heading}\ngradient norm before and after the pipeline's clipping", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    _legend_below(ax, 2)
    fig.tight_layout()
    _save(plt, fig, out / "grad_norm.png", 100)
    return None


def _compare_panels(plt, has_eval: bool, eval_every_step: bool):
    """The panels of a comparison plot (train loss, eval loss first when every step has one, the pre-clip
    norm), their figure and axes, and the colour cycle."""
    panels = [("loss", "train loss")]
    if has_eval:
        panels.insert(0 if eval_every_step else 1, ("eval_loss", "eval loss (held out)"))
    panels.append(("grad_norm", "pre-clip grad norm"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.6 * len(panels) + 1.2), sharex=True, squeeze=False)
    return panels, fig, axes, plt.rcParams["axes.prop_cycle"].by_key()["color"]


def plot_compare(
    path: Path,
    runs: dict[str, list[dict[str, Any]]],
    dpi: int = 100,
    *,
    labels: dict[str, str] | None = None,
) -> str | None:
    """Several runs in one PNG: a panel per metric (train loss, eval loss, gradient norm).

    Each curve is smoothed over `max(3, steps // 30)` steps with its raw values
    faint behind it. The eval-loss panel is drawn when the runs evaluate; when
    they evaluate every step it comes first (it is then the loss to read).
    `labels` maps a run to its legend entry (e.g. with its pipeline and spike count).
    """
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    labels = labels or {}
    has_eval = any("eval_loss" in m for ms in runs.values() for m in ms)
    eval_every_step = has_eval and all(all("eval_loss" in m for m in ms) for ms in runs.values())
    panels, fig, axes, colors = _compare_panels(plt, has_eval, eval_every_step)
    for k, (label, metrics) in enumerate(runs.items()):
        c = colors[k % len(colors)]
        for ax, (key, _) in zip(axes[:, 0], panels):
            pts = [(m["step"], m.get(key)) for m in metrics if key in m]
            if not pts:
                continue
            xs, ys = zip(*pts)
            if len(xs) > 50:
                ax.plot(*_xy(xs, ys), lw=0.5, alpha=0.2, color=c)
                ax.plot(*_xy(xs, smooth(ys, _window(len(xs)))), lw=1.5, color=c, label=labels.get(label, label))
            else:
                ax.plot(*_xy(xs, ys), "o-", ms=3.5, lw=1.4, color=c, label=labels.get(label, label))
    for ax, (key, name) in zip(axes[:, 0], panels):
        ax.set_yscale("log")
        ax.set_ylabel(name)
        ax.grid(True, which="major", alpha=0.3)
    n = max((len(ms) for ms in runs.values()), default=0)
    axes[0, 0].set_title(f"faint: raw values; solid: smoothed over {_window(n)} steps (log scale)", fontsize=9)
    axes[-1, 0].set_xlabel("step")
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2 if len(names) > 2 else len(names) or 1,
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.025 * ((len(names) + 1) // 2) + 0.015, 1, 1))
    _save(plt, fig, path, dpi)
    return None


def _seed_band(per_seed: list[dict[int, float]]) -> tuple[list[int], list[float], list[float | None], list[float | None]]:
    """Steps, geometric mean and its 95% t interval over seeds of `{step: value}` curves.

    At each step the statistics are taken over the logarithms of the seeds'
    positive values (`stats.interval`) and brought back with `exp`: the curve
    is the geometric mean, which suits a log axis, and the band never crosses
    zero. Where fewer than two seeds have a value, the band is None.
    """
    from .stats import interval

    steps = sorted({s for curve in per_seed for s in curve})
    xs, mid, low, high = [], [], [], []
    for s in steps:
        logs = [math.log(c[s]) for c in per_seed if c.get(s) is not None and c[s] > 0]
        if not logs:
            continue
        iv = interval(logs)
        xs.append(s)
        mid.append(math.exp(iv["mean"]))
        low.append(None if iv["low"] is None else math.exp(iv["low"]))
        high.append(None if iv["high"] is None else math.exp(iv["high"]))
    return xs, mid, low, high


def plot_compare_seeds(
    path: Path,
    runs: dict[str, dict[int, list[dict[str, Any]]]],
    dpi: int = 100,
    *,
    labels: dict[str, str] | None = None,
) -> str | None:
    """Several runs over seeds in one PNG: the panels of `plot_compare`, a curve and a band per run.

    `runs` maps a run to `{seed: metrics rows}`. Each seed's curve is smoothed
    as in `plot_compare` (over `max(3, steps // 30)` steps when it has more
    than 50 points); the solid curve is the geometric mean of the smoothed
    curves over the seeds, the band its 95% Student-t interval (`_seed_band`).
    When every run has one seed there is no band: this is `plot_compare`.
    """
    if all(len(seeds) == 1 for seeds in runs.values()):
        return plot_compare(path, {k: next(iter(v.values())) for k, v in runs.items()}, dpi, labels=labels)
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    labels = labels or {}
    rows = [m for seeds in runs.values() for ms in seeds.values() for m in ms]
    has_eval = any("eval_loss" in m for m in rows)
    eval_every_step = has_eval and all(all("eval_loss" in m for m in ms) for seeds in runs.values() for ms in seeds.values())
    panels, fig, axes, colors = _compare_panels(plt, has_eval, eval_every_step)
    n_max = 0
    for k, (label, seeds) in enumerate(runs.items()):
        c = colors[k % len(colors)]
        for ax, (key, _) in zip(axes[:, 0], panels):
            curves = []
            for metrics in seeds.values():
                pts = [(m["step"], m.get(key)) for m in metrics if key in m]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                n_max = max(n_max, len(xs))
                ys = smooth(ys, _window(len(xs))) if len(xs) > 50 else ys
                curves.append(dict(zip(xs, ys)))
            if not curves:
                continue
            xs, mid, low, high = _seed_band(curves)
            ax.plot(xs, mid, "-" if len(xs) > 50 else "o-", ms=3.5, lw=1.5, color=c, label=labels.get(label, label))
            band = [(x, lo, hi) for x, lo, hi in zip(xs, low, high) if lo is not None]
            if band:
                bx, blo, bhi = zip(*band)
                ax.fill_between(bx, blo, bhi, color=c, alpha=0.2, lw=0)
    for ax, (key, name) in zip(axes[:, 0], panels):
        ax.set_yscale("log")
        ax.set_ylabel(name)
        ax.grid(True, which="major", alpha=0.3)
    smoothing = f"each seed smoothed over {_window(n_max)} steps; " if n_max > 50 else ""
    axes[0, 0].set_title(f"solid: geometric mean over seeds ({smoothing}log scale); band: 95% Student-t interval",
                         fontsize=9)
    axes[-1, 0].set_xlabel("step")
    handles, names = axes[0, 0].get_legend_handles_labels()
    ncol = 1 if max(map(len, names), default=0) > 60 else min(2, len(names)) or 1
    fig.legend(handles, names, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.025 * -(-len(names) // ncol) + 0.015, 1, 1))
    _save(plt, fig, path, dpi)
    return None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def plot_sweep(
    path: Path,
    field: str,
    metric: str,
    lines: dict[str, list[tuple[Any, dict[str, Any]]]],
    dpi: int = 100,
) -> str | None:
    """A metric against the values of one swept field: a line per setting of the other fields.

    `lines` maps a legend entry ("" for the only line) to `(value, interval)`
    points, the interval from `stats.interval` over the seeds: the marker is the
    mean, the bar its 95% Student-t interval (none with one seed). Numeric values
    sit on a numeric axis (logarithmic when they are positive and span a factor
    of 10 or more); other values (names, booleans) are evenly spaced in order.
    """
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    values = [v for pts in lines.values() for v, _ in pts]
    numeric = all(_is_number(v) for v in values)
    order: list[Any] = []
    for v in values:
        if v not in order:
            order.append(v)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    log_x = numeric and bool(values) and min(values) > 0 and max(values) >= 10 * min(values)
    if log_x:
        ax.set_xscale("log")
    span = (math.log10(max(values) / min(values)) if log_x else (max(values) - min(values)) or 1.0) if numeric else 1.0
    one_seed = True
    for k, (label, pts) in enumerate(lines.items()):
        pts = [(v, iv) for v, iv in pts if iv["mean"] is not None]
        if not pts:
            continue
        # the lines a little apart (1.5% of the axis each), so that their bars do not hide each other
        shift = 0.015 * span * (k - (len(lines) - 1) / 2)
        xs = [(v * 10**shift if log_x else v + shift) if numeric else order.index(v) + shift for v, _ in pts]
        ys = [iv["mean"] for _, iv in pts]
        err = [iv["half_width"] or 0.0 for _, iv in pts]
        one_seed = one_seed and all(iv["half_width"] is None for _, iv in pts)
        ax.errorbar(xs, ys, yerr=err, fmt="o-", ms=5, capsize=4, lw=1.4, label=label or None)
    ticks = order if numeric else list(range(len(order)))
    ax.set_xticks(ticks, [f"{v:g}" if numeric else str(v) for v in order])
    ax.minorticks_off()
    ax.set_xlabel(field)
    ax.set_ylabel(metric)
    how = "one seed: no intervals" if one_seed else "bars: 95% Student-t interval of the mean over seeds"
    ax.set_title(f"{metric} against {field}\nmarkers: mean over seeds; {how}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    if any(lines):
        _legend_below(ax, 2)
    fig.tight_layout()
    _save(plt, fig, path, dpi)
    return None
