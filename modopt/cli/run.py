"""The training loop behind `modopt run`: metrics, checkpoints, bit-exact resume.

A run directory holds:

* `config.yaml`: the resolved experiment (every default written out), opened by
  the provenance block as a comment (`provenance.py`);
* `metrics.jsonl`: one JSON object per step (deterministic: no timings);
* `timing.jsonl`: wall-clock seconds per step (kept apart so that the same
  config and seed give byte-identical `metrics.jsonl`);
* `summary.json`: final/best loss, loss spikes, % of steps clipped, time per step,
  and the provenance block;
* `loss.png`, `grad_norm.png` (with matplotlib; `.svg` or `.pdf` with `--format`);
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
from typing import Any, Callable, Iterator, TextIO

import torch

from ..config import ConfigError
from ..rewind import Rewind, RewindEvent
from ..telemetry import History
from .experiment import Experiment, experiment_from_data
from .outfiles import open_out, refuse_links, write_text
from .plots import DEFAULT_DPI, FORMATS
from .provenance import KEY as PROVENANCE
from .provenance import provenance, yaml_comment
from .tasks import machine_memory, make_task

#: a run's plots, in every format (`--format`): a run with --force clears, and refuses a link at, each of them
PLOT_FILES = tuple(f"{name}.{fmt}" for name in ("loss", "grad_norm") for fmt in FORMATS)
RUN_FILES = ("config.yaml", "metrics.jsonl", "timing.jsonl", "summary.json", "checkpoint.pt", *PLOT_FILES,
             "tensorboard")

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


def metrics_row(r: dict[str, Any], host: dict[str, Any]) -> dict[str, Any]:
    """A `metrics.jsonl` row from a telemetry history row (`modopt.History`) and the step's host values
    (`lr`, `batch`, `eval_loss`): the fields `modopt run` has always written, in the same order."""
    row: dict[str, Any] = {"step": r["step"], "loss": _num(r["loss"]), "lr": host["lr"],
                           "grad_norm": _num(r["grad_norm"]), "post_clip_norm": _num(r["post_clip_norm"]),
                           "clip_scale": _num(r["clip_scale"]), "clipped": bool(r["clipped"]),
                           "skipped": bool(r.get("skipped", 0.0))}
    row.update({k: host[k] for k in ("batch", "eval_loss") if k in host})
    return row


def _tensorboard(out: Path, exp: Experiment, start: int) -> Any:
    """The TensorBoard sink of a run (`output.tensorboard`), or None. Event files go to
    `<out>/tensorboard`; on a resume the steps after the checkpoint are purged from them
    (`SummaryWriter(purge_step=...)`)."""
    if not exp.output.tensorboard:
        return None
    from torch.utils.tensorboard import SummaryWriter

    from ..telemetry import TensorBoardSink

    return TensorBoardSink(writer=SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start + 1 if start else None))


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


def summarize(name: str, metrics: list[dict[str, Any]], times: list[float], spike_kw: dict[str, Any] | None = None
              ) -> dict[str, Any]:
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

    def __init__(self, total: int, start: int, label: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total: int = total
        self.start: int = start
        self.label: str = label
        self.stream: TextIO = stream or sys.stderr
        self.enabled = enabled
        self.tty: bool = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0: float = time.perf_counter()
        self.last_draw: float = 0.0
        self.every: int = max(1, (total - start) // 10)

    def update(self, step: int, loss: float | None, loss_step: int | None = None) -> None:
        """Show that step `step` is done, with `loss`, the loss of step `loss_step` (the last one read back;
        None: none read yet, shown as a dash). Redrawn at most 5 times a second on a terminal."""
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
        # the loss is read back with the telemetry (no host sync per step): say which step it is from
        loss_s = "-" if loss is None else f"{loss:.4f}"
        if loss is not None and loss_step is not None and loss_step != step:
            loss_s += f" (step {loss_step})"
        line = f"{self.label} [{bar}] {step}/{self.total} loss {loss_s} {rate:.1f} it/s eta {eta:.0f}s"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the display (a newline after a redrawn line)."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# --- the run -------------------------------------------------------------------------------
#: the entries of a metrics row that the summary and the plots read, and what each holds
#: ("number": a float, an int or null); a key ending in "?" may be absent
METRIC_FIELDS = {"step": "int", "loss": "number", "grad_norm": "number", "post_clip_norm": "number",
                 "clipped": "bool", "skipped": "bool", "eval_loss?": "number", "batch?": "int"}
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


def read_jsonl(path: Path, upto: int, fields: dict[str, str] | None = None,
               log: Callable[[str], object] | None = None) -> list[dict[str, Any]]:
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
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def _atomic_save(obj: Any, path: Path) -> None:
    """`torch.save` to a fresh temporary file beside `path`, then one rename: a kill leaves the old file or
    the new one. The temporary name is created here (never an existing file or link followed into)."""
    tmp = path.with_suffix(".tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()  # (a link is removed, not followed: what it points to is untouched)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
    os.replace(tmp, path)


def check_dir(out: Path, force: bool) -> None:
    """Refuse a non-empty `out` unless `force`, and a link at a run file's name (nothing is created or removed)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise ConfigError(f"{out} exists and is not empty; use --resume {out} to continue it, or --force to overwrite")
    refuse_links(out, RUN_FILES)


