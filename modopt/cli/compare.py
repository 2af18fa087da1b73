"""`modopt compare`: run several experiments / variants over seeds and tabulate them.

Every variant runs once per seed into `OUT/<run>/seed-<S>/` (a run directory
of `modopt run`, whose `config.yaml` re-runs it exactly). The table gives, per
metric, the mean over seeds with its 95% Student-t interval (`stats.py`);
`--baseline NAME` adds each run's paired difference to NAME over the same seeds.
Every cell names the seeds it rests on, and below `stats.MIN_SEEDS` seeds no
interval is printed. `compare.json` keeps every seed's values and the summary
(`SCHEMA`, documented in docs/cli.md); `report.html` holds the tables and plots
in one file. Each of them, and `compare.md`, carries the provenance block
(`provenance.py`).

The pieces `modopt sweep` shares live here too: the seeds of an experiment,
the job runner (in process, or in parallel worker processes), the per-seed
record of a run directory and its summary over seeds.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError
from .experiment import INT64_MAX, Experiment, apply_overrides, experiment_from_data, load_experiment
from .outfiles import refuse_links, write_text
from .plots import DEFAULT_DPI, FORMATS, describe_pipeline, legend_labels
from .provenance import KEY as PROVENANCE
from .provenance import markdown as provenance_markdown
from .provenance import provenance
from .run import (
    METRIC_FIELDS, RUN_FILES, SPIKE_FACTOR, SPIKE_MIN_RISE, SPIKE_WINDOW, TIMING_FIELDS, check_kind, prepare_dir, read_jsonl,
    run_experiment, summarize,
)
from .stats import LEVEL, METHOD, MIN_SEEDS, format_interval, interval, paired

#: version of the layout of `compare.json` and `sweep.json` (docs/cli.md); bumped on an incompatible change
#: (2: equal values have no interval, `half_width` null and `status` "same", where 1 gave a zero width)
SCHEMA = 2

#: the comparison's plot in each format it may be written in (`--format`)
COMPARE_PLOTS = tuple(f"compare.{fmt}" for fmt in FORMATS)
#: the files `compare` writes into OUT (beside a directory per run): one of the plots, by `--format`
COMPARE_FILES = ("compare.md", "compare.json", *COMPARE_PLOTS, "report.html")

#: the per-seed metrics summarized over seeds: key -> (column title, format of the mean)
METRICS = {
    "final_loss": ("final loss", ".4g"),
    "best_loss": ("best loss", ".4g"),
    "final_eval_loss": ("eval loss", ".4g"),
    "best_eval_loss": ("best eval loss", ".4g"),
    "loss_spikes": ("loss spikes", ".3g"),
    "worst_excursion": ("worst excursion", ".3g"),
    "clipped_pct": ("% clipped", ".3g"),
    "skipped_steps": ("skipped steps", ".3g"),
    "max_grad_norm": ("max grad norm", ".3g"),
    "time_per_step_ms": ("ms/step", ".3g"),
}
#: the metrics in the tables, in order
TABLE = ("final_loss", "final_eval_loss", "loss_spikes", "worst_excursion", "clipped_pct", "time_per_step_ms")


def _err(*a: Any) -> None:
    print(*a, file=sys.stderr)


# --- one run's metrics ---------------------------------------------------------------------
def worst_excursion(series: list[float | None], window: int = SPIKE_WINDOW) -> tuple[float | None, int | None]:
    """`(ratio, index)`: the largest `series[t] / median(series[t - window : t])` over `t >= window`.

    The running median is the one the loss-spike count uses (`run.count_spikes`),
    over the finite values of the window; steps whose median is not positive are
    left out. A value of 1 means the loss never rose above its recent median.
    `(None, t)` when the value at `t` is non-finite (None), the first such `t`:
    the excursion is unbounded; `(None, None)` when no step has a median
    (the series is at most `window` long).
    """
    best: float | None = None
    where: int | None = None
    for t in range(window, len(series)):
        past = [x for x in series[t - window : t] if x is not None]
        if not past:
            continue
        if series[t] is None:
            return None, t
        med = statistics.median(past)
        if med > 0 and (best is None or series[t] / med > best):
            best, where = series[t] / med, t
    return best, where


def seed_record(name: str, seed: int, rdir: Path, task: str, spike_kw: dict[str, Any] | None = None
                ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The per-seed values of the finished run in `rdir` (its `summarize`, with the spike options,
    plus `seed`, `worst_excursion`, `worst_excursion_step`, `task`, `run_dir`) and its metrics rows."""
    metrics = read_jsonl(rdir / "metrics.jsonl", INT64_MAX, METRIC_FIELDS)
    times = [r["time_s"] for r in read_jsonl(rdir / "timing.jsonl", INT64_MAX, TIMING_FIELDS)]
    rec = summarize(name, metrics, times, spike_kw)
    window = (spike_kw or {}).get("window", SPIKE_WINDOW)
    ratio, t = worst_excursion([m.get(rec["spike_series"]) for m in metrics], window)
    rec.update(seed=seed, worst_excursion=ratio, worst_excursion_step=None if t is None else metrics[t]["step"],
               task=task, run_dir=str(rdir))
    return rec, metrics


