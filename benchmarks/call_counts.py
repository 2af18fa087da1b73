"""The Python work of one default step, counted: calls, functions, files and file-to-file hops.

    python benchmarks/call_counts.py            # the table
    python benchmarks/call_counts.py --trace    # and the calls of modopt's step, in order

One steady-state `opt.step()` (after three warm-up steps, a real backward before each) on a 3-layer MLP,
under `sys.setprofile`. A call counts when its code lives in the library's own files (modopt's package
for modopt; torch's package for torch): `calls` are Python function calls there, `functions` the distinct
ones, `files` the distinct files, `hops` the calls whose file differs from the caller's file (a reader
following the step jumps that often). C functions (torch's ops) are not Python calls and are not counted:
`benchmarks/step_counts.py` counts the aten ops.

Sides: modopt's `Modular(params, ClipNorm(1.0), Adam())` with its defaults, and the hand-written torch
step it replaces, `clip_grad_norm_(params, 1.0)` + `torch.optim.Adam(fused=True).step()`. The counts do
not depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import torch

import modopt as mo


@dataclass
class Count:
    calls: int = 0
    functions: set = field(default_factory=set)
    files: set = field(default_factory=set)
    hops: int = 0
    trace: list = field(default_factory=list)


def count(step, root: str) -> Count:
    """The Python calls `step()` makes into files under `root`."""
    out = Count()
    root = os.path.realpath(root) + os.sep
    here = os.path.realpath(__file__)

    def prof(frame, event, arg):
        if event != "call":
            return
        fn = os.path.realpath(frame.f_code.co_filename)
        if not fn.startswith(root) or fn == here:
            return
        out.calls += 1
        name = f"{os.path.relpath(fn, root)}:{frame.f_code.co_name}"
        out.functions.add(name)
        out.files.add(fn)
        caller = frame.f_back
        if caller is not None and os.path.realpath(caller.f_code.co_filename) != fn:
            out.hops += 1
        out.trace.append(name)

    sys.setprofile(prof)
    try:
        step()
    finally:
        sys.setprofile(None)
    return out


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 10))


def measure() -> dict[str, Count]:
    x, y = torch.randn(16, 32), torch.randn(16, 10)
    model_m, model_t = mlp(), mlp()
    opt_m = mo.Modular(model_m.parameters(), mo.ClipNorm(1.0), mo.Adam())
    params_t = list(model_t.parameters())  # (a list, as a careful loop keeps it: not the module's generator)
    opt_t = torch.optim.Adam(params_t, fused=True)

    def torch_step():
        torch.nn.utils.clip_grad_norm_(params_t, 1.0)
        opt_t.step()

    out = {}
    for name, model, step, root in (("modopt", model_m, opt_m.step, os.path.dirname(mo.__file__)),
                                    ("torch", model_t, torch_step, os.path.dirname(torch.__file__))):
        for k in range(4):
            model.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            if k == 3:
                out[name] = count(step, root)
            else:
                step()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="store_true", help="also print modopt's calls in order")
    args = ap.parse_args(argv)
    rows = measure()
    print(f"one steady-state step, torch {torch.__version__}\n")
    print("| step | Python calls | functions | files | file-to-file hops |")
    print("|---|---|---|---|---|")
    labels = {"modopt": "`Modular(ps, ClipNorm(1.0), Adam())`",
              "torch": "`clip_grad_norm_` + `Adam(fused=True)`"}
    for name, c in rows.items():
        print(f"| {labels[name]} | {c.calls} | {len(c.functions)} | {len(c.files)} | {c.hops} |")
    if args.trace:
        print("\nmodopt's calls, in order:")
        for name in rows["modopt"].trace:
            print(" ", name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
