"""Worker of the 2-D mesh tests: ``python mesh2d_worker.py MODE PORT OUT`` spawns 4 gloo ranks on 127.0.0.1.

MODE is ``mesh2d`` (a 2x2 mesh ``("dp", "tp")``: tensor parallel over ``tp`` as torchtitan lays out a
transformer block, then FSDP2 over ``dp``) or ``single`` (the same model unsharded, one process, the
full batch). Each case trains ``STEPS`` steps; rank 0 saves ``{case: {...}}`` to OUT.

Under the 2-D layout the parameters are DTensors on the 2x2 mesh with two placements each:

* ``ColwiseParallel`` weights and biases: sharded on dim 0 over ``tp`` and again over ``dp``
  (``(_StridedShard(0), Shard(0))``);
* ``RowwiseParallel`` weights: ``(Shard(0), Shard(1))``; their biases ``(Shard(0), Replicate())``;
* ``SequenceParallel`` norm weights: ``(Shard(0), Replicate())``.

So a statistic must be summed over both dims for some tensors and over ``dp`` alone for others
(summing the ``Replicate`` dim would count those tensors twice).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.nn as nn

import modopt as mo

STEPS = 4
WORLD = 4
BATCH, SEQ, FEAT, DIM, HIDDEN, OUT = 4, 4, 6, 8, 12, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.tanh(self.w1(self.norm(x))))


class Model(nn.Module):
    """A transformer-ish stack: an input projection, two residual MLP blocks with pre-norm, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEAT, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(self.norm(h))


def make_model() -> Model:
    torch.manual_seed(0)
    m = Model()
    with torch.no_grad():  # LayerNorm starts at (1, 0): move it off so that its statistics matter
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def parallelize(model: Model, mesh) -> Model:
    """torchtitan's layout on CPU: TP over mesh["tp"] (sequence parallel between blocks), then FSDP2 over mesh["dp"]."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "inp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),  # h: sharded on the sequence
        "norm": SequenceParallel(),
        "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.blocks:
        parallelize_module(block, tp, {
            "norm": SequenceParallel(),
            "w1": ColwiseParallel(input_layouts=Shard(1)),
            "w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def param_groups(model) -> list[dict]:
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named[:6]], "param_names": [n for n, _ in named[:6]]},
        {"params": [p for _, p in named[6:]], "param_names": [n for n, _ in named[6:]]},
    ]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(BATCH, SEQ, FEAT, generator=g) * (1 + step % 3)
    y = torch.randn(BATCH, SEQ, OUT, generator=g)
    return x, y


def dp_batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dp rank's half of `batch(step)` (both tp ranks of a dp rank see the same half)."""
    x, y = batch(step)
    h = BATCH // 2
    return x[dp_rank * h : (dp_rank + 1) * h], y[dp_rank * h : (dp_rank + 1) * h]


def cases() -> dict[str, list]:
    """name -> a fresh pipeline (small thresholds: every clip acts)."""
    return {
        "SGD": [mo.SGD(lr=0.1)],  # no statistic: how far the sharded model alone is from the single-process one
        "ClipNorm-global": [mo.ClipNorm(0.05), mo.SGD(lr=0.1)],
        "ClipNorm-global-l1-linf-l0": [mo.ClipNorm(0.5, ord="l1"), mo.ClipNorm(0.004, ord="linf"),
                                       mo.ClipNorm(40.0, ord=0), mo.SGD(lr=0.1)],
        "ClipNorm-global-std-mad-sum": [mo.ClipNorm(0.002, ord="std"), mo.ClipNorm(0.001, ord="mad"),
                                        mo.ClipNorm(0.001, ord="sum"), mo.SGD(lr=0.1)],
        "ClipNorm-group": [mo.ClipNorm(0.03, scope="group"), mo.SGD(lr=0.1)],
        "ClipNorm-tensor": [mo.ClipNorm(0.01, scope="tensor"), mo.SGD(lr=0.1)],
        "Normalize-tensor": [mo.Normalize(0.01), mo.SGD(lr=0.1)],
        "Centralize-ZScoreNormalize": [mo.Centralize(), mo.ZScoreNormalize(), mo.SGD(lr=0.01)],
        "Centralize-global-Normalize-global": [mo.Centralize(scope="global"), mo.Normalize(0.02, scope="global"),
                                               mo.SGD(lr=0.1)],
        "ClipValueByPercentile-tensor": [mo.ClipValueByPercentile(50), mo.SGD(lr=0.1)],
        "ClipValueByPercentile-global": [mo.ClipValueByPercentile(30, scope="global"), mo.SGD(lr=0.1)],
        "AutoClip-HistClip": [mo.AutoClip(percentile=30), mo.HistClip(warmup_steps=2, warmup_max_norm=0.05),
                              mo.SGD(lr=0.1)],
        "ZClip-ClipNormByEMA": [mo.ZClip(warmup_steps=2, max_grad_norm=0.05), mo.ClipNormByEMA(beta=0.5, scope="tensor"),
                                mo.AdamW(lr=0.01)],
    }