def spike_settings(spike_kw: dict[str, Any] | None) -> dict[str, Any]:
    """The loss-spike thresholds in effect (the defaults of `run.py` where not given)."""
    kw = spike_kw or {}
    return {"window": kw.get("window", SPIKE_WINDOW), "factor": kw.get("factor", SPIKE_FACTOR),
            "min_rise": kw.get("min_rise", SPIKE_MIN_RISE)}


# --- seeds ---------------------------------------------------------------------------------
def seeds_of(exp: Experiment, seeds: list[int] | None = None, seed: int | None = None) -> list[int]:
    """The seeds to run `exp` on: `--seeds`, else `--seed`, else `train.seeds`, else `[train.seed]`."""
    if seeds:
        return list(seeds)
    if seed is not None:
        return [seed]
    return list(exp.train.seeds or [exp.train.seed])


def check_seeds(seeds: list[int] | None) -> None:
    """`--seeds` must not repeat a seed (two runs of one seed are one run twice)."""
    if seeds and len(set(seeds)) != len(seeds):
        twice = sorted({s for s in seeds if seeds.count(s) > 1})
        raise ConfigError(f"--seeds: {', '.join(map(str, twice))} given twice; the seeds must be distinct")


def seeded(exp: Experiment, seed: int) -> Experiment:
    """`exp` as the single-seed run of `seed` (`train.seed = seed`, no `train.seeds`)."""
    return exp.model_copy(update={"train": exp.train.model_copy(update={"seed": seed, "seeds": None})})


def pipeline_text(exp: Experiment) -> str:
    """The experiment's pipeline as `ClipNorm -> Adam` (transform names in order, a container's own in
    parentheses: `Masked(AdamW) -> Masked(Muon)`, `plots.describe_pipeline`)."""
    return describe_pipeline(exp.optimizer.to_dict())


# --- running -------------------------------------------------------------------------------
@dataclass
class Job:
    """One run: the experiment `label` at `seed`, into `dir`."""

    label: str
    seed: int
    exp: Experiment
    dir: Path


def _run_job(data: dict[str, Any], rdir: str, trust_imports: bool, plots: bool,
             plot_as: tuple[str, int] = ("png", DEFAULT_DPI)) -> None:
    """A worker process's run (top level, so that it pickles)."""
    exp = experiment_from_data(data, str(Path(rdir) / "config.yaml"), trust_imports)
    run_experiment(exp, Path(rdir), trust_imports=trust_imports, progress=False, plots=plots,
                   log=lambda *a: None, force=True, plot_format=plot_as[0], plot_dpi=plot_as[1])


