"""What one default step costs, in counts that do not depend on the machine: aten ops, host syncs, bytes.

    python benchmarks/step_counts.py                  # the issue's pipelines on the benchmark MLP
    python benchmarks/step_counts.py --quick --json counts.json
    python benchmarks/step_counts.py --device cuda    # the same counts with CUDA tensors

For each pipeline, `mo.Modular(model.parameters(), *pipeline)` with its defaults takes 3 warm-up steps
after a real backward, on the device path as a GPU would; then one more `opt.step()` runs under a `TorchDispatchMode` that counts

* **ops**: aten ops other than views (a view moves no memory);
* **syncs**: `aten._local_scalar_dense` and `aten.is_nonzero` (`.item()`, `bool(tensor)`): each one
  makes a GPU host wait for the device;
* **bytes**: the bytes every op reads (its tensor inputs) and writes (its outputs, or the tensor it
  updates in place), in units of `P`, the parameters' bytes. An estimate of memory traffic: scratch
  memory inside a kernel is invisible, a fused kernel's reads are counted once, and torch's fused
  optimizers do not count as writing the gradients unless they unscale them (`grad_scale`).

The careful torch loop of each pipeline (`benchmarks/bench.py`'s torch side: torch's kernels and the
finite check `if norm.isfinite(): opt.step()`) is counted the same way. `limit` is the pipeline's bytes
limit (`bench.Pipeline.limit`: every state tensor read and written once, the gradient read once for the
update and once more for each reduction that must finish before it). The counted step is the 4th:
ZClip's careful loop is then still in its warm-up (a Python counter: 17 ops; about 38 after it), while
modopt's device-side counter computes both branches and selects on the device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import PIPELINES, StepCounter, build_model, loss_fn  # noqa: E402  (the benchmark's MLP, counter, sides)

import modopt as mo  # noqa: E402
from modopt.core import runner  # noqa: E402

def pipelines() -> dict[str, list]:
    return {
        "ClipNorm(1.0), Adam()": [mo.ClipNorm(1.0), mo.Adam()],
        "ClipNormByEMA(), Normalize(), Adam()": [mo.ClipNormByEMA(), mo.Normalize(), mo.Adam()],
        "ZClip(), AdamW()": [mo.ZClip(), mo.AdamW()],
        # a setting, as an extra row: the clip's scale folded into the fused kernel (not bit-exact)
        "ClipNorm(1.0), Adam(fold_clip=True)": [mo.ClipNorm(1.0), mo.Adam(fold_clip=True)],
    }


def count(make_step, model, make_batch, g) -> StepCounter:
    for _ in range(4):
        model.zero_grad()
        loss_fn(model, *make_batch(g)).backward()
        if _ == 3:
            with StepCounter() as c:
                make_step()
            return c
        with runner.device_path():  # every step the path a GPU runs (the counted one too: StepCounter)
            make_step()
    raise AssertionError  # pragma: no cover


def rows(quick: bool, device: str = "cpu") -> list[dict]:
    out = []
    by_name = {p.name: p for p in PIPELINES}

    def on_device(quick):
        model, make = build_model("mlp", quick)
        return model.to(device), lambda g: tuple(t.to(device) for t in make(g))

    for name, transforms in pipelines().items():
        limit = by_name[name].limit
        model, make = on_device(quick)
        pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        opt = mo.Modular(model.parameters(), *transforms)
        c = count(opt.step, model, make, torch.Generator().manual_seed(0))
        out.append({"pipeline": name, "side": "modopt", "ops": c.ops, "syncs": c.syncs,
                    "bytes_P": round(c.bytes / pbytes, 2), "limit_P": limit})
        model, make = on_device(quick)
        side = by_name[name].torch(model, True)  # the careful torch loop, with its finite check
        c = count(side.step, model, make, torch.Generator().manual_seed(0))
        out.append({"pipeline": name, "side": "torch (careful loop)", "ops": c.ops, "syncs": c.syncs,
                    "bytes_P": round(c.bytes / pbytes, 2), "limit_P": limit})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny MLP (a smoke run)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--device", default="cpu", help="where the model and optimizer live (default cpu)")
    args = ap.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device!r}: torch {torch.__version__} sees no CUDA device here")
    got = rows(args.quick, args.device)
    print("| pipeline (defaults) | side | ops | syncs | bytes | limit |\n|---|---|---|---|---|---|")
    for r in got:
        print(f"| `{r['pipeline']}` | {r['side']} | {r['ops']} | {r['syncs']} | {r['bytes_P']}P | {r['limit_P']}P |")
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
