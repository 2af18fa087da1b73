"""What the per-mesh split costs a step: parameters on two meshes against the same parameters on one.

    python benchmarks/per_mesh_cost.py                 # 8 dense matrices of 64 x 64 and a stack of 16 experts
    python benchmarks/per_mesh_cost.py --dense 32 --experts 64 --steps 60

An expert-parallel model keeps its dense parameters on one device mesh and its expert stack on another (plus
plain tensors, a router). DTensor refuses a multi-tensor op over several meshes, so `Modular` then steps under
`modopt.core.distributed.per_mesh_mode`, a torch function mode that runs each `_foreach_*` op once per mesh.
The mode sees every torch call of the step; this measures what that costs, in one process (gloo, world size 1,
two meshes of one rank each: the same tensors, only the split differs), for `ClipNorm(1.0), AdamW()`:

* one mesh: the dense matrices and the stack as DTensors on one mesh, the router a DTensor there too (no split);
* two meshes: the dense matrices on mesh "fsdp", the stack on mesh "ep", the router a plain tensor (the split).

Printed per step: modopt's Python calls (`call_counts.count`, the mode's own included), torch's Python calls,
and the median wall time of `--steps` steps, the two sides interleaved step by step. The calls do not depend on
the machine; the times do (and are loose on a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from call_counts import count  # noqa: E402

import modopt as mo  # noqa: E402


def build(two_meshes: bool, dense: int, experts: int, dim: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    fsdp = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    ep = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)) if two_meshes else fsdp
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(distribute_tensor(torch.randn(dim, dim, generator=g), fsdp, [Shard(0)]))
          for _ in range(dense)]
    ps.append(torch.nn.Parameter(distribute_tensor(torch.randn(experts, dim, dim, generator=g), ep, [Shard(0)])))
    router = torch.randn(experts, dim, generator=g)
    ps.append(torch.nn.Parameter(router if two_meshes else distribute_tensor(router, fsdp, [Replicate()])))
    opt = mo.Modular(ps, mo.ClipNorm(1.0), mo.AdamW())
    assert (opt._per_mesh is not None) == two_meshes  # (the split is on exactly where the meshes are mixed)
    return ps, opt


def set_grads(ps, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    for p in ps:
        local = torch.randn(p.shape, generator=g)
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor
            p.grad = distribute_tensor(local, p.device_mesh, p.placements)
        else:
            p.grad = local


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dense", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    try:
        sides = {name: build(two, args.dense, args.experts, args.dim) for name, two in
                 (("one mesh", False), ("two meshes (split)", True))}
        for ps, opt in sides.values():
            for k in range(3):  # warm-up: state made, the layout's plans built
                set_grads(ps, k)
                opt.step()
        mo_root = str(Path(mo.__file__).parent)
        torch_root = str(Path(torch.__file__).parent)
        calls = {}
        for name, (ps, opt) in sides.items():
            set_grads(ps, 3)
            calls[name] = (count(opt.step, mo_root).calls,)
            set_grads(ps, 4)
            calls[name] += (count(opt.step, torch_root).calls,)
        times: dict[str, list[float]] = {name: [] for name in sides}
        for k in range(args.steps):
            for name, (ps, opt) in sides.items():
                set_grads(ps, 10 + k)
                t0 = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - t0)
        print(f"{args.dense} dense {args.dim} x {args.dim}, a stack of {args.experts}, a router; "
              f"ClipNorm(1.0), AdamW(); torch {torch.__version__}, 1 thread, median of {args.steps} steps\n")
        print("| layout | modopt Python calls | torch Python calls | ms/step |")
        print("|---|---|---|---|")
        for name in sides:
            print(f"| {name} | {calls[name][0]} | {calls[name][1]} | {1e3 * statistics.median(times[name]):.2f} |")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
