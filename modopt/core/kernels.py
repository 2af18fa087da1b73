"""The one place modopt calls torch's private optimizer kernels.

Optimizer transforms write the parameters with torch's fused kernels
(`torch._fused_sgd_`, `torch._fused_adam_`, `torch._fused_adamw_`) or, where a
fused kernel is not known to be right, with torch's foreach implementation
(`torch.optim.sgd.sgd` / `torch.optim.adam.adam` with `foreach=True`). Which one
runs for a (kernel, device, dtype) is decided here, by `fused_ok`, and nowhere
else.

A fused kernel is chosen only where `tests/test_optimizer_dtypes.py` shows it
right against torch's reference optimizers. The fused kernels known to be wrong
are listed in `KERNEL_BUGS`, each with the torch versions that have the defect;
`KNOWN_BAD` is what that list excludes in the running torch (`torch.__version__`),
so a kernel torch has fixed is used again on the versions with the fix:

* the CPU `_fused_sgd_` on float16/bfloat16 tensors updates only the first 8
  elements of each tensor (its vectorised loop drops the rest) in torch 2.4.0
  up to 2.13.x, and is right from 2.14.0 (the versions tested are in the docs'
  "Tested torch versions" page). The foreach path runs there instead.
  `torch.optim.SGD(fused=True)` has the same defect.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Union

import torch
from torch.torch_version import TorchVersion
from torch.optim.adam import adam as _torch_adam
from torch.optim.optimizer import (_default_to_fused_or_foreach, _get_foreach_kernels_supported_devices,
                                   _get_fused_kernels_supported_devices)
from torch.optim.sgd import sgd as _torch_sgd

from . import distributed

_CONSTS: dict[tuple, torch.Tensor] = {}
#: `_CONSTS` is cleared past this many entries (a value that moves every step, a scheduled learning rate's
#: factor, would otherwise keep one tensor per step); a tensor handed out stays valid, it is never written
MAX_CONSTS = 256


def const(value: float, like: torch.Tensor) -> Union[torch.Tensor, float]:
    """`value` as a cached 0-d tensor of `like`'s dtype and device, for a `torch.where` or `torch.fmin`
    that would otherwise make its scalar into a new tensor each call (a `scalar_tensor`: on a GPU, a
    fill kernel launched every step). The same values as the Python number (the dtype is `like`'s, as
    the number's would be). Traced by `torch.compile`, the number itself: the graph folds it in.
    Never written to; not for NaN."""
    if torch.compiler.is_compiling():
        return value
    key = (value, math.copysign(1.0, value), like.dtype, like.device)  # (-0.0 == 0.0 as a dict key)
    t = _CONSTS.get(key)
    if t is None:
        if len(_CONSTS) >= MAX_CONSTS:
            _CONSTS.clear()
        t = _CONSTS[key] = torch.full((), value, dtype=like.dtype, device=like.device)
    return t

__all__ = ["const", "KernelBug", "KERNEL_BUGS", "known_bad", "KNOWN_BAD", "fused_ok", "fused_sgd_", "fused_adam_", "foreach_sgd_", "foreach_sgd_skip_", "foreach_sgd_started_",
           "fused_sgd_started_", "foreach_adam_",
           "torch_default_foreach", "torch_adam_", "torch_sgd_", "loop_adam_ok", "loop_adam_"]

#: a hyperparameter a kernel takes as a number or a 0-d tensor (a scheduler may hold `lr` as a tensor)
Scalar = Union[float, torch.Tensor]
#: one tensor per parameter, in the optimizer's order
Tensors = list[torch.Tensor]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class KernelBug:
    """A defect of torch's fused `kernel` on `device` for `dtypes`, present in torch versions
    `first_bad <= version < fixed_in` (`fixed_in=None`: no tested version has the fix).

    `first_bad` is the lowest torch version seen with the defect (modopt's lowest supported version
    where that one has it already), `fixed_in` the first release seen without it; both come from
    running the kernel on those versions (docs/torch-versions.md). Versions compare as torch compares them
    (`torch.torch_version.TorchVersion`): a local build label (`2.13.0+cpu`) is the same
    release, a pre-release or nightly of `fixed_in` (`2.14.0.dev20260101`) counts as not fixed.
    """

    kernel: str
    device: str
    dtypes: tuple[torch.dtype, ...]
    first_bad: str
    fixed_in: str | None
    what: str

    def affects(self, version: str) -> bool:
        """Whether torch `version` (e.g. `torch.__version__`) has this defect."""
        v = TorchVersion(_checked_version(version))
        return v >= self.first_bad and (self.fixed_in is None or v < self.fixed_in)


#: torch's fused kernels known to give wrong results, with the versions that have each defect.
KERNEL_BUGS: tuple[KernelBug, ...] = (
    KernelBug("sgd", "cpu", (torch.float16, torch.bfloat16), first_bad="2.4.0", fixed_in="2.14.0",
              what="only the first 8 elements of each tensor move"),
)


def _checked_version(version: str) -> str:
    if not isinstance(version, str) or not re.match(r"^\d+\.\d+", version):
        raise ValueError(f"version: expected a torch version such as '2.13.0' or '2.15.0+cu132', got {version!r}")
    return version


def known_bad(version: str = torch.__version__) -> set[tuple[str, str, torch.dtype]]:
    """The (kernel, device type, dtype) combinations whose fused kernel is wrong in torch `version`
    (default: the running torch), from `KERNEL_BUGS`."""
    return {(b.kernel, b.device, d) for b in KERNEL_BUGS if b.affects(version) for d in b.dtypes}


#: (kernel, device type, dtype) combinations whose fused kernel gives wrong results in the running
#: torch (`known_bad(torch.__version__)`); the foreach path runs instead.
KNOWN_BAD: set[tuple[str, str, torch.dtype]] = known_bad()


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


_stride = torch.Tensor.stride


def _same_layout(params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """`grads`, each laid out like its parameter: torch 2.13's fused CPU kernels read a gradient whose
    strides differ from the parameter's (a transposed view) in the parameter's order, silently wrong
    (`torch.optim.Adam(fused=True)` too). A copy in the parameter's layout only where they differ."""
    if list(map(_stride, params)) == list(map(_stride, grads)):  # (C-level: checked every step)
        return grads
    return [g if g.stride() == p.stride() else torch.empty_like(p, dtype=g.dtype).copy_(g) for p, g in zip(params, grads)]


def fused_sgd_(params: Tensors, grads: Tensors, bufs: Tensors, *, lr: Scalar, weight_decay: float, momentum: float,
               dampening: float, nesterov: bool, is_first_step: bool, grad_scale: torch.Tensor | None,
               found_inf: torch.Tensor | None = None, maximize: bool = False) -> None:
    """`torch._fused_sgd_` (in place on `params` and `bufs`; divides the gradients by `grad_scale`;
    with `found_inf` nonzero, a 0-d float32 tensor, it leaves everything as it is)."""
    torch._fused_sgd_(
        params, _same_layout(params, grads), bufs, weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
        nesterov=nesterov, maximize=maximize, is_first_step=is_first_step, grad_scale=grad_scale, found_inf=found_inf,
    )


def fused_adam_(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, max_exp_avg_sqs: Tensors,
                steps: Tensors, *, decoupled: bool, lr: Scalar, beta1: Scalar, beta2: Scalar, weight_decay: float,
                eps: float, amsgrad: bool, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None = None,
                maximize: bool = False) -> None:
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


def foreach_sgd_(params: Tensors, grads: Tensors, bufs: list[torch.Tensor | None], *, lr: Scalar, weight_decay: float,
                 momentum: float, dampening: float, nesterov: bool, maximize: bool = False) -> None:
    """torch.optim.SGD's foreach implementation; `bufs` entries that are None are filled in."""
    _torch_sgd(
        params, grads, bufs, foreach=True, fused=False, weight_decay=weight_decay, momentum=momentum, lr=lr,
        dampening=dampening, nesterov=nesterov, maximize=maximize,
    )


def foreach_sgd_skip_(params: Tensors, grads: Tensors, bufs: list[torch.Tensor | None], skip: torch.Tensor, *,
                      lr: Scalar,
                      weight_decay: float, momentum: float, dampening: float, nesterov: bool,
                      maximize: bool = False) -> None:
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


def foreach_sgd_started_(params: Tensors, grads: Tensors, bufs: Tensors, started: Tensors, skip: torch.Tensor | None,
                         *, lr: Scalar, weight_decay: float, momentum: float, dampening: float, nesterov: bool,
                         maximize: bool = False) -> None:
    """torch.optim.SGD's foreach formulas op for op (as `foreach_sgd_skip_`) for momentum buffers
    with a `started` flag: where a flag is False the new buffer is the gradient, torch's first step,
    else `momentum * b + (1 - dampening) * g`. With `skip` (a 0-d bool tensor) a skipped step keeps the
    parameters and buffers. One more pass over the buffers than `foreach_sgd_skip_` (the flag's `where`)."""
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    new = [b.clone() for b in bufs]  # in place on copies: torch's rounding in every dtype
    torch._foreach_mul_(new, momentum)
    torch._foreach_add_(new, grads, alpha=1 - dampening)
    new = [torch.where(f, n, g) for f, n, g in zip(started, new, grads)]
    if skip is not None:
        new = [torch.where(skip, b, n) for b, n in zip(bufs, new)]
    distributed.copy_(bufs, new)
    u = torch._foreach_add(grads, bufs, alpha=momentum) if nesterov else bufs
    if skip is not None:
        u = [torch.where(skip, 0.0, x) for x in u]
    torch._foreach_add_(params, u, alpha=-lr)


def fused_sgd_started_(params: Tensors, grads: Tensors, bufs: Tensors, started: Tensors, skip: torch.Tensor | None,
                       same: bool, *, lr: Scalar, weight_decay: float, momentum: float, dampening: float,
                       nesterov: bool, maximize: bool = False) -> None:
    """torch's fused SGD kernel for momentum buffers with a `started` flag: per flag value, one call as
    a later step (`is_first_step=False`) where it is True and one as torch's first step (the buffer
    becomes the gradient) where it is False, each made a no-op on the device by `found_inf` where it
    does not apply (or where `skip` says the step is skipped). Both calls read nothing where they do
    nothing: no pass more than the plain fused step, one kernel call more. With `same` (the flags are
    known to be equal) one pair of calls serves them all; else one pair per parameter."""
    hyper = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, dampening=dampening, nesterov=nesterov,
                 grad_scale=None, maximize=maximize)
    flags = started[0].reshape(1) if same else torch.stack(started)
    later, first = ~flags, flags  # 1: that call leaves everything as it is
    if skip is not None:
        later, first = later | skip, first | skip
    later, first = later.to(torch.float32).unbind(0), first.to(torch.float32).unbind(0)
    parts = [list(range(len(params)))] if same else [[j] for j in range(len(params))]
    for n, js in enumerate(parts):
        ps, gs, bs = [params[j] for j in js], [grads[j] for j in js], [bufs[j] for j in js]
        fused_sgd_(ps, gs, bs, is_first_step=False, found_inf=later[n], **hyper)
        fused_sgd_(ps, gs, bs, is_first_step=True, found_inf=first[n], **hyper)


