"""Worker of the distributed tests: ``python dist_worker.py MODE PORT OUT`` spawns 2 gloo ranks on 127.0.0.1.

MODE is ``ddp``, ``fsdp``, ``fsdp-dcp`` (checkpoint and resume with
torch.distributed.checkpoint, see :func:`run_dcp`), ``fsdp-compiled`` (the step compiled, see
:func:`run_compiled`) or ``single`` (the
single-process reference, no process group). Every case of :data:`CASES` trains the same small model for
``STEPS`` steps on the same data; under DDP/FSDP each rank sees its half of the
batch and the wrapper averages the gradients, so the full-batch gradient (and
so the trajectory) is the single-process one. Rank 0 (or the single process)
saves ``{case: {"params": [...], "clipped": bool, "error": str | None}}`` to OUT.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

import modopt as mo

STEPS = 10
WORLD = 2


def cases() -> dict[str, list]:
    """name -> the pipeline (fresh transforms; the small max_norms make every clip active)."""
    return {
        "ClipNorm-global": [mo.ClipNorm(0.05), mo.SGD(lr=0.1)],
        "ClipNorm-global-l1": [mo.ClipNorm(0.2, ord="l1"), mo.SGD(lr=0.1)],
        "ClipNorm-global-linf": [mo.ClipNorm(0.01, ord="linf"), mo.SGD(lr=0.1)],
        "ClipNorm-global-l0-l3": [mo.ClipNorm(5.0, ord=0), mo.ClipNorm(0.03, ord=3.0), mo.SGD(lr=0.1)],
        "ClipNorm-global-std-mad-sum": [
            mo.ClipNorm(0.003, ord="std"), mo.ClipNorm(0.002, ord="mad"), mo.ClipNorm(0.001, ord="sum"), mo.SGD(lr=0.1)
        ],
        "ClipNorm-group": [mo.ClipNorm(0.03, scope="group"), mo.SGD(lr=0.1)],
        "ClipNorm-tensor": [mo.ClipNorm(0.02, scope="tensor"), mo.SGD(lr=0.1)],
        "Normalize-tensor": [mo.Normalize(0.01), mo.SGD(lr=0.1)],
        "Normalize-tensor-linf": [mo.Normalize(0.01, ord="linf"), mo.SGD(lr=0.1)],
        "Normalize-global": [mo.Normalize(0.01, scope="global"), mo.SGD(lr=0.1)],
        "Centralize-ZScoreNormalize-tensor": [mo.Centralize(), mo.ZScoreNormalize(), mo.SGD(lr=0.01)],
        "ClipNormByEMA": [mo.ClipNormByEMA(beta=0.5), mo.Adam(lr=0.01)],
        "ClipNormByEMA-tensor-update": [mo.ClipNormByEMA(beta=0.5, scope="tensor", ema_init="update"), mo.Adam(lr=0.01)],
        "ClipNormGrowth": [mo.ClipNormGrowth(mul=1.01), mo.SGD(lr=0.1, momentum=0.9)],
        "HistClip": [mo.HistClip(mo.EMACriterion(r_thresh=1.01), warmup_steps=3, warmup_max_norm=0.05), mo.SGD(lr=0.1)],
        "HistClip-zstat": [mo.HistClip(warmup_steps=2, warmup_max_norm=0.05), mo.SGD(lr=0.1)],
        "ZClip": [mo.ZClip(warmup_steps=3, max_grad_norm=0.05), mo.AdamW(lr=0.01)],
        "AutoClip": [mo.AutoClip(percentile=30), mo.SGD(lr=0.1)],
        "NormalizeByEMA-group": [mo.NormalizeByEMA(beta=0.8, scope="group"), mo.SGD(lr=0.05)],
        # Newton-Schulz of each whole matrix (a sharded one is gathered by DTensor's matmul), in float32: the
        # default bfloat16 iteration turns the gradients' reduction-order rounding into ~1e-3 differences
        "Muon-float32": [mo.Muon(0.05, ns_dtype="float32")],
        "Muon-chain-float32": [mo.Momentum(0.9), mo.Orthogonalize(ns_dtype="float32"), mo.SGD(lr=0.05)],  # the update path
        # issue 12: a global clip over a selection (the statistic of the full selected tensors, the
        # layer that rank 1 holds empty shards of included), and routing to two optimizers by group
        "Masked-ClipNorm-global": [mo.Masked(mo.ClipNorm(0.03), where=mo.Select(exclude=["0.*"])), mo.SGD(lr=0.1)],
        # issue 40: the kept count of each full tensor (rank 1 holds an empty shard of the last layer), so
        # every rank rescales by the same s; a count per shard would give another trajectory
        "Cautious-Adam": [mo.Adam(lr=0.01), mo.Cautious()],
        "Cautious-c_optim-SGD": [mo.SGD(lr=0.1, momentum=0.9), mo.Cautious("c_optim")],
        "Cautious-heavyball-CautiousWeightDecay": [mo.Adam(lr=0.01), mo.Cautious("heavyball"),
                                                   mo.CautiousWeightDecay(0.1)],
        # per-unit norms (each row of a matrix, each element of a vector) of a parameter sharded on dim 0: local
        # to a rank; 0.01 clips some units and not others
        "AGC": [mo.AGC(0.01), mo.SGD(lr=0.1)],
        "Masked-routing": [
            mo.Masked(mo.SGD(lr=0.1, momentum=0.9), where=mo.Select(groups=[0])),
            mo.Masked(mo.ClipNorm(0.05, scope="group"), mo.Adam(lr=0.01), where=mo.Select(groups=[1])),
        ],
    }


#: pipelines that must raise a clear error under FSDP: per-slice statistics of sharded parameters
ERROR_CASES = {
    "ClipNorm-dim1": [mo.ClipNorm(0.01, scope="tensor", dim=1), mo.SGD(lr=0.1)],
    "Normalize-dim0-inverse": [mo.Normalize(0.01, dim=0, inverse_dims=True), mo.SGD(lr=0.1)],
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # odd sizes: uneven shards; Linear(4, 1): rank 1 holds an empty shard of its weight and bias
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1)
    )


def param_groups(model):
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named[:2]], "param_names": [n for n, _ in named[:2]]},
        {"params": [p for _, p in named[2:]], "param_names": [n for n, _ in named[2:]]},
    ]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 6, generator=g) * (1 + step % 3)
    y = torch.randn(8, 1, generator=g)
    return x, y


def rank_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s half of `batch(step)` (data parallel over WORLD ranks)."""
    x, y = batch(step)
    half = x.shape[0] // WORLD
    return x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]


