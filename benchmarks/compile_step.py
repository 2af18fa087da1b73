"""What compiling ``opt.step`` buys, with the default non-finite check and without it.

usage: python benchmarks/compile_step.py [steps=30] [warmup=5] [device=cpu]

One ~5M-parameter MLP, ``Modular(ps, ClipNorm(1.0), Adam())``, timed as ``opt.step()`` after a
real backward, in seven ways (each with its own copy of the model, all starting equal):

* ``eager skip``: the defaults in eager mode (``nonfinite="skip"``, decided on the device: no
  host sync; the fused Adam kernel takes the decision as ``found_inf``);
* ``eager ignore``: eager, no check (what the check costs, by difference);
* ``eager zero``: eager, ``nonfinite="zero"`` (for the compiled ``zero`` row);
* ``compile skip``: ``torch.compile(opt.step)`` with the defaults (one graph);
* ``fullgraph skip``: ``torch.compile(opt.step, fullgraph=True)`` with the defaults;
* ``fullgraph ignore``: ``torch.compile(opt.step, fullgraph=True)``, ``nonfinite="ignore"``;
* ``fullgraph zero``: the same with ``nonfinite="zero"`` (non-finite elements set to 0 on the device).

Every iteration runs all seven on the same batch, in an order that rotates, and each step time is
divided by the ``eager skip`` time of the same iteration; the table gives the median step time and
the median of those per-iteration ratios. The first calls (compilation, state creation) are
excluded by the warm-up; "first call" is the first step's time, compilation included (much less
when inductor's on-disk cache already holds the graphs from an earlier run). The machine may be
shared: the figures are rough.
"""
from __future__ import annotations

import copy
import statistics
import sys
import time

import torch
from bench import build_model  # the benchmark's MLP (this script runs from benchmarks/, beside bench.py)

import modopt as mo


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    warmup = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    device = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cpu")
    torch.manual_seed(0)
    base = build_model("mlp", quick=False)[0].to(device)
    variants = {  # name: (policy, how step is compiled: None, "plain" or "fullgraph")
        "eager skip": ("skip", None),
        "eager ignore": ("ignore", None),
        "eager zero": ("zero", None),
        "compile skip": ("skip", "plain"),
        "fullgraph skip": ("skip", "fullgraph"),
        "fullgraph ignore": ("ignore", "fullgraph"),
        "fullgraph zero": ("zero", "fullgraph"),
    }
    runs = {}
    for name, (policy, how) in variants.items():
        model = copy.deepcopy(base)
        opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(), nonfinite=policy)
        step = opt.step if how is None else torch.compile(opt.step, fullgraph=how == "fullgraph")
        runs[name] = (model, opt, step)
    g = torch.Generator().manual_seed(1)

    def one(name: str, x: torch.Tensor) -> float:
        model, opt, step = runs[name]
        opt.zero_grad()
        model(x).square().mean().backward()
        sync(device)
        t = time.perf_counter()
        step()
        sync(device)
        return time.perf_counter() - t

    names = list(variants)
    first: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(warmup):
        x = torch.randn(64, 1024, generator=g).to(device)
        for n in names:
            first[n].append(one(n, x))
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for i in range(steps):
        x = torch.randn(64, 1024, generator=g).to(device)
        k = i % len(names)
        order = names[k:] + names[:k]
        got = {n: one(n, x) for n in order}
        for n in names:
            times[n].append(got[n])
            ratios[n].append(got[n] / got["eager skip"])
    ref = list(runs["eager skip"][0].parameters())
    n_params = sum(p.numel() for p in ref)
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads; MLP {n_params / 1e6:.2f}M params, "
          f"{len(ref)} tensors; ClipNorm(1.0) + Adam(); {steps} timed steps after {warmup} warm-up")
    print(f"| {'variant':<16} | {'step (median)':>13} | {'/ eager skip (median of ratios)':>31} "
          f"| {'first call':>10} | {'max |param - eager skip|':>24} |")
    print("|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate((16, 13, 31, 10, 24))) + "|")
    for n in names:
        diff = max((p - q).abs().max().item() for p, q in zip(runs[n][0].parameters(), ref))
        print(f"| {n:<16} | {statistics.median(times[n]) * 1e3:10.2f} ms | {statistics.median(ratios[n]):31.3f} "
              f"| {first[n][0]:8.2f} s | {diff:24.1e} |")


if __name__ == "__main__":
    main()
