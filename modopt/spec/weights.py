"""Spec of the weight-stage transforms (float64, one tensor at a time)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def project_norm(params: Sequence[torch.Tensor], radii: Sequence[float | None], eps: float,
                 min_ndim: int) -> list[torch.Tensor]:
    """`ProjectNorm`: each tensor with at least `min_ndim` dims times `R / (||p||_F + eps)` (`radii[i]`: its
    R), left as it is when its norm is 0; the others unchanged."""
    out = []
    for p, r in zip(params, radii):
        vals = p.detach().to(torch.float64).reshape(-1).tolist()
        if p.dim() < min_ndim:
            out.append(torch.tensor(vals, dtype=torch.float64).reshape(p.shape))
            continue
        norm = math.sqrt(sum(v * v for v in vals))
        f = r / (norm + eps) if norm > 0 else 1.0
        out.append(torch.tensor([v * f for v in vals], dtype=torch.float64).reshape(p.shape))
    return out


def frobenius(p: torch.Tensor) -> float:
    """`||p||_F` in float64."""
    return math.sqrt(sum(v * v for v in p.detach().to(torch.float64).reshape(-1).tolist()))


def qk_clip_factor(s: float, tau: float, eps: float, eta_min: float = 1e-3) -> float:
    """QK-Clip's `eta = min(1, max(eta_min, tau / max(S, eps)))`; 1 for a NaN or infinite `S` (no
    measurement: leave the head)."""
    if not math.isfinite(s):
        return 1.0
    return min(1.0, max(eta_min, tau / max(s, eps)))


def qk_clip(query: Sequence[torch.Tensor], key: Sequence[torch.Tensor], max_logits: Sequence[float], tau: float,
            alpha: float, eps: float, eta_min: float = 1e-3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`QKClip` on one layer: each tensor of `query` / `key` holds the layer's query / key rows, split in
    `len(max_logits)` equal blocks of rows (head h: block h); head h's query rows times `eta_h ** alpha`,
    key rows times `eta_h ** (1 - alpha)` (float64, one element at a time)."""
    heads = len(max_logits)
    etas = [qk_clip_factor(s, tau, eps, eta_min) for s in max_logits]

    def scaled(t: torch.Tensor, power: float) -> torch.Tensor:
        rows = t.shape[0] // heads
        flat = t.detach().to(torch.float64).reshape(t.shape[0], -1).tolist()
        out = [[v * etas[r // rows] ** power for v in row] for r, row in enumerate(flat)]
        return torch.tensor(out, dtype=torch.float64).reshape(t.shape)

    return [scaled(t, alpha) for t in query], [scaled(t, 1.0 - alpha) for t in key]


def attention_max_logits(xq: torch.Tensor, xk: torch.Tensor, wq: torch.Tensor, bq: torch.Tensor | None,
                         wk: torch.Tensor, bk: torch.Tensor | None, heads: int,
                         allowed: torch.Tensor | None = None) -> list[float]:
    """Each head's max of `q_i · k_j / sqrt(d)` over batch `b` and the positions `allowed[b, i, j]` (or all),
    for inputs `xq` (B, Lq, E), `xk` (B, Lk, E) and projections `q = xq wq^T + bq` (float64, by head)."""
    xq, xk, wq, wk = (t.detach().to(torch.float64) for t in (xq, xk, wq, wk))
    d = wq.shape[0] // heads
    out = []
    for h in range(heads):
        rows = slice(h * d, (h + 1) * d)
        q = xq @ wq[rows].T + (0.0 if bq is None else bq.detach().to(torch.float64)[rows])
        k = xk @ wk[rows].T + (0.0 if bk is None else bk.detach().to(torch.float64)[rows])
        s = torch.einsum("bid,bjd->bij", q, k) / math.sqrt(d)
        if allowed is not None:
            s = s[allowed.expand_as(s)]
        out.append(float(s.max()))
    return out


def qk_clip_rewritten(wq: torch.Tensor, bq: torch.Tensor | None, wk: torch.Tensor, bk: torch.Tensor | None,
                      heads: int, forwards: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
                      tau: float, alpha: float, eps: float, carried: Sequence[float] | None = None,
                      eta_min: float = 1e-3) -> tuple[list[float], list[torch.Tensor]]:
    """`QKClip(logits="rewritten")` on one layer whose written query / key weights and biases are `wq, bq, wk, bk`:
    `S'_h` is head h's max logit over `forwards` (each `(xq, xk, allowed)`, batch-first inputs and the
    positions kept, as `attention_max_logits`) at these weights, and over `carried` (maxima of forwards whose
    step was skipped); then `qk_clip` by `S'`. Returns `(S', [wq, bq, wk, bk] clipped)` (float64)."""
    s = list(carried) if carried is not None else [-math.inf] * heads
    for xq, xk, allowed in forwards:
        s = [max(a, b) for a, b in zip(s, attention_max_logits(xq, xk, wq, bq, wk, bk, heads, allowed))]
    q = [wq] + ([bq] if bq is not None else [])
    k = [wk] + ([bk] if bk is not None else [])
    cq, ck = qk_clip(q, k, s, tau, alpha, eps, eta_min)
    return s, [cq[0], cq[1] if bq is not None else None, ck[0], ck[1] if bk is not None else None]
