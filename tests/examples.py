"""For every registered transform: instances with every field set away from its default.

The conformance suite checks that every registered transform appears here, so
a new transform gets the shared checks (config round trip of every field,
checkpoint round trip, zero/None/non-finite grads, half precision, groups).
"""

from __future__ import annotations

import torch

import modopt as mo

# name -> an instance, or a list of instances, that together set every field away from its default
# (fields that exclude each other, like SGD's nesterov and dampening, need two instances)
NON_DEFAULT = {
    "Identity": mo.Identity(),
    "ClipValue": mo.ClipValue(0.05),
    "ClipNorm": mo.ClipNorm(0.5, ord="l1", eps=0.0, scope="tensor", dim=-1, inverse_dims=True, min_size=3),
    "Normalize": mo.Normalize(2.0, ord=3.0, scope="group", eps=1e-8, min_size=2),
    "Centralize": mo.Centralize(scope="tensor", dim=(0,), inverse_dims=True, min_size=3),
    "GradientCentralization": mo.GradientCentralization(dim=1, inverse_dims=False, scope="tensor", min_size=1),
    "Chain": mo.Chain(mo.ClipNorm(2.0), mo.Chain(mo.Normalize(), mo.Identity())),
    "LR": mo.LR(0.05),
    "SGD": [
        mo.SGD(lr=0.02, momentum=0.8, dampening=0.0, nesterov=True, weight_decay=1e-3),
        mo.SGD(lr=0.03, momentum=0.5, dampening=0.1, nesterov=False, weight_decay=1e-3),
    ],
    "Adam": mo.Adam(lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=1e-3, amsgrad=True),
    "AdamW": mo.AdamW(lr=2e-3, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.05, amsgrad=True),
    # eps representable in fp16, so the half-precision checks test modopt rather than RMSprop's fp16 underflow
    "TorchOptimizer": mo.TorchOptimizer(torch.optim.RMSprop, lr=3e-3, alpha=0.95, eps=1e-4),
    # the module families (issue 3)
    "ClipNormByEMA": mo.ClipNormByEMA(
        beta=0.9, ord="l1", eps=1e-5, scope="tensor", dim=0, inverse_dims=True, min_size=2,
        max_ema_growth=2.0, ema_init="update",
    ),
    "NormalizeByEMA": mo.NormalizeByEMA(
        beta=0.95, ord=3.0, eps=1e-7, scope="group", min_size=2, max_ema_growth=None, ema_init="update"
    ),
    "ClipValueByEMA": mo.ClipValueByEMA(beta=0.9, ema_init="update"),
    "ClipNormGrowth": mo.ClipNormGrowth(
        add=0.5, mul=2.0, min_value=1e-3, max_decay=3.0, ord="linf", scope="tensor", dim=-1, inverse_dims=True,
        min_size=2,
    ),
    "ClipValueGrowth": mo.ClipValueGrowth(add=0.1, mul=None, min_value=1e-3, max_decay=None),
    "HistClip": mo.HistClip(
        mo.EMACriterion(alpha=0.9, r_thresh=1.2, rule="reciprocal"), warmup_steps=3, warmup_max_norm=None,
        update_stats_with="clipped", ord="l1", eps=0.0, scope="group", min_size=2,
    ),
    "ZClip": mo.ZClip(
        alpha=0.9, z_thresh=2.0, max_grad_norm=None, eps=1e-5, warmup_steps=3, mode="percentile", clip_option="mean",
        clip_factor=0.8, skip_update_on_spike=True, ord=3.0, scope="tensor", dim=0, inverse_dims=True, min_size=2,
    ),
    "AutoClip": mo.AutoClip(percentile=25.0, window=5, ord="l1", eps=0.0, scope="group", min_size=2),
    "ZScoreNormalize": mo.ZScoreNormalize(scope="tensor", dim=-1, inverse_dims=True, eps=1e-6, min_size=3),
    "ClipValueByPercentile": mo.ClipValueByPercentile(90, scope="tensor", dim=0, inverse_dims=True, min_size=2),
    # exclude=[] (not None): test_config builds from unnamed parameters, where a non-empty exclude is an error
    "AGC": mo.AGC(clipping=0.05, eps=1e-2, exclude=["2.bias"]),  # the example models name their params
    "ZeroNonFinite": mo.ZeroNonFinite(),
    "Accumulate": mo.Accumulate(2),
    # issue 12: a mask holding a nested mask; every Select field set
    "Masked": mo.Masked(
        mo.ClipNorm(0.5), mo.Masked(mo.Normalize(0.5), where=mo.Select(max_ndim=1)),
        where=mo.Select(names=["*"], exclude=["0.weight"], min_ndim=1, max_ndim=2, groups=[0, 1]),
    ),
}

#: what the generated ``Masked[...]`` examples select: the example models' later layers (and a 0-d
#: parameter where there is one); the complement gets its own optimizer when the branch holds one
MASK = mo.Select(exclude=["0.*"])
MASK_REST = mo.Select(names=["0.*"])
#: transforms that cannot run inside Masked (they step every parameter of the optimizer themselves)
UNMASKABLE = {"TorchOptimizer"}


def instances(name: str) -> list[mo.Transform]:
    v = NON_DEFAULT[name]
    return list(v) if isinstance(v, (list, tuple)) else [v]


def base_examples() -> list[tuple[str, mo.Transform]]:
    out = []
    for name in sorted(NON_DEFAULT):
        for i, t in enumerate(instances(name)):
            out.append((f"{name}-{i}" if i else name, t))
    return out


def masked_examples() -> list[tuple[str, mo.Transform]]:
    """``Masked`` around every example (generated, so a new transform is covered masked too)."""
    return [
        (f"Masked[{eid}]", mo.Masked(t, where=MASK))
        for eid, t in base_examples()
        if eid.split("-")[0] not in UNMASKABLE and eid != "Masked"
    ]


def all_examples() -> list[tuple[str, mo.Transform]]:
    """Every example as ``(id, instance)``, for parametrized tests; then each of them masked."""
    return base_examples() + masked_examples()


def routes_optimizer(t: mo.Transform) -> bool:
    return isinstance(t, mo.Masked) and any(c.is_optimizer for c in t.transforms)


def pipeline_for(t: mo.Transform) -> list[mo.Transform]:
    """A runnable pipeline exercising ``t``: optimizers end it, others precede SGD; a masked
    optimizer gets a second branch for the parameters it does not select (routing), with the same
    optimizer, so that one param group holding both selections has one default per shared key."""
    if t.is_optimizer:
        return [t]
    if routes_optimizer(t):
        return [t, mo.Masked(*[c for c in t.transforms if c.is_optimizer], where=MASK_REST)]
    return [t, mo.SGD(lr=0.01)]
