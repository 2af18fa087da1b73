"""For every registered transform: instances with every field set away from its default.

The conformance suite checks that every registered transform appears here, so
a new transform gets the shared checks (config round trip of every field,
checkpoint round trip, zero/None/non-finite grads, half precision, groups).
"""

from __future__ import annotations

import torch

import modopt as mo

# name -> (instance with non-default fields, is it usable as an update-only transform before an optimizer)
NON_DEFAULT = {
    "Identity": mo.Identity(),
    "ClipValue": mo.ClipValue(0.05),
    "ClipNorm": mo.ClipNorm(0.5, ord="l1", eps=0.0, scope="tensor", dim=-1, inverse_dims=True, min_size=3),
    "Normalize": mo.Normalize(2.0, ord=3.0, scope="group", eps=1e-8, min_size=2),
    "Centralize": mo.Centralize(scope="tensor", dim=(0,), inverse_dims=True, min_size=3),
    "GradientCentralization": mo.GradientCentralization(dim=1, inverse_dims=False, scope="tensor", min_size=1),
    "Chain": mo.Chain(mo.ClipNorm(2.0), mo.Chain(mo.Normalize(), mo.Identity())),
    "LR": mo.LR(0.05),
    "SGD": mo.SGD(lr=0.02, momentum=0.8, dampening=0.0, nesterov=True, weight_decay=1e-3),
    "Adam": mo.Adam(lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=1e-3, amsgrad=True),
    "AdamW": mo.AdamW(lr=2e-3, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.05, amsgrad=True),
    "TorchOptimizer": mo.TorchOptimizer(torch.optim.RMSprop, lr=3e-3, alpha=0.95),
}


def pipeline_for(t: mo.Transform) -> list[mo.Transform]:
    """A runnable pipeline exercising ``t``: optimizers end it, others precede Adam."""
    if t.is_optimizer:
        return [t]
    return [t, mo.SGD(lr=0.01)]
