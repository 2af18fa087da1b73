"""A plain PyTorch training loop with a modopt optimizer, on data with outliers.

`mo.Modular` is a torch.optim.Optimizer: zero_grad / backward / step as usual,
and any torch LR scheduler drives the `lr` of the Adam transform.

Six of the 2048 training targets are corrupted (+50): a batch that holds one
has a huge loss and gradient, the spikes clipping is for (the "max" column).
The loss worth watching is the one on clean held-out data; the script prints it
with the median and largest batch loss, then the final held-out loss of
ZClip + Adam against Adam alone.

    python examples/train_loop.py            # 400 steps
    python examples/train_loop.py --quick    # a few steps (CI)
"""

import argparse
import os

import torch
from torch import nn

import modopt as mo


def make_data():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 1, generator=g)
    x = torch.randn(2048 + 512, 8, generator=g)
    y = (x @ w).tanh() + 0.05 * torch.randn(len(x), 1, generator=g)
    x_train, y_train, x_test, y_test = x[:2048], y[:2048].clone(), x[2048:], y[2048:]
    y_train[torch.randperm(2048, generator=g)[:6]] += 50.0  # six corrupted training targets
    return x_train, y_train, x_test, y_test


def train(pipeline, steps: int, log: bool) -> float:
    x, y, x_test, y_test = make_data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = mo.Modular(model.parameters(), *pipeline)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    every = max(1, steps // 8)
    losses = []
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(x), (64,))
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log and (step % every == 0 or step == steps):
            with torch.no_grad():
                test = nn.functional.mse_loss(model(x_test), y_test).item()
            recent = sorted(losses[-every:])
            print(f"step {step:4d}  held-out loss {test:.4f}  batch loss: median {recent[len(recent) // 2]:.4f}, "
                  f"max {recent[-1]:7.2f}  lr {opt.param_groups[0]['lr']:.1e}")
    with torch.no_grad():
        return nn.functional.mse_loss(model(x_test), y_test).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", default=bool(os.environ.get("MODOPT_QUICK")))
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    steps = 10 if args.quick else args.steps

    # ZClip clips gradient norms that are outliers of their running statistics; then Adam
    # (the update Adam produces is what moves the parameters)
    pipeline = [mo.ZClip(warmup_steps=10), mo.Adam(lr=1e-2)]
    print("ZClip + Adam:")
    clipped = train(pipeline, steps, log=True)
    plain = train([mo.Adam(lr=1e-2)], steps, log=False)
    print(f"final held-out loss: ZClip + Adam {clipped:.4f}, Adam alone {plain:.4f}")
    print("pipeline config:")
    print(mo.Modular([nn.Parameter(torch.zeros(1))], *pipeline).config.to_yaml())


if __name__ == "__main__":
    main()
