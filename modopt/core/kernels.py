"""The one place modopt calls torch's private optimizer kernels.

Optimizer transforms write the parameters with torch's fused kernels
(`torch._fused_sgd_`, `torch._fused_adam_`, `torch._fused_adamw_`) or, where a
fused kernel is not known to be right, with torch's foreach implementation
(`torch.optim.sgd.sgd` / `torch.optim.adam.adam` with `foreach=True`). Which one
runs for a (kernel, device, dtype) is decided here, by `fused_ok`, and nowhere
else.

A fused kernel is chosen only where `tests/test_optimizer_dtypes.py` shows it
right against torch's reference optimizers. Known wrong, and so excluded:

* torch 2.13's CPU `_fused_sgd_` on float16/bfloat16 tensors updates only the
  first 8 elements of each tensor (its vectorised loop drops the rest); the
  foreach path is used there instead. `torch.optim.SGD(fused=True)` has the
  same defect.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam as _torch_adam
from torch.optim.optimizer import _default_to_fused_or_foreach, _get_fused_kernels_supported_devices
from torch.optim.sgd import sgd as _torch_sgd

from . import distributed

__all__ = ["KNOWN_BAD", "fused_ok", "fused_sgd_", "fused_adam_", "foreach_sgd_", "foreach_sgd_skip_", "foreach_adam_",
           "torch_default_foreach", "torch_adam_", "torch_sgd_"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: (kernel, device type, dtype) combinations whose fused kernel gives wrong results
#: in the torch this modopt is tested with; the foreach path runs instead.
KNOWN_BAD: set[tuple[str, str, torch.dtype]] = {
    ("sgd", "cpu", torch.float16),  # torch 2.13: only the first 8 elements move
    ("sgd", "cpu", torch.bfloat16),  # same
}


def fused_ok(kernel: str, device: torch.device, dtype: torch.dtype, sharded: bool = False) -> bool:
    """Whether torch's fused `kernel` (`"sgd"`, `"adam"`, `"adamw"`) may write these parameters.

    False for devices torch has no fused kernel on, non-float dtypes, DTensors
    (FSDP2: the fused kernels have no sharding strategy; torch.optim takes the
    foreach path there too) and the combinations in `KNOWN_BAD`.
    """
    if sharded or dtype not in FLOAT_DTYPES:
        return False
    if device.type not in _get_fused_kernels_supported_devices():
        return False
    return (kernel, device.type, dtype) not in KNOWN_BAD


def _same_layout(params, grads):
    """`grads`, each laid out like its parameter: torch 2.13's fused CPU kernels read a gradient whose
    strides differ from the parameter's (a transposed view) in the parameter's order, silently wrong
    (`torch.optim.Adam(fused=True)` too). A copy in the parameter's layout only where they differ."""
    if all(g.stride() == p.stride() for p, g in zip(params, grads)):
        return grads
    return [g if g.stride() == p.stride() else torch.empty_like(p, dtype=g.dtype).copy_(g) for p, g in zip(params, grads)]


def fused_sgd_(params, grads, bufs, *, lr, weight_decay, momentum, dampening, nesterov, is_first_step, grad_scale,
               found_inf=None, maximize=False):
    """`torch._fused_sgd_` (in place on `params` and `bufs`; divides the gradients by `grad_scale`;
    with `found_inf` nonzero, a 0-d float32 tensor, it leaves everything as it is)."""
    torch._fused_sgd_(
        params, _same_layout(params, grads), bufs, weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
        nesterov=nesterov, maximize=maximize, is_first_step=is_first_step, grad_scale=grad_scale, found_inf=found_inf,
    )


def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, decoupled, lr, beta1, beta2,
                weight_decay, eps, amsgrad, grad_scale, found_inf=None, maximize=False):
    """`torch._fused_adamw_` (decoupled decay) or `torch._fused_adam_`; the step tensors must
    already be incremented (the kernels read them, torch.optim bumps them first). With `found_inf`
    (a 0-d float32 tensor on the parameters' device) the kernel leaves everything as it is where
    it is nonzero, as under `GradScaler`: the step is skipped on the device."""
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(
        params, _same_layout(params, grads), exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
        weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale,
        found_inf=found_inf,
    )


