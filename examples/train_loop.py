"""A plain PyTorch training loop with a modopt optimizer.

`mo.Modular` is a torch.optim.Optimizer: zero_grad / backward / step as usual,
and any torch LR scheduler drives the `lr` of the Adam transform.

    python examples/train_loop.py            # 400 steps
    python examples/train_loop.py --quick    # a few steps (CI)
"""

import argparse
import os

import torch
from torch import nn

import modopt as mo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", default=bool(os.environ.get("MODOPT_QUICK")))
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    steps = 10 if args.quick else args.steps

    torch.manual_seed(0)
    # a regression problem with a few outlier batches: the gradient spikes that clipping is for
    x = torch.randn(2048, 8)
    y = (x @ torch.randn(8, 1)).tanh() + 0.05 * torch.randn(2048, 1)
    y[torch.randperm(2048)[:20]] += 50.0  # corrupted targets

    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = mo.Modular(
        model.parameters(),
        mo.ZClip(warmup_steps=10) if "ZClip" in mo.available() else mo.ClipNorm(1.0),  # adaptive clipping of the gradient
        mo.Adam(lr=1e-2),  # then Adam; the update Adam produces is what moves the parameters
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)

    for step in range(1, steps + 1):
        idx = torch.randint(0, 2048, (64,))
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % max(1, steps // 8) == 0 or step == steps:
            clipped = any(bool(v.any()) for k, v in opt.stats.items() if k.endswith(".clipped"))
            print(f"step {step:4d}  loss {loss.item():8.4f}  lr {opt.param_groups[0]['lr']:.2e}  clipped {clipped}")

    print("pipeline config:")
    print(opt.config.to_yaml())


if __name__ == "__main__":
    main()
