"""modopt against its peers on the methods both publish: pytorch_optimizer's StableSPAM, SPAM and AdaGC, and
heavyball's AdamW with its global-norm gradient clip (where heavyball is installed).

    python benchmarks/peers.py                        # both models, 3 repeats, 1 thread (a few minutes)
    python benchmarks/peers.py --quick                # tiny models, 2 steps: a smoke run
    python benchmarks/peers.py --only StableSPAM --models mlp --repeats 5 --json rows.json

Each row trains two copies of `benchmarks/bench.py`'s model on the same batches: modopt's pipeline
(`mo.Modular(params, *pipeline)`, the default `nonfinite="skip"`: a step with an inf/NaN gradient is
skipped on the device, which the peer does not check) and the peer's optimizer with its own defaults.
Each modopt pipeline is the configuration that reproduces the peer (its docstring says how): the same
hyperparameters and torch's non-fused AdamW kernel, so `diff` (the largest parameter difference after a
repeat, relative to the largest parameter) is 0 where the two are bit for bit, and for SPAM the eps
placement alone (tests/test_spam.py bounds it). heavyball's AdamW cannot be reproduced bit for bit by
torch's kernels (its own arithmetic, see `_heavyball_row`): its row runs modopt's default AdamW kernel with
heavyball's hyperparameters, and `diff` is the eps placement's (tests/test_bench.py bounds the rest).

Timing is bench.py's own (`bench._timed_steps`: each side's `step` timed alone after a shared forward
and backward, the order alternating, the garbage collector paused); a repeat reports the median of the
per-iteration ratios modopt/peer, the table every repeat's ratio and their median. `ops / syncs / bytes /
Python calls` is one more untimed step per side under `bench.StepCounter` (aten ops, views excluded, host
syncs and the bytes read and written in units of P, the parameters' bytes: the device path's, what a GPU
runs; a peer that compiles its step, heavyball, is counted with its compiled helpers run as the Python they
compile: the ops its kernels fuse) and the next one under `call_counts.count` (the Python calls into the side's own library:
modopt's files for modopt, the peer library's for the peer; the default path, the one timed here).
`benchmarks/bench.py --peers` runs the same rows (`run_rows`), and with `--docs` prints `docs_table`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import importlib.util
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import Side, _backward, _counted, _opt_state, _timed_steps, _version, build_model  # noqa: E402
from call_counts import count as python_calls  # noqa: E402

import modopt as mo  # noqa: E402


@dataclass(frozen=True)
class Peer:
    name: str
    modopt: Callable[[], list]
    modopt_label: str
    peer: Callable[[list], torch.optim.Optimizer]
    peer_label: str
    #: the peer's package: its files are the ones whose Python calls count, its name heads the notes
    lib: str = "pytorch_optimizer"
    #: a context under which the peer's step runs without torch.compile, for `StepCounter` (a dispatch
    #: mode and a compiled frame do not mix); None: the peer compiles nothing
    uncompiled: Callable[[], contextlib.AbstractContextManager] | None = None


def _po():
    import pytorch_optimizer  # the dev extra pins it

    return pytorch_optimizer


PEERS = [
    Peer("StableSPAM", lambda: [mo.StableSPAM(), mo.AdamW(weight_decay=0.0, fused=False)],
         "StableSPAM(), AdamW(weight_decay=0.0, fused=False)",
         lambda ps: _po().StableSPAM(ps), "StableSPAM(params)"),
    Peer("SPAM", lambda: [mo.SPAM(), mo.AdamW(eps=1e-6, weight_decay=0.0, fused=False)],
         "SPAM(), AdamW(eps=1e-6, weight_decay=0.0, fused=False)",
         lambda ps: _po().SPAM(ps), "SPAM(params)"),
    Peer("AdaGC", lambda: [mo.AdaGC(), mo.AdamW(weight_decay=0.1, fused=False)],
         "AdaGC(), AdamW(weight_decay=0.1, fused=False)",
         lambda ps: _po().AdaGC(ps), "AdaGC(params)"),
]


def _heavyball_row() -> Peer:
    """AdamW with a global-norm clip at 1.0, heavyball's defaults (3.2.1: `lr=0.0025`, `betas=(0.9, 0.99)`,
    `eps=1e-8`, `weight_decay=0`; `gradient_clipping=utils.global_l2norm_clip`, whose `clip_at` is 1.0).

    modopt's side takes the same values with its default (fused) AdamW kernel, and `ClipNorm(eps=0.0)`:
    heavyball scales by `clip_at / max(norm, clip_at)`, no eps. The arithmetic differs in three places,
    so the two are not bit for bit: heavyball divides by `max(sqrt(v_hat), eps)` where torch's kernel
    divides by `sqrt(v_hat) + eps` (an element whose |gradient| is near eps moves up to twice as far:
    `diff` on these models is this); it keeps bias-corrected moments (an EMA whose weight is
    `(1 - beta) / (1 - beta**t)`) where torch corrects at the end; it sums the squares of all
    gradients for the norm where modopt adds per-tensor norms. By default heavyball also compiles its
    kernels with torch.compile (mode "max-autotune-no-cudagraphs"): the first step pays the compile,
    the timed steps run compiled code, modopt's run eagerly."""
    import heavyball  # noqa: F401  (the row exists only where it is installed)

    @contextlib.contextmanager
    def uncompiled():  # heavyball's compiled helpers run their Python body when compile_mode is None
        mode, heavyball.utils.compile_mode = heavyball.utils.compile_mode, None
        try:
            yield
        finally:
            heavyball.utils.compile_mode = mode

    def make(ps):
        import heavyball
        return heavyball.AdamW(ps, gradient_clipping=heavyball.utils.global_l2norm_clip)

    return Peer("AdamW+clip (heavyball)",
                lambda: [mo.ClipNorm(1.0, eps=0.0), mo.AdamW(lr=0.0025, betas=(0.9, 0.99), weight_decay=0.0)],
                "ClipNorm(1.0, eps=0.0), AdamW(lr=0.0025, betas=(0.9, 0.99), weight_decay=0.0)",
                make, "AdamW(params, gradient_clipping=heavyball.utils.global_l2norm_clip)", lib="heavyball",
                uncompiled=uncompiled)


