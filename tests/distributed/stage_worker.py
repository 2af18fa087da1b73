"""Worker of test_pipeline_stages.py: two pipeline stages (one gloo rank each), each with its own `Modular` over
its stage's parameters and `stage_group` set, against one process that holds every parameter.

    python stage_worker.py MODE PORT OUT      # MODE: host (the CPU's default) or device (`device_path()`)

Each rank writes its parameters after the run and the single process's to OUT.<rank>.pt."""

from __future__ import annotations

import contextlib
import sys

import torch

import modopt as mo
from launch import spawn_ranks

SHAPES = [(8, 6), (8,), (5, 8), (5,)]
STAGE_OF = [0, 0, 1, 1]  # which stage owns each parameter
STEPS = 6
NAN_AT = {3: 2}  # step -> a parameter (of stage 1 only) whose gradient holds a NaN that step

PIPELINES = {
    "ClipNorm+Adam": lambda: [mo.ClipNorm(0.5), mo.Adam(lr=0.01)],
    "mission": lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(lr=0.01)],
    "ZClip+AdamW": lambda: [mo.ZClip(), mo.AdamW(lr=0.01)],
    "ClipNorm(inf)+SGD": lambda: [mo.ClipNorm(0.1, ord="inf"), mo.SGD(lr=0.1)],
    "Centralize(global)+SGD": lambda: [mo.Centralize(scope="global"), mo.SGD(lr=0.1)],
    "ClipNormByRMS(global)+SGD": lambda: [mo.ClipNormByRMS(0.01, scope="global"), mo.SGD(lr=0.1)],
    # torch's non-fused SGD: the host decides the skip (the cheap check, then the exact one)
    "ClipNorm+SGD(host decision)": lambda: [mo.ClipNorm(0.5), mo.SGD(lr=0.1, momentum=0.9, fused=False)],
}


def params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(s, generator=g) * (1 + 5 * (step % 2)) for s in SHAPES]
    if step in NAN_AT:
        out[NAN_AT[step]].view(-1)[0] = float("nan")
    return out


def train(ps: list[torch.nn.Parameter], idx: list[int], pipeline: str, stage_group) -> tuple[list[torch.Tensor], int]:
    opt = mo.Modular(ps, *PIPELINES[pipeline](), stage_group=stage_group, lint=False)
    for k in range(STEPS):
        gs = grads(k)
        for p, i in zip(ps, idx):
            p.grad = gs[i].clone()
        opt.step()
    return [p.detach().clone() for p in ps], int(opt.stats["skipped_steps"])


def job(rank: int, mode: str, out: str) -> None:
    import torch.distributed as dist

    from modopt.core.runner import device_path

    group = dist.group.WORLD
    mine = [i for i, s in enumerate(STAGE_OF) if s == rank]
    result = {}
    with device_path() if mode == "device" else contextlib.nullcontext():
        for name in PIPELINES:
            every = params()
            ref, ref_skipped = train(every, list(range(len(SHAPES))), name, None)
            ps = [params()[i] for i in mine]
            got, skipped = train(ps, mine, name, group)
            result[name] = {"got": got, "ref": [ref[i] for i in mine], "skipped": skipped, "ref_skipped": ref_skipped,
                            "start": [params()[i].detach() for i in mine]}
    torch.save(result, f"{out}.{rank}.pt")


if __name__ == "__main__":
    mode, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    spawn_ranks(2, port, job, mode, out)
