"""`modopt sweep`: an experiment over a grid of settings × seeds, resumable.

`--grid PATH=V1,V2,...` names a field of the experiment by its dotted path
(`optimizer.transforms.0.max_norm`, `train.steps`, `task.options.dim`; a number
indexes a list) and the values to try, each read as a YAML scalar (`0.5`,
`1e-3`, `null`, `true`, `cosine`). Several `--grid` options span their
Cartesian product. Every grid point is validated (the pydantic models, then
the task and the optimizer built as `modopt validate` does) before anything
runs; an invalid path or value is refused with the path in the message.

Each point × seed is a `modopt run` directory `OUT/<point>/seed-<S>/`, run in
this process one after the other, or `--jobs N` at a time in worker processes. A directory whose `summary.json` is complete for
the same resolved config is reused, anything else there is run again: a sweep
that was interrupted (or extended with more values or seeds) continues where
it stopped. The table, `sweep.json`, one plot per swept field (the metric
against the value, with intervals) and `report.html` are written to `OUT`;
`sweep.md`, `sweep.json` and `report.html` carry the provenance block
(`provenance.py`).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError
from ..core.configfile import load_yaml
from .compare import (
    METRICS, SCHEMA, TABLE, Job, Table, check_seeds, footnote, markdown, over_seeds, per_seed_table, pick_variants,
    pipeline_text, run_jobs, seed_record, seeded, seeds_of, spike_settings, summary_cells,
)
from .experiment import (INT64_MAX, NAME_MAX, SWEEP_MAX_RUNS, Experiment, apply_overrides, experiment_from_data,
                         load_experiment)
from .outfiles import refuse_links, write_text
from .plots import DEFAULT_DPI, FORMATS
from .provenance import KEY as PROVENANCE
from .provenance import markdown as provenance_markdown
from .provenance import provenance
from .run import METRIC_FIELDS, RUN_FILES, check_experiment, check_kind, load_run_config, make_dir, read_jsonl
from .stats import LEVEL, METHOD, MIN_SEEDS

#: paths (and what is under them) a grid may not sweep, and why
RESERVED = {
    "train.seed": "the seeds are --seeds",
    "train.seeds": "the seeds are --seeds",
    "name": "the name labels the runs",
    "variants": "choose one variant with --variant, then sweep optimizer.*",
}

#: the most runs (grid points x seeds) a sweep starts without `--max-runs`: every point is built and
#: checked before the first run, so a grid typed by mistake (100 values x 100) would otherwise hold the
#: command for hours before it said anything (the value lives beside the parser, which shows it)
MAX_RUNS = SWEEP_MAX_RUNS


def _err(*a: Any) -> None:
    print(*a, file=sys.stderr)


# --- the grid --------------------------------------------------------------------------------
def parse_value(text: str) -> Any:
    """A YAML scalar, read as config files are (`1e-3` is a float)."""
    try:
        value = load_yaml(text)
    except yaml.YAMLError:
        raise ValueError(f"{text!r} is not a YAML scalar (a number, null, true/false or a word)") from None
    if isinstance(value, (dict, list)):
        raise ValueError(f"{text!r} is not a YAML scalar (a number, null, true/false or a word)")
    return value


def _same(value: Any) -> Any:
    """A key equal for values a field takes as equal (1 and 1.0), not for true and 1."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ("number", float(value)) if number else json.dumps(value)


