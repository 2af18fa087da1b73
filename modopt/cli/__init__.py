"""The `modopt` command: run, compare, sweep, report, validate, schema, modules, examples, bench.

`main(argv)` returns the exit status: 0 on success, 1 on a user error (a config
that does not validate, a missing file, a bad option value, a path or disk the
system refused: full, read-only, a name too long), 2 on bad command-line usage,
3 for `--stop-after`, 4 when training stopped as the config told it to (a
`Rewind` guard gave up, `nonfinite: raise` met a non-finite gradient), 70 on an
internal error.

A user error is one readable message on stderr, no traceback. Anything else is
a bug (in modopt, or in a task / optimizer class given by import path) and is
reported as one, with its traceback; `MODOPT_DEBUG=1` re-raises every error.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Sequence

from pydantic import ValidationError

from ..config import ConfigError
from ..rewind import RewindError
from .experiment import INT64_MAX, SEED_MAX, SWEEP_MAX_RUNS
from .plots import DEFAULT_DPI, DPI_RANGE, FORMATS

#: errors that are the user's input, not a bug: shown as one line, exit status 1. `ConfigError`
#: covers configs, task options and command-line values; pydantic's `ValidationError` is user data
#: that did not validate; the OS errors are paths the user named.
USER_ERRORS = (ConfigError, ValidationError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
#: OS errors that are the machine refusing the user's request (a full or read-only disk, a file-size
#: limit, a name too long): user errors, exit 1, not bugs
_SYSTEM_REFUSALS = {errno.ENOSPC, errno.EFBIG, errno.ENAMETOOLONG, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM}


def _outcome(e: BaseException, command: str) -> int | None:
    """The exit status of an error that is not a bug, after its one line on stderr; None for a bug.

    A request the machine refused (a full or read-only disk, a name too long, more memory than it
    has) is the user's, exit 1; training that stopped as the config told it to (a Rewind guard that
    gave up, `nonfinite: raise`) is exit 4."""
    if isinstance(e, OSError) and e.errno in _SYSTEM_REFUSALS:
        where = f"{e.filename}: " if e.filename else ""
        print(f"modopt {command}: error: {where}{e.strerror} (the system refused a write: free space, pick "
              "another --out, or shorten the name)", file=sys.stderr)
        return 1
    if _out_of_memory(e):
        said = re.sub(r"^\[enforce fail at [^\]]*\]\s*(err == 0\.)?\s*", "", str(e).splitlines()[0])[:200]
        print(f"modopt {command}: error: out of memory ({said}): the config asks for more memory than this "
              "machine has (train.batch_size, the task's options, a rewind window)", file=sys.stderr)
        return 1
    if isinstance(e, (RewindError, FloatingPointError)):
        print(f"modopt {command}: training stopped: {e}", file=sys.stderr)
        return 4
    return None


def _out_of_memory(e: BaseException) -> bool:
    """An allocation the machine refused (torch's CPU allocator raises a RuntimeError saying so)."""
    import torch

    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


def _int_in(lo: int, hi: int, what: str = ""):
    """An argparse `type`: an integer in [lo, hi] (a usage error, exit 2, otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if not lo <= value <= hi:
            shown = f"{text[:24]}..." if len(text) > 27 else text
            raise argparse.ArgumentTypeError(f"{shown} is out of range: {what or 'must be'} {lo}..{hi}")
        return value

    parse.__name__ = "int"
    return parse


def _float_in(lo: float, strict: bool):
    """An argparse `type`: a finite float above `lo` (`strict`) or at least `lo`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if not math.isfinite(value) or value < lo or (strict and value == lo):
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be a finite number {'>' if strict else '>='} {lo}")
        return value

    parse.__name__ = "float"
    return parse


#: `--jobs` of compare and sweep: one default for both (in this process: the progress line and a failing
#: run's error show directly, and no worker processes start unasked)
JOBS_HELP = ("runs at a time, in worker processes (default 1: one after the other in this process; each run is "
             "single-threaded and deterministic, so N changes the wall time, not the results)")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=_int_in(1, INT64_MAX), help="override train.steps")
    p.add_argument("--seed", type=_int_in(0, SEED_MAX, "a seed is one of"), help="override train.seed")
    p.add_argument("--trust-imports", action="store_true", help="allow tasks and optimizer classes named by import path (runs their code)")
    p.add_argument("--no-plots", action="store_true", help="do not write plots")
    p.add_argument("--format", choices=FORMATS, dest="plot_format", metavar="{" + ",".join(FORMATS) + "}",
                   help="the plots' file format (default png; svg and pdf are vector graphics for a paper)")
    p.add_argument("--dpi", type=_int_in(*DPI_RANGE), metavar="N",
                   help=f"the plots' resolution in dots per inch (default {DEFAULT_DPI}, {DPI_RANGE[0]}..{DPI_RANGE[1]})")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress display")


