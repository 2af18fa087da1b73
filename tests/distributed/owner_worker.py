"""Worker of the owner-rank Newton-Schulz tests: ``python owner_worker.py MODE PORT OUT``.

MODE is ``fsdp`` (2 gloo ranks, FSDP2 on a 1-D mesh: every parameter ``Shard(0)``), ``hsdp`` (4 ranks on a
2x2 mesh, FSDP2 over "shard" and replicated over "replicate": ``(Replicate(), Shard(0))``, a matrix split over
one mesh dim and copied over the other), ``tp2d`` (4 ranks on a 2x2 mesh ("dp", "tp"): tensor parallel over "tp",
then FSDP2 over "dp", torchtitan's layout: matrices split over both mesh dims, `tensor_parallel`) or ``single``
(no process group). Rank 0 saves the results to OUT.

Two kinds of run per case:

* ``given``: the gradients are set, not computed: each step every parameter's full gradient is drawn from a
  seeded generator and each rank takes its shard of it (``distribute_tensor``), so the optimizer sees the
  single-process gradients bit for bit and the comparison isolates the optimizer: the owner path must equal
  the single process bit for bit (the owner reassembles each full matrix and runs the same kernels);
* ``train``: a real forward and backward on each rank's half of the batch, the gradients averaged by FSDP2
  (another reduction order than one process: compared within float32 rounding).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

import modopt as mo

STEPS = 4


def make_model() -> torch.nn.Module:
    """Several matrix shapes: three 8x8 (batched on an owner), 8x6, 5x8 (5 rows: uneven shards, 3 + 2; on 4
    ranks 2 + 2 + 1 + 0), 1x5 (one row: the other rank holds an empty shard), and biases (not matrices)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
        torch.nn.Tanh(), torch.nn.Linear(8, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 5), torch.nn.Tanh(),
        torch.nn.Linear(5, 1),
    )


def param_groups(model):
    ps = list(model.parameters())
    return [{"params": ps[:4]}, {"params": ps[4:]}]


def cases() -> dict[str, object]:
    """name -> a function of `sharded` giving a fresh pipeline."""
    return {
        "Muon-bf16": lambda s: [mo.Muon(0.05, sharded=s)],
        "Muon-float32": lambda s: [mo.Muon(0.05, ns_dtype="float32", sharded=s)],
        "Muon-nonesterov-adjust": lambda s: [mo.Muon(0.05, nesterov=False, adjust_lr_fn="match_rms_adamw",
                                                     ns_dtype="float32", sharded=s)],
        "Momentum-Orthogonalize-SGD": lambda s: [mo.Momentum(0.9), mo.Orthogonalize(ns_dtype="float32", sharded=s),
                                                 mo.SGD(lr=0.05)],
        # a statistic of the orthogonalized DTensors after it (all-reduced norms)
        "Orthogonalize-bf16-ClipNorm-SGD": lambda s: [mo.Momentum(0.9), mo.Orthogonalize(adjust_lr="original", sharded=s),
                                                 mo.ClipNorm(0.5), mo.SGD(lr=0.05)],
        # NorMuon after the owner-rank orthogonalization: per-row (and, per="larger", per-column) second moments as
        # DTensors, row sums all-reduced over the mesh dims that split the columns
        "Orthogonalize-NorMuon-SGD": lambda s: [mo.Momentum(0.95), mo.Orthogonalize(adjust_lr="original",
                                                ns_dtype="float32", sharded=s), mo.NorMuon(), mo.SGD(lr=0.05)],
        "Orthogonalize-NorMuon-larger-SGD": lambda s: [mo.Momentum(0.95), mo.Orthogonalize(ns_dtype="float32", sharded=s),
                                                       mo.NorMuon(per="larger"), mo.SGD(lr=0.05)],
        # AdaMuon: its Newton-Schulz on the owner rank, the elementwise moment on the shards, the norm all-reduced
        "AdaMuon-float32": lambda s: [mo.AdaMuon(0.05, ns_dtype="float32", sharded=s)],
        # the update path of Muon (not the last transform)
        "Muon-then-ClipNorm": lambda s: [mo.Muon(0.05, ns_dtype="float32", sharded=s), mo.ClipNorm(0.5)],
    }


def given_grad(step: int, i: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + i)
    return torch.randn(shape, generator=g) * (1 + i % 3)


def batch(step: int, n: int = 8):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)


