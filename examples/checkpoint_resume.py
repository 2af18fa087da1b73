"""Checkpoint and resume a modopt optimizer bit-exactly.

Trains N steps in one go, then trains the same thing in two halves with a
checkpoint (model, optimizer with every transform's state, RNG) written to disk
and loaded into freshly built objects in between, and checks that the final
parameters are identical.

    python examples/checkpoint_resume.py --quick
"""

import argparse
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

import modopt as mo


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    clip = mo.ZClip(warmup_steps=5)
    opt = mo.Modular(model.parameters(), clip, mo.AdamW(lr=1e-2))
    return model, opt


def train(model, opt, start: int, stop: int) -> None:
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)  # data as a function of the step: resumable
        x = torch.randn(32, 8, generator=g)
        y = x.sum(1, keepdim=True).sin() + torch.randn(32, 1, generator=g) ** 3
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", default=bool(os.environ.get("MODOPT_QUICK")))
    args = ap.parse_args()
    steps = 20 if args.quick else 400
    half = steps // 2

    model, opt = build()
    train(model, opt, 0, steps)
    straight = [p.detach().clone() for p in model.parameters()]

    model, opt = build()
    train(model, opt, 0, half)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ckpt.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": half, "rng": torch.get_rng_state()}, path)
        # a new process would start here: rebuild everything, then load
        model, opt = build()
        ckpt = torch.load(path, weights_only=True)  # plain data only: safe to load
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
        # the pipeline config travels inside the checkpoint too
        print("pipeline in the checkpoint:", [t["type"] for t in ckpt["optimizer"]["modopt"]["config"]["transforms"]])
    train(model, opt, ckpt["step"], steps)
    resumed = [p.detach() for p in model.parameters()]

    same = all(torch.equal(a, b) for a, b in zip(straight, resumed))
    print(f"{steps} steps straight vs {half} + checkpoint + {steps - half}: identical = {same}")
    if not same:
        raise SystemExit("resume was not bit-exact")


if __name__ == "__main__":
    main()