def _add_seed_args(p: argparse.ArgumentParser) -> None:
    """`--seeds` and the loss-spike thresholds of `compare` and `sweep`."""
    p.add_argument("--seeds", nargs="+", type=_int_in(0, SEED_MAX, "a seed is one of"), metavar="S",
                   help="run on each of these seeds (overrides train.seeds; default: train.seeds, else train.seed)")
    p.add_argument("--spike-factor", type=_float_in(0.0, strict=True), help="a spike is a loss above FACTOR x the running median (default 1.5)")
    p.add_argument("--spike-min-rise", type=_float_in(0.0, strict=False), help="... and at least this much above it (default 0.1)")
    p.add_argument("--spike-window", type=_int_in(1, INT64_MAX), help="steps in the running median (default 20)")


def build_parser() -> argparse.ArgumentParser:
    """The `modopt` command's argument parser, every subcommand included."""
    parser = argparse.ArgumentParser(prog="modopt", description="Composable optimizer modules for PyTorch: experiments and configs.")
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("run", help="train a task with a config's optimizer pipeline and write a run directory",
                       description="Train a task with the optimizer pipeline of CONFIG (the built-in default experiment without one).")
    p.add_argument("config", nargs="?", help="experiment config (.yaml/.yml/.json/.toml) or a shipped example's name "
                   "(modopt examples); omit for the default experiment")
    p.add_argument("--out", help="run directory (default: output.dir of the config, else runs/<name>-<time>)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoint")
    p.add_argument("--variant", help="which optimizer variant of a config with 'variants'")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty run directory")
    p.add_argument("--stop-after", type=_int_in(1, INT64_MAX), metavar="K", help="stop after step K as if interrupted (to test --resume)")
    _add_run_args(p)

    p = sub.add_parser("compare", help="run several configs / variants and print a comparison table",
                       description="Run every config (and every variant of each) on every seed and compare them: "
                       "the mean over seeds with its 95% Student-t interval, and with --baseline the paired difference.")
    p.add_argument("configs", nargs="+", metavar="CONFIG", help="config files or shipped examples' names (modopt examples)")
    p.add_argument("--out", help="directory for the runs, the tables, the plot and report.html (default runs/compare-<time>)")
    _add_seed_args(p)
    p.add_argument("--variant", nargs="+", metavar="NAME",
                   help="run only these variants of the configs (a variant's name, or its run's name as the tables "
                   "show it); an unknown name is refused before anything runs")
    p.add_argument("--baseline", metavar="NAME", help="also give each run's paired difference to the run NAME over the same seeds (a run's "
                   "name as the tables show it, or the CONFIG argument of a config that makes one run)")
    p.add_argument("--jobs", type=_int_in(1, 1024), default=1, metavar="N", help=JOBS_HELP)
    _add_run_args(p)

    p = sub.add_parser("sweep", help="run a config over a grid of field values x seeds, resumable",
                       description="Run CONFIG at every point of the grid (the Cartesian product of the --grid options) "
                       "and every seed; reuse the runs in OUT that already finished.")
    p.add_argument("config", metavar="CONFIG", help="a config file or a shipped example's name (modopt examples)")
    p.add_argument("--grid", action="append", required=True, metavar="PATH=V1,V2,...",
                   help="a dotted path into the experiment (optimizer.transforms.0.max_norm) and the values to try "
                   "(YAML scalars); repeat for a grid of several fields")
    p.add_argument("--variant", nargs="+", metavar="NAME",
                   help="which optimizer variant(s) of a config with 'variants' (several: the grid is run for each)")
    p.add_argument("--out", help="directory of the sweep; run again with the same OUT to resume (default runs/sweep-<time>)")
    p.add_argument("--jobs", type=_int_in(1, 1024), default=1, metavar="N", help=JOBS_HELP)
    p.add_argument("--max-runs", type=_int_in(1, INT64_MAX), metavar="N",
                   help=f"the most runs (grid points x seeds) to start (default {SWEEP_MAX_RUNS}): a larger sweep is "
                   "refused before anything is checked or run")
    p.add_argument("--metric", default="final_loss",
                   help="what the plots show (default final_loss; or best_loss, final_eval_loss, best_eval_loss, "
                   "loss_spikes, worst_excursion, clipped_pct, skipped_steps, max_grad_norm, time_per_step_ms)")
    _add_seed_args(p)
    _add_run_args(p)

    p = sub.add_parser("validate", help="check a config file (experiment or pipeline)",
                       description="Check CONFIG (an experiment or a bare pipeline; YAML, JSON or TOML) as modopt "
                       "run does before it trains: the fields, the task built, every optimizer built on its model; "
                       "the pipeline's lint findings are printed as warnings. An error names the file and the field "
                       "path or line (exit status 1).")
    p.add_argument("config", help="a config file or a shipped example's name (modopt examples)")
    p.add_argument("--trust-imports", action="store_true",
                   help="allow tasks and optimizer classes named by import path (imports them, running their code)")

    p = sub.add_parser("schema", help="print the JSON schema of configs (for editor completion)",
                       description="Print the JSON schema of experiment configs (of bare pipeline configs with "
                       "--pipeline), for an editor's completion and checking: modopt schema > modopt.schema.json.")
    p.add_argument("--pipeline", action="store_true", help="the schema of a bare pipeline config instead of an experiment")
    p.add_argument("--indent", type=_int_in(0, 64), default=2, help="spaces per indentation level (default 2)")

    p = sub.add_parser("modules", help="list the registered transforms with their fields, defaults and ranges",
                       description="List the registered transforms (every type a config may name) with their fields, "
                       "types, defaults, allowed ranges and the first line of their docstrings.")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these transforms (case-insensitive)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("examples", help="list the example configs shipped with modopt (run one by name: modopt run NAME)",
                       description="List the example configs shipped with modopt, or print one (to copy and edit).")
    p.add_argument("name", nargs="?", metavar="NAME", help="print this example's config")

    p = sub.add_parser("report", help="show what a result came from: versions, commit, devices, date, config hash",
                       description="Show the provenance of a run directory, a compare or sweep output directory, or "
                       "one of their result files (summary.json, config.yaml, compare.json, sweep.json): the modopt "
                       "version and commit, torch and Python, the devices, the date, the command line and the hash "
                       "of the resolved config; with a compare or sweep, its tables too.")
    p.add_argument("path", metavar="PATH", help="a run, compare or sweep directory, or one of their result files")

    sub.add_parser("bench", help="time the default step against torch (benchmarks/bench.py, source checkout)",
                   add_help=False)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, where an unknown argument is a usage error of the subcommand it was given
    to: that command's usage line, and the closest of its options to each unknown one (`--varaint`: did
    you mean --variant?); exit status 2, as argparse gives."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        from ..core.transform import closest

        sub = _subparsers(parser).get(getattr(args, "command", None) or "", parser)
        options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        hints = []
        for word in extra:
            close = closest(word.split("=", 1)[0], options) if word.startswith("-") else None
            if close:
                hints.append(f"{word.split('=', 1)[0]}: did you mean {close}?")
        sub.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else ""))
    return args


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """`{command: its parser}` of `parser`'s subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _plot_as(args) -> tuple[str, int]:
    """The plots' `(format, dpi)` of `--format` and `--dpi`; either with `--no-plots` is refused."""
    if args.no_plots:
        given = [f for f, v in (("--format", args.plot_format), ("--dpi", args.dpi)) if v is not None]
        if given:
            raise ConfigError(f"{' and '.join(given)}: no plots are written with --no-plots; drop one or the other")
    return args.plot_format or FORMATS[0], args.dpi or DEFAULT_DPI