if importlib.util.find_spec("heavyball") is not None:  # an optional peer: peers.py runs without it
    PEERS.append(_heavyball_row())


@dataclass
class Row:
    model: str
    method: str
    modopt_ms: float
    peer_ms: float
    ratio: float  # median over repeats of each repeat's median paired ratio modopt/peer
    ratios: list[float]
    diff: float
    counts: dict[str, list[float]]


def run_one(peer: Peer, model_name: str, args) -> Row:
    ratios, t_mo, t_pe, diffs = [], [], [], []
    counts: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        torch.manual_seed(rep)
        base, make_batch = build_model(model_name, args.quick)

        def modopt_side(model: nn.Module) -> Side:
            opt = mo.Modular(model.parameters(), *peer.modopt())
            return Side(model, opt.step, _opt_state(opt))

        def peer_side(model: nn.Module) -> Side:
            opt = peer.peer(list(model.parameters()))
            return Side(model, opt.step, _opt_state(opt))

        sides = {"modopt": modopt_side(copy.deepcopy(base)), "peer": peer_side(copy.deepcopy(base))}
        g = torch.Generator().manual_seed(1000 + rep)
        batches = [make_batch(g) for _ in range(args.warmup + args.steps)]
        times = _timed_steps(sides, batches, args.warmup, 1)
        ratios.append(statistics.median(a / b for a, b in zip(times["modopt"], times["peer"])))
        t_mo.append(statistics.median(times["modopt"]))
        t_pe.append(statistics.median(times["peer"]))
        ps_mo, ps_pe = sides["modopt"].params, sides["peer"].params
        scale = max(p.abs().max().item() for p in ps_pe) or 1.0
        diffs.append(max((a - b).abs().max().item() for a, b in zip(ps_mo, ps_pe)) / scale)
        if rep == 0:
            pbytes = sum(p.numel() * p.element_size() for p in ps_pe)
            roots = {"modopt": Path(mo.__file__).parent,
                     "peer": Path(importlib.import_module(peer.lib).__file__).parent}
            for n in sides:
                eager = peer.uncompiled if n == "peer" and peer.uncompiled is not None else contextlib.nullcontext
                with eager():
                    c = _counted(sides[n], batches[0])
                _backward(sides[n], batches[1])
                calls = python_calls(sides[n].step, str(roots[n])).calls
                counts[n] = [c.ops, c.syncs, c.bytes / pbytes, calls]
    return Row(model_name, peer.name, 1e3 * statistics.median(t_mo), 1e3 * statistics.median(t_pe),
               statistics.median(ratios), ratios, max(diffs), counts)