#: the file that marks each kind of output directory: a run's, a comparison's, a sweep's
KIND_FILES = {"run": "config.yaml", "compare": "compare.json", "sweep": "sweep.json"}


def check_kind(out: Path, kind: str) -> None:
    """Refuse to write `kind`'s output into a directory another command wrote (its files would be replaced
    or mixed with these): `modopt compare --out` an existing run directory removed that run's checkpoint."""
    for other, marker in KIND_FILES.items():
        if other != kind and (out / marker).is_file():
            raise ConfigError(f"{out} holds the output of `modopt {other}` ({marker}); `modopt {kind}` would "
                              f"replace or mix with its files: give --out a new directory (or this {kind}'s own, "
                              "to continue it)")


def make_dir(out: Path) -> None:
    """Create the output directory `out` (and its parents); a path that cannot be one is a `ConfigError`
    naming it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{out}: cannot create the output directory ({e.strerror or e})") from None


def prepare_dir(out: Path, force: bool) -> None:
    """Create `out`; refuse a non-empty directory unless `force` (then clear the run files). A link at a run
    file's name is refused (`check_dir`), never removed or followed."""
    check_dir(out, force)
    if out.exists() and any(out.iterdir()):
        for name in RUN_FILES:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    make_dir(out)


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


# --- rewinds (train.rewind) ------------------------------------------------------------------
def _checkpoint(step: int, model: Any, opt: Any, guard: Rewind | None) -> dict[str, Any]:
    """What `checkpoint.pt` holds (`CHECKPOINT_ENTRIES`, and the guard's state under `rewind` when it is on)."""
    ckpt = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()}
    if guard is not None:
        ckpt["rewind"] = guard.state_dict()
    return ckpt


def _make_guard(cfg: Any, opt: Any, model: Any, sched: Any, path: Path, ckpt: dict[str, Any] | None,
                history: Any = None) -> Rewind | None:
    """The run's `Rewind` (None when `train.rewind` is off), with the checkpoint's guard state on a resume."""
    if cfg is None:
        return None
    also = [x for x in (sched, history) if x is not None]  # (the telemetry history goes back with the rest)
    guard = Rewind(opt, model=model, also=also, config=cfg)
    if ckpt is not None:
        if "rewind" not in ckpt:
            raise _damaged(path, "no 'rewind' entry, and config.yaml sets train.rewind (the checkpoint is of a run without it)")
        try:
            guard.load_state_dict(ckpt["rewind"])
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise _damaged(path, f"its 'rewind' entry does not fit train.rewind of config.yaml ({_one_line(e)})") from None
    return guard


def _rewind_words(e: RewindEvent) -> str:
    return (f"{e.trigger} at step {e.step} (batch {e.batch}), back to step {e.restored_to}, "
            f"batches {e.skipped[0]}-{e.skipped[1]} skipped")


def _rewound(e: RewindEvent, out: Path, model: Any, opt: Any, guard: Rewind, metrics: list, mf: Any, tf: Any, log) -> int:
    """After a rewind: checkpoint the restored state, drop the rows of the rewound steps; the step to continue from.

    The checkpoint comes first: a kill between the two leaves a checkpoint at
    `e.restored_to` and rows a resume drops, never rows missing below a checkpoint.
    """
    log(f"rewind: {_rewind_words(e)}")
    _atomic_save(_checkpoint(e.restored_to, model, opt, guard), out / "checkpoint.pt")
    del metrics[e.restored_to:]
    for fh, rows in ((mf, metrics), (tf, None)):
        fh.flush()
        if rows is None:
            rows = read_jsonl(Path(fh.name), e.restored_to, TIMING_FIELDS)
        fh.truncate(0)
        fh.write("".join(json.dumps(r) + "\n" for r in rows))
        fh.flush()
    return e.restored_to