def foreach_adam_(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, max_exp_avg_sqs: Tensors,
                  steps: Tensors, *, decoupled: bool, lr: Scalar, beta1: Scalar, beta2: Scalar, weight_decay: float,
                  eps: float, amsgrad: bool, maximize: bool = False) -> None:
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


def loop_adam_ok(params: Tensors, steps: Tensors, *, foreach: bool | None, capturable: bool, lr: Scalar,
                 beta1: Scalar, beta2: Scalar) -> bool:
    """Whether `loop_adam_` may stand in for torch's for-loop Adam on these tensors: where torch would
    run its for-loop kernel (`foreach=False`, or `foreach=None` on parameters torch gives no foreach
    kernel: the CPU), not `capturable`, with every parameter a real floating-point CPU tensor, every
    step count a 0-d float32 CPU tensor (torch's layout) and `lr`, `beta1`, `beta2` Python numbers
    (torch's for-loop kernel reads tensor hyperparameters in ways of its own). Elsewhere torch's call."""
    if capturable or not params or foreach or isinstance(lr, torch.Tensor) or isinstance(beta1, torch.Tensor) \
            or isinstance(beta2, torch.Tensor):
        return False
    cpu = _CPU_DEVICE
    if set(map(_device, params)) != cpu or not all(map(torch.is_floating_point, params)):
        return False
    if set(map(_device, steps)) != cpu or set(map(_dtype, steps)) != _F32 or any(map(_ndim, steps)):
        return False
    # (`foreach=None`: torch's default, its for-loop kernel wherever the CPU has no foreach kernel)
    return foreach is False or "cpu" not in _get_foreach_kernels_supported_devices()


