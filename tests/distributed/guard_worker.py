"""Worker of the step-guard test: ``python guard_worker.py fsdp PORT OUT`` spawns 2 gloo ranks on 127.0.0.1.

A small MLP (``rewind_worker.make_model``: every layer ``fully_shard``-ed, parameters sharded unevenly on
dim 0) trains with ``SkipNorm(TAU) -> Adam`` and ``max_consecutive_skips=LIMIT``. Each step's gradients
are scaled (by the worker, from their full norm) to the full 2-norm ``TAU / 2``, and at the batches of
``SPIKES`` to ``OVER * TAU``: then the full norm exceeds ``TAU`` while the norm of a rank's own shards
alone does not (each rank's shards hold at most 92% of it here; ``test_guards_fsdp.py`` checks it): a
rank deciding from its shards would not skip where the other does. The last ``LIMIT`` spikes are in a row: the run stops
there. Each rank saves, per call of ``opt.step()``, whether it was skipped, the norm ``SkipNorm`` saw, the
norm of its own shards and the run of skips, then the call that raised ``SkipLimitError`` and its fields,
to ``OUT.<rank>``; ``run("single")`` is the same run in one process.

The run is made twice: as on the CPU (the count read as each step ends) and on the device path
(``hostdata.device_path()``: the count read by the next call, as on a GPU).
"""

from __future__ import annotations

import math
import os
import sys
import traceback

import torch

import modopt as mo
from modopt.core import hostdata
from modopt.core.skip_limit import SkipLimitError
from rewind_worker import WORLD, batch, make_model, rank_batch

TAU = 1.0
OVER = 1.05  # the spikes' full norm, in TAUs
SPIKES = (2, 5, 6, 7)
LIMIT = 3
STEPS = 10


def local_norm(model: torch.nn.Module) -> float:
    """The 2-norm of this rank's shards of the gradients (a local decision would read this)."""
    parts = [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for p in model.parameters()]
    return math.sqrt(sum(float(g.double().square().sum()) for g in parts))


def scale_to(model: torch.nn.Module, target: float, mode: str) -> None:
    """Scale the gradients to the full 2-norm `target` (the shards' squares summed over the ranks)."""
    sq = torch.tensor(local_norm(model) ** 2, dtype=torch.float64)
    if mode != "single":
        import torch.distributed as dist

        dist.all_reduce(sq)
    for p in model.parameters():
        p.grad.mul_(target / math.sqrt(float(sq)))


def run(mode: str, rank: int = 0, device_path: bool = False) -> dict:
    model = make_model()
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        fully_shard(model)
    opt = mo.Modular(model.parameters(), mo.SkipNorm(TAU), mo.Adam(lr=0.02), max_consecutive_skips=LIMIT)
    res: dict = {"calls": [], "raised_at": None, "error": None}
    for k in range(STEPS):
        x, y = batch(k) if mode == "single" else rank_batch(k, rank)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        scale_to(model, (OVER if k in SPIKES else 0.5) * TAU, mode)
        try:
            if device_path:
                with hostdata.device_path():
                    opt.step()
            else:
                opt.step()
        except SkipLimitError as e:
            res["raised_at"] = k
            res["error"] = {"limit": e.limit, "skipped": e.skipped, "by_rule": e.by_rule, "message": str(e)}
            break
        res["calls"].append({"skipped": bool(opt.stats["skipped"]), "norm": float(opt.stats["0:SkipNorm.norm"]),
                             "local_norm": local_norm(model), "run": int(opt.stats["consecutive_skips"])})
    res["sharded"] = sum(hasattr(p, "to_local") for p in model.parameters())
    return res


def _rank_main(rank: int, out: str) -> None:
    try:
        res = {"cpu": run("fsdp", rank), "device_path": run("fsdp", rank, device_path=True), "failure": None}
    except Exception:
        res = {"failure": traceback.format_exc()}
    torch.save(res, f"{out}.{rank}")


def main(argv: list[str]) -> None:
    mode, port, out = argv[0], int(argv[1]), argv[2]
    assert mode == "fsdp", mode
    from launch import spawn_ranks

    spawn_ranks(WORLD, port, _rank_main, out)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main(sys.argv[1:])