def start_run(exp: Experiment, pipeline: Any = None, trust_imports: bool = False) -> tuple[Any, Any]:
    """The task and the optimizer of `exp` exactly as `modopt run` builds them; writes nothing.

    `pipeline` (default `exp.optimizer`) is the pipeline to build. Call it
    inside `deterministic()` after seeding, as the run does. Errors are
    `ConfigError` (a bad task name, options, batch size (`check_batch`) or
    optimizer) or the task's own.
    The optimizer also takes one step on shape-only copies of the parameters
    (`dry_step`), so what only a step finds is a `ConfigError` here too.
    """
    pipe = pipeline if pipeline is not None else exp.optimizer
    if exp.output.tensorboard:
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
        except ImportError:
            raise ConfigError("output.tensorboard is true, and the tensorboard package is not installed "
                              "(pip install 'torch-modopt[tensorboard]')") from None
    try:
        task = make_task(exp.task.name, dict(exp.task.options), exp.train.seed, trust_imports)
    except PermissionError as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None
    check_batch(task, exp.task.name, exp.train.batch_size)
    _watch_attention(pipe, task.model)
    named = list(task.model.named_parameters())
    try:
        opt = pipe.build(named)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"optimizer: {e}") from None
    dry_step(pipe, named, exp.train)
    return task, opt


def _tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (tuple, list)):
        for x in batch:
            yield from _tensors_in(x)
    elif isinstance(batch, Mapping):
        for x in batch.values():
            yield from _tensors_in(x)


def check_batch(task: Any, name: str, batch_size: int) -> None:
    """Refuse a `train.batch_size` whose batch alone cannot be held: the bytes of a batch of one
    (drawn apart from the global RNG) times `batch_size`, against torch's 64-bit sizes and, for a batch
    on the CPU, this machine's memory. What the batch's activations need on top is found by the run (an
    allocation refused is exit 1). A task whose batch of one cannot be drawn is left to the run."""
    try:
        with torch.random.fork_rng(devices=[]):
            one = list(_tensors_in(task.get_batch(1, 1)))
    except Exception:  # (a user task that needs more than one example: the real batch says what is wrong)
        return
    per = sum(t.numel() * t.element_size() for t in one)
    if per == 0:
        return
    need = per * batch_size
    memory = machine_memory() if all(t.device.type == "cpu" for t in one) else None
    limit, what = (memory, f"this machine's memory ({memory} bytes)") if memory else (2**63 - 1, "torch's 64-bit sizes")
    if need > limit:
        raise ConfigError(f"train.batch_size: {batch_size} examples of the {name} task take {need} bytes ({per} "
                          f"per example) for the batch alone, more than {what}; at most {limit // per} fit")


