"""Compiled against eager, with the defaults, for every benchmark pipeline (issue 18 item 4).

    python benchmarks/compile_pipelines.py                 # both models, 20 timed steps after 4 warm-up
    python benchmarks/compile_pipelines.py --models mlp --steps 30 --only ZClip

For each pipeline of `benchmarks/bench.py` and each model, two copies of the model train on the same
batches: one with `opt.step()` in eager mode, one with `torch.compile(opt.step, fullgraph=True)` (both
with every default: `nonfinite="skip"`, decided on the device). Every iteration runs forward and
backward on both, then times each side's step alone (`time.perf_counter`, the order alternating);
the first steps (compilation, state creation) are the warm-up. A row gives the median step times and
the median of the per-iteration ratios compiled/eager (a paired statistic). An `Accumulate(4)` row
times one call, not a cycle. The parameters after the run are compared: compiled code rounds
differently (inductor fuses and reorders), so they agree to rounding, not bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import PIPELINES, build_model, loss_fn  # noqa: E402

import modopt as mo  # noqa: E402


def run(pipe, model_name: str, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    base, make = build_model(model_name, quick=False)
    models = {"eager": copy.deepcopy(base), "compiled": copy.deepcopy(base)}
    opts = {n: mo.Modular(m.parameters(), *pipe.modopt()) for n, m in models.items()}
    steps_of = {"eager": opts["eager"].step, "compiled": torch.compile(opts["compiled"].step, fullgraph=True)}
    g = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    ratios: list[float] = []
    for i in range(warmup + steps):
        batch = make(g)
        got = {}
        for n in (("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")):
            for p in models[n].parameters():
                p.grad = None
            loss_fn(models[n], *batch).backward()
            t0 = time.perf_counter()
            steps_of[n]()
            got[n] = time.perf_counter() - t0
        if i >= warmup:
            for n in got:
                times[n].append(got[n])
            ratios.append(got["compiled"] / got["eager"])
    diff = max((p - q).abs().max().item() for p, q in zip(models["eager"].parameters(), models["compiled"].parameters()))
    scale = max(p.abs().max().item() for p in models["eager"].parameters())
    return {"pipeline": pipe.name, "model": model_name, "eager_ms": statistics.median(times["eager"]) * 1e3,
            "compiled_ms": statistics.median(times["compiled"]) * 1e3, "ratio": statistics.median(ratios),
            "diff": diff / scale}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=["mlp", "transformer"], default=["mlp", "transformer"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--only", default=None, help="only pipelines whose name contains this text")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.steps} timed steps after "
          f"{args.warmup} warm-up; fullgraph=True against eager, the defaults")
    print("| pipeline | model | eager ms | compiled ms | compiled / eager | max diff (relative) |")
    print("|---|---|---|---|---|---|")
    for pipe in PIPELINES:
        if args.only and args.only not in pipe.name:
            continue
        for model_name in args.models:
            torch._dynamo.reset()
            r = run(pipe, model_name, args.steps, args.warmup)
            print(f"| `{r['pipeline']}` | {r['model']} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | "
                  f"{r['ratio']:.3f}x | {r['diff']:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