def parse_grid(specs: list[str]) -> list[tuple[str, list[Any], list[str]]]:
    """`[(path, values, raw texts)]` of the `--grid PATH=V1,V2,...` options."""
    grid: list[tuple[str, list[Any], list[str]]] = []
    for spec in specs:
        path, eq, rest = spec.partition("=")
        path = path.strip()
        if not eq or not path:
            raise ConfigError(f"--grid {spec}: expected PATH=V1,V2,... (e.g. optimizer.transforms.0.max_norm=0.5,1,2)")
        for key, why in RESERVED.items():
            if path == key or path.startswith(key + "."):
                raise ConfigError(f"--grid {path}: cannot be swept ({why})")
        if any(path == p for p, _, _ in grid):
            raise ConfigError(f"--grid {path}: given twice; put all its values in one --grid")
        raws = [r.strip() for r in rest.split(",")]
        if not rest.strip() or any(not r for r in raws):
            raise ConfigError(f"--grid {spec}: an empty value; give PATH=V1,V2,... with no empty entry")
        try:
            values = [parse_value(r) for r in raws]
        except ValueError as e:
            raise ConfigError(f"--grid {path}: {e}") from None
        if len({_same(v) for v in values}) != len(values):
            raise ConfigError(f"--grid {path}: a value is given twice ({rest})")
        grid.append((path, values, raws))
    return grid


def set_path(data: Any, path: str, value: Any) -> None:
    """Set the field at the dotted `path` of plain experiment data (dicts and lists) to `value`.

    Every part but the last must exist; the last may be a new key of a mapping
    (a field left at its default, a task option): the models then decide if it
    is a field. Errors name the path and what it has instead.
    """
    from ..core.transform import did_you_mean

    parts = path.split(".")
    node = data
    for i, part in enumerate(parts):
        here = ".".join(parts[:i]) or "the experiment"
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--grid {path}: {here} is a list of {len(node)}; '{part}' is not an index 0..{len(node) - 1}")
            key: Any = int(part)
        elif isinstance(node, dict):
            if part not in node and not (last and node is not data):
                raise ConfigError(f"--grid {path}: {here} has no {part!r}{did_you_mean(part, node)} "
                                  f"(it has: {', '.join(map(str, node)) or 'nothing'})")
            key = part
        else:
            raise ConfigError(f"--grid {path}: {here} is a value ({node!r}), not a mapping or a list")
        if last:
            node[key] = value
        else:
            node = node[key]


def _short_names(paths: list[str]) -> dict[str, str]:
    """The last part of each path, or the whole path where two share a last part."""
    last = [p.rsplit(".", 1)[-1] for p in paths]
    return {p: (n if last.count(n) == 1 else p) for p, n in zip(paths, last)}


def _dirname(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)


def _point_name(name: str, label: str) -> str:
    """A grid point's experiment name, `name[label]`, kept a plain name (`check_name`): a value with
    a path separator is spelt with `_`, and a label too long for the name becomes its digest."""
    import hashlib

    tag = _dirname(label)
    if len(name) + len(tag) + 2 > NAME_MAX:
        tag = hashlib.sha1(label.encode()).hexdigest()[:12]
    return f"{name[:NAME_MAX - len(tag) - 2]}[{tag}]"


def plan_sweep(exp: Experiment, grid: list[tuple[str, list[Any], list[str]]], trust_imports: bool) -> list[dict[str, Any]]:
    """Every grid point as `{label, values, raw, exp}`, each validated as `modopt validate` does; runs nothing."""
    base = exp.to_dict()
    base["train"].pop("seeds", None)
    for path, values, raws in grid:  # each value alone first: the message names that path and value
        for value, raw in zip(values, raws):
            data = json.loads(json.dumps(base))
            set_path(data, path, value)
            experiment_from_data(data, f"--grid {path}={raw}", trust_imports)
    short = _short_names([p for p, _, _ in grid])
    points = []
    total = math.prod(len(v) for _, v, _ in grid)
    if total > 200:  # (each point is built and validated: a large grid takes a while before the first run)
        _err(f"modopt sweep: checking {total} grid points before running any")
    for combo in itertools.product(*(list(zip(v, r)) for _, v, r in grid)):
        data = json.loads(json.dumps(base))
        for (path, _, _), (value, _) in zip(grid, combo):
            set_path(data, path, value)
        label = ",".join(f"{short[p]}={raw}" for (p, _, _), (_, raw) in zip(grid, combo))
        where = "--grid " + " ".join(f"{p}={raw}" for (p, _, _), (_, raw) in zip(grid, combo))
        data["name"] = _point_name(exp.name, label)
        one = experiment_from_data(data, where, trust_imports)
        try:
            check_experiment(one, trust_imports)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        points.append({"label": label, "dir": _dirname(label), "values": {p: v for (p, _, _), (v, _) in zip(grid, combo)},
                       "raw": {p: r for (p, _, _), (_, r) in zip(grid, combo)}, "exp": one})
    dirs = [p["dir"] for p in points]
    if len(set(dirs)) != len(dirs):
        raise ConfigError("--grid: two grid points map to one directory name; use values that differ in letters or digits")
    return points