def _watch_attention(pipe: Any, model: torch.nn.Module) -> None:
    """A pipeline with `QKClip` reads the per-head max logits: hook the model's `nn.MultiheadAttention`s
    (`mo.AttentionLogits.attach`), unless the task watched its attention itself."""
    from ..attention import AttentionLogits, layers_of
    from ..transforms.weights import QKClip

    clips = [t for t in pipe.transforms if isinstance(t, QKClip)]
    if not clips or layers_of(model.parameters()):
        return
    try:  # (logits="rewritten" measures the kept inputs again after the write)
        AttentionLogits.attach(model, keep_inputs=any(t.logits == "rewritten" for t in clips))
    except ValueError as e:
        raise ConfigError(f"QKClip: {e}; a task with its own attention watches it in its make_task") from None


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
    log: Callable[[str], object] = print,
    force: bool | None = None,
    saved: Experiment | None = None,
    announce: str | None = None,
    plot_format: str = "png",
    plot_dpi: int = DEFAULT_DPI,
) -> dict[str, Any]:
    """Train `exp` (one optimizer) writing the run directory `out`; return the summary.

    With `resume` the run continues from `out/checkpoint.pt` (if there is
    none, it starts over); metrics logged after the checkpoint are dropped and
    recomputed, so the result equals an uninterrupted run. `stop_after=K`
    stops after step K as if the process had been killed (raises
    `RunInterrupted`); only checkpoints already written survive.

    A symbolic link at the name of a run file in `out` is refused before
    anything is built or written (`outfiles.refuse_links`); every file is
    opened without following a link. A new run builds its task and optimizer
    before writing anything, so a failed start leaves no run directory; a run that fails before its first
    checkpoint removes the files it wrote (a re-run starts clean). `force`:
    None uses `out` as it is (created if missing); False refuses a
    non-empty `out`; True clears its run files first.

    A resume checks the whole directory (`read_checkpoint`, `read_jsonl`)
    before it writes anything: a refused resume changes no file. `saved`
    (with `resume`): the experiment of `out/config.yaml` when `exp` is it with
    another `train.steps` (`--resume DIR --steps N`); `config.yaml` is rewritten
    to `exp` once the checks pass. A run is not shortened below its
    checkpoint's step, nor is the length of a run whose schedule depends on it
    changed. `announce`: a line `log` gets once the task and optimizer are
    built (a refused start shows its error alone). `plot_format`, `plot_dpi`:
    the plots' file format (`plots.FORMATS`) and resolution.
    """
    from .plots import check_format

    try:
        check_format(plot_format, plot_dpi)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    out = Path(out)
    refuse_links(out, RUN_FILES)  # before anything is built or written
    wrote = {"dir": False, "files": False}
    try:
        return _run(exp, out, resume, trust_imports, stop_after, progress, plots, log, force, wrote, saved, announce,
                    (plot_format, plot_dpi))
    except RunInterrupted:
        raise
    except Exception:
        if wrote["files"] and not (out / "checkpoint.pt").exists():
            _remove_run_files(out, remove_dir=wrote["dir"])
        raise


def _devices(model: torch.nn.Module) -> set[torch.device]:
    """The devices the model's parameters and buffers are on."""
    return {t.device for t in (*model.parameters(), *model.buffers())}


def _write_config(out: Path, exp: Experiment, model: torch.nn.Module) -> None:
    """`config.yaml`: the provenance block as a comment, then the resolved experiment (which it hashes)."""
    write_text(out / "config.yaml", yaml_comment(provenance(exp.to_dict(), used=_devices(model))) + exp.to_yaml())


def _remove_run_files(out: Path, remove_dir: bool) -> None:
    """Undo a run that failed before its first checkpoint: its files, and the directory if it made it."""
    for name in (*RUN_FILES, "checkpoint.tmp"):
        p = out / name
        if p.is_file():
            p.unlink()
        elif p.is_dir() and not p.is_symlink() and name == "tensorboard":
            shutil.rmtree(p)
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


