"""Plots of runs (matplotlib, optional: without it the plots are skipped with a message).

`loss.png` and `grad_norm.png` of one run mark the loss spikes (the count the
summary reports), the eval loss and the clipped steps; `compare.png` of several
runs has one panel per metric, each curve smoothed with the raw values faint
behind it, or over several seeds the mean curve with its interval as a band
(from `stats.MIN_SEEDS` seeds on; with fewer, each seed's curve, faint);
`sweep-<field>.png` is a metric against a swept field's values, with interval
bars. Legends sit outside the axes, so they never cover the data. On a log
axis the y limits come from the curves, never from a band: a wide interval is
clipped at the axes instead of stretching them over decades.

Every plot is written as PNG, SVG or PDF (`FORMATS`, the file's suffix) at a
print resolution (`DEFAULT_DPI`; the PNG records it in its `pHYs` chunk).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

NO_MATPLOTLIB = "plots skipped: matplotlib is not installed (pip install 'torch-modopt[plot]')"

SERIES_NAMES = {"loss": "train loss", "eval_loss": "eval loss"}

#: the file formats a plot can be written in (`--format`); the first is the default
FORMATS = ("png", "svg", "pdf")
#: the resolution of a plot (`--dpi`): print quality (a 9-inch wide figure is 1800 pixels wide)
DEFAULT_DPI = 200
#: the resolutions `--dpi` accepts: below 50 the text is unreadable, above 600 a PNG runs to tens of megabytes
DPI_RANGE = (50, 600)
#: the fraction of the curves' (log) range left free above and below them
MARGIN = 0.06


def _is_transform(x: Any) -> bool:
    return isinstance(x, dict) and isinstance(x.get("type"), str)


def describe_pipeline(pipeline: dict[str, Any]) -> str:
    """A pipeline's transforms in order, a container's own in parentheses: `Masked(AdamW) -> Masked(Muon)`.

    `pipeline` is a pipeline config as plain data (`PipelineConfig.to_dict()`). Naming what a `Masked`
    holds is what tells two Muon variants apart, where the outer names alone read `Masked -> Masked`."""

    def one(t: dict[str, Any]) -> str:
        inner = [x for v in t.values() if isinstance(v, list) for x in v if _is_transform(x)]
        inner += [v for v in t.values() if _is_transform(v)]
        return f"{t['type']}({' -> '.join(map(one, inner))})" if inner else t["type"]

    return " -> ".join(one(t) for t in pipeline.get("transforms", []) if _is_transform(t))


def _fields(pipeline: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """`{dotted config path: (Type.field, value)}` of every field of every transform, nested ones too."""
    out: dict[str, tuple[str, Any]] = {}

    def walk(t: dict[str, Any], path: str) -> None:
        for k, v in t.items():
            if k == "type":
                continue
            if isinstance(v, list) and v and all(_is_transform(x) for x in v):
                for j, x in enumerate(v):
                    walk(x, f"{path}.{k}.{j}")
            elif _is_transform(v):
                walk(v, f"{path}.{k}")
            else:
                out[f"{path}.{k}"] = (f"{t['type']}.{k}", v)

    for i, t in enumerate(pipeline.get("transforms", [])):
        if _is_transform(t):
            walk(t, f"transforms.{i}")
    for k, v in pipeline.items():
        if k != "transforms":
            out[k] = (k, v)
    return out


def _short(value: Any, width: int = 32) -> str:
    import json

    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def legend_labels(pipelines: dict[str, dict[str, Any]], shown: int = 3) -> dict[str, str]:
    """A legend entry per run that tells the runs apart: `name: Masked(AdamW) -> Masked(Muon)`.

    `pipelines` maps each run's (unique) name to its pipeline as plain data. Runs whose pipelines read
    the same (`describe_pipeline`) also get the fields in which they differ, `[QKClip.logits=rewritten]`
    (at most `shown`, then `+k more`; a field is named by its config path where `Type.field` is
    ambiguous). The name comes first, so two runs never share an entry.
    """
    text = {name: describe_pipeline(p) for name, p in pipelines.items()}
    fields = {name: _fields(p) for name, p in pipelines.items()}
    labels = {}
    for name in pipelines:
        same = [n for n in pipelines if text[n] == text[name]]
        extra = ""
        if len(same) > 1:
            paths = sorted({path for n in same for path in fields[n]})
            differ = [path for path in paths
                      if len({_short(fields[n].get(path, (None, None))[1], 10**6) for n in same}) > 1]
            short = [fields[name].get(path, (path, None))[0] for path in differ]
            parts = [f"{s if short.count(s) == 1 else path}={_short(fields[name].get(path, (None, None))[1])}"
                     for s, path in zip(short, differ)]
            if parts:
                more = f", +{len(parts) - shown} more" if len(parts) > shown else ""
                extra = f" [{', '.join(parts[:shown])}{more}]"
        labels[name] = f"{name}: {text[name] or 'no transforms'}{extra}"
    return labels


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def check_format(fmt: str, dpi: int) -> None:
    """Refuse a plot format not in `FORMATS` or a dpi outside `DPI_RANGE` (a `ValueError` naming it)."""
    if fmt not in FORMATS:
        raise ValueError(f"plot format {fmt!r}: not one of {', '.join(FORMATS)}")
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not DPI_RANGE[0] <= dpi <= DPI_RANGE[1]:
        raise ValueError(f"plot dpi {dpi!r}: must be an integer {DPI_RANGE[0]}..{DPI_RANGE[1]}")


def _save(plt, fig, path: Path, dpi: int) -> None:
    """Write `fig` to `path` in the format its suffix names (`FORMATS`) without following a link there
    (`outfiles.open_out`), and close it."""
    from .outfiles import open_out

    fmt = path.suffix.lstrip(".").lower()
    try:
        check_format(fmt, dpi)
        with open_out(path, "wb") as f:
            # (tight: the figure grows to hold a legend below it, whatever its labels' length)
            fig.savefig(f, format=fmt, dpi=dpi, bbox_inches="tight", pad_inches=0.15)
    finally:
        plt.close(fig)


def _log_limits(values: Sequence[float]) -> tuple[float, float] | None:
    """The y limits of a log axis around the positive `values`, `MARGIN` of their log range free on each
    side (at least a factor 1.05 when they are all about equal); None without a positive value."""
    pos = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not pos:
        return None
    lo, hi = math.log(min(pos)), math.log(max(pos))
    pad = max(MARGIN * (hi - lo), math.log(1.05))
    return math.exp(lo - pad), math.exp(hi + pad)


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


def _figure_legend(fig, ax, width: int = 100) -> None:
    """The legend of `ax`'s curves under the whole figure (`_save` grows the figure to hold it): a long
    entry wrapped at `width` characters, one column when an entry is long, else two."""
    import textwrap

    fig.tight_layout()
    handles, names = ax.get_legend_handles_labels()
    names = [textwrap.fill(n, width, subsequent_indent="    ") for n in names]
    ncol = 1 if max(map(len, names), default=0) > 45 else min(2, len(names)) or 1
    fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, fontsize=8, frameon=False)


def _plain_log_ticks(ax) -> None:
    """On a log y axis spanning less than a decade, tick labels as plain numbers (2.75, not 2.75 x 10^0)."""
    from matplotlib.ticker import FuncFormatter

    lo, hi = ax.get_ylim()
    if lo > 0 and hi / lo < 10:
        plain = FuncFormatter(lambda v, _: f"{v:.3g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)


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
    fmt: str = "png",
    dpi: int = DEFAULT_DPI,
) -> str | None:
    """`loss.<fmt>` and `grad_norm.<fmt>` in `out` (`fmt` one of `FORMATS`); returns a message when skipped.

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
    import textwrap

    heading = textwrap.fill(f"{title}: {pipeline}" if pipeline else title, 95)
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
    _plain_log_ticks(ax)
    _legend_below(ax, 3)
    fig.tight_layout()
    _save(plt, fig, out / f"loss.{fmt}", dpi)

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
    _plain_log_ticks(ax)
    _legend_below(ax, 2)
    fig.tight_layout()
    _save(plt, fig, out / f"grad_norm.{fmt}", dpi)
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
    dpi: int = DEFAULT_DPI,
    *,
    labels: dict[str, str] | None = None,
) -> str | None:
    """Several runs in one figure (`path`'s suffix its format): a panel per metric (train loss, eval loss,
    gradient norm).

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
    for ax in axes[:, 0]:
        _plain_log_ticks(ax)
    _figure_legend(fig, axes[0, 0])
    _save(plt, fig, path, dpi)
    return None


def _seed_band(per_seed: list[dict[int, float]], min_seeds: int = 2
               ) -> tuple[list[int], list[float], list[float | None], list[float | None]]:
    """Steps, geometric mean and its 95% t interval over seeds of `{step: value}` curves.

    At each step the statistics are taken over the logarithms of the seeds'
    positive values (`stats.interval`) and brought back with `exp`: the curve
    is the geometric mean, which suits a log axis, and the band never crosses
    zero. Where fewer than `min_seeds` seeds (and at least two) have a value,
    or the values are all equal, the band is None.
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
        banded = iv["low"] is not None and len(logs) >= min_seeds
        low.append(math.exp(iv["low"]) if banded else None)
        high.append(math.exp(iv["high"]) if banded else None)
    return xs, mid, low, high


