"""The training loop behind `modopt run`: metrics, checkpoints, bit-exact resume.

A run directory holds:

* `config.yaml`: the resolved experiment (every default written out);
* `metrics.jsonl`: one JSON object per step (deterministic: no timings);
* `timing.jsonl`: wall-clock seconds per step (kept apart so that the same
  config and seed give byte-identical `metrics.jsonl`);
* `summary.json`: final/best loss, loss spikes, % of steps clipped, time per step;
* `loss.png`, `grad_norm.png` (with matplotlib);
* `checkpoint.pt`: model, optimizer, RNG state and step; `--resume` continues from it.

`--resume` checks the directory before it changes anything in it: a torn last
line of `metrics.jsonl` or `timing.jsonl` (what a kill during a write leaves)
is dropped with a notice; any other damage (a line torn in the middle, a
`checkpoint.pt` that is not a torch checkpoint or lacks an entry, a
`config.yaml` that does not read) is a `ConfigError` naming the file. A
checkpoint is loaded with `weights_only=True` only: one that holds anything
else is refused, never loaded another way.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import shutil
import statistics
import sys
import time
import warnings
import zipfile
from collections.abc import Mapping
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
#: the entries of a metrics row that the summary and the plots read, and what each holds
#: ("number": a float, an int or null); a key ending in "?" may be absent
METRIC_FIELDS = {"step": "int", "loss": "number", "grad_norm": "number", "post_clip_norm": "number",
                 "clipped": "bool", "skipped": "bool", "eval_loss?": "number"}
TIMING_FIELDS = {"step": "int", "time_s": "real"}


_KIND_WORDS = {"int": "an integer", "number": "a number or null", "real": "a number", "bool": "true or false"}


def _field_ok(value: Any, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "real":
        return isinstance(value, (int, float))
    return value is None or isinstance(value, (int, float))


def _parse_row(raw: bytes, fields: dict[str, str]) -> tuple[dict | None, str]:
    """`(row, "")` for a good JSON-lines row, else `(None, what is wrong)`."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except ValueError:
        return None, "not valid JSON"
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not an object"
    for key, kind in fields.items():
        key, optional = key.rstrip("?"), key.endswith("?")
        if key not in row:
            if optional:
                continue
            return None, f"no {key!r}"
        if not _field_ok(row[key], kind):
            return None, f"{key!r} is {row[key]!r}, not {_KIND_WORDS[kind]}"
    return row, ""


def read_jsonl(path: Path, upto: int, fields: dict[str, str] | None = None, log=None) -> list[dict]:
    """The rows with `step <= upto` of a JSON-lines file of a run (`metrics.jsonl`, `timing.jsonl`).

    A last line without its newline that does not parse is what a kill during
    a write leaves: it is dropped, with a notice through `log`. Any other bad
    line (not a JSON object with the `fields`) is a `ConfigError` naming the
    file and the line. A missing file has no rows.
    """
    fields = fields if fields is not None else {"step": "int"}
    if not path.exists():
        return []
    if not path.is_file():
        raise ConfigError(f"{path}: not a file")
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    rows = []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        row, why = _parse_row(raw, fields)
        if row is None:
            raise ConfigError(
                f"{path}, line {i}: damaged ({why}); only a torn last line (what a kill during a write "
                "leaves) is dropped on resume"
            )
        rows.append(row)
    if tail.strip():
        row, why = _parse_row(tail, fields)
        if row is not None:
            rows.append(row)  # a whole row that only lacks its newline
        elif log is not None:
            log(f"{path}: dropped its torn last line (line {len(lines) + 1}, {len(tail)} bytes, {why}): "
                "the run was killed while writing it")
    return [r for r in rows if r["step"] <= upto]


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
    """The experiment of the run directory `out` (its `config.yaml`); a damaged file is a `ConfigError`."""
    from .experiment import read_config

    path = out / "config.yaml"
    if not out.is_dir():
        raise ConfigError(f"{out}: not a run directory ({'no such directory' if not out.exists() else 'not a directory'})")
    if not path.exists():
        raise ConfigError(f"{out}: not a run directory (no config.yaml)")
    data = read_config(path)
    if data is None:
        raise ConfigError(f"{path}: damaged (empty)")
    return experiment_from_data(data, str(path), trust_imports)


# --- checkpoints ------------------------------------------------------------------------------
#: what a run's checkpoint.pt holds: entry -> what it is
CHECKPOINT_ENTRIES = {"step": "an int", "model": "a state dict", "optimizer": "a state dict", "rng": "a torch RNG state (uint8 tensor)"}


