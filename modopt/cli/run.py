"""The training loop behind `modopt run`: metrics, checkpoints, bit-exact resume.

A run directory holds:

* `config.yaml`: the resolved experiment (every default written out);
* `metrics.jsonl`: one JSON object per step (deterministic: no timings);
* `timing.jsonl`: wall-clock seconds per step (kept apart so that the same
  config and seed give byte-identical `metrics.jsonl`);
* `summary.json`: final/best loss, loss spikes, % of steps clipped, time per step;
* `loss.png`, `grad_norm.png` (with matplotlib);
* `checkpoint.pt`: model, optimizer, RNG state and step; `--resume` continues from it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from ..config import ConfigError
from ..core.keys import split_value_key
from ..functional import grad_norm
from .experiment import Experiment, experiment_from_data
from .tasks import make_task

RUN_FILES = ("config.yaml", "metrics.jsonl", "timing.jsonl", "summary.json", "checkpoint.pt", "loss.png", "grad_norm.png")

#: loss spikes: a step whose loss exceeds `SPIKE_FACTOR` x the median of the previous
#: `SPIKE_WINDOW` losses and that median by at least `SPIKE_MIN_RISE`;
#: consecutive spike steps count as one spike.
SPIKE_WINDOW = 20
SPIKE_FACTOR = 1.5
SPIKE_MIN_RISE = 0.1


class RunInterrupted(Exception):
    """Raised by `stop_after`: the run stopped as if killed (for resume tests)."""


# --- determinism -------------------------------------------------------------------------
@contextlib.contextmanager
def deterministic(threads: int) -> Iterator[None]:
    """Single-threaded (by default), deterministic torch ops; restores the previous settings."""
    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det, warn_only=old_warn)


# --- telemetry ----------------------------------------------------------------------------
def _num(x: Any) -> float | None:
    """A finite float, or None (JSON null) for inf/NaN."""
    v = float(x)
    return v if math.isfinite(v) else None


def step_telemetry(stats: dict[str, torch.Tensor], pre_norm: float) -> dict[str, Any]:
    """Clip scale / clipped / skipped of one step from `opt.stats`.

    `clip_scale` is the product of the global-scope `scale` telemetry of the
    pipeline's transforms (1 if none records one); `clipped` is true when any
    transform reports a clipped segment; `post_clip_norm = grad_norm * clip_scale`.
    """
    scale = 1.0
    clipped = False
    for key, v in stats.items():
        name = (split_value_key(key) or (None, key))[1]
        if not isinstance(v, torch.Tensor):
            continue
        if name == "scale" and v.numel() == 1:
            scale *= float(v)
        elif name == "clipped":
            clipped = clipped or bool(v.any())
    skipped = bool(stats["skipped"]) if "skipped" in stats else False
    return {
        "post_clip_norm": _num(pre_norm * scale) if not skipped else 0.0,
        "clip_scale": _num(scale),
        "clipped": clipped,
        "skipped": skipped,
    }


def count_spikes(
    losses: list[float | None], window: int = SPIKE_WINDOW, factor: float = SPIKE_FACTOR, min_rise: float = SPIKE_MIN_RISE
) -> list[int]:
    """Indices where a loss spike starts (see `SPIKE_FACTOR`); a non-finite loss is a spike."""
    starts: list[int] = []
    prev = False
    for i in range(window, len(losses)):
        past = [x for x in losses[i - window : i] if x is not None]
        x = losses[i]
        if not past:
            now = x is None
        else:
            med = statistics.median(past)
            now = x is None or (x > factor * med and x - med >= min_rise)
        if now and not prev:
            starts.append(i)
        prev = now
    return starts


def summarize(name: str, metrics: list[dict], times: list[float], spike_kw: dict | None = None) -> dict[str, Any]:
    """The `summary.json` of a run from its metrics and step times."""
    losses = [m["loss"] for m in metrics]
    finite = [x for x in losses if x is not None]
    tail = max(1, len(losses) // 20)
    last = [x for x in losses[-tail:] if x is not None]
    evals = [(m["step"], m["eval_loss"]) for m in metrics if "eval_loss" in m]
    use_eval = len(evals) == len(metrics) and len(metrics) > 0
    series = [e for _, e in evals] if use_eval else losses
    spikes = count_spikes(series, **(spike_kw or {}))
    n = len(metrics)
    out = {
        "name": name,
        "steps": n,
        "final_loss": statistics.fmean(last) if last else None,
        "final_loss_window": tail,
        "best_loss": min(finite) if finite else None,
        "final_eval_loss": evals[-1][1] if evals else None,
        "best_eval_loss": min((e for _, e in evals if e is not None), default=None),
        "loss_spikes": len(spikes),
        "spike_steps": [metrics[i]["step"] for i in spikes],
        "spike_series": "eval_loss" if use_eval else "loss",
        "clipped_pct": 100.0 * sum(m["clipped"] for m in metrics) / n if n else 0.0,
        "skipped_steps": sum(m["skipped"] for m in metrics),
        "max_grad_norm": max((m["grad_norm"] for m in metrics if m["grad_norm"] is not None), default=None),
        "time_per_step_ms": 1000.0 * statistics.fmean(times) if times else None,
    }
    return out


# --- progress -------------------------------------------------------------------------------
class Progress:
    """A one-line progress display on stderr (redrawn on a terminal, a line per 10% otherwise)."""

    def __init__(self, total: int, start: int, label: str, enabled: bool = True, stream=None):
        self.total, self.start, self.label = total, start, label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.last_draw = 0.0
        self.every = max(1, (total - start) // 10)

    def update(self, step: int, loss: float | None) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        done = step - self.start
        if self.tty:
            if now - self.last_draw < 0.2 and step != self.total:
                return
        elif done % self.every and step != self.total:
            return
        self.last_draw = now
        rate = done / max(now - self.t0, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else 0.0
        width = 24
        fill = int(width * step / self.total)
        bar = "#" * fill + "." * (width - fill)
        loss_s = f"{loss:.4f}" if loss is not None else "nan"
        line = f"{self.label} [{bar}] {step}/{self.total} loss {loss_s} {rate:.1f} it/s eta {eta:.0f}s"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# --- the run -------------------------------------------------------------------------------
def _read_jsonl(path: Path, upto: int) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row["step"] <= upto:
                rows.append(row)
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def check_dir(out: Path, force: bool) -> None:
    """Refuse a non-empty `out` unless `force` (nothing is created or removed)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise ConfigError(f"{out} exists and is not empty; use --resume {out} to continue it, or --force to overwrite")