def run_jobs(jobs: list[Job], *, n_jobs: int = 1, trust_imports: bool = False, progress: bool = True,
             plots: bool = True, log: Callable[..., None] = _err, tool: str = "compare",
             plot_as: tuple[str, int] = ("png", DEFAULT_DPI)) -> None:
    """Run `jobs`: in this process one after the other (`n_jobs` 1), else in `n_jobs` worker processes.

    Each run is `modopt run` of its experiment (single-threaded and deterministic
    by default, `train.threads`), so a worker gives the same metrics as the
    command. Workers are started with "spawn" (a fresh interpreter; forking a
    process that already ran torch can hang). The first failing run stops the
    rest from starting and raises its error. `plot_as`: each run's plots' `(format, dpi)`.
    """
    n = len(jobs)
    if n_jobs <= 1 or n <= 1:
        for k, job in enumerate(jobs, 1):
            log(f"modopt {tool}: [{k}/{n}] {job.label} seed {job.seed} -> {job.dir}")
            run_experiment(job.exp, job.dir, trust_imports=trust_imports, progress=progress, plots=plots,
                           log=log, force=True, plot_format=plot_as[0], plot_dpi=plot_as[1])
        return
    log(f"modopt {tool}: {n} runs in {min(n_jobs, n)} worker processes")
    pool = ProcessPoolExecutor(max_workers=min(n_jobs, n), mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {pool.submit(_run_job, j.exp.to_dict(), str(j.dir), trust_imports, plots, plot_as): j for j in jobs}
        for k, fut in enumerate(as_completed(futures), 1):
            job = futures[fut]
            fut.result()
            log(f"modopt {tool}: [{k}/{n}] finished {job.label} seed {job.seed} -> {job.dir}")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --- summaries over seeds ------------------------------------------------------------------
def over_seeds(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`{metric: interval}` of every metric in `METRICS` over the per-seed records."""
    return {k: interval([r.get(k) for r in records]) for k in METRICS}


def versus(records: list[dict[str, Any]], base: list[dict[str, Any]], baseline: str) -> dict[str, Any]:
    """The paired differences `run - baseline` on the seeds both ran: `{baseline, seeds, metrics}`."""
    by_seed = {r["seed"]: r for r in base}
    shared = [r for r in records if r["seed"] in by_seed]
    return {
        "baseline": baseline,
        "seeds": [r["seed"] for r in shared],
        "metrics": {k: paired([r.get(k) for r in shared], [by_seed[r["seed"]].get(k) for r in shared]) for k in METRICS},
    }


# --- tables --------------------------------------------------------------------------------
Table = tuple[list[str], list[list[str]]]


def markdown(table: Table) -> str:
    """A Markdown table (readable in a terminal too): the first column left-aligned, the rest right."""
    head, body = table
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 2)) if i == 0 else ("-" * (w + 1) + ":") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep, *(line(b) for b in body)])


def summary_cells(summary: dict[str, dict[str, Any]], metrics: tuple[str, ...] = TABLE,
                  signed: bool = False) -> list[str]:
    """The cells of `metrics` from a summary over seeds, each naming its seeds (`stats.format_interval`;
    `signed`: with a sign, for differences)."""
    return [format_interval(summary[k], METRICS[k][1], signed=signed) for k in metrics]


def summary_table(runs: list[dict[str, Any]]) -> Table:
    """One row per run: its name, number of seeds and each metric over the seeds."""
    head = ["run", "seeds", *(METRICS[k][0] for k in TABLE)]
    return head, [[r["name"], str(len(r["seeds"])), *summary_cells(r["summary"])] for r in runs]


def baseline_table(runs: list[dict[str, Any]], baseline: str) -> Table:
    """One row per run other than `baseline`: its paired differences to the baseline over the shared seeds."""
    head = [f"run - {baseline}", "paired seeds", *(f"Δ {METRICS[k][0]}" for k in TABLE)]
    body = [[r["name"], str(len(r["vs_baseline"]["seeds"])), *summary_cells(r["vs_baseline"]["metrics"], signed=True)]
            for r in runs if r["name"] != baseline]
    return head, body


def per_seed_table(runs: list[dict[str, Any]]) -> Table:
    """Every seed's values: a row per `(run["name"], seed)` of `run["per_seed"]`."""
    head = ["run", "seed", *(METRICS[k][0] for k in TABLE)]
    body = []
    for r in runs:
        for s in r["per_seed"]:
            body.append([r["name"], str(s["seed"]), *("-" if s.get(k) is None else format(s[k], METRICS[k][1]) for k in TABLE)])
    return head, body


def footnote(spike: dict[str, Any], baseline: str | None = None) -> str:
    """What the cells of the tables mean (printed under them), wrapped at 100 columns."""
    text = (
        f"Each cell: the mean over n seeds ± the half-width of the {METHOD} (t_{{0.975, n-1}} × sd / √n), "
        f"given from {MIN_SEEDS} seeds on. (n=k, too few): k = 2 to {MIN_SEEDS - 1} seeds that differ, too few "
        "for an interval (its width would rest on an sd estimated from k values): the mean alone. (same on all k "
        "seeds): every seed gave this value; not an interval of zero width. (n=1, no interval): one seed. "
        "(n=k of m): only k of the m seeds have a value; -: none has. "
        f"Worst excursion: the largest ratio of the loss to the median of its previous {spike['window']} values "
        "(the loss-spike median; 1 = never above it)."
    )
    if baseline is not None:
        text += (
            f" Δ: the paired difference run - {baseline} over the seeds both ran: the mean of the per-seed "
            f"differences ± the half-width of its t interval. Only an interval (n >= {MIN_SEEDS}) that excludes 0 "
            "is a difference these seeds resolve at the 95% level; a Δ with too few seeds, or the same on every "
            "seed, is not resolved by them."
        )
    return textwrap.fill(text, 100)


# --- compare -------------------------------------------------------------------------------
def pick_variants(exps: dict[str, Experiment], names: list[str] | None) -> dict[str, list[str | None]]:
    """The variants to run of each config (`[None]`: a config with one optimizer): all of them, or those
    `--variant` names (a variant's name, or its run's name as the tables show it, `<experiment>-<variant>`).

    A name that is no config's variant is refused, naming the variants there are and the closest; so is
    a name given twice, and a config with variants none of which is named. Nothing is run."""
    from ..core.transform import did_you_mean

    picked = {path: ([None] if exp.optimizer is not None else list(exp.variants or {})) for path, exp in exps.items()}
    if names is None:
        return picked
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--variant: {', '.join(twice)} given twice; name each variant once")
    known = {path: {v: f"{exp.name}-{v}" for v in exp.variants or {}} for path, exp in exps.items()}
    every = [v for vs in known.values() for v in vs]
    if not every:
        raise ConfigError(f"--variant {' '.join(names)}: {', '.join(exps)} "
                          f"{'has' if len(exps) == 1 else 'have'} no variants (an optimizer of its own); drop --variant")
    for n in names:
        if not any(n in vs or n in vs.values() for vs in known.values()):
            raise ConfigError(f"--variant {n}: no such variant{did_you_mean(n, every)}; the variants are: "
                              f"{', '.join(every)}")
    for path, vs in known.items():
        if vs:
            picked[path] = [v for v, full in vs.items() if v in names or full in names]
            if not picked[path]:
                raise ConfigError(f"--variant: {path} has none of the variants named ({', '.join(names)}); its "
                                  f"variants are: {', '.join(vs)}")
    return picked


def plan_compare(configs: list[str], overrides: Any, seeds: list[int] | None, trust_imports: bool,
                 sources: dict[str, list[str]] | None = None, variants: list[str] | None = None
                 ) -> list[tuple[str, Experiment, list[int]]]:
    """`(label, experiment, seeds)` of every config / variant (only those `variants` names, when given:
    `pick_variants`); every name and seed checked, nothing run. `sources`, when given, receives each
    config argument's run labels."""
    check_seeds(seeds)
    runs = []
    labels: set[str] = set()
    exps = {path: load_experiment(path, trust_imports) for path in configs}
    picked = pick_variants(exps, variants)
    for path in configs:
        exp = exps[path]
        for v in picked[path]:
            one = exp.select(v)
            if overrides is not None:
                one = apply_overrides(one, overrides)
            label = one.name
            if label in labels:
                label = f"{Path(path).stem}-{label}"
            if label in labels:
                raise ConfigError(f"two runs are named {label!r}; give the configs distinct names")
            labels.add(label)
            runs.append((label, one, seeds_of(one, seeds, getattr(overrides, "seed", None))))
            if sources is not None:
                sources.setdefault(path, []).append(label)
    return runs


def _check_baseline(baseline: str, runs: list[tuple[str, Experiment, list[int]]],
                    sources: dict[str, list[str]]) -> str:
    """The run `--baseline` names: a run's name as the table shows it, or the config argument (a path or
    an example's name, as given) of a config that makes one run. Its seeds checked against every run's."""
    names = [label for label, _, _ in runs]
    if baseline not in names and len(sources.get(baseline, ())) == 1:
        baseline = sources[baseline][0]
    if baseline not in names:
        from ..core.transform import did_you_mean

        raise ConfigError(f"--baseline {baseline}: no run is named so{did_you_mean(baseline, names)}; the runs are: {', '.join(names)}")
    base_seeds = set(next(s for label, _, s in runs if label == baseline))
    for label, _, s in runs:
        if not base_seeds & set(s):
            raise ConfigError(f"--baseline {baseline}: {label} shares no seed with it ({label}: {s}, {baseline}: "
                              f"{sorted(base_seeds)}); a paired difference needs the same seeds (give --seeds)")
    return baseline


def compare(
    configs: list[str],
    out: Path,
    *,
    overrides: Any = None,
    seeds: list[int] | None = None,
    baseline: str | None = None,
    jobs: int = 1,
    spike_kw: dict[str, Any] | None = None,
    trust_imports: bool = False,
    progress: bool = True,
    plots: bool = True,
    command: str | None = None,
    variants: list[str] | None = None,
    plot_format: str = "png",
    plot_dpi: int = DEFAULT_DPI,
) -> str:
    """Run every experiment (every variant of each, or those `variants` names) over its seeds under `out`;
    write and return the tables. The plots are written as `plot_format` at `plot_dpi`."""
    from .plots import check_format

    try:
        check_format(plot_format, plot_dpi)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sources: dict[str, list[str]] = {}
    planned = plan_compare(configs, overrides, seeds, trust_imports, sources, variants)
    if baseline is not None:
        baseline = _check_baseline(baseline, planned, sources)
    check_kind(out, "compare")
    todo = [Job(label, s, seeded(exp, s), out / label / f"seed-{s}") for label, exp, ss in planned for s in ss]
    refuse_links(out, [*RUN_FILES, *COMPARE_FILES, *(Path(label) / f"seed-{s}" / f for label, _, ss in planned
                                                     for s in ss for f in RUN_FILES)])
    prepare_dir(out, force=True)
    run_jobs(todo, n_jobs=jobs, trust_imports=trust_imports, progress=progress, plots=plots,
             plot_as=(plot_format, plot_dpi))
    runs, curves = [], {}
    for label, exp, ss in planned:
        recs = [seed_record(label, s, out / label / f"seed-{s}", exp.task.name, spike_kw) for s in ss]
        curves[label] = {s: m for s, (_, m) in zip(ss, recs)}
        per_seed = [r for r, _ in recs]
        runs.append({"name": label, "task": exp.task.name, "pipeline": pipeline_text(exp), "seeds": ss,
                     "summary": over_seeds(per_seed), "vs_baseline": None, "per_seed": per_seed})
    if baseline is not None:
        base = next(r for r in runs if r["name"] == baseline)
        for r in runs:
            r["vs_baseline"] = versus(r["per_seed"], base["per_seed"], baseline) if r is not base else None
    resolved = {"runs": {label: exp.to_dict() for label, exp, _ in planned},
                "seeds": {label: ss for label, _, ss in planned}, "baseline": baseline,
                "spike": spike_settings(spike_kw)}
    result = {"schema": SCHEMA, "kind": "compare", "command": command,
              "interval": {"method": METHOD, "level": LEVEL, "min_seeds": MIN_SEEDS}, "spike": resolved["spike"],
              "baseline": baseline, "plots": {"format": plot_format, "dpi": plot_dpi} if plots else None,
              "runs": runs, PROVENANCE: provenance(resolved)}
    tables = [summary_table(runs)] + ([baseline_table(runs, baseline)] if baseline is not None else [])
    text = "\n\n".join(markdown(t) for t in tables) + "\n\n" + footnote(result["spike"], baseline)
    write_text(out / "compare.md", text + "\n\n" + provenance_markdown(result[PROVENANCE]) + "\n")
    write_text(out / "compare.json", json.dumps(result, indent=2) + "\n")
    plot = out / f"compare.{plot_format}"
    for stale in COMPARE_PLOTS:  # an earlier comparison's plot in OUT is not this one's
        if (out / stale).is_file():
            (out / stale).unlink()
    pipes = {label: exp.optimizer.to_dict() for label, exp, _ in planned}
    plot_msg = _compare_plot(plot, runs, curves, pipes, plot_dpi) if plots else None
    if plot_msg:
        _err(plot_msg)
    _compare_report(out / "report.html", result, tables, plots, plot)
    written = ", ".join(str(out / f) for f in COMPARE_FILES if (out / f).exists())
    _err(f"modopt compare: wrote {written}")
    return text


def _compare_plot(path: Path, runs: list[dict[str, Any]], curves: dict[str, dict[int, list[dict[str, Any]]]],
                  pipelines: dict[str, dict[str, Any]], dpi: int = DEFAULT_DPI) -> str | None:
    """The comparison's plot; each legend entry names the run, its pipeline (with the fields that tell
    it from a run whose pipeline reads the same, `plots.legend_labels`) and its spike count."""
    from .plots import plot_compare_seeds

    described = legend_labels(pipelines)
    names = {}
    for r in runs:
        spikes = r["summary"]["loss_spikes"]
        n = spikes["n"]
        count = (f"{spikes['mean']:g} spike{'' if spikes['mean'] == 1 else 's'}" if n == 1
                 else f"{spikes['mean']:.3g} spike{'' if spikes['mean'] == 1 else 's'}, mean of {n} seeds")
        names[r["name"]] = f"{described[r['name']]} ({count})"
    return plot_compare_seeds(path, curves, dpi, labels=names)


def _compare_report(path: Path, result: dict[str, Any], tables: list[Table], plots: bool, plot: Path) -> None:
    from .report import Report

    rep = Report("modopt compare", command=result["command"], provenance=result[PROVENANCE])
    rep.heading("Summary over seeds")
    rep.table(tables[0])
    if len(tables) > 1:
        rep.heading(f"Paired difference to the baseline {result['baseline']}")
        rep.table(tables[1])
    rep.text(footnote(result["spike"], result["baseline"]))
    rep.text("Loss spikes: a step whose loss exceeds {factor} × the median of the previous {window} losses and that "
             "median by at least {min_rise}; consecutive spike steps count as one.".format(**result["spike"]))
    rep.heading("Curves")
    rep.plot(plot, f"{plot.name}: the runs' curves", plots=plots)
    rep.heading("Every seed")
    rep.table(per_seed_table(result["runs"]))
    rep.write(path)
