"""Write tests/data/checkpoint_v1.pt: a format-1 modopt checkpoint, committed as a compatibility fixture.

How it was made (``python tests/data/make_checkpoint_v1.py`` with modopt at
format_version 1, torch 2.13 CPU, float32): a small MLP trained for 5 steps
by a pipeline that keeps every kind of state (global scalars, per-group
values, per-parameter EMA vectors and slice values, a history, Adam's
buffers); the file holds the model's and the optimizer's state dicts, the
pipeline config, the 3 batches of the resumed steps and the parameters after
them (``expected``). tests/test_checkpoint_compat.py loads it with the
current code, resumes, and compares. Never regenerate it to make that test
pass: it stands for checkpoints users already have on disk.

Its ``expected`` is what the code computed before the one-D rule (docs/concepts.md,
"Slices"): ``ClipNormByEMA(scope="tensor", dim=0, inverse_dims=True)`` then clipped each
bias element as a slice of its own; now the biases are left alone. The parameters the
resumed steps give under the rule are in ``checkpoint_v1_one_d.pt``, written by
``python tests/data/make_checkpoint_v1.py --one-d`` at c984f1c (the code before the rule;
see ``record_one_d``); the fixture itself was not rewritten.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import modopt as mo

OUT = Path(__file__).with_name("checkpoint_v1.pt")
ONE_D = Path(__file__).with_name("checkpoint_v1_one_d.pt")


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def pipeline() -> list:
    return [
        mo.ZClip(warmup_steps=2, max_grad_norm=1.0),
        mo.ClipNormByEMA(beta=0.9, scope="tensor", dim=0, inverse_dims=True),
        mo.AutoClip(percentile=50, window=4, scope="group"),
        mo.AdamW(lr=1e-2),
    ]


def groups(m):
    named = list(m.named_parameters())
    return [{"params": [p for _, p in named[:2]], "param_names": [n for n, _ in named[:2]]},
            {"params": [p for _, p in named[2:]], "param_names": [n for n, _ in named[2:]], "lr": 5e-3}]


def batches(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 4, generator=g) for _ in range(n)]


def train(m, opt, xs) -> None:
    for x in xs:
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()


def main() -> None:
    m = model()
    opt = mo.Modular(groups(m), *pipeline())
    train(m, opt, batches(1, 5))
    # deep copies: state_dict() returns the live state tensors, which the resumed steps below update
    ck = {"model": copy.deepcopy(m.state_dict()), "optimizer": copy.deepcopy(opt.state_dict()),
          "config": opt.config.to_dict(), "resume_batches": batches(2, 3)}
    train(m, opt, ck["resume_batches"])
    ck["expected"] = [p.detach().clone() for p in m.parameters()]
    assert ck["optimizer"]["modopt"]["format_version"] == 1
    torch.save(ck, OUT)
    print(f"wrote {OUT}")


def one_d_pipeline() -> list:
    """`pipeline()` with the ClipNormByEMA leaving the biases alone by `min_size=2` (their slices had one
    element each before the one-D rule): what the code before the rule computed for `pipeline()` under
    it. The weights' slices (4 and 6 elements) and the checkpoint's state layout are the same."""
    pipe = pipeline()
    pipe[1] = mo.ClipNormByEMA(beta=0.9, scope="tensor", dim=0, inverse_dims=True, min_size=2)
    return pipe


def record_one_d() -> None:
    """Write checkpoint_v1_one_d.pt: the parameters after the fixture's resumed steps under the one-D
    rule, computed by the code before the rule (run at c984f1c) through `one_d_pipeline()`."""
    import warnings

    ck = torch.load(OUT, weights_only=True)
    m = model()
    m.load_state_dict(ck["model"])
    opt = mo.Modular(groups(m), *one_d_pipeline())
    with warnings.catch_warnings():  # min_size: 1 in the checkpoint, 2 here
        warnings.simplefilter("ignore", UserWarning)
        opt.load_state_dict(ck["optimizer"])
    train(m, opt, ck["resume_batches"])
    torch.save([p.detach().clone() for p in m.parameters()], ONE_D)
    print(f"wrote {ONE_D}")


if __name__ == "__main__":
    import sys

    record_one_d() if "--one-d" in sys.argv else main()
