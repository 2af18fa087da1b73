"""How far QK-Clip keeps the attention logits under tau: no clip, `logits="recorded"`, `logits="rewritten"`.

The built-in transformer task of `modopt run` (its `TinyTransformer`, the options of
examples/configs/transformer_*.yaml: 2 layers, 2 heads of 16 dims, sequences of 24, batch 32), trained with
`mo.Adam(lr)` on every parameter (its other defaults; a constant lr, no warm-up) at learning rates from
Adam's default up to aggressive, and with Muon (`adjust_lr_fn="match_rms_adamw"`) on the encoder's matrices
and Adam on the rest, in three arms: no clip, `mo.QKClip(tau)` (Kimi K2's reactive rule) and
`mo.QKClip(tau, logits="rewritten")`, over five seeds. Every arm watches the attention with
`mo.AttentionLogits` (the no-clip arm only to measure it).

Per run, after each step t (the optimizer's write and the clip):

* same batch: the per-head max logit of a forward at the new weights on the batch of step t;
* next batch: the per-head max logit of the forward of step t + 1 (the one the next step trains on, on its
  own batch; for the last step one more batch);

and the table gives, as the mean over seeds with its Student-t 95% interval (`modopt.cli.stats`, as
`modopt compare` reports): the largest of each over the run divided by tau, the % of steps whose next-batch
max logit exceeds tau (by more than float32 rounding, 1e-5 relative), the final loss (the mean training loss
of the last 5% of steps, as `modopt run`'s summary) and the loss spikes (`modopt.cli.run.count_spikes` on the
training losses, the count `modopt compare` reports).

    python examples/qkclip_bound.py                         # the study (6 to 9 minutes on 2 shared cores)
    python examples/qkclip_bound.py --json /tmp/qk.json     # also every seed's values
    python examples/qkclip_bound.py --quick                 # a few steps, one seed, two lrs (CI)

docs/modules/weights.md "How far each mode keeps the logits under tau" shows the table;
`docs/regenerate qkclip` reruns this script.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

import modopt as mo
from modopt.cli.run import count_spikes
from modopt.cli.stats import format_interval, interval, paired
from modopt.cli.tasks import transformer

#: the task's options: those of examples/configs/transformer_*.yaml (and the task's defaults)
TASK = {"vocab": 16, "seq_len": 24, "d_model": 32, "nhead": 2, "layers": 2, "ff": 64}
BATCH = 32
#: the encoder's matrices, the ones Muon steps in the Muon rows (examples/configs/muon_adamw.yaml)
MATRICES = ["*.in_proj_weight", "*.out_proj.weight", "*.linear1.weight", "*.linear2.weight"]
ARMS = ("no clip", "recorded", "rewritten")
#: a next-batch max logit over tau * (1 + ROUNDING) counts as over tau
ROUNDING = 1e-5


def pipeline(opt: str, lr: float, arm: str, tau: float) -> list[mo.Transform]:
    """The transforms of one run: Adam (or Muon on the matrices, Adam on the rest), then the clip of `arm`."""
    if opt == "adam":
        steps: list[mo.Transform] = [mo.Adam(lr=lr)]
    else:
        steps = [mo.Masked(mo.Adam(lr=lr), where={"exclude": MATRICES}),
                 mo.Masked(mo.Muon(lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"), where={"names": MATRICES})]
    if arm != "no clip":
        steps.append(mo.QKClip(tau, logits=arm))
    return steps


def max_logit(stats: mo.AttentionLogits) -> float:
    """The largest per-head max logit the provider recorded since its last reset, over every layer."""
    return max(float(v.max()) for v in stats.max_logits().values())


def train(opt: str, lr: float, arm: str, tau: float, seed: int, steps: int) -> dict[str, Any]:
    """One run; its per-run measurements (see the module's docstring)."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)  # (as `modopt run`: the model is built after seeding)
    task = transformer(seed, **TASK)
    model = task.model
    stats = mo.AttentionLogits.attach(model, keep_inputs=arm == "rewritten")
    optim = mo.Modular(model.named_parameters(), *pipeline(opt, lr, arm, tau))
    losses: list[float | None] = []
    same: list[float] = []
    nxt: list[float] = []
    batch = task.get_batch(1, BATCH)
    for step in range(1, steps + 1):
        loss = task.loss_fn(model, batch)
        optim.zero_grad()
        loss.backward()
        if step > 1:
            nxt.append(max_logit(stats))  # this step's forward: the next batch after step - 1's write
        optim.step()
        value = float(loss.detach())
        losses.append(value if value == value and abs(value) != float("inf") else None)
        stats.reset()  # (the clip read and reset it already; the no-clip arm's maxima are let go here)
        task.loss_fn(model, batch)  # the step's own forward again, at the written (and clipped) weights
        same.append(max_logit(stats))
        stats.reset()
        batch = task.get_batch(step + 1, BATCH)
    task.loss_fn(model, batch)  # the batch after the last step
    nxt.append(max_logit(stats))
    stats.reset()
    tail = [x for x in losses[-max(1, steps // 20):] if x is not None]
    return {
        "same_over_tau": max(same) / tau,
        "next_over_tau": max(nxt) / tau,
        "next_over_pct": 100.0 * sum(s > tau * (1 + ROUNDING) for s in nxt) / steps,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "loss_spikes": len(count_spikes(losses)),
    }


def _job(args: tuple) -> tuple[tuple, dict[str, Any]]:
    return args, train(*args)


COLUMNS = {
    "same_over_tau": ("max same-batch / tau", ".3g"),
    "next_over_tau": ("max next-batch / tau", ".3g"),
    "next_over_pct": ("% steps next > tau", ".3g"),
    "final_loss": ("final loss", ".3g"),
    "loss_spikes": ("loss spikes", ".2g"),
}


def table(opt: str, lrs: list[float], results: dict[tuple, list[dict[str, Any]]]) -> str:
    """The markdown table of `opt`: a row per lr and arm, each column's mean ± 95% half-width over seeds."""
    head = "| lr | arm | " + " | ".join(title for title, _ in COLUMNS.values()) + " |"
    rows = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for lr in lrs:
        for arm in ARMS:
            recs = results[(opt, lr, arm)]
            cells = [format_interval(interval([r[k] for r in recs]), spec) for k, (_, spec) in COLUMNS.items()]
            rows.append(f"| {lr:g} | {arm} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


#: the paired differences over seeds: (arm, baseline arm)
PAIRS = (("recorded", "no clip"), ("rewritten", "no clip"), ("rewritten", "recorded"))
PAIRED = ("next_over_pct", "final_loss", "loss_spikes")


def paired_table(opt: str, lrs: list[float], results: dict[tuple, list[dict[str, Any]]]) -> str:
    """The paired differences `arm - baseline` over the seeds (as `modopt compare --baseline` gives them)."""
    head = "| lr | arm - baseline | " + " | ".join(f"Δ {COLUMNS[k][0]}" for k in PAIRED) + " |"
    rows = [head, "|" + "---|" * (len(PAIRED) + 2)]
    for lr in lrs:
        for arm, base in PAIRS:
            a = {r["seed"]: r for r in results[(opt, lr, arm)]}
            b = {r["seed"]: r for r in results[(opt, lr, base)]}
            seeds = sorted(a.keys() & b.keys())
            cells = [format_interval(paired([a[s][k] for s in seeds], [b[s][k] for s in seeds]), COLUMNS[k][1],
                                     signed=True) for k in PAIRED]
            rows.append(f"| {lr:g} | {arm} - {base} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", default=bool(os.environ.get("MODOPT_QUICK")))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tau", type=float, default=5.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--adam-lrs", type=float, nargs="*", default=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1])
    ap.add_argument("--muon-lrs", type=float, nargs="*", default=[2e-2, 1e-1])
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (one thread each)")
    ap.add_argument("--json", default=None, help="write every run's values here")
    ap.add_argument("--tables-from", default=None, metavar="JSON",
                    help="print the tables of a --json file written before; run nothing")
    args = ap.parse_args()
    if args.tables_from:
        with open(args.tables_from) as f:
            saved = json.load(f)
        results = {(r["optimizer"], r["lr"], r["arm"]): r["per_seed"] for r in saved["runs"]}
        print_tables(saved, sorted({lr for o, lr, _ in results if o == "adam"}),
                     sorted({lr for o, lr, _ in results if o == "muon"}), results)
        return
    if args.quick:
        args.steps, args.seeds, args.adam_lrs, args.muon_lrs, args.jobs = 6, [0], [1e-3, 1e-1], [1e-1], 1
    plan = [(opt, lr, arm, args.tau, seed, args.steps)
            for opt, lrs in (("adam", args.adam_lrs), ("muon", args.muon_lrs))
            for lr in lrs for arm in ARMS for seed in args.seeds]
    start = time.perf_counter()
    results: dict[tuple, list[dict[str, Any]]] = {}
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            done = list(pool.map(_job, plan))
    else:
        done = [_job(p) for p in plan]
    for (opt, lr, arm, _, seed, _), rec in done:
        results.setdefault((opt, lr, arm), []).append({"seed": seed, **rec})
    saved = {"tau": args.tau, "steps": args.steps, "seeds": args.seeds, "task": TASK, "batch": BATCH,
             "seconds": round(time.perf_counter() - start),
             "runs": [{"optimizer": o, "lr": lr, "arm": a, "per_seed": recs} for (o, lr, a), recs in results.items()]}
    print_tables(saved, args.adam_lrs, args.muon_lrs, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=1)


def print_tables(saved: dict[str, Any], adam_lrs: list[float], muon_lrs: list[float],
                 results: dict[tuple, list[dict[str, Any]]]) -> None:
    """The tables of every optimizer: the per-arm values, then the paired differences."""
    print(f"tau = {saved['tau']:g}, {saved['steps']} steps, seeds {saved['seeds']}, batch {saved['batch']}; "
          f"mean ± 95% interval over seeds ({sum(len(v) for v in results.values())} runs"
          + (f", {saved['seconds']} s" if "seconds" in saved else "") + ")\n")
    for opt, lrs, title in (("adam", adam_lrs, "Adam on every parameter"),
                            ("muon", muon_lrs, "Muon on the encoder's matrices, Adam on the rest")):
        if lrs:
            print(f"{title}:\n\n{table(opt, lrs, results)}\n\n{paired_table(opt, lrs, results)}\n")


if __name__ == "__main__":
    main()