def prepare_dir(out: Path, force: bool) -> None:
    """Create `out`; refuse a non-empty directory unless `force` (then clear the run files)."""
    check_dir(out, force)
    if out.exists() and any(out.iterdir()):
        for name in RUN_FILES:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def load_run_config(out: Path, trust_imports: bool = False) -> Experiment:
    from ..config import read_file

    path = out / "config.yaml"
    if not path.exists():
        raise ConfigError(f"{out}: not a run directory (no config.yaml)")
    return experiment_from_data(read_file(path), str(path), trust_imports)


def start_run(exp: Experiment, pipeline: Any = None, trust_imports: bool = False) -> tuple[Any, Any]:
    """The task and the optimizer of `exp` exactly as `modopt run` builds them; writes nothing.

    `pipeline` (default `exp.optimizer`) is the pipeline to build. Call it
    inside `deterministic()` after seeding, as the run does. Errors are
    `ConfigError` (a bad task name, options or optimizer) or the task's own.
    """
    pipe = pipeline if pipeline is not None else exp.optimizer
    try:
        task = make_task(exp.task.name, dict(exp.task.options), exp.train.seed, trust_imports)
    except PermissionError as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None
    try:
        opt = pipe.build(list(task.model.named_parameters()))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"optimizer: {e}") from None
    return task, opt


def check_experiment(exp: Experiment, trust_imports: bool = False) -> None:
    """Everything `modopt run` checks before its first step, for every pipeline of `exp` (`modopt validate`)."""
    with deterministic(exp.train.threads):
        for label, pipe in exp.pipelines().items():
            torch.manual_seed(exp.train.seed)
            try:
                start_run(exp, pipe, trust_imports)
            except ConfigError as e:
                raise ConfigError(f"optimizer {label}: {e}" if len(exp.pipelines()) > 1 else str(e)) from None


def run_experiment(
    exp: Experiment,
    out: str | Path,
    *,
    resume: bool = False,
    trust_imports: bool = False,
    stop_after: int | None = None,
    progress: bool = True,
    plots: bool | None = None,
    log=print,
    force: bool | None = None,
) -> dict[str, Any]:
    """Train `exp` (one optimizer) writing the run directory `out`; return the summary.

    With `resume` the run continues from `out/checkpoint.pt` (if there is
    none, it starts over); metrics logged after the checkpoint are dropped and
    recomputed, so the result equals an uninterrupted run. `stop_after=K`
    stops after step K as if the process had been killed (raises
    `RunInterrupted`); only checkpoints already written survive.

    A new run builds its task and optimizer before writing anything, so a
    failed start leaves no run directory; a run that fails before its first
    checkpoint removes the files it wrote (a re-run starts clean). `force`:
    None uses `out` as it is (created if missing); False refuses a
    non-empty `out`; True clears its run files first.
    """
    out = Path(out)
    wrote = {"dir": False, "files": False}
    try:
        return _run(exp, out, resume, trust_imports, stop_after, progress, plots, log, force, wrote)
    except RunInterrupted:
        raise
    except Exception:
        if wrote["files"] and not (out / "checkpoint.pt").exists():
            _remove_run_files(out, remove_dir=wrote["dir"])
        raise


