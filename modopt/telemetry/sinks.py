"""Where a `History`'s rows go: JSON lines, CSV, TensorBoard, Weights & Biases.

A sink is any object with `write(rows)` (and optionally `close()`); the history calls
it only when it reads back (`flush()`, or every `every` steps), never per step. Each row
is `{"step": n, column: value, ...}` (see `modopt.telemetry.history`). Loggers that mix
modopt's values with others' get them as `modopt/<column>` (`tag`).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

#: the prefix of every value a sink writes into a shared logger (TensorBoard, W&B, Lightning, HF)
PREFIX = "modopt/"


def tag(column: str) -> str:
    """The logger name of a row column: `"grad_norm"` -> `"modopt/grad_norm"`,
    `"0:ZClip/norm"` -> `"modopt/0:ZClip/norm"`."""
    return PREFIX + column


def json_value(v: Any) -> Any:
    """A finite float as it is; inf/NaN as None (JSON null); ints and bools unchanged."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def tagged(row: dict[str, Any]) -> dict[str, float]:
    """A row's values under their logger names (`tag`), without `step`."""
    return {tag(k): v for k, v in row.items() if k != "step"}


class JsonlSink:
    """One JSON object per row (`{"step": 3, "grad_norm": 1.2, ...}`), appended to `path`;
    inf/NaN are written as null."""

    def __init__(self, path: str | Path):
        self.path: Path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Append one line per row."""
        with self.path.open("a") as f:
            for r in rows:
                f.write(json.dumps({k: json_value(v) for k, v in r.items()}) + "\n")


class CsvSink:
    """Rows as CSV with a header (`step` first, then the columns in the order they appeared).
    A column that appears later rewrites the file with the wider header; a row without a
    column leaves its cell empty. inf/NaN are written as `inf`/`nan`."""

    def __init__(self, path: str | Path):
        self.path: Path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fields: list[str] = ["step"]
        if self.path.exists() and self.path.stat().st_size:
            with self.path.open(newline="") as f:
                header = next(csv.reader(f), None)
            if header:
                if header[0] != "step":
                    raise ValueError(f"CsvSink: {self.path} exists and is not a telemetry CSV (its first column is "
                                     f"{header[0]!r}, not 'step')")
                self.fields = header

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Append the rows (rewriting the file first when a row has a new column)."""
        new = [k for r in rows for k in r if k not in self.fields]
        if new:
            self.fields += list(dict.fromkeys(new))
            old = []
            if self.path.exists() and self.path.stat().st_size:
                with self.path.open(newline="") as f:
                    old = list(csv.DictReader(f))
            with self.path.open("w", newline="") as f:
                w = csv.DictWriter(f, self.fields, restval="")
                w.writeheader()
                w.writerows(old)
        elif not self.path.exists() or not self.path.stat().st_size:
            with self.path.open("w", newline="") as f:
                csv.DictWriter(f, self.fields).writeheader()
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, self.fields, restval="").writerows(rows)


class TensorBoardSink:
    """Every value as a TensorBoard scalar `modopt/<column>` at its row's step, through
    `torch.utils.tensorboard.SummaryWriter` (needs the `tensorboard` package:
    `pip install 'torch-modopt[tensorboard]'`). Give `log_dir` or a `writer` of your own."""

    def __init__(self, log_dir: str | Path | None = None, writer: Any = None):
        if (log_dir is None) == (writer is None):
            raise TypeError("TensorBoardSink: give log_dir or writer (one of them)")
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("TensorBoardSink needs the tensorboard package: pip install 'torch-modopt[tensorboard]'") from e
            writer = SummaryWriter(log_dir=str(log_dir))
            self._own = True
        else:
            self._own = False
        self.writer = writer

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Add every value of every row as a scalar at the row's step, then flush the writer."""
        for r in rows:
            for k, v in tagged(r).items():
                self.writer.add_scalar(k, v, global_step=r["step"])
        self.writer.flush()

    def close(self) -> None:
        """Close the writer this sink made (a writer given to it stays open)."""
        if self._own:
            self.writer.close()


class WandbSink:
    """Every row as one `run.log(...)` of `modopt/<column>` values, with `modopt/step` as their
    x-axis (`define_metric`), so rows that arrive late never clash with W&B's own step.
    `run`: a `wandb` run (default: the current `wandb.run`)."""

    def __init__(self, run: Any = None):
        if run is None:
            import wandb

            run = wandb.run
            if run is None:
                raise RuntimeError("WandbSink: no wandb run; call wandb.init() first or pass run=")
        self.run = run
        run.define_metric(tag("step"))
        run.define_metric(PREFIX + "*", step_metric=tag("step"))

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Log each row, with its step as `modopt/step`."""
        for r in rows:
            self.run.log({tag("step"): r["step"], **tagged(r)})