def _run(exp, out, resume, trust_imports, stop_after, progress, plots, log, force, wrote, saved=None,
         announce=None, plot_as=("png", DEFAULT_DPI)) -> dict[str, Any]:
    if exp.optimizer is None:
        raise ConfigError("run_experiment needs an experiment with a single optimizer (select a variant)")
    tr = exp.train
    ckpt_path = out / "checkpoint.pt"
    with deterministic(tr.threads):
        torch.manual_seed(tr.seed)
        # the task and optimizer first: a start that fails writes nothing
        task, opt = start_run(exp, trust_imports=trust_imports)
        if announce:
            log(announce)
        model = task.model
        if not resume:
            wrote["dir"] = not out.exists()
            if force is None:
                make_dir(out)
            else:
                prepare_dir(out, force)
            wrote["files"] = True
            _write_config(out, exp, model)
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
        # the step telemetry: a history on the device, read back every output.read_every steps (and at each
        # checkpoint): the one host copy that metrics.jsonl and TensorBoard get their rows from
        history = History.attach(opt, capacity=exp.output.read_every)
        if history.count != start:  # a checkpoint without a history (written before modopt.telemetry)
            history.start_at(start)
        guard = _make_guard(tr.rewind, opt, model, sched, ckpt_path, ckpt if resume and start else None, history)
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
            _write_config(out, exp, model)
        _write_jsonl(out / "metrics.jsonl", metrics)
        _write_jsonl(out / "timing.jsonl", timing)
        tb = _tensorboard(out, exp, start)
        host: dict[int, dict[str, Any]] = {}  # lr, batch and eval_loss by step: the values the host has
        bar = Progress(tr.steps, start, exp.name, enabled=progress and tr.steps - start >= 50)
        mf = open_out(out / "metrics.jsonl", "a")
        tf = open_out(out / "timing.jsonl", "a")
        # (step, loss) of the last row read back; a null loss in metrics.jsonl was non-finite
        shown: list[tuple[int | None, float | None]] = [(None, None)]
        if metrics:
            shown[0] = (metrics[-1]["step"], math.nan if metrics[-1]["loss"] is None else metrics[-1]["loss"])

        def read_back() -> None:
            for r in history.flush():
                if metrics and r["step"] <= metrics[-1]["step"]:
                    continue  # read again after a rewind restored the history: the row is written already
                row = metrics_row(r, host.pop(r["step"]))
                metrics.append(row)
                mf.write(json.dumps(row) + "\n")
                if tb is not None:
                    tb.write([{**r, **{k: row[k] for k in ("lr", "eval_loss") if row.get(k) is not None}}])
                shown[0] = (r["step"], float(r["loss"]))  # the value itself: a NaN or inf loss shows as such

        try:
            step = start
            while step < tr.steps:  # (a rewind sets `step` back)
                step += 1
                t0 = time.perf_counter()
                model.train()
                batch = task.get_batch(step if guard is None else guard.batches_seen + 1, tr.batch_size)
                opt.zero_grad(set_to_none=True)
                loss = task.loss_fn(model, batch)
                loss.backward()
                history.note(loss=loss.detach())
                opt.step(loss=loss.detach())  # (a transform that watches the loss, SkipStep, reads it)
                row: dict[str, Any] = {"lr": opt.param_groups[0].get("lr")}
                host[step] = row
                if sched is not None:
                    sched.step()
                if guard is not None:
                    row["batch"] = guard.batches_seen + 1
                    event = guard.step(loss.detach(), opt.stats["grad_norm"])
                    if event is not None:
                        step = _rewound(event, out, model, opt, guard, metrics, mf, tf, log)
                        continue
                if task.eval_fn is not None and (
                    (tr.eval_every and step % tr.eval_every == 0) or step == tr.steps
                ):
                    model.eval()
                    row["eval_loss"] = _num(task.eval_fn(model))
                dt = time.perf_counter() - t0
                tf.write(json.dumps({"step": step, "time_s": dt}) + "\n")
                stop = stop_after is not None and step >= stop_after and step < tr.steps
                save = (tr.checkpoint_every and step % tr.checkpoint_every == 0) or step == tr.steps
                if save or stop or step % exp.output.read_every == 0:
                    read_back()
                if save:
                    mf.flush()
                    tf.flush()
                    _atomic_save(_checkpoint(step, model, opt, guard), ckpt_path)
                bar.update(step, shown[0][1], shown[0][0])
                if stop:
                    raise RunInterrupted(f"stopped after step {step} (--stop-after)")
            if opt.skip_limit is not None:  # (max_consecutive_skips: a GPU's count of the last step, read now)
                opt.skip_limit.check()
        finally:
            mf.close()
            tf.close()
            bar.close()
            if tb is not None:
                tb.close()
    times = [r["time_s"] for r in read_jsonl(out / "timing.jsonl", tr.steps, TIMING_FIELDS)]
    summary = summarize(exp.name, metrics, times)
    summary["task"] = exp.task.name
    summary["run_dir"] = str(out)
    if guard is not None:
        summary["rewinds"] = [e.as_dict() for e in guard.rewinds]
        skipped = sum(e.skipped[1] - e.skipped[0] + 1 for e in guard.rewinds)
        log(f"rewinds: {len(guard.rewinds)}, {skipped} batches skipped (each listed in {out / 'summary.json'})")
    summary[PROVENANCE] = provenance(exp.to_dict(), used=_devices(model))
    write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    if plots if plots is not None else exp.output.plots:
        from .plots import describe_pipeline, plot_run

        pipeline = describe_pipeline(exp.optimizer.to_dict())
        msg = plot_run(out, metrics, exp.name, pipeline=pipeline, summary=summary, fmt=plot_as[0], dpi=plot_as[1])
        if msg:
            log(msg)
    return summary