def _one_line(e: BaseException, limit: int = 200) -> str:
    """An exception's text on one line, without torch's advice on loading files unsafely."""
    text = " ".join(str(e).split())
    text = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", text)
    if "weights_only" in text or "pickle" in text.lower() or not text:
        return type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _damaged(path: Path, what: str) -> ConfigError:
    return ConfigError(f"{path}: {what}; the run cannot be resumed from it (restore the file, or start the run again)")


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The entries of a run's `checkpoint.pt`, checked (`CHECKPOINT_ENTRIES`).

    Loaded with `weights_only=True` and nothing else: a file that holds other
    objects is refused. Every kind of damage (empty, truncated, not a torch
    file, an entry missing or of the wrong type) is a `ConfigError` naming the
    file and what is wrong; nothing is changed.
    """
    if not path.is_file():
        raise _damaged(path, "not a file")
    if path.stat().st_size == 0:
        raise _damaged(path, "damaged (the file is empty)")
    if not zipfile.is_zipfile(path):
        raise _damaged(path, "damaged (not a torch checkpoint: truncated, or another kind of file)")
    try:
        ckpt = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:  # never repeat torch's advice: it would run the file's code
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"it names {found.group(1)}" if found else "it holds more than tensors and plain data"
        raise _damaged(path, f"refused ({what}; a run checkpoint holds only tensors and plain data, and modopt loads nothing else)") from None
    except Exception as e:  # a zip that is not a torch file, a damaged archive, ...
        raise _damaged(path, f"damaged (not a readable torch checkpoint: {_one_line(e)})") from None
    if not isinstance(ckpt, dict):
        raise _damaged(path, f"damaged (it holds a {type(ckpt).__name__}, not the dict of a run checkpoint)")
    missing = [k for k in CHECKPOINT_ENTRIES if k not in ckpt]
    if missing:
        raise _damaged(path, f"damaged (no {', '.join(repr(k) for k in missing)} entry; a run checkpoint holds "
                             f"{', '.join(CHECKPOINT_ENTRIES)})")
    step, model, opt, rng = (ckpt[k] for k in CHECKPOINT_ENTRIES)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise _damaged(path, f"damaged ('step' is {step!r}, not {CHECKPOINT_ENTRIES['step']} >= 0)")
    if not isinstance(model, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()):
        raise _damaged(path, f"damaged ('model' is not {CHECKPOINT_ENTRIES['model']} of tensors)")
    if not isinstance(opt, Mapping):
        raise _damaged(path, f"damaged ('optimizer' is {type(opt).__name__}, not {CHECKPOINT_ENTRIES['optimizer']})")
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.dim() != 1:
        raise _damaged(path, f"damaged ('rng' is not {CHECKPOINT_ENTRIES['rng']})")
    return ckpt


def _restore(path: Path, ckpt: dict[str, Any], model: Any, opt: Any) -> None:
    """Load a checked checkpoint into the model, the optimizer and torch's RNG; a checkpoint that
    does not fit the run's config is a `ConfigError` naming the file."""
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise _damaged(path, f"its model does not fit the task of config.yaml ({_one_line(e)})") from None
    try:
        opt.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise _damaged(path, f"its optimizer state does not fit the pipeline of config.yaml ({_one_line(e)})") from None
    try:
        torch.set_rng_state(ckpt["rng"])
    except (RuntimeError, ValueError, TypeError) as e:
        raise _damaged(path, f"damaged ('rng' is not a torch RNG state: {_one_line(e)})") from None


def start_run(exp: Experiment, pipeline: Any = None, trust_imports: bool = False) -> tuple[Any, Any]:
    """The task and the optimizer of `exp` exactly as `modopt run` builds them; writes nothing.

    `pipeline` (default `exp.optimizer`) is the pipeline to build. Call it
    inside `deterministic()` after seeding, as the run does. Errors are
    `ConfigError` (a bad task name, options or optimizer) or the task's own.
    The optimizer also takes one step on shape-only copies of the parameters
    (`dry_step`), so what only a step finds is a `ConfigError` here too.
    """
    pipe = pipeline if pipeline is not None else exp.optimizer
    try:
        task = make_task(exp.task.name, dict(exp.task.options), exp.train.seed, trust_imports)
    except PermissionError as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None
    named = list(task.model.named_parameters())
    try:
        opt = pipe.build(named)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"optimizer: {e}") from None
    dry_step(pipe, named, exp.train)
    return task, opt


