"""`import modopt` against `import torch`, each timed in a fresh interpreter.

    python benchmarks/import_time.py               # 7 pairs of each kind
    python benchmarks/import_time.py --repeats 15

A pair is two fresh interpreters, one running `import torch` and one `import torch; import modopt`
(the order alternates between pairs, so a slow phase of the machine hits both); each times its
imports with `time.perf_counter`, so interpreter start-up is left out. The report gives the median of
each side, their ratio and the median of the per-pair ratios. The goal: at most 1.15x `import torch`
(what modopt adds: pydantic, yaml and its own modules; not `torch._dynamo`, which
`tests/test_import_time.py` checks).

Two kinds of pair. *raw*: as above. *settled*: both sides run `gc.collect()` right after
`import torch`. Importing torch leaves a full garbage collection pending (about 0.08 s on a 2-core
machine): the next few hundred thousand objects any program allocates trigger it, so `import modopt`
(pydantic alone does) pays it in the raw pair while `import torch` on its own exits first. The
settled pair charges it to both sides and shows what modopt itself adds.

Both sides read bytecode from a temporary cache (`PYTHONPYCACHEPREFIX`, filled by an untimed first
run), as an installed package does: with `PYTHONDONTWRITEBYTECODE` set, a source checkout would
compile modopt from source on every import (about 0.1 s that no user pays twice). `--as-is` keeps
the environment as it is.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

PAIRS = {
    "raw": {"torch": "import torch", "torch + modopt": "import torch; import modopt"},
    "settled": {
        "torch": "import torch, gc; gc.collect()",
        "torch + modopt": "import torch, gc; gc.collect(); import modopt",
    },
}


def timed(code: str, env: dict[str, str]) -> float:
    """Seconds that `code` takes in a fresh interpreter."""
    script = f"import time; t = time.perf_counter(); {code}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def run(sides: dict[str, str], repeats: int, env: dict[str, str]) -> dict[str, list[float]]:
    """Each side's times, `repeats` pairs."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    for i in range(repeats):
        for side in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            times[side].append(timed(sides[side], env))
    return times


def report(kind: str, times: dict[str, list[float]]) -> None:
    base, both = (statistics.median(ts) for ts in times.values())
    pair = statistics.median(b / a for a, b in zip(*times.values()))
    print(f"{kind}:")
    for side, ts in times.items():
        print(f"  {side:>15}: median {statistics.median(ts):.3f} s  ({', '.join(f'{t:.2f}' for t in ts)})")
    print(f"  ratio of medians: {both / base:.3f}x import torch; median per-pair ratio: {pair:.3f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="pairs of each kind (default 7)")
    ap.add_argument("--as-is", action="store_true", help="no temporary bytecode cache: the environment as it is")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="modopt-pyc-") as cache:
        env = dict(os.environ)
        if not args.as_is:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = cache
        timed(PAIRS["raw"]["torch + modopt"], env)  # fills the file cache and the bytecode cache: not timed
        for kind, sides in PAIRS.items():
            report(kind, run(sides, args.repeats, env))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
