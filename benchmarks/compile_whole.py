"""What `mo.compile_step(opt)` buys over the eager step, `torch.compile(opt.step)` and hand-written steps.

    python benchmarks/compile_whole.py [--steps 40] [--warmup 8] [--cases 8,64,512,64x16,mlp,transformer]
                                       [--pipeline clipnorm|mission|zclip] [--only "own guards" ...]

`ClipNorm(1.0) + Adam()` (the defaults: `nonfinite="skip"`) on 8 or 64 tensors of 256x256, on N tensors
of S elements (a case `NxS`: `64x16` measures the fixed cost of a call), or on the bench MLP (8 tensors,
5.8M parameters), every side in one process on the same gradients, in a rotating
order, one thread. Sides:

* `eager`: `opt.step()`;
* `torch.compile`: `torch.compile(opt.step, fullgraph=True)` (the traced multi-tensor Adam);
* `compile_step`: `mo.compile_step(opt)` (torch's fused Adam kept as one op: the eager bits);
* `compile_step, own guards`: the same with `guards="own"` (modopt's own key; dynamo's guards only when it changes);
* `compile_step, tensor guards`: the same with `guards="tensors"`;
* `compile_step, no guards`: the same with every dynamo guard dropped (unsafe: what the guards cost);
* `hand eager`: `clip_grad_norm_` + `torch.optim.Adam(fused=True)`, `if norm.isfinite()`;
* `hand compiled`: the same algorithm hand-written per tensor with a device-side skip, compiled with
  `fullgraph=True` (inductor's loops for Adam).

Reports the median wall and CPU time (`time.process_time`) per step, their ratios to `eager`, and the
largest difference of each side's parameters from `eager`'s at the end (0: the same bits). The guard
cost per call is `compile_step` minus `compile_step, no guards`. The machine may be shared: rough figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import build_model  # noqa: E402

import modopt as mo  # noqa: E402
from modopt.core.compiled import own_key  # noqa: E402


PIPELINES = {
    "clipnorm": lambda: [mo.ClipNorm(1.0), mo.Adam()],
    "mission": lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam()],
    "zclip": lambda: [mo.ZClip(), mo.AdamW()],
}
PIPELINE = "clipnorm"  # (--pipeline; the hand-written sides are ClipNorm + Adam's, run only for it)
#: --only: run just the sides whose names contain one of these (eager always runs)
ONLY: list[str] = []


def tensors(case: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    if case in ("mlp", "transformer"):
        return [p.detach().clone() for p in build_model(case, quick=False)[0].parameters()]
    if "x" in case:  # N tensors of S elements: the fixed cost per call where the kernels cost little
        n, size = map(int, case.split("x"))
        return [torch.randn(size) for _ in range(n)]
    return [torch.randn(256, 256) for _ in range(int(case))]


def hand_eager(ps):
    opt = torch.optim.Adam(ps, fused=True)

    def step():
        norm = torch.nn.utils.clip_grad_norm_(ps, 1.0)
        if norm.isfinite():
            opt.step()
    return step


def hand_compiled(ps, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    st = [torch.zeros(()) for _ in ps]

    @torch.compile(fullgraph=True)
    @torch.no_grad()
    def step():
        gs = [p.grad for p in ps]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs]))
        skip = ~(total < float("inf"))
        c = torch.clamp(1.0 / (total + 1e-6), max=1.0)
        for i, p in enumerate(ps):
            g = gs[i] * c
            t = st[i] + (~skip).float()
            st[i].copy_(t)
            mi = torch.where(skip, m[i], torch.lerp(m[i], g, 1 - b1))
            vi = torch.where(skip, v[i], v[i] * b2 + g * g * (1 - b2))
            u = mi / ((vi.sqrt() / (1 - b2 ** t).sqrt()) + eps) * (lr / (1 - b1 ** t))
            m[i].copy_(mi)
            v[i].copy_(vi)
            p.sub_(torch.where(skip, 0.0, u))
    return step


def sides() -> dict:
    def modular(ps):
        return mo.Modular(ps, *PIPELINES[PIPELINE]())
    out = {
        "eager": lambda ps: modular(ps).step,
        "torch.compile": lambda ps: torch.compile(modular(ps).step, fullgraph=True),
        "compile_step": lambda ps: mo.compile_step(modular(ps)),
        "compile_step, own guards": lambda ps: mo.compile_step(modular(ps), guards="own"),
        "compile_step, tensor guards": lambda ps: mo.compile_step(modular(ps), guards="tensors"),
        "compile_step, no guards": lambda ps: mo.compile_step(
            modular(ps), options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}),
        "hand eager": hand_eager,
        "hand compiled": hand_compiled,
    }
    if PIPELINE != "clipnorm":
        del out["hand eager"], out["hand compiled"]
    if ONLY:
        out = {n: b for n, b in out.items() if n == "eager" or any(o in n for o in ONLY)}
    return out


def run_case(case: str, steps: int, warmup: int) -> None:
    base = tensors(case)
    runs = {}
    for name, build in sides().items():
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        runs[name] = (ps, build(ps))
    names = list(runs)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    key = []  # guards="own": `own_key` alone, right after fresh gradients (as inside the call)
    for it in range(warmup + steps):
        g = torch.Generator().manual_seed(it)
        grads = [torch.randn(b.shape, generator=g) for b in base]
        order = names[it % len(names):] + names[:it % len(names)]
        for n in order:
            ps, step = runs[n]
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            t1, c1 = time.perf_counter(), time.process_time()
            if it >= warmup:
                wall[n].append(t1 - t0)
                cpu[n].append(c1 - c0)
                if n == "compile_step, own guards":
                    for p, gr in zip(ps, grads):
                        p.grad = gr.clone()
                    t0 = time.perf_counter()
                    own_key(step.opt)
                    key.append(time.perf_counter() - t0)
    ew, ec = statistics.median(wall["eager"]), statistics.median(cpu["eager"])
    ref = runs["eager"][0]
    label = {"mlp": "bench MLP", "transformer": "bench transformer"}.get(
        case, f"{case.split('x')[0]} tensors of {case.split('x')[1]} elements" if "x" in case else f"{case} tensors of 256x256")
    print(f"\n{PIPELINE}, {label} ({len(base)} tensors, {sum(b.numel() for b in base) / 1e6:.2f}M parameters)")
    print("| side | wall ms | CPU ms | wall / eager | CPU / eager | max diff from eager |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in names:
        w, c = statistics.median(wall[n]), statistics.median(cpu[n])
        diff = max(float((p - q).abs().max()) for p, q in zip(runs[n][0], ref))
        print(f"| {n} | {w * 1e3:.3f} | {c * 1e3:.3f} | {w / ew:.2f} | {c / ec:.2f} | {diff:.2g} |")
    if "compile_step" in cpu and "compile_step, no guards" in cpu:
        guard = statistics.median(cpu["compile_step"]) - statistics.median(cpu["compile_step, no guards"])
        print(f"guard cost per call (compile_step - no guards, CPU): {guard * 1e6:.0f} us")
    if key:
        print(f"own key per call (guards=\"own\", after fresh gradients, wall): {statistics.median(key) * 1e6:.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--cases", default="8,64,512,mlp,transformer")
    ap.add_argument("--pipeline", choices=sorted(PIPELINES), default="clipnorm")
    ap.add_argument("--only", nargs="*", default=[],
                    help='sides to run besides eager, by part of their name (e.g. "own guards"): at hundreds of '
                         "tensors the plain torch.compile and the hand-written compiled step take many minutes to compile")
    a = ap.parse_args()
    global PIPELINE, ONLY
    PIPELINE, ONLY = a.pipeline, a.only
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {a.steps} steps after {a.warmup}, 1 thread")
    for case in a.cases.split(","):
        run_case(case, a.steps, a.warmup)


if __name__ == "__main__":
    main()