def plain_store(opt) -> bool:
    """Every per-transform value (global/group statistics, counters, histories) is a plain tensor."""
    return all(type(v) is torch.Tensor for store in opt._store.values() for v in store.values()
               if isinstance(v, torch.Tensor))


def train(mode: str, rank: int, pipeline: list) -> tuple[list[torch.Tensor], bool, bool]:
    model = make_model()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    elif mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        wrapped = fully_shard(model)
    else:
        wrapped = model
    opt = mo.Modular(param_groups(model), *pipeline)
    clipped = False
    for step in range(STEPS):
        x, y = batch(step) if mode == "single" else rank_batch(step, rank)
        opt.zero_grad()
        (wrapped(x) - y).pow(2).mean().backward()
        opt.step()
        clipped |= any(bool(v.any()) for k, v in opt.stats.items() if k.endswith((".clipped", ".scale", ".kept")) and
                       (k.endswith(".clipped") or bool((v != 1).any())))
    out = []
    for p in model.parameters():
        out.append(p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone())
    return out, clipped, plain_store(opt)


def run_all(mode: str, rank: int) -> dict:
    results: dict = {}
    for name, pipeline in cases().items():
        try:
            params, clipped, plain = train(mode, rank, pipeline)
            results[name] = {"params": params, "clipped": clipped, "plain_state": plain, "error": None}
        except Exception:  # reported to the test, which fails with the traceback
            results[name] = {"params": None, "clipped": False, "error": traceback.format_exc()}
    if mode == "ddp":
        try:
            results[LOSS_CASE] = run_skipstep_loss(rank)
        except Exception:
            results[LOSS_CASE] = {"error": traceback.format_exc()}
        try:
            results[REWIND_CASE] = run_rewind(rank)
        except Exception:
            results[REWIND_CASE] = {"error": traceback.format_exc()}
    if mode == "fsdp":
        try:
            results[SKIP_CASE] = run_skip(rank)
        except Exception:
            results[SKIP_CASE] = {"error": traceback.format_exc()}
        for name, pipeline in ERROR_CASES.items():
            try:
                train(mode, rank, pipeline)
                results[name] = {"params": None, "clipped": False, "error": None}
            except Exception as e:
                results[name] = {"params": None, "clipped": False, "error": f"{type(e).__name__}: {e}"}
    return results


#: SkipStep on the loss under DDP: at LOSS_SPIKE_STEP rank 1 alone reports a loss 1000x its own
LOSS_CASE, LOSS_STEPS, LOSS_SPIKE_STEP = "__skipstep-loss__", 8, 6


