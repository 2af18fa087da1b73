"""Small helpers shared by the clipping families (tensor math only, no host syncs)."""

from __future__ import annotations

from typing import Callable

import torch

from ..core.scope import Segments, Stat


def below_one(ratio: torch.Tensor) -> torch.Tensor:
    """`ratio` where it is < 1, else 1. A NaN ratio (0/0) gives 1: never scales up, never NaN."""
    return torch.where(ratio < 1, ratio, torch.ones_like(ratio))


def clip_to(norm: torch.Tensor, limit: torch.Tensor | float, eps: float) -> torch.Tensor:
    """The scale `min(1, limit / (norm + eps))` that clips `norm` to `limit` (1 for 0/0)."""
    return below_one(limit / (norm + eps))


def map_many(seg: Segments, fn: Callable[..., tuple], *stats: Stat) -> tuple:
    """Like `Segments.map()` for a `fn` returning a tuple: a tuple of Stats."""
    if seg.stacked:
        return tuple(fn(*stats))
    outs = [fn(*xs) for xs in zip(*stats)]
    return tuple(list(col) for col in zip(*outs))


def record_clip(st, seg: Segments, norm: Stat, scale: Stat, **extra: Stat) -> None:
    """Telemetry of a norm clipper: pre-clip `norm`, `scale`, `clipped` (stacked scopes only)."""
    if not seg.stacked:
        return
    st.record("norm", norm)
    st.record("scale", scale)
    st.record("clipped", scale < 1)
    for k, v in extra.items():
        st.record(k, v)