def _counts(c: list[float]) -> str:
    """`ops / syncs / bytes / Python calls` of one step (rows without the calls: the first three)."""
    return " / ".join([f"{int(c[0])}", f"{int(c[1])}", f"{c[2]:.1f}P"] + [f"{int(x)}" for x in c[3:]])


def format_table(rows: list[Row]) -> str:
    head = ["model", "method", "modopt ms", "peer ms", "modopt/peer", "repeats",
            "ops/syncs/bytes/calls modopt", "ops/syncs/bytes/calls peer", "diff"]
    lines = [head] + [[r.model, r.method, f"{r.modopt_ms:.2f}", f"{r.peer_ms:.2f}", f"{r.ratio:.3f}x",
                       " ".join(f"{x:.3f}" for x in r.ratios), _counts(r.counts["modopt"]),
                       _counts(r.counts["peer"]), f"{r.diff:.1e}"] for r in rows]
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    out = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    notes = [f"- {p.name}: modopt `{p.modopt_label}` against `{p.lib}.{p.peer_label}`"
             for p in PEERS if any(r.method == p.name for r in rows)]
    return "\n".join(out + [""] + notes)


#: the line before the peers table on docs/performance.md (`docs_table`); not `bench.DOCS_MARKER`'s form, so
#: tests/test_bench.py's check of the main tables' counts leaves it alone
DOCS_MARKER = "<!-- bench.py --peers --docs; counts made with {versions} -->"


def docs_table(rows: list[Row], versions: str) -> str:
    """The peers table as docs/performance.md publishes it."""
    head = ["model", "method", "modopt ms", "peer ms", "modopt / peer", "repeats",
            "ops / syncs / bytes / Python calls modopt", "the same, peer", "diff"]
    lines = [DOCS_MARKER.format(versions=versions), "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.model, r.method, f"{r.modopt_ms:.2f}", f"{r.peer_ms:.2f}", f"{r.ratio:.3f}x",
                 " ".join(f"{x:.3f}" for x in r.ratios), _counts(r.counts["modopt"]), _counts(r.counts["peer"]),
                 "0" if r.diff == 0 else f"{r.diff:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_rows(methods: list[str] | None, models: list[str], args, report=None) -> list[Row]:
    """`run_one` for each method of `PEERS` (all, or those named in `methods`) on each model, in order;
    `report(row)` after each. `args` has `quick`, `steps`, `warmup` and `repeats`."""
    rows = []
    for peer in PEERS:
        if methods and peer.name not in methods:
            continue
        for model in models:
            rows.append(run_one(peer, model, args))
            if report is not None:
                report(rows[-1])
    return rows


def header(args) -> str:
    """The first line of a run: versions, threads, repeats."""
    libs = "".join(f"{lib} {_version(lib)}, " for lib in dict.fromkeys(p.lib for p in PEERS))
    return (f"modopt peers: torch {torch.__version__}, {libs}"
            f"{torch.get_num_threads()} CPU thread(s), {args.repeats} repeat(s) of {args.steps} timed steps after "
            f"{args.warmup} warm-up{' (quick)' if args.quick else ''}")


def _report(r: Row) -> None:
    print(f"  {r.model:11s} {r.method}: modopt/peer {r.ratio:.3f}x", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, 2 timed steps, 1 repeat (a smoke run)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per repeat (default 20; quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; quick 1)")
    ap.add_argument("--repeats", type=int, default=None, help="independent repeats (default 3; quick 1)")
    ap.add_argument("--models", nargs="+", choices=["mlp", "transformer"], default=["mlp", "transformer"])
    ap.add_argument("--only", nargs="+", choices=[p.name for p in PEERS], default=None, help="only these methods")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = ap.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    torch.set_num_threads(args.threads)
    print(header(args), flush=True)
    rows = run_rows(args.only, args.models, args, _report)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