def dry_step(pipe: Any, named_params: list[tuple[str, torch.Tensor]], train: Any = None) -> None:
    """Build `pipe` over meta-device (shape-only) copies of `named_params`, with `train`'s
    schedule, and take one step with zero gradients: no data, no memory, no effect on the RNG.

    It finds what building alone does not, because the first step does it: a
    `TorchOptimizer` class that cannot be constructed (`torch.optim.Optimizer`),
    a group hyperparameter of the wrong type. Those (`ValueError`, `TypeError`)
    become `ConfigError`. What a shape-only tensor cannot do (`Tensor.item()`,
    an op without a meta kernel, e.g. torch's own multi-tensor Adam) ends the
    check there silently: the real step is no worse off.
    """
    meta = [(n, torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)) for n, p in named_params]
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            opt = pipe.build(meta)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"optimizer: {e}") from None
        if train is not None:
            try:
                train.schedule.build(opt, train.steps)
            except (ValueError, TypeError) as e:
                if isinstance(e, ConfigError):
                    raise
                raise ConfigError(f"train.schedule: {e}") from None
        for _, p in meta:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        try:
            opt.step()
        except (ValueError, TypeError) as e:
            raise ConfigError(f"optimizer: its first step fails: {e}") from None
        except RuntimeError:  # incl. NotImplementedError: a limit of the meta device, not of the config
            pass


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
    saved: Experiment | None = None,
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

    A resume checks the whole directory (`read_checkpoint`, `read_jsonl`)
    before it writes anything: a refused resume changes no file. `saved`
    (with `resume`): the experiment of `out/config.yaml` when `exp` is it with
    another `train.steps` (`--resume DIR --steps N`); `config.yaml` is rewritten
    to `exp` once the checks pass. A run is not shortened below its
    checkpoint's step, nor is the length of a run whose schedule depends on it
    changed.
    """
    out = Path(out)
    wrote = {"dir": False, "files": False}
    try:
        return _run(exp, out, resume, trust_imports, stop_after, progress, plots, log, force, wrote, saved)
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


def _check_length(exp: Experiment, saved: Experiment | None, out: Path, start: int) -> None:
    """A resume at the checkpoint's step `start` to `exp.train.steps`: refuse what no run could have done."""
    steps = exp.train.steps
    changed = saved is not None and saved.train.steps != steps
    if changed and steps <= start and start > 0:
        raise ConfigError(
            f"--steps {steps}: {out} has done {start} steps (its checkpoint.pt is at step {start}); --steps "
            f"must be above that, a run cannot be shortened to or below its checkpoint"
        )
    if start > steps:
        raise ConfigError(
            f"{out / 'checkpoint.pt'}: at step {start}, past the {steps} steps of {out / 'config.yaml'}: "
            "the two files are not of the same run"
        )
    kind = exp.train.schedule.kind
    if changed and start > 0 and kind != "constant":
        raise ConfigError(
            f"--steps {steps}: the {kind} learning-rate schedule of {out} spans its {saved.train.steps} steps, "
            f"and the {start} steps done followed it; a run with a {kind} schedule cannot change its length "
            "(start a new run instead)"
        )


def _run(exp, out, resume, trust_imports, stop_after, progress, plots, log, force, wrote, saved=None) -> dict[str, Any]:
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
            # everything is checked before anything is written: a refused resume changes no file
            ckpt = read_checkpoint(ckpt_path)
            start = ckpt["step"]
            _check_length(exp, saved, out, start)
            _restore(ckpt_path, ckpt, model, opt)
            if sched is not None:  # the same scheduler, replayed to the checkpoint's step
                for g, base in zip(opt.param_groups, base_lrs):
                    g["lr"] = base
                    g.pop("initial_lr", None)
                sched = tr.schedule.build(opt, tr.steps)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    for _ in range(start):
                        sched.step()
        metrics, timing = [], []
        if resume:
            metrics = read_jsonl(out / "metrics.jsonl", start, METRIC_FIELDS, log=log)
            timing = read_jsonl(out / "timing.jsonl", start, TIMING_FIELDS, log=log)
        if [r["step"] for r in metrics] != list(range(1, start + 1)):
            have = f"{len(metrics)} rows" if len(metrics) != start else "its rows out of order"
            raise ConfigError(
                f"{out / 'metrics.jsonl'}: damaged ({have} up to the checkpoint's step {start}, which needs steps 1..{start})"
                if (out / "metrics.jsonl").exists() else f"{out / 'metrics.jsonl'}: missing (the checkpoint is at step {start})"
            )
        if resume and start:
            log(f"resuming {out} from step {start}")
        if resume and saved is not None:
            (out / "config.yaml").write_text(exp.to_yaml())
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
    times = [r["time_s"] for r in read_jsonl(out / "timing.jsonl", tr.steps, TIMING_FIELDS)]
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
