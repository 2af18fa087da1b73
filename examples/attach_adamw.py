"""Add modopt transforms in front of an existing torch.optim.AdamW with `mo.attach`.

Nothing about the torch optimizer changes (its state_dict, its fused kernels);
the attached transforms rewrite the gradients right before every `step()`.

    python examples/attach_adamw.py --quick
"""

import argparse
import os

import torch
from torch import nn

import modopt as mo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", default=bool(os.environ.get("MODOPT_QUICK")))
    args = ap.parse_args()
    steps = 10 if args.quick else 300

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    clip = mo.AutoClip(percentile=10)  # clip to the 10th percentile of the gradient norms seen so far
    handle = mo.attach(opt, mo.GradientCentralization(), clip)

    # a learnable task: the labels come from a random linear "teacher"
    data = torch.randn(512, 16)
    target = (data @ torch.randn(16, 4)).argmax(1)
    for step in range(1, steps + 1):
        idx = torch.randint(0, 512, (32,))
        loss = nn.functional.cross_entropy(model(data[idx]), target[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()  # the attached transforms run first (a step pre-hook)
        if step % max(1, steps // 5) == 0 or step == steps:
            with torch.no_grad():
                logits = model(data)
                full = nn.functional.cross_entropy(logits, target).item()
                acc = (logits.argmax(1) == target).float().mean().item()
            print(f"step {step:4d}  loss on all 512 examples {full:.4f}  accuracy {acc:.0%}")

    # checkpoints: the torch optimizer saves its own state, the handle the transforms' state
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "clip": handle.state_dict()}
    print("checkpoint keys:", sorted(ckpt))
    handle.remove()  # detach: AdamW steps as if nothing had been attached
    print("detached; plain AdamW from here on")


if __name__ == "__main__":
    main()
