"""The functional layer: in place on `p.grad`, torch's style.

Each function runs the corresponding transform once on the gradients, so the
functional and the module layer share one implementation.
"""

from __future__ import annotations

import types
import warnings
from typing import Iterable

import torch

from .core.reduce import ORD_NAMES, Ord, parse_ord
from .core.keys import split_value_key
from .core.step import Step, run_step
from .core.reduce import make_segments
from .core.scope import ScopeName
from .core.transform import Transform

TensorOrTensors = torch.Tensor | Iterable[torch.Tensor]


def _with_grad(parameters: TensorOrTensors) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [p for p in parameters if p.grad is not None]


def run_on_grads(transform: Transform, parameters: TensorOrTensors) -> dict[str, torch.Tensor]:
    """Apply a (stateless) transform to the gradients in place; return its telemetry."""
    params = _with_grad(parameters)
    stats: dict[str, torch.Tensor] = {}
    if not params:
        return stats
    out = run_step([transform], Step.over(params, stats=stats))
    for p, u in zip(params, out):
        if u is not p.grad:
            p.grad.copy_(u)
    return {split_value_key(k)[1]: v for k, v in stats.items()}


def grad_norm(parameters: TensorOrTensors, ord: Ord = 2.0) -> torch.Tensor:
    """The total `ord` norm of the gradients (as one concatenated vector); changes nothing."""
    params = _with_grad(parameters)
    if not params:
        return torch.zeros(())
    grads = [p.grad for p in params]
    seg = make_segments(grads, [(0, len(grads))], "global", None, False, 1)
    return seg.reduce(grads, ord)[0]


def _torch_ord(ord: Ord | None, norm_type: float | str | None) -> float | str:
    """`ord` (or torch's name for it, `norm_type`); a string torch accepts (`"inf"`) is a number."""
    if norm_type is not None:
        if ord is not None and ord != norm_type:
            raise TypeError("clip_grad_norm_ got both ord and norm_type; they are the same argument")
        ord = norm_type
    if ord is None:
        return 2.0
    if isinstance(ord, str) and ord not in ORD_NAMES:
        try:
            return float(ord)  # "inf", "2": torch's float(norm_type)
        except ValueError:
            pass
    return ord


def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    ord: Ord | None = None,
    error_if_nonfinite: bool = False,
    eps: float = 1e-6,
    *,
    norm_type: float | str | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients' total norm to `max_norm` in place; return the pre-clip total norm.

    The same contract as `torch.nn.utils.clip_grad_norm_` (scale
    `min(1, max_norm / (norm + eps))`), with modopt's whole `ord` vocabulary.
    As in torch: `norm_type` is accepted as another name of `ord`, and
    either may be a string torch accepts (`"inf"`); an empty generator of
    parameters warns; `error_if_nonfinite` raises torch's error. With float32
    gradients, `ord=2` and the same `parameters` in the same order, the
    returned norm and the clipped gradients equal torch's bit for bit (the
    total adds the per-tensor norms in the order given, as torch does; another
    order can change its last bit). `foreach` is accepted for compatibility
    (modopt always uses the multi-tensor kernels).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([3.0, 4.0])
    >>> mo.clip_grad_norm_([p], 1.0, norm_type="inf")
    tensor(4.)

    ```
    """
    from .transforms.clipping import ClipNorm

    ord = _torch_ord(ord, norm_type)
    if isinstance(parameters, types.GeneratorType):
        parameters = list(parameters)
        if not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=2)
    t = ClipNorm(max_norm=max_norm, ord=ord, eps=eps)
    params = _with_grad(parameters)
    if not params:
        return torch.zeros(())
    if error_if_nonfinite:
        n = grad_norm(params, ord)
        if not torch.isfinite(n):
            shown = float(parse_ord(ord)) if isinstance(parse_ord(ord), float) else ord
            raise RuntimeError(
                f"The total norm of order {shown} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
    stats = run_on_grads(t, params)
    return stats["norm"][0]


def clip_grad_value_(parameters: TensorOrTensors, clip_value: float) -> None:
    """Clamp every gradient element to `[-clip_value, clip_value]` in place."""
    from .transforms.clipping import ClipValue

    run_on_grads(ClipValue(value=clip_value), parameters)


def normalize_grads_(
    parameters: TensorOrTensors,
    norm_value: float = 1.0,
    ord: Ord = 2.0,
    scope: ScopeName = "tensor",
    eps: float = 0.0,
) -> None:
    """Set each gradient's (`scope="tensor"`) or the total (`"global"`) norm to `norm_value` in place."""
    from .transforms.normalization import Normalize

    run_on_grads(Normalize(norm_value=norm_value, ord=ord, scope=scope, eps=eps), parameters)


def clip_grad_percentile_(parameters: TensorOrTensors, pct: int, scope: ScopeName = "tensor") -> None:
    """Clamp each gradient (`scope="tensor"`) or all of them (`"global"`) to the `pct`-th
    percentile of its absolute values, in place (the lower order statistic, see
    `ClipValueByPercentile`)."""
    from .transforms.percentile import ClipValueByPercentile

    run_on_grads(ClipValueByPercentile(pct=pct, scope=scope), parameters)
