"""The optimizer state's memory, AdamW with float32 moments against `state_dtype="bfloat16"`.

    python benchmarks/state_memory.py            # the transformer task's model and a 1024-wide MLP
    python benchmarks/state_memory.py --amsgrad  # with the third moment (max_exp_avg_sq)

The bytes are counted, not sampled: `sum(t.numel() * t.element_size())` over every tensor of
`opt.state` after one step (the moments, and the 0-d float32 step counts, 4 bytes per parameter
tensor), next to the parameters' own bytes. A step with bfloat16 moments on a CPU, or on parameters
torch's fused CUDA kernel does not take them with, also makes float32 copies of the moments for the
length of the kernel call: transient, not kept (docs/modules/optimizers.md, "bfloat16 moments").
"""

from __future__ import annotations

import argparse

import torch

import modopt as mo
from modopt.cli.tasks import transformer


def state_bytes(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes of the moments, bytes of everything else in `opt.state`)."""
    moments = other = 0
    for s in opt.state.values():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                n = v.numel() * v.element_size()
                if k.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    moments += n
                else:
                    other += n
    return moments, other


def measure(make_model, amsgrad: bool) -> list[tuple[str, int, int, int]]:
    rows = []
    for state_dtype in ("param", "bfloat16"):
        model = make_model()
        opt = mo.Modular(model.parameters(), mo.AdamW(1e-3, amsgrad=amsgrad, state_dtype=state_dtype))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        rows.append((state_dtype, params, *state_bytes(opt)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--amsgrad", action="store_true", help="AdamW(amsgrad=True): a third moment")
    args = ap.parse_args()
    models = {
        "transformer task (d_model 32, 2 layers)": lambda: transformer(0).model,
        "MLP 1024-1024-1024-10": lambda: torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                                             torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                                             torch.nn.Linear(1024, 10)),
    }
    print(f"AdamW{'(amsgrad=True)' if args.amsgrad else ''}, float32 parameters, torch {torch.__version__}\n")
    print("| model | state_dtype | parameters | moments | step counts | state / parameters |")
    print("|---|---|---:|---:|---:|---:|")
    for name, make in models.items():
        for state_dtype, params, moments, other in measure(make, args.amsgrad):
            print(f"| {name} | {state_dtype} | {params:,} B | {moments:,} B | {other:,} B | "
                  f"{(moments + other) / params:.2f} |")


if __name__ == "__main__":
    main()
