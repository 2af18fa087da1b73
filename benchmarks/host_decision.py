"""Where the non-finite skip is decided, timed: on a CPU the host reads the decision back, on a GPU the
device keeps it. This runs modopt against itself in one process, both ways, on a CPU.

    python benchmarks/host_decision.py                 # 8 and 512 tensors of 256 elements
    python benchmarks/host_decision.py --tensors 8 2048 --steps 300

Each side is the same pipeline over its own copy of the same parameters and gradients, with
the CPU's default (one `.item()` a step, the plain chain) or inside `modopt.core.runner.device_path()`
(the device path a GPU runs: no sync, skip-aware kernels, the cleaning pass). Medians of the per-step
times after 20 warm-up steps, the median over repeats; 1 thread. Ratios carry across machines, not times.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import modopt as mo
from modopt.core import runner

PIPELINES = {
    "ClipNorm(1.0), Adam()": lambda: [mo.ClipNorm(1.0), mo.Adam()],
    "ClipNormByEMA(), Normalize(), Adam()": lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam()],
    "Accumulate(4), ClipNorm(1.0), Adam()": lambda: [mo.Accumulate(4), mo.ClipNorm(1.0), mo.Adam()],
}


def step_time(n: int, make, host: bool, steps: int) -> float:
    """Median microseconds of one `opt.step()` over `n` tensors of 256 elements."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(256, generator=g)) for _ in range(n)]
    grads = [torch.randn(256, generator=g) for _ in range(n)]
    opt = mo.Modular(ps, *make(), lint=False)
    times = []
    with contextlib.nullcontext() if host else runner.device_path():
        for _ in range(steps):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
    return statistics.median(times[20:]) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, nargs="+", default=[8, 512])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, host read / device path\n")
    print("| pipeline | tensors | host us | device us | host / device |")
    print("|---|---|---|---|---|")
    for name, make in PIPELINES.items():
        for n in args.tensors:
            runs = [(step_time(n, make, True, args.steps), step_time(n, make, False, args.steps))
                    for _ in range(args.repeats)]
            h, d = statistics.median(a for a, _ in runs), statistics.median(b for _, b in runs)
            print(f"| `{name}` | {n} | {h:.0f} | {d:.0f} | {h / d:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
