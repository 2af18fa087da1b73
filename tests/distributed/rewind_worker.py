"""Worker of the FSDP2 Rewind tests: ``python rewind_worker.py MODE PORT OUT`` spawns 2 gloo ranks on 127.0.0.1.

MODE is ``fsdp`` (every layer and the model ``fully_shard``-ed: parameters and Adam's moments are
DTensors sharded on dim 0, unevenly) or ``single`` (the same run in one process, no process group).
A small MLP trains with ``ClipNorm -> Adam`` under a ``Rewind`` guard that snapshots every
``EVERY`` steps; at batch ``SPIKE_BATCH`` rank 1 alone reports its loss times 1000 (in one
process: the loss times 1000), so the guard must rewind once, on every rank, to the snapshot of
step ``SPIKE_BATCH // EVERY * EVERY``. The batch fed is always ``batches_seen`` (the rewound
batches are skipped, not replayed). Each rank saves its results to ``OUT.<rank>``.

Besides the straight run each rank checks (``run_fsdp``):

* bit for bit, that the parameters' shards and the optimizer state right after the rewind equal
  this rank's copy taken when the restored snapshot was taken;
* the snapshot's memory: the bytes kept for the parameters are this rank's shards', not the full
  tensors';
* two resumes from a checkpoint taken after batch ``CKPT_BATCH`` (model and optimizer through
  torch.distributed.checkpoint, the guard's ``state_dict()`` either in the same ``dcp.save`` or
  saved per rank with ``torch.save`` and loaded with ``weights_only=True``): a fresh sharded
  model, optimizer and guard load it and run to the end; they must end where the straight run
  ends, bit for bit, with the same rewind.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

import modopt as mo

WORLD = 2
STEPS = 10  # batches fed (rewound ones included)
EVERY = 2
SPIKE_BATCH = 5  # (0-based) rank 1's loss x1000 here: triggers at step 6, the check of step 6 rewinds to 4
CKPT_BATCH = 2  # checkpoint after this batch: steps_done 3, the snapshot of step 2, a pending window


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # odd sizes: uneven shards; Linear(4, 1): rank 1 holds an empty shard of its weight and bias
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 1))


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + k)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def rank_batch(k: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(k)
    half = x.shape[0] // WORLD
    return x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]


def build(mode: str, scramble: bool = False):
    model = make_model()
    if scramble:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2.0)  # other weights: a load must restore them
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        fully_shard(model)
    opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Adam(lr=0.02))
    guard = mo.Rewind(opt, model=model, every=EVERY, loss_z=4.0, window=8, min_count=3)
    return model, opt, guard


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def local_state(model, opt) -> dict:
    """This rank's copy of everything a rewind restores: parameter shards and the optimizer's state."""
    return {"params": [local(p) for p in model.parameters()],
            "state": [{k: local(v) for k, v in sorted(opt.state[p].items())} for p in model.parameters()],
            "store": {k: {n: v.detach().clone() for n, v in sorted(s.items())} for k, s in sorted(opt._store.items())}}


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def train(mode: str, rank: int, model, opt, guard, until: int, record: dict | None = None) -> list:
    """Feed batches `guard.batches_seen` .. `until - 1`; rank 1's (or the single process's) loss x1000 at SPIKE_BATCH."""
    events = []
    while guard.batches_seen < until:
        k = guard.batches_seen
        x, y = batch(k) if mode == "single" else rank_batch(k, rank)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        spike = k == SPIKE_BATCH and (mode == "single" or rank == 1)
        before = guard.snapshot_step
        event = guard.step(loss.detach() * (1000.0 if spike else 1.0))
        if event is not None:
            events.append(event.as_dict())
            if record is not None:
                record["after_rewind"] = local_state(model, opt)
                record["after_rewind_full"] = [full(p) for p in model.parameters()]
        elif record is not None and guard.snapshot_step != before:  # a snapshot was just taken
            record.setdefault("at_snapshot", {})[guard.snapshot_step] = local_state(model, opt)
    return events


def run_single() -> dict:
    torch.set_num_threads(1)
    model, opt, guard = build("single")
    record: dict = {}
    events = train("single", 0, model, opt, guard, STEPS, record)
    return {"events": events, "params": [full(p) for p in model.parameters()],
            "after_rewind_full": record.get("after_rewind_full"), "error": None}


def run_fsdp(rank: int, out: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    res: dict = {"error": None}
    model, opt, guard = build("fsdp")
    res["sharded"] = sum(hasattr(p, "to_local") for p in model.parameters())
    record: dict = {}
    train("fsdp", rank, model, opt, guard, CKPT_BATCH + 1, record)
    res["local_param_bytes"] = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    res["full_param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    res["snapshot_param_bytes"] = guard.snapshot_bytes()["params"]
    # the checkpoint: model and optimizer through DCP, the guard in the same dcp.save and, per rank, with torch.save
    msd, osd = get_state_dict(model, opt)
    gsd = guard.state_dict()
    res["sd_sharded_entries"] = sum(hasattr(e["__rewind_tensor__"], "to_local") for e in gsd["snapshot"]["tensors"])
    dcp.save({"model": msd, "optim": osd, "rewind": gsd}, checkpoint_id=f"{out}.dcp")
    torch.save(gsd, f"{out}.guard.{rank}")
    events = train("fsdp", rank, model, opt, guard, STEPS, record)
    res["events"] = events
    res["params"] = [full(p) for p in model.parameters()]
    res["after_rewind_full"] = record.get("after_rewind_full")
    restored = events[0]["restored_to"] if events else None
    res["restored_bit_exact"] = (restored is not None and restored in record.get("at_snapshot", {})
                                 and equal(record["after_rewind"], record["at_snapshot"][restored]))
    for how in ("dcp", "torch.save"):
        try:
            m2, o2, g2 = build("fsdp", scramble=True)
            msd2, osd2 = get_state_dict(m2, o2)
            target = {"model": msd2, "optim": osd2, "rewind": g2.state_dict()}
            dcp.load(target, checkpoint_id=f"{out}.dcp")
            set_state_dict(m2, o2, model_state_dict=target["model"], optim_state_dict=target["optim"])
            if how == "dcp":
                g2.load_state_dict(target["rewind"])
            else:
                g2.load_state_dict(torch.load(f"{out}.guard.{rank}", weights_only=True))
            ev2 = train("fsdp", rank, m2, o2, g2, STEPS)
            res[f"resume-{how}"] = {"events": ev2, "params_equal": equal([full(p) for p in m2.parameters()],
                                                                          res["params"]),
                                    "rewinds_equal": [e.as_dict() for e in g2.rewinds] == [e.as_dict() for e in guard.rewinds],
                                    "error": None}
        except Exception:
            res[f"resume-{how}"] = {"error": traceback.format_exc()}
    # a guard state saved by another rank holds another shard: refused where the shapes show it
    try:
        other = torch.load(f"{out}.guard.{1 - rank}", weights_only=True)
        _, _, g3 = build("fsdp")
        g3.load_state_dict(other)
        res["other_rank_refused"] = None
    except ValueError as e:
        res["other_rank_refused"] = str(e)
    return res


def _rank_main(rank: int, out: str) -> None:
    try:
        res = run_fsdp(rank, out)
    except Exception:
        res = {"error": traceback.format_exc()}
    torch.save(res, f"{out}.{rank}")


def main(argv: list[str]) -> None:
    mode, port, out = argv[0], int(argv[1]), argv[2]
    if mode == "single":
        torch.save(run_single(), f"{out}.0")
        return
    from launch import spawn_ranks

    spawn_ranks(WORLD, port, _rank_main, out)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main(sys.argv[1:])