def _remove_run_files(out: Path, remove_dir: bool) -> None:
    """Undo a run that failed before its first checkpoint: its files, and the directory if it made it."""
    for name in (*RUN_FILES, "checkpoint.tmp"):
        p = out / name
        if p.is_file():
            p.unlink()
    if remove_dir and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def _run(exp, out, resume, trust_imports, stop_after, progress, plots, log, force, wrote) -> dict[str, Any]:
    if exp.optimizer is None:
        raise ConfigError("run_experiment needs an experiment with a single optimizer (select a variant)")
    tr = exp.train
    ckpt_path = out / "checkpoint.pt"
    with deterministic(tr.threads):
        torch.manual_seed(tr.seed)
        # the task and optimizer first: a start that fails writes nothing
        task, opt = start_run(exp, trust_imports=trust_imports)
        model = task.model
        if not resume:
            wrote["dir"] = not out.exists()
            if force is None:
                out.mkdir(parents=True, exist_ok=True)
            else:
                prepare_dir(out, force)
            wrote["files"] = True
            (out / "config.yaml").write_text(exp.to_yaml())
        base_lrs = [g.get("lr") for g in opt.param_groups]
        sched = tr.schedule.build(opt, tr.steps)
        start = 0
        if resume and ckpt_path.exists():
            ckpt = torch.load(ckpt_path, weights_only=True)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            torch.set_rng_state(ckpt["rng"])
            start = int(ckpt["step"])
            log(f"resuming {out} from step {start}")
            if sched is not None:  # the same scheduler, replayed to the checkpoint's step
                for g, base in zip(opt.param_groups, base_lrs):
                    g["lr"] = base
                    g.pop("initial_lr", None)
                sched = tr.schedule.build(opt, tr.steps)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    for _ in range(start):
                        sched.step()
        metrics = _read_jsonl(out / "metrics.jsonl", start)
        timing = _read_jsonl(out / "timing.jsonl", start)
        if len(metrics) != start:
            raise ConfigError(f"{out}/metrics.jsonl has {len(metrics)} steps up to the checkpoint's step {start}")
        _write_jsonl(out / "metrics.jsonl", metrics)
        _write_jsonl(out / "timing.jsonl", timing)
        params = [p for p in model.parameters() if p.requires_grad]
        bar = Progress(tr.steps, start, exp.name, enabled=progress and tr.steps - start >= 50)
        mf = (out / "metrics.jsonl").open("a")
        tf = (out / "timing.jsonl").open("a")
        try:
            for step in range(start + 1, tr.steps + 1):
                t0 = time.perf_counter()
                model.train()
                batch = task.get_batch(step, tr.batch_size)
                opt.zero_grad(set_to_none=True)
                loss = task.loss_fn(model, batch)
                loss.backward()
                pre = float(grad_norm(params))
                opt.step()
                row: dict[str, Any] = {"step": step, "loss": _num(loss.detach())}
                row["lr"] = opt.param_groups[0].get("lr")
                if sched is not None:
                    sched.step()
                row["grad_norm"] = _num(pre)
                row.update(step_telemetry(opt.stats, pre))
                if task.eval_fn is not None and (
                    (tr.eval_every and step % tr.eval_every == 0) or step == tr.steps
                ):
                    model.eval()
                    row["eval_loss"] = _num(task.eval_fn(model))
                dt = time.perf_counter() - t0
                metrics.append(row)
                mf.write(json.dumps(row) + "\n")
                tf.write(json.dumps({"step": step, "time_s": dt}) + "\n")
                if (tr.checkpoint_every and step % tr.checkpoint_every == 0) or step == tr.steps:
                    mf.flush()
                    tf.flush()
                    _atomic_save(
                        {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()},
                        ckpt_path,
                    )
                bar.update(step, row["loss"])
                if stop_after is not None and step >= stop_after and step < tr.steps:
                    raise RunInterrupted(f"stopped after step {step} (--stop-after)")
        finally:
            mf.close()
            tf.close()
            bar.close()
    times = [r["time_s"] for r in _read_jsonl(out / "timing.jsonl", tr.steps)]
    summary = summarize(exp.name, metrics, times)
    summary["task"] = exp.task.name
    summary["run_dir"] = str(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if plots if plots is not None else exp.output.plots:
        from .plots import plot_run

        pipeline = " -> ".join(type(t).__name__ for t in exp.optimizer.transforms)
        msg = plot_run(out, metrics, exp.name, pipeline=pipeline, summary=summary)
        if msg:
            log(msg)
    return summary