def shard(model, mesh) -> None:
    """FSDP2 over the mesh (HSDP over a 2-D one); on a ("dp", "tp") mesh tensor parallel over "tp" first."""
    from torch.distributed.fsdp import fully_shard

    if mesh.mesh_dim_names == ("dp", "tp"):
        tensor_parallel(model, mesh["tp"])
        mesh = mesh["dp"]
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def tensor_parallel(model, tp) -> None:
    """Column- and row-parallel Linears alternately (Megatron's MLP pairs) on the 8-wide layers: column-parallel
    weights and biases end `(_StridedShard(0), Shard(0))` after FSDP2, row-parallel weights `(Shard(0), Shard(1))`,
    their biases `(Shard(0), Replicate())`. The 5x8 and 1x5 layers are replicated over tp (`distribute_module`,
    then `(Shard(0), Replicate())`: uneven and empty shards over dp): DTensor's tensor parallel takes no
    activation split unevenly over tp."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp, {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(),
                                   "6": RowwiseParallel()})
    for i in ("8", "10"):
        distribute_module(model.get_submodule(i), tp,
                          input_fn=lambda mod, inputs, mesh: tuple(DTensor.from_local(x, mesh, [Replicate()])
                                                                   for x in inputs),
                          output_fn=lambda mod, out, mesh: out.to_local())


def local_grad(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`g` (a full gradient) as a DTensor laid out as `p`. FSDP2's `(_StridedShard(d), Shard(d))` over tensor
    parallelism, which `distribute_tensor` refuses in torch 2.13, is cut as FSDP2 cuts it: the tp rank's
    `torch.chunk` of `g`, then the dp rank's chunk of that."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not any(type(pl).__name__ == "_StridedShard" for pl in p.placements):
        return distribute_tensor(g, p.device_mesh, p.placements)
    mesh, d = p.device_mesh, p.placements[1].dim
    piece = g.chunk(mesh.size(1), dim=d)[mesh.get_local_rank(1)]
    chunks = piece.chunk(mesh.size(0), dim=d)
    r = mesh.get_local_rank(0)
    local = chunks[r] if r < len(chunks) else piece.narrow(d, 0, 0)
    assert local.shape == p.to_local().shape, (local.shape, p.to_local().shape)
    return DTensor.from_local(local.contiguous(), mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()


def run_case(mode: str, mesh, kind: str, pipeline: list, dp_rank: int, dp_size: int) -> list[torch.Tensor]:
    model = make_model()
    if mode != "single":
        shard(model, mesh)
    opt = mo.Modular(param_groups(model), *pipeline)
    for step in range(STEPS):
        opt.zero_grad()
        if kind == "given":
            for i, p in enumerate(model.parameters()):
                g = given_grad(step, i, p.shape)
                p.grad = g if mode == "single" else local_grad(g, p)
        else:
            x, y = batch(step)
            if mode != "single":
                n = x.shape[0] // dp_size
                x, y = x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]
            (model(x) - y).pow(2).mean().backward()
        opt.step()
    return [full(p) for p in model.parameters()]


def run_skip(mode: str, mesh, rank: int, sharded: str) -> dict:
    """Muon (owner path) with the default non-finite policy: at step 2 rank 1 alone puts a NaN into its shard of
    a gradient. Every rank must skip that step, leaving the parameters and the momentum buffers bit for bit,
    with no host sync in any step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Syncs(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
                Syncs.n += 1
            return func(*args, **(kwargs or {}))

    from modopt.core import runner

    model = make_model()
    shard(model, mesh)
    opt = mo.Modular(param_groups(model), mo.Muon(0.05, sharded=sharded))
    skipped, unchanged = [], None
    for step in range(4):
        opt.zero_grad()
        for i, p in enumerate(model.parameters()):
            p.grad = local_grad(given_grad(step, i, p.shape), p)
        if step == 2 and rank == 1:
            next(p.grad.to_local() for p in model.parameters() if p.grad.to_local().numel()).view(-1)[0] = float("nan")
        before = [p.to_local().clone() for p in model.parameters()]
        bufs = [v.to_local().clone() for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")]
        with runner.device_path(), Syncs():  # the device path of the skip decision (a GPU's)
            opt.step()
        skipped.append(bool(opt.stats["skipped"]))
        if step == 2:
            after_bufs = [v.to_local() for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")]
            unchanged = (all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
                         and len(bufs) == len(after_bufs) > 0 and all(torch.equal(a, b) for a, b in zip(bufs, after_bufs)))
    return {"skipped": skipped, "unchanged": unchanged, "syncs": Syncs.n, "on_device": opt._skip_on_device,
            "params": [full(p) for p in model.parameters()], "error": None}


#: the pipelines `run_dcp` saves and resumes (owner path): Muon's momentum, NorMuon's per-row second moments,
#: AdaMuon's elementwise ones
DCP_PIPELINES = {
    "Muon": lambda: [mo.Muon(0.05, sharded="owner")],
    "NorMuon": lambda: [mo.Momentum(0.95), mo.Orthogonalize(ns_dtype="float32", sharded="owner"), mo.NorMuon(),
                        mo.SGD(lr=0.05)],
    "AdaMuon": lambda: [mo.AdaMuon(0.05, ns_dtype="float32", sharded="owner")],
}


def run_dcp(mesh, rank: int, ckpt_dir: str, pipeline: str = "Muon") -> dict:
    """A pipeline of `DCP_PIPELINES` (owner path) under FSDP2: 2 steps, dcp.save, 2 more (straight); a fresh
    model and optimizer load the checkpoint and take the same 2 (resumed). The state buffers of a sharded
    parameter are sharded DTensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def steps(model, opt, rng):
        for step in rng:
            opt.zero_grad()
            for i, p in enumerate(model.parameters()):
                p.grad = local_grad(given_grad(step, i, p.shape), p)
            opt.step()

    def fresh():
        model = make_model()
        shard(model, mesh)
        return model, mo.Modular(param_groups(model), *DCP_PIPELINES[pipeline]())

    model, opt = fresh()
    steps(model, opt, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    steps(model, opt, range(2, 4))
    straight = [full(p) for p in model.parameters()]
    m2, o2 = fresh()
    with torch.no_grad():
        for p in m2.parameters():
            p.mul_(-2.0)
    msd2, osd2 = get_state_dict(m2, o2)
    target = {"model": msd2, "optim": osd2}
    dcp.load(target, checkpoint_id=ckpt_dir)
    set_state_dict(m2, o2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    steps(m2, o2, range(2, 4))
    sharded_bufs = sum(hasattr(v, "to_local") for s in o2.state.values() for v in s.values())
    return {"straight": straight, "resumed": [full(p) for p in m2.parameters()], "sharded_buffers": sharded_bufs,
            "error": None}


def run_all(mode: str, mesh=None, rank: int = 0, dp_rank: int = 0, dp_size: int = 1, ckpt: str = "") -> dict:
    results: dict = {}
    modes = ("owner",) if mode == "single" else ("owner", "dtensor")
    for name, make in cases().items():
        for kind in ("given", "train"):
            for sharded in modes:
                key = f"{name}/{kind}" + ("" if mode == "single" else f"/{sharded}")
                try:
                    results[key] = {"params": run_case(mode, mesh, kind, make(sharded), dp_rank, dp_size), "error": None}
                except Exception:
                    results[key] = {"params": None, "error": traceback.format_exc()}
    if mode != "single":
        from modopt.core.distributed import owner_split

        model = make_model()
        shard(model, mesh)
        results["__layouts__"] = {n: (tuple(str(pl) for pl in p.placements), owner_split(p))
                                  for n, p in model.named_parameters() if p.dim() >= 2}
        for key, fn in (("__skip__/owner", lambda: run_skip(mode, mesh, rank, "owner")),
                        ("__skip__/dtensor", lambda: run_skip(mode, mesh, rank, "dtensor")),
                        *((f"__dcp__/{name}", lambda name=name: run_dcp(mesh, rank, f"{ckpt}-{name}", name))
                          for name in DCP_PIPELINES)):
            try:
                results[key] = fn()
            except Exception:
                results[key] = {"error": traceback.format_exc()}
    return results


def _rank_main(rank: int, mode: str, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        dp_rank, dp_size = rank, 4  # every rank its own quarter of the batch (HSDP averages over all four)
    elif mode == "tp2d":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_rank, dp_size = mesh.get_local_rank("dp"), 2  # the tp ranks of a dp rank: the same half
    else:
        mesh = init_device_mesh("cpu", (world,))
        dp_rank, dp_size = rank, world
    results = run_all(mode, mesh, rank, dp_rank, dp_size, out + ".dcp")
    if rank == 0:
        torch.save(results, out)


def main(argv: list[str]) -> None:
    mode, port, out = argv[0], int(argv[1]), argv[2]
    if mode == "single":
        torch.set_num_threads(1)
        torch.save(run_all(mode), out)
        return
    from launch import spawn_ranks

    world = 4 if mode in ("hsdp", "tp2d") else 2
    spawn_ranks(world, port, _rank_main, mode, world, out)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main(sys.argv[1:])
