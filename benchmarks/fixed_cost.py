"""The fixed cost of a default step: many small tensors, where the Python around the kernels decides.

    python benchmarks/fixed_cost.py                      # 8, 128 and 512 tensors of 256 elements
    python benchmarks/fixed_cost.py --tensors 8 --repeats 7

Sides, each on its own copy of the same parameters, with the same gradients every iteration:

* modopt: `Modular(params, ClipNorm(1.0), Adam())` with every default (the non-finite check decided on
  the device);
* torch: `clip_grad_norm_(params, 1.0)` then `torch.optim.Adam(params, fused=True).step()`, no finite
  check (the cheapest hand-written step: a careful loop adds one).

Each iteration times both steps alone with `time.perf_counter`, in an order that alternates; a repeat
reports the median of the per-iteration ratios modopt/torch (paired: a slow phase of the machine hits
both), and the table the median over repeats with each repeat's value. One thread (`torch.set_num_threads
(1)`), the garbage collector paused while timing. Ratios, not absolute times, are what carries across
machines; the machine may be shared.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import modopt as mo


def one_repeat(n: int, size: int, steps: int, warmup: int, seed: int) -> tuple[float, float, float, float]:
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(size, generator=g) for _ in range(n)]
    pm = [torch.nn.Parameter(b.clone()) for b in base]
    pt = [torch.nn.Parameter(b.clone()) for b in base]
    opt_m = mo.Modular(pm, mo.ClipNorm(1.0), mo.Adam())
    opt_t = torch.optim.Adam(pt, fused=True)

    def step_t():
        torch.nn.utils.clip_grad_norm_(pt, 1.0)
        opt_t.step()

    ratios, tm, tt = [], [], []
    for k in range(warmup + steps):
        grads = [torch.randn(size, generator=g) for _ in range(n)]
        for p, q, gr in zip(pm, pt, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        times = {}
        order = (("m", opt_m.step), ("t", step_t)) if k % 2 else (("t", step_t), ("m", opt_m.step))
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - t0
        if k >= warmup:
            ratios.append(times["m"] / times["t"])
            tm.append(times["m"])
            tt.append(times["t"])
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(pm, pt))
    return statistics.median(ratios), statistics.median(tm) * 1e6, statistics.median(tt) * 1e6, diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, nargs="+", default=[8, 128, 512])
    ap.add_argument("--size", type=int, default=256, help="elements per tensor (default 256)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.repeats} repeats of {args.steps} timed steps\n")
    print("| tensors x elements | modopt us | torch us | modopt/torch | repeats | max diff |")
    print("|---|---|---|---|---|---|")
    gc.disable()
    try:
        for n in args.tensors:
            runs = [one_repeat(n, args.size, args.steps, args.warmup, seed) for seed in range(args.repeats)]
            r = statistics.median(x[0] for x in runs)
            print(f"| {n} x {args.size} | {statistics.median(x[1] for x in runs):.0f} | "
                  f"{statistics.median(x[2] for x in runs):.0f} | {r:.3f}x | "
                  f"{' / '.join(f'{x[0]:.3f}' for x in runs)} | {max(x[3] for x in runs):.1e} |", flush=True)
    finally:
        gc.enable()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