def plot_compare_seeds(
    path: Path,
    runs: dict[str, dict[int, list[dict[str, Any]]]],
    dpi: int = DEFAULT_DPI,
    *,
    labels: dict[str, str] | None = None,
) -> str | None:
    """Several runs over seeds in one figure: the panels of `plot_compare`, a curve per run with its
    band or its seeds.

    `runs` maps a run to `{seed: metrics rows}`. Each seed's curve is smoothed
    as in `plot_compare` (over `max(3, steps // 30)` steps when it has more
    than 50 points); the solid curve is the geometric mean of the smoothed
    curves over the seeds. A run with `stats.MIN_SEEDS` seeds or more gets the
    mean's 95% Student-t interval as a band (`_seed_band`); with fewer (too few
    for an interval, as in the tables) each seed's curve is drawn faint instead.
    The y limits come from the seeds' curves and the means (with a margin), and
    a band is clipped to them: its lower edge never reaches zero or below, and
    a wide interval from few seeds cannot stretch the log axis over decades.
    When every run has one seed there is no band: this is `plot_compare`.
    """
    if all(len(seeds) == 1 for seeds in runs.values()):
        return plot_compare(path, {k: next(iter(v.values())) for k, v in runs.items()}, dpi, labels=labels)
    from .stats import MIN_SEEDS

    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    labels = labels or {}
    rows = [m for seeds in runs.values() for ms in seeds.values() for m in ms]
    has_eval = any("eval_loss" in m for m in rows)
    eval_every_step = has_eval and all(all("eval_loss" in m for m in ms) for seeds in runs.values() for ms in seeds.values())
    panels, fig, axes, colors = _compare_panels(plt, has_eval, eval_every_step)
    n_max = 0
    drawn: dict[int, list[float]] = {}  # panel -> every value of a curve drawn in it (the y limits)
    bands: dict[int, list[tuple[Any, list, list, list]]] = {}  # panel -> (colour, xs, low, high)
    kinds = set()
    for k, (label, seeds) in enumerate(runs.items()):
        c = colors[k % len(colors)]
        for i, (ax, (key, _)) in enumerate(zip(axes[:, 0], panels)):
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
            xs, mid, low, high = _seed_band(curves, MIN_SEEDS)
            ax.plot(xs, mid, "-" if len(xs) > 50 else "o-", ms=3.5, lw=1.5, color=c, label=labels.get(label, label))
            drawn.setdefault(i, []).extend(mid)
            if len(curves) >= MIN_SEEDS:
                kinds.add("band")
                bands.setdefault(i, []).append((c, xs, low, high))
            elif len(curves) > 1:
                kinds.add("seeds")
                for curve in curves:
                    sx, sy = _xy(sorted(curve), [curve[x] for x in sorted(curve)])
                    ax.plot(sx, sy, lw=0.7, alpha=0.35, color=c)
                    drawn[i].extend(sy)
            # a band's y limits come from its seeds' curves, not from the interval's edges
            if len(curves) >= MIN_SEEDS:
                drawn[i].extend(v for curve in curves for v in curve.values() if v is not None)
    clipped = False
    for i, (ax, (key, name)) in enumerate(zip(axes[:, 0], panels)):
        ax.set_yscale("log")
        limits = _log_limits(drawn.get(i, []))
        if limits is not None:
            ax.set_ylim(*limits)
        for c, xs, low, high in bands.get(i, []):
            band = [(x, lo, hi) for x, lo, hi in zip(xs, low, high) if lo is not None]
            if not band:
                continue
            bx, blo, bhi = zip(*band)
            if limits is not None:  # within the axes: a positive floor below, the top above
                clipped = clipped or min(blo) < limits[0] or max(bhi) > limits[1]
                blo = [max(v, limits[0]) for v in blo]
                bhi = [min(v, limits[1]) for v in bhi]
            ax.fill_between(bx, blo, bhi, color=c, alpha=0.2, lw=0)
        ax.set_ylabel(name)
        ax.grid(True, which="major", alpha=0.3)
    smoothing = f"each seed smoothed over {_window(n_max)} steps; " if n_max > 50 else ""
    how = []
    if "band" in kinds:
        how.append("band: 95% Student-t interval" + (" (clipped at the axes)" if clipped else ""))
    if "seeds" in kinds:
        how.append(f"faint: each seed (fewer than {MIN_SEEDS} seeds: too few for an interval)")
    axes[0, 0].set_title(f"solid: geometric mean over seeds ({smoothing}log scale); " + "; ".join(how),
                         fontsize=9)
    axes[-1, 0].set_xlabel("step")
    for ax in axes[:, 0]:
        _plain_log_ticks(ax)
    _figure_legend(fig, axes[0, 0])
    _save(plt, fig, path, dpi)
    return None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def plot_sweep(
    path: Path,
    field: str,
    metric: str,
    lines: dict[str, list[tuple[Any, dict[str, Any]]]],
    dpi: int = DEFAULT_DPI,
) -> str | None:
    """A metric against the values of one swept field: a line per setting of the other fields.

    `lines` maps a legend entry ("" for the only line) to `(value, interval)`
    points, the interval from `stats.interval` over the seeds: the marker is the
    mean, the bar its 95% Student-t interval, drawn where the tables print one (`stats.MIN_SEEDS`
    seeds or more whose values differ). Numeric values
    sit on a numeric axis (logarithmic when they are positive and span a factor
    of 10 or more); other values (names, booleans) are evenly spaced in order.
    """
    from .stats import MIN_SEEDS, _status

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
    bars = few = False
    for k, (label, pts) in enumerate(lines.items()):
        pts = [(v, iv) for v, iv in pts if iv["mean"] is not None]
        if not pts:
            continue
        # the lines a little apart (1.5% of the axis each), so that their bars do not hide each other
        shift = 0.015 * span * (k - (len(lines) - 1) / 2)
        xs = [(v * 10**shift if log_x else v + shift) if numeric else order.index(v) + shift for v, _ in pts]
        ys = [iv["mean"] for _, iv in pts]
        # a bar only where the tables print an interval (MIN_SEEDS seeds that differ): the width of a
        # "too few" interval rests on an sd from 2-4 values and would read as resolved
        shown = [(iv.get("status") or _status(iv)) == "interval" for _, iv in pts]
        err = [iv["half_width"] if ok else 0.0 for (_, iv), ok in zip(pts, shown)]
        bars = bars or any(shown)
        few = few or any((iv.get("status") or _status(iv)) == "too_few" for _, iv in pts)
        ax.errorbar(xs, ys, yerr=err if any(shown) else None, fmt="o-", ms=5, capsize=4, lw=1.4, label=label or None)
    ticks = order if numeric else list(range(len(order)))
    ax.set_xticks(ticks, [f"{v:g}" if numeric else str(v) for v in order])
    ax.minorticks_off()
    ax.set_xlabel(field)
    ax.set_ylabel(metric)
    how = "bars: 95% Student-t interval of the mean over seeds" if bars else "no intervals"
    if few:
        how += f"; no bar where fewer than {MIN_SEEDS} seeds (too few for an interval)"
    elif not bars:
        how += " (one seed, or equal values)"
    ax.set_title(f"{metric} against {field}\nmarkers: mean over seeds; {how}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    if any(lines):
        _legend_below(ax, 2)
    fig.tight_layout()
    _save(plt, fig, path, dpi)
    return None