def loss_pipeline() -> list:
    return [mo.SkipStep(watch="loss", window=8, min_steps=4), mo.SGD(lr=0.05)]


def run_skipstep_loss(rank: int) -> dict:
    """DDP with SkipStep(watch="loss"): each rank passes its own loss; rank 1's alone spikes at
    LOSS_SPIKE_STEP. Every rank must skip that step (and only that one): the replicas stay equal."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    wrapped = DistributedDataParallel(model)
    opt = mo.Modular(param_groups(model), *loss_pipeline())
    skipped = []
    for step in range(LOSS_STEPS):
        x, y = rank_batch(step, rank)
        opt.zero_grad()
        loss = (wrapped(x) - y).pow(2).mean()
        loss.backward()
        reported = loss.detach() * (1000.0 if step == LOSS_SPIKE_STEP and rank == 1 else 1.0)
        opt.step(loss=reported)
        skipped.append(bool(opt.stats["skipped"]))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    flags = torch.tensor([float(s) for s in skipped])
    any_skip = flags.clone()
    dist.all_reduce(any_skip, op=dist.ReduceOp.MAX)
    return {"skipped": skipped, "replicas_equal": bool(torch.equal(hi, lo)),
            "skips_agree": bool(torch.equal(any_skip, flags)), "error": None}


#: Rewind under DDP: at REWIND_NAN_STEP rank 1 alone reports a NaN loss
REWIND_CASE, REWIND_STEPS, REWIND_NAN_STEP = "__rewind__", 8, 5


def run_rewind(rank: int) -> dict:
    """DDP with a Rewind guard fed each rank's own loss; rank 1's alone is NaN at REWIND_NAN_STEP.
    Every rank must rewind at the same check, to the same snapshot: the replicas stay equal."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    wrapped = DistributedDataParallel(model)
    opt = mo.Modular(param_groups(model), mo.ClipNorm(1.0), mo.SGD(lr=0.05))
    guard = mo.Rewind(opt, model=model, every=2, loss_z=None)
    events = []
    for _ in range(REWIND_STEPS):
        step = guard.batches_seen
        x, y = rank_batch(step, rank)
        opt.zero_grad()
        loss = (wrapped(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        bad = step == REWIND_NAN_STEP and rank == 1
        event = guard.step(torch.full_like(loss, float("nan")) if bad else loss.detach())
        events.append(None if event is None else (event.step, event.restored_to))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    n = torch.tensor([float(len(guard.rewinds))])
    n_max = n.clone()
    dist.all_reduce(n_max, op=dist.ReduceOp.MAX)
    return {"events": events, "rewinds": len(guard.rewinds), "rewinds_agree": bool(torch.equal(n, n_max)),
            "replicas_equal": bool(torch.equal(hi, lo)), "error": None}


#: the device-decided skip under FSDP2 (issue 18): one rank alone holds a NaN in its shard at NAN_STEP
SKIP_CASE, SKIP_STEPS, NAN_STEP = "__device-skip__", 7, 4


def skip_pipeline() -> list:
    return [mo.ClipNorm(0.05), mo.Adam(lr=0.01)]  # defaults otherwise: nonfinite="skip"


def run_skip(rank: int) -> dict:
    """FSDP2 with the default policy: at NAN_STEP rank 1 alone puts a NaN into its local shard of a
    gradient. Every rank must skip that step (the norms are all-reduced), with no host sync in any step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Syncs(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
                Syncs.n += 1
            return func(*args, **(kwargs or {}))

    from modopt.core import runner

    model, opt = _sharded(skip_pipeline())

    def step() -> None:
        with runner.device_path(), Syncs():  # the device path (a GPU's): on a CPU the host reads the decision
            opt.step()
    skipped = _steps_with_a_nan(model, opt, step, rank)
    return {"params": [p.full_tensor().detach().clone() for p in model.parameters()], "skipped": skipped,
            "syncs": Syncs.n, "on_device": opt._skip_on_device, "error": None}


def _steps_with_a_nan(model, opt, step, rank: int) -> list[bool]:
    """SKIP_STEPS steps of `step()` on FSDP2, rank 1 alone putting a NaN into its local shard of a gradient at
    NAN_STEP; whether each step was skipped."""
    skipped = []
    for k in range(SKIP_STEPS):
        x, y = rank_batch(k, rank)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        if k == NAN_STEP and rank == 1:
            local = next(p.grad.to_local() for p in model.parameters() if p.grad.to_local().numel())
            local.view(-1)[0] = float("nan")
        step()
        skipped.append(bool(opt.stats["skipped"]))
    return skipped


#: pipelines checkpointed with torch.distributed.checkpoint under FSDP2 (mode ``fsdp-dcp``)
DCP_CASES = {
    "ZClip-EMA-AdamW": lambda: [mo.ZClip(warmup_steps=2), mo.ClipNormByEMA(beta=0.5, scope="group"), mo.AdamW(lr=0.01)],
    "AutoClip-tensor-SGD": lambda: [mo.AutoClip(percentile=50, scope="tensor"), mo.HistClip(warmup_steps=2),
                                    mo.SGD(lr=0.1, momentum=0.9)],
}


def _sharded(pipeline):
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    return model, mo.Modular(param_groups(model), *pipeline)


def _fsdp_steps(model, opt, rank: int, steps) -> None:
    for step in steps:
        x, y = rank_batch(step, rank)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()


def run_dcp(rank: int, ckpt_dir: str) -> dict:
    """FSDP2 + DCP: train 5 steps, dcp.save, train 5 more (straight); a fresh sharded model and optimizer
    dcp.load and train the same 5 (resumed). Both runs' full parameters are returned."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    results: dict = {}
    for name, pipeline in DCP_CASES.items():
        try:
            model, opt = _sharded(pipeline())
            _fsdp_steps(model, opt, rank, range(5))
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{ckpt_dir}/{name}")
            _fsdp_steps(model, opt, rank, range(5, 10))
            straight = [p.full_tensor().detach().clone() for p in model.parameters()]
            m2, o2 = _sharded(pipeline())
            with torch.no_grad():
                for p in m2.parameters():
                    p.mul_(-2.0)  # other weights: the load must restore them
            msd2, osd2 = get_state_dict(m2, o2)
            target = {"model": msd2, "optim": osd2}
            dcp.load(target, checkpoint_id=f"{ckpt_dir}/{name}")
            set_state_dict(m2, o2, model_state_dict=target["model"], optim_state_dict=target["optim"])
            _fsdp_steps(m2, o2, rank, range(5, 10))
            resumed = [p.full_tensor().detach().clone() for p in m2.parameters()]
            sharded_buffers = sum(type(v) is not torch.Tensor for s in o2.state.values() for v in s.values()
                                  if isinstance(v, torch.Tensor))
            results[name] = {"straight": straight, "resumed": resumed, "sharded_buffers": sharded_buffers, "error": None}
        except Exception:
            results[name] = {"straight": None, "resumed": None, "sharded_buffers": 0, "error": traceback.format_exc()}
    return results


#: pipelines whose step is compiled under FSDP2 (mode ``fsdp-compiled``), each by both ways of compiling
COMPILED_CASES = {
    "ClipNorm-Adam": skip_pipeline,
    "mission": lambda: [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam(lr=0.01)],
}


def run_compiled(rank: int) -> dict:
    """FSDP2 with the step compiled (`torch.compile(opt.step, fullgraph=True)`, `mo.compile_step(opt)`), the
    default policy: at NAN_STEP rank 1 alone puts a NaN into its local shard of a gradient, and every rank
    must skip that step, as `run_skip`'s eager step does."""
    results: dict = {}
    for name, pipeline in COMPILED_CASES.items():
        for how in ("torch.compile", "compile_step"):
            try:
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                model, opt = _sharded(pipeline())
                step = torch.compile(opt.step, fullgraph=True) if how == "torch.compile" else mo.compile_step(opt)
                skipped = _steps_with_a_nan(model, opt, step, rank)
                results[f"{name}/{how}"] = {
                    "params": [p.full_tensor().detach().clone() for p in model.parameters()], "skipped": skipped,
                    "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"], "error": None}
            except Exception:
                results[f"{name}/{how}"] = {"error": traceback.format_exc()}
    return results


def _rank_main(rank: int, mode: str, out: str) -> None:
    if mode == "fsdp-compiled":
        results = run_compiled(rank)
    else:
        results = run_dcp(rank, out + ".dcp") if mode == "fsdp-dcp" else run_all(mode, rank)
    if rank == 0:
        torch.save(results, out)


def main(argv: list[str]) -> None:
    mode, port, out = argv[0], int(argv[1]), argv[2]
    if mode == "single":
        torch.set_num_threads(1)
        torch.save(run_all(mode, 0), out)
        return
    from launch import spawn_ranks

    spawn_ranks(WORLD, port, _rank_main, mode, out)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main(sys.argv[1:])