def build(mode: str, mesh):
    model = make_model()
    if mode == "mesh2d":
        parallelize(model, mesh)
    return model


def loss_of(model, x, y) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def full_params(model) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def data(mode: str, step: int, mesh):
    return batch(step) if mode == "single" else dp_batch(step, mesh.get_local_rank("dp"))


def train(mode: str, mesh, pipeline: list) -> dict:
    model = build(mode, mesh)
    opt = mo.Modular(param_groups(model), *pipeline)
    acted = False
    for step in range(STEPS):
        x, y = data(mode, step, mesh)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        acted |= any(bool((v != 1).any()) if k.endswith(".scale") else bool(v.any())
                     for k, v in opt.stats.items() if k.endswith((".clipped", ".scale")))
    placements = sorted({tuple(str(pl) for pl in p.placements) for p in model.parameters() if hasattr(p, "placements")})
    plain = all(type(v) is torch.Tensor for store in opt._store.values() for v in store.values()
                if isinstance(v, torch.Tensor))
    return {"params": full_params(model), "acted": acted, "plain_state": plain, "placements": placements,
            "agree": _ranks_agree(model, mode), "error": None}


def _ranks_agree(model, mode: str) -> bool:
    """Every rank ends with the same full parameters (bit for bit)."""
    if mode == "single":
        return True
    import torch.distributed as dist

    flat = torch.cat([p.reshape(-1) for p in full_params(model)])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


def _all_ranks_equal(flags: list[float]) -> bool:
    import torch.distributed as dist

    t = torch.tensor(flags, dtype=torch.float64)
    hi, lo = t.clone(), t.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


#: the non-finite skip (on the device, the default policy): one rank alone plants a NaN in its local shard
#: of a gradient, at NAN_STEPS[i] in the i-th named parameter (a Replicate-over-tp one, then a fully sharded one)
SKIP_CASE, SKIP_STEPS, NAN_PLANTS = "__skip__", 5, {1: ("blocks.0.w2.bias", 1), 3: ("blocks.1.w1.weight", 2)}


def skip_pipeline() -> list:
    return [mo.ClipNorm(0.05), mo.Adam(lr=0.01)]


def run_skip(mode: str, mesh) -> dict:
    model = build(mode, mesh)
    opt = mo.Modular(param_groups(model), *skip_pipeline())
    named = dict(model.named_parameters())
    skipped = []
    for step in range(SKIP_STEPS):
        if mode == "single" and step in NAN_PLANTS:  # the reference leaves those steps out
            skipped.append(True)
            continue
        x, y = data(mode, step, mesh)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        if step in NAN_PLANTS:
            name, rank = NAN_PLANTS[step]
            import torch.distributed as dist

            if dist.get_rank() == rank:
                local = named[name].grad.to_local()
                assert local.numel(), f"rank {rank} holds no element of {name}"
                local.view(-1)[0] = float("nan")
        opt.step()
        skipped.append(bool(opt.stats["skipped"]))
    out = {"params": full_params(model), "skipped": skipped, "on_device": opt._skip_on_device, "error": None,
           "agree": _ranks_agree(model, mode)}
    if mode != "single":
        out["skips_agree"] = _all_ranks_equal([float(s) for s in skipped])
    return out


