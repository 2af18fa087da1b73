"""`mo.compile_step` and `mo.cuda_graph_step` against the eager step on one device: the largest
parameter difference after a few steps, and the step time of each, for `ClipNorm + Adam` and the
mission (`ClipNormByEMA + Normalize + Adam`: its EMA is an op of the graph, `modopt::lerp_`).

    python benchmarks/captured_step.py [device=cuda] [steps=20]

On a CPU only the compiled row runs (a CUDA graph needs CUDA). `scripts/gpu-check compile` runs it.
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch

import modopt as mo


PIPELINES = {
    "ClipNorm(1.0)+Adam": lambda: [mo.ClipNorm(1.0), mo.Adam(lr=1e-3)],
    "mission": lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(lr=1e-3)],
}


def main() -> None:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    warnings.filterwarnings("ignore")
    for label, pipeline in PIPELINES.items():
        run(device, steps, label, pipeline)


def run(device: torch.device, steps: int, label: str, pipeline) -> None:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    base = [torch.randn(256, 256, device=device) for _ in range(8)]
    grads = [[torch.randn(256, 256, device=device) for _ in base] for _ in range(steps + 4)]
    sides = {}
    for name in ("eager", "compile_step") + (("cuda_graph_step",) if device.type == "cuda" else ()):
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(ps, grads[0]):
            p.grad = g.clone()
        opt = mo.Modular(ps, *pipeline())
        mo.tensor_hyperparams(opt)
        sides[name] = [ps, opt, None]
    times = {n: [] for n in sides}
    for it in range(steps):
        for name, side in sides.items():
            ps, opt, step = side
            for p, g in zip(ps, grads[it]):
                p.grad.copy_(g)  # the same .grad tensors: what a captured graph reads
            if step is None:  # built at the first step (cuda_graph_step runs its own warm-up steps on these grads)
                step = side[2] = {"eager": opt.step, "compile_step": mo.compile_step(opt)}.get(name) \
                    or mo.cuda_graph_step(opt, warmup=1)
                if name == "cuda_graph_step":
                    continue  # its warm-up took this step
            sync()
            t = time.perf_counter()
            step()
            sync()
            times[name].append(time.perf_counter() - t)
    ref = sides["eager"][0]
    print(f"torch {torch.__version__}, {device}, {label}, 8 tensors of 256x256, {steps} steps")
    for name, (ps, _, _) in sides.items():
        diff = max(float((p - q).abs().max()) for p, q in zip(ps, ref))
        print(f"{name:16s} median step {statistics.median(times[name][3:]) * 1e3:.3f} ms  max diff from eager {diff:.3g}")


if __name__ == "__main__":
    main()
