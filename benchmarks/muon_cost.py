"""What Muon adds to a step of the benchmark's models: Newton-Schulz FLOPs, against the forward and
backward, and the parameters it orthogonalizes.

    python benchmarks/muon_cost.py             # the models of benchmarks/bench.py
    python benchmarks/muon_cost.py --quick     # their tiny versions

For each model, the 2-D parameters (the ones `bench.py`'s Muon row gives to Muon) are counted with
their Newton-Schulz FLOPs per step (`modopt.transforms.orthogonal.newton_schulz_flops`, 5 steps), and
the FLOPs of one optimizer step and of one forward + backward on the benchmark's batch are measured
with `torch.utils.flop_counter.FlopCounterMode` (matrix products only, as that counter counts them).
The bytes a step moves are in bench.py's `ops/syncs/bytes` columns.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

import modopt as mo  # noqa: E402
from modopt.transforms.orthogonal import newton_schulz_flops  # noqa: E402


def measure(model_name: str, quick: bool) -> dict:
    torch.manual_seed(0)
    model, make = bench.build_model(model_name, quick)
    g = torch.Generator().manual_seed(0)
    batch = make(g)
    mats = [p for p in model.parameters() if p.dim() == 2]
    formula = sum(newton_schulz_flops(p.shape[0], p.shape[1], 5) for p in mats)
    with FlopCounterMode(display=False) as fb:
        bench.loss_fn(model, *batch).backward()
    sides = {"modopt": None, "torch": None}
    m1, m2 = copy.deepcopy(model), copy.deepcopy(model)
    pipe = next(p for p in bench.PIPELINES if p.name.startswith("Muon"))
    sides["modopt"] = bench.modopt_side(pipe.modopt, None, pipe.groups)(m1)
    sides["torch"] = pipe.torch(m2, True)
    steps = {}
    for name, side in sides.items():
        for p, q in zip(side.model.parameters(), model.parameters()):
            p.grad = q.grad.clone()
        with FlopCounterMode(display=False) as fc:
            side.step()
        steps[name] = fc.get_total_flops()
    return {
        "model": model_name, "params": sum(p.numel() for p in model.parameters()), "matrices": len(mats),
        "matrix_params": sum(p.numel() for p in mats), "ns_formula": formula,
        "step_modopt": steps["modopt"], "step_torch": steps["torch"], "fwd_bwd": fb.get_total_flops(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny models")
    args = ap.parse_args(argv)
    print("| model | parameters | matrices (their parameters) | Newton-Schulz GFLOP/step (formula) "
          "| step GFLOP modopt / torch (counted) | forward+backward GFLOP | step / (forward+backward) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in ("mlp", "transformer"):
        r = measure(name, args.quick)
        print(f"| {name} | {r['params'] / 1e6:.2f}M | {r['matrices']} ({r['matrix_params'] / 1e6:.2f}M) "
              f"| {r['ns_formula'] / 1e9:.2f} | {r['step_modopt'] / 1e9:.2f} / {r['step_torch'] / 1e9:.2f} "
              f"| {r['fwd_bwd'] / 1e9:.3f} | {r['step_torch'] / r['fwd_bwd']:.0f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