def _check_size(grid: list[tuple[str, list[Any], list[str]]], n_seeds: int, max_runs: int, n_variants: int = 1) -> None:
    """Refuse a sweep of more than `max_runs` runs, saying how many the grid makes."""
    sizes = [len(v) for _, v, _ in grid]
    points = math.prod(sizes)
    runs = points * n_seeds * n_variants
    if runs > max_runs:
        shape = " x ".join(map(str, sizes)) + (f" = {points}" if len(sizes) > 1 else "")
        variants = f" x {n_variants} variants" if n_variants > 1 else ""
        raise ConfigError(
            f"--grid: {shape} grid points{variants} x {n_seeds} seed{'s' if n_seeds != 1 else ''} = {runs} runs, more than "
            f"the {max_runs} a sweep runs without --max-runs; nothing was checked, run or written (narrow the "
            f"grid, or pass --max-runs {runs} to run them all)")


# --- resume ----------------------------------------------------------------------------------
def finished(rdir: Path, exp: Experiment, trust_imports: bool = False) -> bool:
    """Whether `rdir` holds a complete run of `exp`: its `config.yaml` is `exp`, `summary.json`
    is complete and `metrics.jsonl` has every step. Anything else (a partial run, another
    config, damage) is not finished: the run is done again."""
    try:
        summary = json.loads((rdir / "summary.json").read_text())
        same = load_run_config(rdir, trust_imports).to_dict() == exp.to_dict()
        rows = read_jsonl(rdir / "metrics.jsonl", INT64_MAX, METRIC_FIELDS) if same else []
    except (OSError, ValueError):  # ConfigError is a ValueError
        return False
    steps = exp.train.steps
    return same and isinstance(summary, dict) and summary.get("steps") == steps and [r["step"] for r in rows] == list(range(1, steps + 1))


