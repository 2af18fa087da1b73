"""Muon under FSDP2 on CPU (gloo): the owner-rank Newton-Schulz against DTensor's sharded matrix products.

    PYTHONPATH=$PWD python benchmarks/owner_rank_muon.py [--world 2] [--dim 128] [--steps 6] [--ns-dtype bfloat16]

Spawns `--world` gloo ranks on 127.0.0.1, shards a stack of Linear layers with `fully_shard` (every weight
`Shard(0)`; shapes dim x dim (x6), 3dim x dim, dim x 3dim, and an uneven (dim - 28) x dim), sets fixed
gradients and times `opt.step()` of `mo.Muon(sharded=...)` for both paths, alternating, after a warm-up.
Prints, per path: the median step time (the slowest rank's), and the collectives of one step with the bytes
this rank sends (modelled per algorithm: an all-gather sends its input to each of the W - 1 other ranks,
an all-to-all its input less the part it keeps, a ring all-reduce 2 (W - 1) / W of its input). The
collectives are counted with `CommDebugMode` (which sees DTensor's own ones) plus the sizes of their inputs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def model(dim: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(dim, dim, bias=False) for _ in range(6)]
    layers += [torch.nn.Linear(dim, 3 * dim, bias=False), torch.nn.Linear(3 * dim, dim, bias=False),
               torch.nn.Linear(dim, dim - 28, bias=False)]
    return torch.nn.Sequential(*layers)


def counter(world: int):
    from torch.distributed.tensor.debug import CommDebugMode

    class Bytes(CommDebugMode):
        """CommDebugMode that also adds up the bytes each collective sends from this rank."""

        def __init__(self):
            super().__init__()
            self.sent = 0
            self.calls: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._overloadpacket.__name__
            if func.namespace in ("c10d", "_c10d_functional", "c10d_functional") and name not in (
                    "wait_tensor", "_wrap_tensor_autograd"):
                self.calls[name] = self.calls.get(name, 0) + 1
                if name.startswith("all_gather"):
                    t = args[0]
                    self.sent += t.numel() * t.element_size() * (world - 1)
                elif name.startswith("alltoall"):
                    out, inp, _, out_splits, in_splits = args[:5]
                    keep = in_splits[dist.get_rank()] if in_splits else inp.numel() // world
                    self.sent += (inp.numel() - keep) * inp.element_size()
                elif name.startswith(("allreduce", "all_reduce")):
                    ts = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                    self.sent += sum(t.numel() * t.element_size() for t in ts) * 2 * (world - 1) // world
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Bytes


def rank_main(rank: int, world: int, port: int, args) -> None:
    import modopt as mo
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    Bytes = counter(world)
    net = model(args.dim)
    for layer in net:
        fully_shard(layer)
    fully_shard(net)
    gen = torch.Generator().manual_seed(1)
    for p in net.parameters():
        p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), p.device_mesh, p.placements)
    opts = {s: mo.Modular(net.parameters(), mo.Muon(1e-4, ns_dtype=args.ns_dtype, sharded=s))
            for s in ("owner", "dtensor")}
    times: dict[str, list[float]] = {s: [] for s in opts}
    comm = {}
    for s, opt in opts.items():  # warm-up, and the collectives of one step
        opt.step()
        with Bytes() as c:
            opt.step()
        comm[s] = (c.sent, dict(c.calls))
    for _ in range(args.steps):
        for s, opt in opts.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank's ends
            times[s].append(dt.item())
    if rank == 0:
        n = sum(p.numel() for p in net.parameters())
        print(f"world {world}, {n} matrix elements in {len(list(net.parameters()))} matrices, ns_dtype "
              f"{args.ns_dtype}, {args.steps} timed steps each, torch {torch.__version__}")
        for s in opts:
            sent, calls = comm[s]
            med = statistics.median(times[s]) * 1e3
            print(f"  sharded={s!r:10s} step {med:8.1f} ms (median)   sent by rank 0: {sent / 1e6:7.3f} MB/step   "
                  f"collectives: {calls}")
        ratio = statistics.median(times["dtensor"]) / statistics.median(times["owner"])
        print(f"  dtensor / owner step time: {ratio:.2f}x")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--port", type=int, default=29671)
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(args.world, args.port, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