def foreach_sgd_(params, grads, bufs, *, lr, weight_decay, momentum, dampening, nesterov, maximize=False):
    """torch.optim.SGD's foreach implementation; `bufs` entries that are None are filled in."""
    _torch_sgd(
        params, grads, bufs, foreach=True, fused=False, weight_decay=weight_decay, momentum=momentum, lr=lr,
        dampening=dampening, nesterov=nesterov, maximize=maximize,
    )


def foreach_sgd_skip_(params, grads, bufs, skip, *, lr, weight_decay, momentum, dampening, nesterov, maximize=False):
    """torch.optim.SGD's foreach formulas op for op (so bit for bit with `foreach_sgd_` on a step that
    goes ahead), on a step whose skip the device decides (`skip`, a 0-d bool tensor): on a skipped
    step the parameters and the momentum buffers keep their values. `bufs` entries that are None are
    filled: a zero buffer, which the step fills exactly as torch's first step (`momentum * 0 + g`),
    so `dampening` must be 0 there. The new buffers are computed out of place and chosen with a
    `where`, so rounding is torch's: two more passes over the buffers than `foreach_sgd_`."""
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if momentum != 0:
        for i, b in enumerate(bufs):
            if b is None:
                bufs[i] = torch.zeros_like(grads[i])
        new = [b.clone() for b in bufs]  # in place on copies: the out-of-place foreach mul rounds bf16 otherwise
        torch._foreach_mul_(new, momentum)
        torch._foreach_add_(new, grads, alpha=1 - dampening)
        distributed.copy_(bufs, [torch.where(skip, b, n) for b, n in zip(bufs, new)])
        grads = torch._foreach_add(grads, bufs, alpha=momentum) if nesterov else bufs
    torch._foreach_add_(params, [torch.where(skip, 0.0, u) for u in grads], alpha=-lr)


def foreach_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, decoupled, lr, beta1, beta2,
                  weight_decay, eps, amsgrad, maximize=False):
    """torch.optim.Adam's (or AdamW's, `decoupled`) foreach implementation; it increments `steps`."""
    _torch_adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=True, fused=False,
        decoupled_weight_decay=decoupled, amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr,
        weight_decay=weight_decay, eps=eps, maximize=maximize,
    )


# torch's own kernel choice (`fused=False` / `foreach=`): torch.optim's functional step, as is ---------------


def torch_default_foreach(params: list[torch.Tensor]) -> bool:
    """Whether torch.optim, given `foreach=None, fused=None`, runs its foreach kernel on `params`
    (torch's own rule: foreach on CUDA and other native accelerators, the for-loop kernel on a CPU)."""
    return bool(params) and _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1]


def torch_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, foreach, capturable, decoupled, lr,
                beta1, beta2, weight_decay, eps, amsgrad, maximize):
    """`torch.optim.Adam`'s (`decoupled`: `AdamW`'s) functional step with torch's non-fused kernels:
    the foreach kernel (`foreach=True`), the for-loop kernel (`foreach=False`) or torch's default
    for these tensors (`foreach=None`). It increments `steps` itself (0-d float32 tensors: on the CPU
    unless `capturable`, where torch keeps them). The same call `torch.optim.Adam.step` makes, so the
    same bits by construction on every device."""
    _torch_adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=foreach, capturable=capturable,
        differentiable=False, fused=None, decoupled_weight_decay=decoupled, amsgrad=amsgrad, beta1=beta1,
        beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize,
    )


def torch_sgd_(params, grads, bufs, *, foreach, lr, weight_decay, momentum, dampening, nesterov, maximize):
    """`torch.optim.SGD`'s functional step with torch's non-fused kernels (`foreach` as in
    `torch_adam_`); `bufs` entries that are None become torch's first buffers (the gradient)."""
    _torch_sgd(
        params, grads, bufs, foreach=foreach, fused=None, weight_decay=weight_decay, momentum=momentum, lr=lr,
        dampening=dampening, nesterov=nesterov, maximize=maximize,
    )
