"""Worker of the expert-parallel tests: ``python ep_worker.py MODE PORT OUT`` spawns 4 gloo ranks on 127.0.0.1.

MODE is ``ep`` (4 ranks) or ``single`` (the same model unsharded, one process, the full batch). A small
mixture-of-experts model, laid out as torchtitan lays one out, in ONE `mo.Modular`:

* the dense layers (``inp``, ``router``, ``out``) under FSDP2 over a 1-D mesh of the 4 ranks: DTensors
  ``(Shard(0),)`` on mesh ``("fsdp",)``;
* the expert stack ``moe.experts`` ``(E, D, D)`` on a second mesh, 2x2 ``("dp", "ep")``: ``(Replicate(), Shard(0))``,
  each rank holding E/2 whole experts, the same ones as its dp partner (expert parallel over ``ep``, replicated
  over ``dp``). A statistic of the stack is summed over ``ep`` alone (summing ``dp`` too would count it twice).

Every rank takes a quarter of the batch. The experts are gathered for the forward (a dense softmax-gated
mixture, every expert weighing every token: no routing ties) and their gradient summed over the 4 ranks by
the backward (a `Partial` gradient reduced to the stack's placements), then divided by 4: FSDP2 averages the
dense gradients, so both are the gradient of the full batch's mean loss, as in the single-process run.

Each case trains ``STEPS`` steps; rank 0 saves ``{case: {...}}`` to OUT.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings

import torch
import torch.nn as nn

import modopt as mo

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # (each rank imports this; no output is written in place)

STEPS = 4
WORLD = 4
BATCH, SEQ, FEAT, DIM, E, OUT = 8, 3, 6, 8, 4, 2
EXPERTS = "moe.experts"


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(E, DIM, DIM) * 0.3)

    def stack(self) -> torch.Tensor:
        """The full `(E, D, D)` stack for the forward; under expert parallelism gathered, and its gradient a sum
        over the ranks (`Partial`) that the backward reduces to the stack's own placements."""
        w = self.experts
        if hasattr(w, "placements"):
            from torch.distributed.tensor import Partial, Replicate

            n = w.device_mesh.ndim
            return w.redistribute(placements=[Replicate()] * n).to_local(grad_placements=[Partial()] * n)
        return w

    def forward(self, h: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bsd,edf,bse->bsf", h, self.stack(), gates)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEAT, DIM)
        self.router = nn.Linear(DIM, E)
        self.moe = MoE()
        self.out = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        gates = torch.softmax(self.router(h), dim=-1)
        return self.out(h + torch.tanh(self.moe(h, gates)))


def make_model() -> Model:
    torch.manual_seed(0)
    return Model()


def parallelize(model: Model, fsdp_mesh, ep_mesh) -> Model:
    """The dense layers under FSDP2 over `fsdp_mesh`; the expert stack `(Replicate(), Shard(0))` over `ep_mesh`; the
    router left a plain tensor on every rank, its gradient averaged as DDP would (`backward`): three kinds of
    parameter in one optimizer."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for name in ("inp", "out"):
        fully_shard(getattr(model, name), mesh=fsdp_mesh)
    model.moe.experts = nn.Parameter(distribute_tensor(model.moe.experts.detach(), ep_mesh, [Replicate(), Shard(0)]))
    return model


def named(model) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(BATCH, SEQ, FEAT, generator=g) * (1 + step % 3), torch.randn(BATCH, SEQ, OUT, generator=g)


def data(mode: str, step: int):
    x, y = batch(step)
    if mode == "single":
        return x, y
    import torch.distributed as dist

    q, r = BATCH // WORLD, dist.get_rank()
    return x[r * q:(r + 1) * q], y[r * q:(r + 1) * q]


def backward(model, mode: str, step: int) -> None:
    x, y = data(mode, step)
    (model(x) - y).pow(2).mean().backward()
    if mode != "single":  # the experts' gradient is the sum of the 4 ranks' ones; the dense ones are averaged
        model.moe.experts.grad.to_local().div_(WORLD)
        import torch.distributed as dist

        for p in model.router.parameters():  # (a plain replicated module: its gradients averaged, as DDP does)
            dist.all_reduce(p.grad)
            p.grad.div_(WORLD)


def meshes(mode: str):
    if mode == "single":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return (init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",)),
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep")))


def build(mode: str, ms):
    model = make_model()
    if mode != "single":
        parallelize(model, *ms)
    return model


def full_params(model) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def cases() -> dict[str, list]:
    """name -> a fresh pipeline over the dense parameters and the expert stack together (small thresholds: every
    clip acts)."""
    experts, dense = mo.Select(names=[EXPERTS]), mo.Select(exclude=[EXPERTS])
    return {
        "SGD": [mo.SGD(lr=0.1)],  # no statistic: how far the sharded run alone is from the single-process one
        "ClipNorm-global-SGD": [mo.ClipNorm(0.05), mo.SGD(lr=0.1)],
        "ClipNorm-global-AdamW": [mo.ClipNorm(0.05), mo.AdamW(lr=0.01)],
        "ClipNorm-tensor-linf-SGD": [mo.ClipNorm(0.02, scope="tensor"), mo.ClipNorm(0.003, ord="linf"), mo.SGD(lr=0.1)],
        "ZClip-ClipNormByEMA-AdamW": [mo.ZClip(warmup_steps=2, max_grad_norm=0.05),
                                      mo.ClipNormByEMA(beta=0.5, scope="tensor"), mo.AdamW(lr=0.01)],
        "AdamW-Cautious": [mo.AdamW(lr=0.01), mo.Cautious()],
        "Muon-experts-AdamW-dense": [mo.ClipNorm(0.05),
                                     mo.Masked(mo.Muon(lr=0.01, batch_dims=1, weight_decay=0.0), where=experts),
                                     mo.Masked(mo.AdamW(lr=0.01, weight_decay=0.0), where=dense)],
        # nanochat's per-matrix stages around the orthogonalization, each expert where it lies
        "MuonEq-MuonPlus-experts": [mo.ClipNorm(0.05),
                                    mo.Masked(mo.Momentum(0.9), mo.MuonEq(batch_dims=1), mo.Orthogonalize(batch_dims=1),
                                              mo.MuonPlus(batch_dims=1), mo.ShapeScale(batch_dims=1), mo.LR(0.01),
                                              where=experts),
                                    mo.Masked(mo.AdamW(lr=0.01, weight_decay=0.0), where=dense)],
        # NorMuon's per-row second moments of each expert, kept where the expert lies
        "NorMuon-experts": [mo.ClipNorm(0.05),
                            mo.Masked(mo.Momentum(0.9), mo.Orthogonalize(batch_dims=1), mo.NorMuon(batch_dims=1),
                                      mo.LR(0.01), where=experts),
                            mo.Masked(mo.AdamW(lr=0.01, weight_decay=0.0), where=dense)],
        # AdaMuon's elementwise second moment and each expert's own norm, where the expert lies (one group: the
        # dense AdamW reads the same betas and weight decay)
        "AdaMuon-experts": [mo.ClipNorm(0.05), mo.Masked(mo.AdaMuon(lr=0.01, batch_dims=1), where=experts),
                            mo.Masked(mo.AdamW(lr=0.01, betas=(0.9, 0.95), weight_decay=0.0), where=dense)],
    }


def train(mode: str, ms, pipeline: list) -> dict:
    from modopt.transforms import orthogonal

    model = build(mode, ms)
    opt = mo.Modular(named(model), *pipeline)
    calls = []
    real = orthogonal.owner_apply  # (counted where Orthogonalize and Muon call it: the owner-rank exchange)
    orthogonal.owner_apply = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        acted = False
        for step in range(STEPS):
            opt.zero_grad()
            backward(model, mode, step)
            opt.step()
            acted |= any(bool((v != 1).any()) if k.endswith(".scale") else bool(v.any())
                         for k, v in opt.stats.items() if k.endswith((".clipped", ".scale")))
    finally:
        orthogonal.owner_apply = real
    placements = sorted({(p.device_mesh.mesh_dim_names, tuple(str(pl) for pl in p.placements))
                         for p in model.parameters() if hasattr(p, "placements")})
    moments = [(v, hasattr(v, "placements")) for s in opt.state.values() for k, v in sorted(s.items())
               if k.endswith(".second_moment")]  # (NorMuon's: whole, and whether each is a DTensor)
    return {"params": full_params(model), "acted": acted, "placements": placements, "owner_calls": len(calls),
            "agree": ranks_agree(model, mode), "error": None,
            "moments": [(v.full_tensor() if d else v).detach().clone() for v, d in moments],
            "moment_placements": [tuple(str(pl) for pl in v.placements) if d else None for v, d in moments]}


def ranks_agree(model, mode: str) -> bool:
    if mode == "single":
        return True
    return all_equal(torch.cat([p.reshape(-1) for p in full_params(model)]))


def all_equal(t: torch.Tensor) -> bool:
    import torch.distributed as dist

    t = t.to(torch.float64)
    hi, lo = t.clone(), t.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


#: the non-finite skip: rank NAN_RANK alone plants a NaN in its local shard of the expert stack's gradient at NAN_STEP
SKIP_CASE, SKIP_STEPS, NAN_STEP, NAN_RANK = "__skip__", 4, 2, 3


def skip_pipeline() -> list:
    return [mo.ClipNorm(0.05), mo.AdamW(lr=0.01)]


def local_state(opt) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state as this rank holds it (local shards), in a fixed order."""
    out = []
    for s in opt.state.values():
        for k in sorted(s):
            v = s[k]
            if isinstance(v, torch.Tensor):
                out.append((v.to_local() if hasattr(v, "to_local") else v).detach().clone())
    for store in opt._store.values():
        for k in sorted(store):
            if isinstance(store[k], torch.Tensor):
                out.append(store[k].detach().clone())
    return out


def run_skip(mode: str, ms) -> dict:
    import torch.distributed as dist

    model = build(mode, ms)
    opt = mo.Modular(named(model), *skip_pipeline())
    skipped, unchanged = [], None
    for step in range(SKIP_STEPS):
        if mode == "single" and step == NAN_STEP:  # the reference leaves that step out
            skipped.append(True)
            continue
        opt.zero_grad()
        backward(model, mode, step)
        if step == NAN_STEP:
            before = local_state(opt) + [(p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                                         for p in model.parameters()]
            if dist.get_rank() == NAN_RANK:
                model.moe.experts.grad.to_local().view(-1)[0] = float("nan")
        opt.step()
        skipped.append(bool(opt.stats["skipped"]))
        if step == NAN_STEP:
            after = local_state(opt) + [(p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                                        for p in model.parameters()]
            unchanged = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    out = {"params": full_params(model), "skipped": skipped, "on_device": opt._skip_on_device,
           "agree": ranks_agree(model, mode), "unchanged": unchanged, "error": None}
    if mode != "single":
        out["skips_agree"] = all_equal(torch.tensor([float(s) for s in skipped]))
        out["unchanged_everywhere"] = all_equal(torch.tensor([float(bool(unchanged))])) and bool(unchanged)
    return out


#: DCP: a pipeline of `cases()` (Muon on the experts; NorMuon's state on the experts), 2 steps, dcp.save, 2 more
#: (straight); a fresh model and optimizer load and take the same 2 (resumed)
DCP_CASE, DCP_NORMUON_CASE = "__dcp__", "__dcp_normuon__"
DCP_PIPELINES = {DCP_CASE: "Muon-experts-AdamW-dense", DCP_NORMUON_CASE: "NorMuon-experts"}


def run_dcp(ms, ckpt_dir: str, name: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def fresh():
        model = build("ep", ms)
        return model, mo.Modular(named(model), *cases()[DCP_PIPELINES[name]])

    def steps(model, opt, rng):
        for step in rng:
            opt.zero_grad()
            backward(model, "ep", step)
            opt.step()

    model, opt = fresh()
    steps(model, opt, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    steps(model, opt, range(2, 4))
    straight = full_params(model)
    m2, o2 = fresh()
    with torch.no_grad():
        for p in m2.parameters():
            p.mul_(-2.0)
    msd2, osd2 = get_state_dict(m2, o2)
    target = {"model": msd2, "optim": osd2}
    dcp.load(target, checkpoint_id=ckpt_dir)
    set_state_dict(m2, o2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    steps(m2, o2, range(2, 4))
    sharded = sum(hasattr(v, "to_local") for s in o2.state.values() for v in s.values())
    return {"straight": straight, "resumed": full_params(m2), "sharded_buffers": sharded, "error": None}


#: plain per-rank expert tensors (Megatron's layout: each rank's E/2 experts a plain parameter): the library cannot
#: know they are pieces of one stack, so a global norm over them is this rank's alone
PLAIN_CASE = "__plain-experts__"


def run_plain(ms) -> dict:
    import torch.distributed as dist

    model = build("ep", ms)
    ep = ms[1]
    local_experts = nn.Parameter(model.moe.experts.to_local().detach().clone())  # this rank's experts, plain
    opt = mo.Modular([(n, p) for n, p in named(model) if n != EXPERTS] + [("local_experts", local_experts)],
                     mo.ClipNorm(1e9), mo.SGD(lr=0.0))
    opt.zero_grad()
    backward(model, "ep", 0)
    local_experts.grad = model.moe.experts.grad.to_local().clone()
    opt.step()
    norm = opt.stats["0:ClipNorm.norm"].detach().clone() if "0:ClipNorm.norm" in opt.stats else None
    return {"norm": norm, "norms_agree": all_equal(norm.reshape(1)) if norm is not None else None,
            "ep_rank": ep.get_local_rank("ep"), "rank": dist.get_rank(), "error": None}


#: controls: the same global clip with the stack's statistics also summed over "dp" (where it is replicated) must
#: end elsewhere; and the step without the per-mesh split of multi-tensor ops must fail (DTensor refuses them)
ATTACH_CASE = "__attach__"


def run_attach(mode: str, ms) -> dict:
    """A global ClipNorm attached in front of torch's SGD (its for-loop kernel: torch's foreach kernels take one
    mesh per call) over the same two meshes: the handle's step splits its multi-tensor ops per mesh too."""
    model = build(mode, ms)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    handle = mo.attach(opt, mo.ClipNorm(0.05))
    for step in range(STEPS):
        opt.zero_grad()
        backward(model, mode, step)
        opt.step()
    handle.remove()
    return {"params": full_params(model), "agree": ranks_agree(model, mode), "error": None}


DOUBLE_COUNT_CASE, NO_SPLIT_CASE = "__double-count-control__", "__no-per-mesh-control__"


def run_double_count(ms) -> dict:
    from modopt.core import distributed

    real = distributed.groups_of
    distributed.groups_of = lambda t, where="": distributed.all_groups_of(t)  # (every mesh dim, Replicate too)
    try:
        return train("ep", ms, cases()["ClipNorm-global-SGD"])
    finally:
        distributed.groups_of = real


def run_no_split(ms) -> dict:
    from modopt.core import distributed

    real = distributed.meshes_mixed
    distributed.meshes_mixed = lambda params: False
    try:
        train("ep", ms, cases()["ClipNorm-global-SGD"])
        return {"failed": None, "error": None}
    except Exception as e:
        return {"failed": f"{type(e).__name__}: {e}"[:400], "error": None}
    finally:
        distributed.meshes_mixed = real


REFUSED_CASE = "__split-matrices-refused__"
#: the transforms that take each matrix of a stack whole: refused on a stack split inside them, when built
REFUSING = {"NorMuon": lambda: [mo.NorMuon(batch_dims=1), mo.LR(0.01)],
            "AdaMuon": lambda: [mo.AdaMuon(lr=0.01, batch_dims=1)],
            "MuonEq": lambda: [mo.MuonEq(batch_dims=1), mo.LR(0.01)],
            "Orthogonalize-dtensor": lambda: [mo.Orthogonalize(batch_dims=1, sharded="dtensor"), mo.LR(0.01)]}


def run_refused(ms) -> dict:
    """A stack split inside its matrices (`Shard(1)`: each rank holds some rows of every expert) gives these
    transforms no whole matrix: `Modular` refuses it when built, and `add_param_group` when the stack comes in a
    group added after, naming the parameter and the transform. The owner-rank `Orthogonalize` gathers each
    matrix on one rank and is built."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.randn(E, DIM, DIM, generator=torch.Generator().manual_seed(7))
    p = nn.Parameter(distribute_tensor(full, ms[1], [Replicate(), Shard(1)]))
    out: dict = {"error": None}
    for name, make in REFUSING.items():
        try:
            mo.Modular([("stack", p)], *make())
            out[name] = {"failed": None}
        except ValueError as e:
            out[name] = {"failed": str(e)[:600]}
    dense = nn.Parameter(torch.zeros(DIM, DIM))
    opt = mo.Modular([("dense", dense)], mo.NorMuon(batch_dims=1), mo.LR(0.01), lint=False)
    try:
        opt.add_param_group({"params": [p], "param_names": ["stack"]})
        out["added"] = {"failed": None}
    except ValueError as e:
        out["added"] = {"failed": str(e)[:600], "groups": len(opt.param_groups)}
    out["owner-built"] = len(mo.Modular([("stack", p)], mo.Orthogonalize(batch_dims=1), mo.LR(0.01)).param_groups)
    return out


def run_all(mode: str, ms, ckpt: str = "") -> dict:
    results: dict = {}
    only = os.environ.get("EP_ONLY")  # (debugging: a comma-separated subset of the cases)
    for name, pipeline in cases().items():
        if only and name not in only.split(","):
            continue
        try:
            results[name] = train(mode, ms, pipeline)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    extra = {SKIP_CASE: lambda: run_skip(mode, ms), ATTACH_CASE: lambda: run_attach(mode, ms)}
    if mode != "single":
        extra.update({DCP_CASE: lambda: run_dcp(ms, ckpt, DCP_CASE),
                      DCP_NORMUON_CASE: lambda: run_dcp(ms, ckpt + "2", DCP_NORMUON_CASE), PLAIN_CASE: lambda: run_plain(ms),
                      DOUBLE_COUNT_CASE: lambda: run_double_count(ms), NO_SPLIT_CASE: lambda: run_no_split(ms),
                      REFUSED_CASE: lambda: run_refused(ms)})
    for name, fn in extra.items():
        if only and name not in only.split(","):
            continue
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


def _rank_main(rank: int, out: str) -> None:
    import torch.distributed as dist

    results = run_all("ep", meshes("ep"), out + ".dcp")
    if PLAIN_CASE in results and results[PLAIN_CASE].get("error") is None:  # every rank's norm, on rank 0
        from modopt.core.distributed import gather_0d

        results[PLAIN_CASE]["norms"] = gather_0d(results[PLAIN_CASE]["norm"], dist.group.WORLD)
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