#: SkipStep on the loss: at LOSS_SPIKE_STEP rank 3 alone (dp 1, tp 1) reports a loss 1000x its own
LOSS_CASE, LOSS_STEPS, LOSS_SPIKE_STEP, LOSS_RANK = "__skipstep-loss__", 6, 4, 3


def run_skipstep_loss(mode: str, mesh) -> dict:
    import torch.distributed as dist

    model = build(mode, mesh)
    opt = mo.Modular(param_groups(model), mo.SkipStep(watch="loss", window=8, min_steps=3), mo.SGD(lr=0.05))
    skipped = []
    for step in range(LOSS_STEPS):
        x, y = data(mode, step, mesh)
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        spike = step == LOSS_SPIKE_STEP and dist.get_rank() == LOSS_RANK
        opt.step(loss=loss.detach() * (1000.0 if spike else 1.0))
        skipped.append(bool(opt.stats["skipped"]))
    return {"skipped": skipped, "skips_agree": _all_ranks_equal([float(s) for s in skipped]),
            "agree": _ranks_agree(model, mode), "params": full_params(model), "error": None}


#: the loss every rank decides on (SkipStep(watch="loss") and Rewind take `distributed.world_mean` of the
#: loss they are given): the mean over the 4 ranks is the mean over dp (the tp ranks of a dp rank hold the
#: same loss), and a NaN in rank WORLD_MEAN_NAN_RANK's loss alone reaches every rank
WORLD_MEAN_CASE, WORLD_MEAN_NAN_RANK = "__world-mean__", 2


def run_world_mean(mode: str, mesh) -> dict:
    import torch.distributed as dist
    from modopt.core import distributed

    model = build(mode, mesh)
    x, y = data(mode, 0, mesh)
    loss = loss_of(model, x, y).detach()
    mean = distributed.world_mean(loss)
    nan = distributed.world_mean(torch.full_like(loss, float("nan")) if dist.get_rank() == WORLD_MEAN_NAN_RANK
                                 else loss)
    return {"mean": mean, "mean_agrees": _all_ranks_equal([mean.item()]),
            "nan_everywhere": _all_ranks_equal([float(torch.isnan(nan))]) and bool(torch.isnan(nan)), "error": None}


#: a control: the same global clip with every statistic also summed over the Replicate dims (the
#: whole-world all-reduce bug) must give another trajectory, or the tests could not see that bug
DOUBLE_COUNT_CASE = "__double-count-control__"


def run_double_count(mode: str, mesh) -> dict:
    from modopt.core import distributed

    real = distributed.groups_of

    def every_dim(t, where=""):
        return tuple(t.device_mesh.get_group(d) for d in range(t.device_mesh.ndim)) if distributed.is_sharded(t) else ()

    distributed.groups_of = every_dim  # (the groups partial sums are summed over)
    try:
        return train(mode, mesh, [mo.ClipNorm(0.05), mo.SGD(lr=0.1)])
    finally:
        distributed.groups_of = real


def run_all(mode: str, mesh) -> dict:
    results: dict = {}
    only = os.environ.get("MESH2D_ONLY")  # (debugging: a comma-separated subset of the cases)
    for name, pipeline in cases().items():
        if only and name not in only.split(","):
            continue
        try:
            results[name] = train(mode, mesh, pipeline)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    extra = {SKIP_CASE: run_skip}
    if mode != "single":
        extra.update({LOSS_CASE: run_skipstep_loss, WORLD_MEAN_CASE: run_world_mean, DOUBLE_COUNT_CASE: run_double_count})
    for name, fn in extra.items():
        if only and name not in only.split(","):
            continue
        try:
            results[name] = fn(mode, mesh)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


def _rank_main(rank: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = run_all("mesh2d", mesh)
    if rank == 0:
        torch.save(results, out)


def main(argv: list[str]) -> None:
    mode, port, out = argv[0], int(argv[1]), argv[2]
    if mode == "single":
        torch.set_num_threads(1)
        torch.save(run_all(mode, None), out)
        return
    from launch import spawn_ranks

    spawn_ranks(WORLD, port, _rank_main, out)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main(sys.argv[1:])