def _version() -> str:
    from .. import __version__

    return __version__


def _version_line() -> str:
    """`modopt --version`: the version (modopt.__version__, which the build also writes into the
    distribution's metadata) and the distribution's name (the index's `modopt` is another project)."""
    return f"modopt {_version()} (torch-modopt)"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `modopt` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    parser = build_parser()
    try:
        args = _parse(parser, argv)
    except SystemExit as e:  # usage errors (2), --help and --version (0): returned, as documented
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command is None:
        parser.print_help()
        return 2
    args.argv = argv
    try:
        return {
            "run": _cmd_run,
            "compare": _cmd_compare,
            "sweep": _cmd_sweep,
            "validate": _cmd_validate,
            "schema": _cmd_schema,
            "modules": _cmd_modules,
            "examples": _cmd_examples,
            "report": _cmd_report,
        }[args.command](args)
    except USER_ERRORS as e:
        if os.environ.get("MODOPT_DEBUG"):
            raise
        print(f"modopt {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nmodopt {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`modopt modules | head`): stop quietly, as a program killed
        # by SIGPIPE does; stdout goes to /dev/null so the interpreter's flush at exit cannot raise it again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # (SIGPIPE's number on every POSIX system; the status a shell reports for `cmd | head`)
    except Exception as e:
        if os.environ.get("MODOPT_DEBUG"):
            raise
        code = _outcome(e, args.command)
        if code is not None:
            return code
        traceback.print_exc()
        print(
            f"modopt {args.command}: internal error: {type(e).__name__}: {e}\n"
            "This is not a problem with your config: it is a bug in modopt (or in a task or optimizer "
            "class given by import path). Please report it with the traceback above.",
            file=sys.stderr,
        )
        return 70


# --- run ---------------------------------------------------------------------------------
def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _cmd_run(args) -> int:
    from .experiment import apply_overrides, default_experiment, load_experiment
    from .run import RunInterrupted, check_dir, load_run_config, run_experiment

    saved = None
    plot_format, plot_dpi = _plot_as(args)
    if args.resume:
        if args.config or args.out:
            raise ConfigError("--resume DIR continues the run in DIR with its own config; drop CONFIG/--out")
        for flag, given in (("--variant", args.variant), ("--force", args.force)):
            if given:
                raise ConfigError(f"--resume DIR continues the run in DIR as it is; drop {flag}")
        out = Path(args.resume)
        saved = load_run_config(out, args.trust_imports)
        if args.seed is not None and args.seed != saved.train.seed:
            raise ConfigError(
                f"--seed {args.seed}: the run in {out} has seed {saved.train.seed}, and a resumed run keeps it "
                "(start a new run for another seed)"
            )
        exp = apply_overrides(saved, args)
        # config.yaml is rewritten only once the resume has checked the run directory
        saved = saved if exp.train.steps != saved.train.steps else None
    else:
        exp = load_experiment(args.config, args.trust_imports) if args.config else default_experiment()
        exp = apply_overrides(exp.select(args.variant), args)
        out = Path(args.out or exp.output.dir or f"runs/{exp.name}-{_stamp()}")
        check_dir(out, args.force)  # created only once the task and optimizer are built
    err = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    try:  # (the line saying what runs is shown once the task and optimizer are built: a refusal is one line)
        summary = run_experiment(
            exp, out, resume=bool(args.resume), trust_imports=args.trust_imports, stop_after=args.stop_after,
            progress=not args.quiet, plots=False if args.no_plots else None, log=err,
            force=None if args.resume else args.force, saved=saved,
            plot_format=plot_format, plot_dpi=plot_dpi,
            announce=None if args.resume else f"modopt run: {exp.name} ({exp.task.name}, {exp.train.steps} steps) -> {out}",
        )
    except RunInterrupted as e:
        err(f"modopt run: {e}; continue with: modopt run --resume {out}")
        return 3
    print(_format_summary(summary))
    return 0


def _fmt(x, spec=".4g") -> str:
    return "-" if x is None else format(x, spec)


def _format_summary(s: dict) -> str:
    lines = [
        f"run:          {s['run_dir']}",
        f"steps:        {s['steps']}",
        f"final loss:   {_fmt(s['final_loss'])} (mean of the last {s['final_loss_window']} steps)",
        f"best loss:    {_fmt(s['best_loss'])}",
    ]
    if s.get("final_eval_loss") is not None:
        lines.append(f"eval loss:    {_fmt(s['final_eval_loss'])} (best {_fmt(s['best_eval_loss'])})")
    lines += [
        _format_spikes(s),
        f"clipped:      {s['clipped_pct']:.1f}% of steps; skipped {s['skipped_steps']}",
        f"time/step:    {_fmt(s['time_per_step_ms'], '.2f')} ms",
    ]
    if s.get("rewinds") is not None:
        lines.append(_format_rewinds(s["rewinds"]))
    return "\n".join(lines)


def _format_rewinds(rewinds: list, shown: int = 5) -> str:
    """`rewinds:      N (K batches skipped): step s (trigger) -> back to r, batches a-b skipped; ...`."""
    skipped = sum(r["skipped"][1] - r["skipped"][0] + 1 for r in rewinds)
    line = f"rewinds:      {len(rewinds)} ({skipped} batches skipped)"
    parts = [f"step {r['step']} ({r['trigger']}) -> back to {r['restored_to']}, batches "
             f"{r['skipped'][0]}-{r['skipped'][1]} skipped" for r in rewinds[:shown]]
    if parts:
        line += ": " + "; ".join(parts)
    if len(rewinds) > shown:
        line += f"; ... (+{len(rewinds) - shown} more, all in summary.json)"
    return line


def _format_spikes(s: dict, shown: int = 10) -> str:
    """`loss spikes:  N on the train loss at steps a, b, ... (+K more)`."""
    series = {"loss": "train loss", "eval_loss": "eval loss"}.get(s.get("spike_series", "loss"), s.get("spike_series"))
    line = f"loss spikes:  {s['loss_spikes']} (counted on the {series})"
    steps = list(s.get("spike_steps") or [])
    if steps:
        line += " at steps " + ", ".join(str(x) for x in steps[:shown])
        if len(steps) > shown:
            line += f", ... (+{len(steps) - shown} more, all in summary.json)"
    return line


# --- compare -----------------------------------------------------------------------------
def _spike_kw(args) -> dict:
    return {k: v for k, v in {
        "factor": args.spike_factor, "min_rise": args.spike_min_rise, "window": args.spike_window,
    }.items() if v is not None}


def _command_line(args) -> str:
    """The command as typed (for the report)."""
    import shlex

    return shlex.join(["modopt", *getattr(args, "argv", [])])


def _cmd_compare(args) -> int:
    from .compare import compare

    if args.seeds and args.seed is not None:
        raise ConfigError("give --seed S (one seed) or --seeds S1 S2 ..., not both")
    plot_format, plot_dpi = _plot_as(args)
    out = Path(args.out or f"runs/compare-{_stamp()}")
    table = compare(args.configs, out, overrides=args, seeds=args.seeds, baseline=args.baseline, jobs=args.jobs,
                    spike_kw=_spike_kw(args), trust_imports=args.trust_imports, progress=not args.quiet,
                    plots=not args.no_plots, command=_command_line(args), variants=args.variant,
                    plot_format=plot_format, plot_dpi=plot_dpi)
    print(table)
    return 0


# --- sweep -------------------------------------------------------------------------------
def _cmd_sweep(args) -> int:
    from .sweep import sweep

    if args.seeds and args.seed is not None:
        raise ConfigError("give --seed S (one seed) or --seeds S1 S2 ..., not both")
    plot_format, plot_dpi = _plot_as(args)
    out = Path(args.out or f"runs/sweep-{_stamp()}")
    table = sweep(args.config, args.grid, out, variant=args.variant, overrides=args, seeds=args.seeds, jobs=args.jobs,
                  metric=args.metric, spike_kw=_spike_kw(args), trust_imports=args.trust_imports,
                  progress=not args.quiet, plots=not args.no_plots, command=_command_line(args),
                  max_runs=args.max_runs or SWEEP_MAX_RUNS, plot_format=plot_format, plot_dpi=plot_dpi)
    print(table)
    return 0


# --- validate / schema / modules ---------------------------------------------------------
def _cmd_validate(args) -> int:
    """Everything `modopt run` checks before training: the config, the task (name, options, built),
    every optimizer built on the task's model; then the pipeline lint (warnings, exit 0)."""
    from .experiment import load_experiment, read_config
    from .run import check_experiment

    data = read_config(args.config)
    exp = load_experiment(args.config, args.trust_imports)
    try:
        check_experiment(exp, args.trust_imports)
    except ConfigError as e:
        raise ConfigError(f"{args.config}: {e}") from None
    kind = "pipeline" if isinstance(data, dict) and "transforms" in data else "experiment"
    print(f"{args.config}: valid {kind} config")
    print(f"  task: {exp.task.name} {exp.task.options or ''}".rstrip())
    seeds = f"seeds {exp.train.seeds} (compare, sweep), seed {exp.train.seed} (run)" if exp.train.seeds else f"seed {exp.train.seed}"
    print(f"  train: {exp.train.steps} steps, batch {exp.train.batch_size}, {seeds}")
    for label, pipe in exp.pipelines().items():
        names = " -> ".join(type(t).__name__ for t in pipe.transforms)
        print(f"  optimizer {label}: {names} (nonfinite={pipe.nonfinite})")
        lint = getattr(pipe, "lint", None)
        for finding in (lint() if lint is not None else []):
            print(f"  warning ({label}): {finding}")
    return 0


def _cmd_schema(args) -> int:
    from ..config import config_schema
    from .experiment import experiment_schema

    schema = config_schema() if args.pipeline else experiment_schema()
    print(json.dumps(schema, indent=args.indent))
    return 0


def _cmd_modules(args) -> int:
    from .modules import describe_modules, format_modules

    mods = describe_modules(args.names)
    print(json.dumps(mods, indent=2) if args.json else format_modules(mods))
    return 0


def _cmd_examples(args) -> int:
    from .examples import example_text, format_examples

    if args.name:
        sys.stdout.write(example_text(args.name))  # the file as it is, to redirect into a copy
    else:
        print(format_examples())
    return 0


# --- report ------------------------------------------------------------------------------
def _cmd_report(args) -> int:
    from .show import printable, show

    print(printable(show(args.path)))
    return 0


# --- bench -------------------------------------------------------------------------------
#: the benchmark is part of the source checkout, not of the installed package
BENCH_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"


def _bench(argv: list[str]) -> int:
    """`modopt bench ARGS`: run the checkout's `benchmarks/bench.py` with ARGS."""
    if not BENCH_SCRIPT.is_file():
        print(
            "modopt bench: the benchmark is part of modopt's source checkout (benchmarks/bench.py), "
            "which this installation does not have; from a clone run: python benchmarks/bench.py",
            file=sys.stderr,
        )
        return 1
    import importlib.util

    spec = importlib.util.spec_from_file_location("modopt_benchmark", BENCH_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return int(module.main(argv) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