# --- sweep -----------------------------------------------------------------------------------
def sweep(
    config: str,
    grid_specs: list[str],
    out: Path,
    *,
    variant: str | list[str] | None = None,
    overrides: Any = None,
    seeds: list[int] | None = None,
    jobs: int = 1,
    metric: str = "final_loss",
    spike_kw: dict[str, Any] | None = None,
    trust_imports: bool = False,
    progress: bool = True,
    plots: bool = True,
    command: str | None = None,
    max_runs: int = MAX_RUNS,
    plot_format: str = "png",
    plot_dpi: int = DEFAULT_DPI,
) -> str:
    """Run the grid × seeds of `config` under `out` (reusing finished runs); write and return the table.

    `variant`: the variant of a config with variants, or a list of them (`--variant A B`): the grid is
    then run for each, its points labelled `variant=A,...`. A sweep of more than `max_runs` runs (grid
    points x variants x seeds) is refused before any point is checked. The plots are written as
    `plot_format` at `plot_dpi`."""
    from .plots import check_format

    if metric not in METRICS:
        raise ConfigError(f"--metric {metric}: not a metric; one of {', '.join(METRICS)}")
    try:
        check_format(plot_format, plot_dpi)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_seeds(seeds)
    if not grid_specs:
        raise ConfigError("give at least one --grid PATH=V1,V2,...")
    grid = parse_grid(grid_specs)
    names = [variant] if isinstance(variant, str) else variant
    loaded = load_experiment(config, trust_imports)
    chosen = pick_variants({str(config): loaded}, list(names))[str(config)] if names else [None]
    exps = {v: loaded.select(v) for v in chosen}
    if overrides is not None:
        exps = {v: apply_overrides(e, overrides) for v, e in exps.items()}
    exp = next(iter(exps.values()))
    several = len(exps) > 1
    ss = seeds_of(exp, seeds, getattr(overrides, "seed", None))
    _check_size(grid, len(ss), max_runs, len(exps))
    points = []
    for v, e in exps.items():
        for pt in plan_sweep(e, grid, trust_imports):
            if several:  # the variant is the grid's first dimension
                pt.update(variant=v, label=f"variant={v},{pt['label']}", dir=_dirname(f"variant={v},{pt['label']}"))
            points.append(pt)
    check_kind(out, "sweep")
    refuse_links(out, [*_sweep_files(grid), *(Path(pt["dir"]) / f"seed-{s}" / f for pt in points for s in ss
                                              for f in RUN_FILES)])
    make_dir(out)
    todo, reused = [], 0
    for pt in points:
        for s in ss:
            job = Job(pt["label"], s, seeded(pt["exp"], s), out / pt["dir"] / f"seed-{s}")
            if finished(job.dir, job.exp, trust_imports):
                reused += 1
            else:
                todo.append(job)
    _err(f"modopt sweep: {len(points)} grid points x {len(ss)} seeds = {len(points) * len(ss)} runs: "
         f"{len(todo)} to run, {reused} finished already (reused)")
    run_jobs(todo, n_jobs=jobs, trust_imports=trust_imports, progress=progress, plots=plots, tool="sweep",
             plot_as=(plot_format, plot_dpi))
    for pt in points:
        recs = [seed_record(pt["label"], s, out / pt["dir"] / f"seed-{s}", pt["exp"].task.name, spike_kw)[0] for s in ss]
        pt.update(seeds=ss, per_seed=recs, summary=over_seeds(recs))
    resolved = {"experiment": exp.to_dict(), "grid": [{"path": p, "values": v} for p, v, _ in grid], "seeds": ss,
                "metric": metric, "spike": spike_settings(spike_kw)}
    if several:
        del resolved["experiment"]
        resolved = {"experiments": {v: e.to_dict() for v, e in exps.items()}, **resolved}
    result = {
        "schema": SCHEMA, "kind": "sweep", "command": command, "config": str(config),
        "variant": None if several else chosen[0], "variants": chosen if names else None,
        "pipeline": {v: pipeline_text(e) for v, e in exps.items()} if several else pipeline_text(exp),
        "grid": resolved["grid"], "seeds": ss, "metric": metric,
        "interval": {"method": METHOD, "level": LEVEL, "min_seeds": MIN_SEEDS}, "spike": resolved["spike"],
        "plots": {"format": plot_format, "dpi": plot_dpi} if plots else None,
        "points": [{"label": p["label"], **({"variant": p["variant"]} if several else {}), "dir": str(out / p["dir"]),
                    "values": p["values"], "seeds": p["seeds"], "summary": p["summary"], "per_seed": p["per_seed"]}
                   for p in points],
        PROVENANCE: provenance(resolved),
    }
    table = sweep_table(grid, points, metric)
    text = markdown(table) + "\n\n" + footnote(result["spike"])
    write_text(out / "sweep.md", text + "\n\n" + provenance_markdown(result[PROVENANCE]) + "\n")
    write_text(out / "sweep.json", json.dumps(result, indent=2) + "\n")
    for stale in _sweep_files(grid):  # an earlier sweep's plots in another format are not this one's
        if stale.startswith("sweep-") and (out / stale).is_file():
            (out / stale).unlink()
    pngs = _sweep_plots(out, grid, points, metric, plot_format, plot_dpi) if plots else {}
    _sweep_report(out / "report.html", result, table, pngs, grid, plots, plot_format)
    written = ", ".join(str(out / f) for f in ("sweep.md", "sweep.json", *pngs, "report.html") if (out / f).exists())
    _err(f"modopt sweep: wrote {written}")
    return text


