"""The aten op count of one optimizer step over many expert tensors, next to torch's clip + fused AdamW.

    python benchmarks/expert_counts.py              # E = 2048 experts of 16 x 16, as E tensors and as one stack
    python benchmarks/expert_counts.py --experts 256 --dim 32

A mixture-of-experts layer holds its experts either as E separate tensors (E parameters) or as one stacked
weight `(E, d, d)` (torchtitan's layout: one parameter). For each, one process on the CPU, gradients given: 3
warm-up steps, then the 4th counted under `bench.StepCounter` (aten ops other than views, host syncs; modopt's
step takes the device path, as on a GPU), for

* modopt: `mo.Modular(params, mo.ClipNorm(1.0), mo.AdamW())` (its defaults: torch's fused kernel);
* torch: `torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)` then `torch.optim.AdamW(fused=True).step()`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import StepCounter  # noqa: E402

import modopt as mo  # noqa: E402
from modopt.core import runner  # noqa: E402


def params_of(layout: str, experts: int, dim: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    if layout == "stack":
        return [torch.nn.Parameter(torch.randn(experts, dim, dim, generator=g))]
    return [torch.nn.Parameter(torch.randn(dim, dim, generator=g)) for _ in range(experts)]


def count(ps: list[torch.nn.Parameter], step) -> StepCounter:
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        if i == 3:
            with StepCounter() as c:
                step()
            return c
        with runner.device_path():
            step()
    raise AssertionError  # pragma: no cover


def rows(experts: int, dim: int) -> list[dict]:
    out = []
    for layout in ("tensors", "stack"):
        ps = params_of(layout, experts, dim)
        opt = mo.Modular(ps, mo.ClipNorm(1.0), mo.AdamW())
        c = count(ps, opt.step)
        out.append({"layout": layout, "side": "modopt ClipNorm(1.0), AdamW()", "params": len(ps), "ops": c.ops,
                    "syncs": c.syncs})
        ps = params_of(layout, experts, dim)
        topt = torch.optim.AdamW(ps, fused=True)

        def torch_step():
            torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
            topt.step()

        c = count(ps, torch_step)
        out.append({"layout": layout, "side": "torch clip_grad_norm_(foreach=True) + AdamW(fused=True)",
                    "params": len(ps), "ops": c.ops, "syncs": c.syncs})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=16)
    a = ap.parse_args(argv)
    print(f"one step, {a.experts} experts of {a.dim} x {a.dim}, torch {torch.__version__}\n")
    print("| experts as | step | parameters | aten ops | host syncs |\n|---|---|---|---|---|")
    for r in rows(a.experts, a.dim):
        print(f"| {r['layout']} | {r['side']} | {r['params']} | {r['ops']} | {r['syncs']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
