"""Spec of scopes: split tensors into segments, as flat float64 vectors.

Written for clarity, independently of the runtime's reductions: each segment
is a list of `(tensor index, flat element indices)`; its values are gathered
into one float64 vector, a rule maps that vector to a new one, and the result
is scattered back. Segments with fewer than `min_size` elements are left as
they are.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

Segment = list[tuple[int, torch.Tensor]]


def reduce_dims(ndim: int, dim, inverse_dims: bool) -> list[int]:
    """The dims a slice spans. Dims outside the tensor are ignored; if no listed
    dim applies (and not inverse), the slice is the whole tensor."""
    listed = [dim] if isinstance(dim, int) else list(dim or [])
    valid = []
    for d in listed:
        if -ndim <= d < ndim:
            d = d + ndim if d < 0 else d
            if d not in valid:
                valid.append(d)
    if inverse_dims:
        return [d for d in range(ndim) if d not in valid]
    return sorted(valid) if valid else list(range(ndim))


def tensor_slices(shape, dims: list[int]) -> list[torch.Tensor]:
    """Flat element indices of every slice spanning `dims` of a tensor of `shape`."""
    numel = math.prod(shape)
    flat = torch.arange(numel).reshape(shape)
    keep = [d for d in range(len(shape)) if d not in dims]
    moved = flat.permute(*keep, *dims) if shape else flat
    size = math.prod(shape[d] for d in dims)
    return list(moved.reshape(-1, size)) if numel else []


def segments(tensors, group_of: list[int], scope: str, dim=None, inverse_dims: bool = False) -> list[Segment]:
    if scope == "global":
        return [[(i, torch.arange(t.numel())) for i, t in enumerate(tensors)]]
    if scope == "group":
        out: dict[int, Segment] = {}
        for i, t in enumerate(tensors):
            out.setdefault(group_of[i], []).append((i, torch.arange(t.numel())))
        return [out[g] for g in sorted(out)]
    if dim is None and not inverse_dims:
        return [[(i, torch.arange(t.numel()))] for i, t in enumerate(tensors)]
    segs = []
    for i, t in enumerate(tensors):
        for idx in tensor_slices(tuple(t.shape), reduce_dims(t.dim(), dim, inverse_dims)):
            segs.append([(i, idx)])
    return segs


def gather(tensors, seg: Segment) -> torch.Tensor:
    parts = [tensors[i].reshape(-1)[idx].to(torch.float64) for i, idx in seg]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def scatter(out, seg: Segment, values: torch.Tensor) -> None:
    pos = 0
    for i, idx in seg:
        flat = out[i].reshape(-1)
        flat[idx] = values[pos : pos + len(idx)]
        pos += len(idx)


def map_segments(
    tensors, group_of, scope, dim, inverse_dims, min_size, rule: Callable[[int, torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    """Apply `rule(segment number, values)` to every segment with at least `min_size` elements."""
    out = [t.detach().to(torch.float64).clone() for t in tensors]
    for s, seg in enumerate(segments(tensors, group_of, scope, dim, inverse_dims)):
        x = gather(out, seg)
        if x.numel() >= min_size:
            scatter(out, seg, rule(s, x))
    return out
