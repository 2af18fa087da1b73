"""Flat partitions: parameters handed to the optimizer as 1-D pieces of flattened tensors, refused where the
result would depend on a tensor's shape.

DeepSpeed's ZeRO stage 3 partitions each parameter as a flat 1-D piece per rank and records the full shape on
the parameter (`ds_shape`, with `ds_numel`); FSDP1 without `use_orig_params` hands the optimizer a
`FlatParameter`, many parameters concatenated into one 1-D tensor. An elementwise rule (Adam, SGD, a clip of
values) gives the same numbers on such a piece; a rule that reads a tensor's shape does not, and nothing would
fail: `Orthogonalize` passes a 1-D tensor through unchanged, a per-tensor norm becomes the norm of a piece.

`check_flat_partitions(transforms, named)` runs when `Modular` is built and when a param group is added
(never in a step): each transform that takes the `ShapeDependent` role and says why these fields depend on
the shape (`shape_dependence()`) refuses every flat partition among the parameters it would step (a `Masked`
branch sees its selection), naming the parameter, the transform and why.

Not detectable, so not refused: flat fp32 partitions that a wrapper hands its inner optimizer with no marker
(DeepSpeed's ZeRO 1 and 2 groups, `single_partition_of_fp32_groups`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
import torch

from .keys import transform_key
from .roles import SelectsByName, ShapeDependent
from .select import selected_named
from .transform import Transform

Named = list[tuple[str | None, torch.Tensor]]


def flat_partition(p: torch.Tensor) -> str | None:
    """What makes `p` a flat partition, in words (with the full shape it stands for), or None for a whole tensor.

    A parameter whose recorded `ds_shape` is its own shape (a ZeRO-3 parameter gathered whole) is whole."""
    full = getattr(p, "ds_shape", None)
    if full is not None and tuple(full) != tuple(p.shape):
        return (f"a flat partition of shape {tuple(p.shape)} standing for a tensor of shape {tuple(full)} "
                "(DeepSpeed ZeRO's ds_shape)")
    mod = sys.modules.get("torch.distributed.fsdp._flat_param")  # (FSDP1 imported: else no FlatParameter exists)
    cls = getattr(mod, "FlatParameter", None) if mod is not None else None
    if cls is not None and isinstance(p, cls):
        return f"an FSDP1 FlatParameter of shape {tuple(p.shape)} (several parameters flattened into one; use_orig_params=False)"
    return None


def check_flat_partitions(transforms: Sequence[Transform], named: Named) -> None:
    """Refuse (`ValueError`) a flat partition (`flat_partition`) among `named` (`(name or None, parameter)` in the
    optimizer's order) given to a transform whose result depends on a tensor's shape (see the module docs)."""
    flat = {id(p): why for n, p in named if (why := flat_partition(p)) is not None}
    if flat:  # (the usual case ends here: one look per parameter, when built)
        _check(tuple(transforms), "", named, flat)


def _check(transforms: tuple[Transform, ...], prefix: str, named: Named, flat: dict[int, str]) -> None:
    for i, t in enumerate(transforms):
        key = transform_key(i, type(t).__name__, prefix)
        why = t.shape_dependence() if isinstance(t, ShapeDependent) else None
        if why is not None:
            for j, (n, p) in enumerate(named):
                if id(p) in flat:
                    name = repr(n) if n is not None else f"#{j} (unnamed)"
                    raise ValueError(
                        f"modopt: parameter {name} is {flat[id(p)]}; {key} {why}, which on a "
                        "flat partition would be silently wrong. Give this transform whole parameters (FSDP2's "
                        "fully_shard keeps each parameter's shape, as a DTensor), or keep the flat partitions to "
                        "elementwise transforms and global- or group-scope statistics (mo.Masked)")
        kids = t.children()
        if kids:
            sel = t.name_selection(key) if isinstance(t, SelectsByName) else None
            _check(kids, key, selected_named(sel[0], named) if sel is not None else named, flat)