_device, _dtype, _ndim = operator.attrgetter("device"), operator.attrgetter("dtype"), operator.attrgetter("ndim")
_CPU_DEVICE, _F32 = {torch.device("cpu")}, {torch.float32}


def loop_adam_(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, max_exp_avg_sqs: Tensors,
               steps: Tensors, *, decoupled: bool, lr: float, beta1: float, beta2: float, weight_decay: float,
               eps: float, amsgrad: bool, maximize: bool) -> None:
    """torch's for-loop Adam/AdamW (`torch.optim.adam._single_tensor_adam`, not capturable, not
    differentiable) with the same elementwise operations in the same order on each tensor, so the
    same bits in every dtype, where `loop_adam_ok` says so. Two things differ, neither a value: the
    denominator `sqrt(v) / sqrt(1 - beta2^t) + eps` is divided in place in the square root's
    tensor (torch allocates the quotient as a second full-size temporary), and the step counts are
    incremented by one foreach add and read in one list read (torch adds to and reads back each
    count separately: a dispatch and a host read per tensor). The bias corrections are torch's
    Python-float arithmetic on the count it reads (float32, exact below 2**24). On float32 and float64
    tensors the in-place multiplies by `1 - lr * weight_decay` and `beta2` and the add of `eps` take
    cached 0-d tensors of the tensor's dtype (`const`), the values torch makes of the numbers on each
    call, without making them again for every tensor; on the other dtypes torch computes with the number
    in float32, so the numbers stay."""
    torch._foreach_add_(steps, 1)
    counts = torch.stack(steps).tolist()  # (0-d CPU tensors: a read, no device wait)
    memo: dict[float, tuple[float, float]] = {}
    factors: dict[torch.dtype, tuple] = {}
    decay = 1 - lr * weight_decay
    for i, param in enumerate(params):
        grad = -grads[i] if maximize else grads[i]  # (out of place, as torch: the gradients stay the caller's)
        exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]
        f = factors.get(param.dtype)
        if f is None:
            f = factors[param.dtype] = ((const(decay, param), const(beta2, param), const(eps, param))
                                        if param.dtype in (torch.float32, torch.float64) else (decay, beta2, eps))
        wd_factor, b2, e = f
        if weight_decay != 0:
            if decoupled:
                param.mul_(wd_factor)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - beta2)
        step = counts[i]
        bc = memo.get(step)
        if bc is None:
            bc = memo[step] = (lr / (1 - beta1**step), (1 - beta2**step) ** 0.5)
        step_size, bias_correction2_sqrt = bc
        if amsgrad:
            torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i])
            denom = max_exp_avg_sqs[i].sqrt()
        else:
            denom = exp_avg_sq.sqrt()
        denom.div_(bias_correction2_sqrt).add_(e)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def torch_adam_(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, max_exp_avg_sqs: Tensors,
                steps: Tensors, *, foreach: bool | None, capturable: bool, decoupled: bool, lr: Scalar, beta1: Scalar,
                beta2: Scalar, weight_decay: float, eps: float, amsgrad: bool, maximize: bool) -> None:
    """`torch.optim.Adam`'s (`decoupled`: `AdamW`'s) functional step with torch's non-fused kernels:
    the foreach kernel (`foreach=True`), the for-loop kernel (`foreach=False`) or torch's default
    for these tensors (`foreach=None`). It increments `steps` itself (0-d float32 tensors: on the CPU
    unless `capturable`, where torch keeps them). Where torch would run its for-loop kernel on CPU
    tensors (`loop_adam_ok`), `loop_adam_`: the same operations in the same order, fewer temporaries
    and host reads (tests/test_optimizer_dtypes.py compares the bits); elsewhere the same call
    `torch.optim.Adam.step` makes, so the same bits by construction on every device."""
    if loop_adam_ok(params, steps, foreach=foreach, capturable=capturable, lr=lr, beta1=beta1, beta2=beta2):
        loop_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, decoupled=decoupled, lr=lr,
                   beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize)
        return
    _torch_adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=foreach, capturable=capturable,
        differentiable=False, fused=None, decoupled_weight_decay=decoupled, amsgrad=amsgrad, beta1=beta1,
        beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize,
    )


def torch_sgd_(params: Tensors, grads: Tensors, bufs: list[torch.Tensor | None], *, foreach: bool | None, lr: Scalar,
               weight_decay: float, momentum: float, dampening: float, nesterov: bool, maximize: bool) -> None:
    """`torch.optim.SGD`'s functional step with torch's non-fused kernels (`foreach` as in
    `torch_adam_`); `bufs` entries that are None become torch's first buffers (the gradient)."""
    _torch_sgd(
        params, grads, bufs, foreach=foreach, fused=None, weight_decay=weight_decay, momentum=momentum, lr=lr,
        dampening=dampening, nesterov=nesterov, maximize=maximize,
    )
