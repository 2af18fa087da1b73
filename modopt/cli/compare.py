"""`modopt compare`: run several experiments / variants and tabulate them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ..config import ConfigError
from .experiment import apply_overrides, load_experiment
from .run import prepare_dir, run_experiment, summarize

COLUMNS = [
    ("run", "name", "s"),
    ("final loss", "final_loss", ".4g"),
    ("best loss", "best_loss", ".4g"),
    ("eval loss", "final_eval_loss", ".4g"),
    ("loss spikes", "loss_spikes", "d"),
    ("% clipped", "clipped_pct", ".1f"),
    ("max grad norm", "max_grad_norm", ".3g"),
    ("ms/step", "time_per_step_ms", ".2f"),
]


def format_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of summaries (readable in a terminal too)."""
    head = [c[0] for c in COLUMNS]
    body = [[("-" if r.get(k) is None else format(r[k], f)) for _, k, f in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    sep = "|" + "|".join(("-" * (w + 2)) if i == 0 else ("-" * (w + 1) + ":") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep, *(line(b) for b in body)])


def compare(
    configs: list[str],
    out: Path,
    *,
    overrides: Any = None,
    spike_kw: dict | None = None,
    trust_imports: bool = False,
    progress: bool = True,
    plots: bool = True,
) -> str:
    """Run every experiment (every variant of each) under `out`; write and return the table."""

    runs = []
    labels: set[str] = set()
    for path in configs:
        exp = load_experiment(path, trust_imports)
        variants = [None] if exp.optimizer is not None else list(exp.variants or {})
        for v in variants:
            one = exp.select(v)
            if overrides is not None:
                one = apply_overrides(one, overrides)
            label = one.name
            if label in labels:
                label = f"{Path(path).stem}-{label}"
            if label in labels:
                raise ConfigError(f"two runs are named {label!r}; give the configs distinct names")
            labels.add(label)
            runs.append((label, one))
    prepare_dir(out, force=True)
    rows = []
    curves: dict[str, list[dict]] = {}
    for label, exp in runs:
        rdir = out / label
        prepare_dir(rdir, force=True)
        print(f"modopt compare: {label} -> {rdir}", file=sys.stderr)
        s = run_experiment(exp, rdir, trust_imports=trust_imports, progress=progress, plots=plots,
                           log=lambda *a: print(*a, file=sys.stderr))
        metrics = [json.loads(x) for x in (rdir / "metrics.jsonl").read_text().splitlines() if x]
        if spike_kw:
            times = [json.loads(x)["time_s"] for x in (rdir / "timing.jsonl").read_text().splitlines() if x]
            s = {**summarize(label, metrics, times, spike_kw), "task": s["task"], "run_dir": s["run_dir"]}
        s["name"] = label
        rows.append(s)
        curves[label] = metrics
    table = format_table(rows)
    (out / "compare.md").write_text(table + "\n")
    (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    if plots:
        from .plots import plot_compare

        names = {}
        for (label, exp), row in zip(runs, rows):
            pipe = " -> ".join(type(t).__name__ for t in exp.optimizer.transforms)
            names[label] = f"{label}: {pipe} ({row['loss_spikes']} spike{'' if row['loss_spikes'] == 1 else 's'})"
        msg = plot_compare(out / "compare.png", curves, labels=names)
        if msg:
            print(msg, file=sys.stderr)
    written = ", ".join(str(out / f) for f in ("compare.md", "compare.json", "compare.png") if (out / f).exists())
    print(f"modopt compare: wrote {written}", file=sys.stderr)
    return table