def _plot_name(short: str, fmt: str = "png") -> str:
    return f"sweep-{_dirname(short)}.{fmt}"


def _sweep_files(grid: list[tuple[str, list[Any], list[str]]]) -> list[str]:
    """The files a sweep writes into OUT (beside a directory per grid point): its plots in any of the
    formats (`--format` picks one)."""
    short = _short_names([p for p, _, _ in grid])
    return ["sweep.md", "sweep.json", *(_plot_name(short[p], f) for p, _, _ in grid for f in FORMATS), "report.html"]


def _columns(metric: str) -> tuple[str, ...]:
    """The table's metrics: `TABLE`, with the swept metric first when it is not among them."""
    return TABLE if metric in TABLE else (metric, *TABLE)


def sweep_table(grid: list[tuple[str, list[Any], list[str]]], points: list[dict[str, Any]], metric: str) -> Table:
    """The sweep's table `(head, rows)`: per grid point its swept values, its number of seeds, then each metric
    over the seeds (`metric` first when it is not one of the usual columns)."""
    short = _short_names([p for p, _, _ in grid])
    cols = _columns(metric)
    several = any("variant" in p for p in points)  # a sweep of several variants: their names first
    head = [*(["variant"] if several else []), *(short[p] for p, _, _ in grid), "seeds", *(METRICS[k][0] for k in cols)]
    body = [[*([p["variant"]] if several else []), *(p["raw"][path] for path, _, _ in grid), str(len(p["seeds"])),
             *summary_cells(p["summary"], cols)] for p in points]
    return head, body


def _sweep_plots(out: Path, grid: list, points: list[dict], metric: str, fmt: str = "png",
                 dpi: int = DEFAULT_DPI) -> list[str]:
    """`sweep-<field>.<fmt>` per swept field (a line per variant and setting of the other fields); the names
    of the files written."""
    from .plots import plot_sweep

    short = _short_names([p for p, _, _ in grid])
    written = []
    for path, _, _ in grid:
        lines: dict[str, list] = {}
        for p in points:
            others = [f"{short[q]}={p['raw'][q]}" for q, _, _ in grid if q != path]
            if "variant" in p:
                others.insert(0, p["variant"])
            lines.setdefault(",".join(others), []).append((p["values"][path], p["summary"][metric]))
        name = _plot_name(short[path], fmt)
        msg = plot_sweep(out / name, path, METRICS[metric][0], lines, dpi)
        if msg:
            _err(msg)
            break
        written.append(name)
    return written


def _sweep_report(path: Path, result: dict, table: Table, pngs: list[str], grid: list, plots: bool,
                  fmt: str = "png") -> None:
    from .report import Report

    rep = Report("modopt sweep", command=result["command"], provenance=result[PROVENANCE])
    if isinstance(result["pipeline"], dict):
        what = " (variants " + "; ".join(f"{v}: {p}" for v, p in result["pipeline"].items()) + ")"
    else:
        what = (f" (variant {result['variant']})" if result["variant"] else "") + f": {result['pipeline']}"
    rep.text(f"{result['config']}{what}; seeds {', '.join(map(str, result['seeds']))}")
    rep.heading("Summary over seeds")
    rep.table(table)
    rep.text(footnote(result["spike"]))
    rep.heading(f"{METRICS[result['metric']][0]} against each swept field")
    short = _short_names([p for p, _, _ in grid])
    for p, _, _ in grid:
        rep.plot(path.parent / _plot_name(short[p], fmt), f"{result['metric']} against {p}", plots=plots)
    rep.heading("Every seed")
    rows = [{"name": pt["label"], "per_seed": pt["per_seed"]} for pt in result["points"]]
    rep.table(per_seed_table(rows))
    rep.write(path)
