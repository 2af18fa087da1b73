"""modopt against an earlier modopt, in one process: the step's cost on many small tensors, then and now.

    python benchmarks/against_commit.py                       # the mission at 512, 1024, 2048 tensors vs a73d81a
    python benchmarks/against_commit.py --tensors 512 --pipelines mission accumulate --steps 200
    python benchmarks/against_commit.py --commit 8fc2c71

The earlier commit's package comes out of this checkout's git history (`git archive COMMIT modopt`) into a
temporary folder under another name (`modopt_<commit>`; its imports are relative, and any absolute
`modopt` import in the copy is rewritten to the new name), so both versions are imported side by side.
Without git, or without the commit in the history (a shallow clone, an unpacked sdist), the script says
so and exits 0.

Default commit: a73d81a, the last one before the non-finite skip was decided on the device (issue 43:
"the skip costs no more per tensor than it did before the device-side skip existed"). Sides, each on its
own copy of the same parameters, with the same gradients every iteration:

* **then**: the earlier `Modular(params, *pipeline)` with its defaults;
* **now, host**: this checkout's `Modular` with its defaults; on a CPU the step reads the skip
  decision back on the host (one `.item()`, which there only reads memory) and runs the plain chain;
* **now, device**: the same, each step inside `modopt.core.runner.device_path()`: the decision kept
  on the device, no sync, the cleaning pass and the skip-aware kernels (what a GPU runs).

Timing: every iteration times each side's `opt.step()` alone with `time.perf_counter`, in an order that
rotates each iteration, the garbage collector paused; a repeat reports the median of the per-iteration
ratios now/then (paired: a slow phase of the machine hits all sides), the table the median over repeats
with each repeat's value. 1 thread by default. Ratios carry across machines, not times. `diff` is the
largest difference between the parameters of a now side and the then side after a repeat, relative
to the largest parameter (0: bit for bit).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

import modopt as mo
from modopt.core import runner

PIPELINES = {
    "mission": lambda m: [m.ClipNormByEMA(), m.Normalize(), m.Adam()],
    "clipnorm": lambda m: [m.ClipNorm(1.0), m.Adam()],
    "accumulate": lambda m: [m.Accumulate(4), m.ClipNorm(1.0), m.Adam()],
}
LABELS = {"mission": "`ClipNormByEMA(), Normalize(), Adam()`", "clipnorm": "`ClipNorm(1.0), Adam()`",
          "accumulate": "`Accumulate(4), ClipNorm(1.0), Adam()` (one call)"}

_ABSOLUTE = re.compile(r"^(\s*)(from|import)\s+modopt\b", re.M)


def load_commit(commit: str, into: Path) -> ModuleType | str:
    """The package `modopt` of `commit`, imported as `modopt_<commit>`; or why it cannot be."""
    root = Path(__file__).resolve().parents[1]
    try:
        tar = subprocess.run(["git", "-C", str(root), "archive", commit, "modopt"], capture_output=True, check=True).stdout
    except FileNotFoundError:
        return "git is not installed"
    except subprocess.CalledProcessError as e:
        return f"git archive {commit} failed ({e.stderr.decode().strip() or 'no output'}): no git history here?"
    name = f"modopt_{re.sub(r'[^0-9A-Za-z_]', '_', commit)}"
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    (into / "modopt").rename(into / name)
    for f in (into / name).rglob("*.py"):
        text = f.read_text()
        fixed = _ABSOLUTE.sub(lambda m: f"{m.group(1)}{m.group(2)} {name}", text)
        if fixed != text:
            f.write_text(fixed)
    sys.path.insert(0, str(into))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(into))


def one_repeat(old: ModuleType, pipeline: str, n: int, steps: int, warmup: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(256, generator=g) for _ in range(n)]
    params = {s: [torch.nn.Parameter(b.clone()) for b in base] for s in ("then", "host", "device")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lint: the mission's clip is cancelled by its Normalize, as designed
        opts = {"then": old.Modular(params["then"], *PIPELINES[pipeline](old)),
                "host": mo.Modular(params["host"], *PIPELINES[pipeline](mo)),
                "device": mo.Modular(params["device"], *PIPELINES[pipeline](mo))}
    paths = {"then": contextlib.nullcontext, "host": contextlib.nullcontext, "device": runner.device_path}
    names = list(opts)
    times: dict[str, list[float]] = {s: [] for s in names}
    for k in range(warmup + steps):
        grads = [torch.randn(256, generator=g) for _ in range(n)]
        order = names[k % 3:] + names[:k % 3]
        for s in order:
            for p, gr in zip(params[s], grads):
                p.grad = gr.clone()
            with paths[s]():
                t0 = time.perf_counter()
                opts[s].step()
                spent = time.perf_counter() - t0
            if k >= warmup:
                times[s].append(spent)
    scale = max(float(p.detach().abs().max()) for p in params["then"]) or 1.0
    out = {"us": {s: statistics.median(t) * 1e6 for s, t in times.items()}}
    for s in ("host", "device"):
        out[s] = statistics.median(a / b for a, b in zip(times[s], times["then"]))
        out[f"diff_{s}"] = max(float((p - q).detach().abs().max()) for p, q in zip(params[s], params["then"])) / scale
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default="a73d81a", help="the earlier commit (default a73d81a)")
    ap.add_argument("--pipelines", nargs="+", choices=list(PIPELINES), default=["mission"])
    ap.add_argument("--tensors", type=int, nargs="+", default=[512, 1024, 2048], help="tensors of 256 elements")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per repeat (default 100)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="modopt-then-"))
    try:
        old = load_commit(args.commit, tmp)
        if isinstance(old, str):
            print(f"skipped: modopt at {args.commit} is not available: {old}")
            return 0
        print(f"modopt now ({Path(mo.__file__).parent}) against modopt at {args.commit} (imported as {old.__name__}), "
              f"torch {torch.__version__}, {args.threads} thread(s), {args.repeats} repeat(s) of {args.steps} timed "
              f"steps after {args.warmup}\n")
        print("| pipeline | tensors x 256 | then us | now host us | now device us | now host / then (repeats) | "
              "now device / then (repeats) | diff host / device |")
        print("|---|---|---|---|---|---|---|---|")
        gc_was = gc.isenabled()
        gc.disable()
        try:
            for pipeline in args.pipelines:
                for n in args.tensors:
                    runs = [one_repeat(old, pipeline, n, args.steps, args.warmup, seed) for seed in range(args.repeats)]

                    def med(key, runs=runs):
                        return statistics.median(r[key] for r in runs)

                    def us(side, runs=runs):
                        return statistics.median(r["us"][side] for r in runs)

                    def each(key, runs=runs):
                        return ", ".join(f"{r[key]:.3f}" for r in runs)

                    print(f"| {LABELS[pipeline]} | {n} | {us('then'):.0f} | {us('host'):.0f} | {us('device'):.0f} | "
                          f"{med('host'):.3f}x ({each('host')}) | {med('device'):.3f}x ({each('device')}) | "
                          f"{max(r['diff_host'] for r in runs):.1e} / {max(r['diff_device'] for r in runs):.1e} |",
                          flush=True)
        finally:
            if gc_was:
                gc.enable()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
