"""Spec of the caution family: `Cautious`, `Grams`, `WeightDecay` / `CautiousWeightDecay` (float64).

Element by element in plain Python numbers, one tensor at a time: the signs are compared as the
rules state them (in exact arithmetic), the counts are Python integers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _values(t: torch.Tensor) -> list[float]:
    return t.detach().to(torch.float64).reshape(-1).tolist()


def _same_sign(a: float, b: float) -> bool:
    """`a * b > 0` in exact arithmetic: both non-zero and of one sign (False with a NaN)."""
    return (a > 0 and b > 0) or (a < 0 and b < 0)


def _signbit(a: float) -> bool:
    return math.copysign(1.0, a) < 0


def cautious(updates: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scale: str = "timm") -> list[torch.Tensor]:
    """`Cautious`: per tensor, `u` where it agrees in sign with `g` (else 0), times the rescaling `s`.

    The mask is `u * g > 0`, or for `scale="heavyball"` equal sign bits (a zero counts by its sign
    bit); with `N` elements and `k` kept, `s` is `1 / max(k / N, 1e-3)` ("timm"), `N / (k + 1)`
    ("c_optim"), `N / max(k, 1)` ("heavyball") or 1 ("none").
    """
    out = []
    for u, g in zip(updates, grads):
        us, gs = _values(u), _values(g)
        if scale == "heavyball":
            keep = [_signbit(a) == _signbit(b) for a, b in zip(us, gs)]
        else:
            keep = [_same_sign(a, b) for a, b in zip(us, gs)]
        n, k = len(us), sum(keep)
        if scale == "timm":
            s = 1.0 / max(k / max(n, 1), 1e-3)
        elif scale == "c_optim":
            s = n / (k + 1)
        elif scale == "heavyball":
            s = n / max(k, 1)
        else:
            s = 1.0
        vals = [a * s if kk else 0.0 for a, kk in zip(us, keep)]
        out.append(torch.tensor(vals, dtype=torch.float64).reshape(u.shape))
    return out


def grams(updates: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`Grams`: `sign(g) * |u|`, with `sign(0) = 0`: an element with a zero gradient does not move; nor does
    one with a NaN gradient (`torch.sign` and pytorch_optimizer's `Grams` give NaN the sign 0)."""
    out = []
    for u, g in zip(updates, grads):
        vals = [abs(a) * (1.0 if b > 0 else -1.0 if b < 0 else 0.0) for a, b in zip(_values(u), _values(g))]
        out.append(torch.tensor(vals, dtype=torch.float64).reshape(u.shape))
    return out


def weight_decay(updates: Sequence[torch.Tensor], params: Sequence[torch.Tensor], lrs: Sequence[float],
                 weight_decay: float = 1e-2, cautious: bool = False) -> list[torch.Tensor]:
    """`WeightDecay`: `u + lr * weight_decay * x` (`lrs[i]`: the lr of tensor `i`'s param group); with
    `cautious`, only where `u * x >= 0` in exact arithmetic (not both non-zero of opposite signs)."""
    out = []
    for u, x, lr in zip(updates, params, lrs):
        vals = []
        for a, w in zip(_values(u), _values(x)):
            opposite = (a > 0 and w < 0) or (a < 0 and w > 0)  # (False with a NaN: a NaN stays NaN)
            decays = not (cautious and opposite)
            vals.append(a + lr * weight_decay * w if decays else a)
        out.append(torch.tensor(vals, dtype=torch.float64).reshape(u.shape))
    return out
