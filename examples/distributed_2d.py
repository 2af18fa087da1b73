"""FSDP2 x tensor parallel on a 2x2 mesh (torchtitan's layout), Muon + AdamW split by `mo.Masked`.

Four gloo processes on 127.0.0.1 train a small transformer (token embedding, two pre-norm blocks of causal
self-attention and an MLP, a final norm, an output head) laid out as torchtitan lays out a transformer:
tensor parallel over the mesh dim "tp" (attention heads and MLP columns split; sequence parallel between
the blocks), then FSDP2 over "dp". The hidden matrices of the blocks train with `mo.Muon`, the embedding,
the head, the norms and the biases with `mo.AdamW`, after one global `ClipNorm` of the full gradient.

The same training then runs in this process, unsharded, on the whole batch: the script prints the time per
step of both and the largest difference between their final parameters.

    python examples/distributed_2d.py                        # 20 steps
    python examples/distributed_2d.py --sharded dtensor      # Muon's Newton-Schulz as sharded matmuls
    python examples/distributed_2d.py --quick                # 2 steps (CI)

On GPUs: backend "nccl", `init_device_mesh("cuda", ...)`, the model on the rank's device, and `torchrun`
instead of `mp.spawn`; nothing else changes.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import modopt as mo

VOCAB, DIM, HEADS, HIDDEN, LAYERS = 64, 32, 4, 64, 2
BATCH, SEQ = 8, 16  # SEQ: a multiple of the tp size (sequence parallel splits it)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them (torchtitan's rule)
        q, k, v = (w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(DIM), Attention()
        self.mlp_norm, self.mlp = nn.LayerNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer()


def parallelize(model: Transformer, mesh) -> Transformer:
    """torchtitan's plan: tensor parallel over mesh["tp"] (sequence parallel between blocks), then FSDP2 over mesh["dp"]."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),  # h: split on the sequence
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp, {
            "attn_norm": SequenceParallel(),
            "attn.wq": ColwiseParallel(input_layouts=Shard(1)),  # the heads split over tp
            "attn.wk": ColwiseParallel(input_layouts=Shard(1)),
            "attn.wv": ColwiseParallel(input_layouts=Shard(1)),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp.w1": ColwiseParallel(input_layouts=Shard(1)),
            "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def param_groups(model: nn.Module) -> list[dict]:
    """Two param groups: the hidden matrices of the blocks (Muon) and everything else (AdamW: the embedding, the
    head, the norms, the biases). Each branch reads its own lr and weight decay from its group."""
    named = list(model.named_parameters())
    hidden = [(n, p) for n, p in named if n.startswith("layers.") and p.dim() == 2]
    rest = [(n, p) for n, p in named if not (n.startswith("layers.") and p.dim() == 2)]
    return [{"name": name, "params": [p for _, p in ps], "param_names": [n for n, _ in ps]}
            for name, ps in (("muon", hidden), ("adamw", rest))]


def optimizer(model: nn.Module, sharded: str = "owner", ns_dtype: str = "bfloat16") -> mo.Modular:
    return mo.Modular(
        param_groups(model),
        mo.ClipNorm(1.0),  # the 2-norm of the full gradient (all-reduced over the mesh dims that split each tensor)
        mo.Masked(mo.Muon(0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype, sharded=sharded),
                  where=mo.Select(groups=["muon"])),
        mo.Masked(mo.AdamW(3e-3, weight_decay=0.01), where=mo.Select(groups=["adamw"])),
    )


def batch(step: int) -> torch.Tensor:
    """The global batch of a step: BATCH sequences of SEQ + 1 tokens (inputs and shifted targets)."""
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def train(model: nn.Module, opt: mo.Modular, steps: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[list, list]:
    """`steps` steps on this dp rank's share of each global batch: (losses of this share, seconds per step)."""
    losses, seconds = [], []
    per = BATCH // dp_size
    for step in range(steps):
        tokens = batch(step)[dp_rank * per : (dp_rank + 1) * per]  # the tp ranks of a dp rank: the same share
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()  # FSDP2 averages the gradients over dp: the whole batch's gradient
        opt.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, seconds


def rank_main(rank: int, world: int, port: int, steps: int, sharded: str, ns_dtype: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import warnings

    # the head's replicated output is a view of the gathered tensor; nothing here writes into it in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize(make_model(), mesh)
        opt = optimizer(model, sharded, ns_dtype)
        losses, seconds = train(model, opt, steps, mesh.get_local_rank("dp"), mesh.size(0))
        slowest = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank's ends
        params = full_params(model)  # (collective: every rank)
        if rank == 0:
            placements = {n: tuple(str(pl) for pl in p.placements) for n, p in model.named_parameters()}
            torch.save({"params": params, "losses": losses, "seconds": slowest.tolist(), "placements": placements}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_2d(steps: int, sharded: str = "owner", ns_dtype: str = "bfloat16", port: int | None = None,
           out: str | None = None) -> dict:
    """Train on 4 spawned processes (a 2x2 mesh); rank 0's results."""
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = out or os.path.join(tmp, "2d.pt")
        mp.spawn(rank_main, args=(4, port, steps, sharded, ns_dtype, path), nprocs=4, join=True)
        return torch.load(path, weights_only=True)


def run_single(steps: int, ns_dtype: str = "bfloat16") -> dict:
    """The same training in this process: the unsharded model, the whole batch."""
    torch.set_num_threads(1)
    model = make_model()
    losses, seconds = train(model, optimizer(model, ns_dtype=ns_dtype), steps)
    return {"params": full_params(model), "losses": losses, "seconds": seconds}


def max_diff(a: dict, b: dict) -> tuple[float, str]:
    return max(((a[n] - b[n]).abs().max().item(), n) for n in a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sharded", choices=["owner", "dtensor"], default="owner")
    ap.add_argument("--ns-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="Muon's Newton-Schulz precision (float32: the run agrees with one process to float32 rounding)")
    ap.add_argument("--quick", action="store_true", help="2 steps")
    args = ap.parse_args()
    steps = 2 if args.quick else args.steps
    two_d, one = run_2d(steps, args.sharded, args.ns_dtype), run_single(steps, args.ns_dtype)
    for step in range(steps):
        print(f"step {step:2d}: loss (dp rank 0's half) {two_d['losses'][step]:.4f}, one process {one['losses'][step]:.4f}")
    timed = slice(1, None) if steps > 1 else slice(None)  # the first step builds the state
    print(f"time per step: 2x2 mesh {1e3 * statistics.median(two_d['seconds'][timed]):.1f} ms, "
          f"one process {1e3 * statistics.median(one['seconds'][timed]):.1f} ms (median of {len(one['seconds'][timed])})")
    diff, name = max_diff(two_d["params"], one["params"])
    print(f"largest |2x2 mesh - one process| over the parameters after {steps} steps: {diff:.2e} ({name})")


if __name__ == "__main__":
    main()
