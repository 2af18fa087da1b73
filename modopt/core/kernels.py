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
from typing import Any, Callable, Union

import torch
from torch.torch_version import TorchVersion
from torch.optim.adam import adam as _torch_adam
from torch.optim.optimizer import (_default_to_fused_or_foreach, _get_capturable_supported_devices,
                                   _get_foreach_kernels_supported_devices,
                                   _get_fused_kernels_supported_devices)
from torch.optim.sgd import sgd as _torch_sgd

from . import distributed
from .keys import value_key

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
           "torch_default_foreach", "torch_adam_", "torch_sgd_", "loop_adam_ok", "loop_adam_",
           "AdamPlan", "SGDPlan", "split", "adam_state", "wide", "narrow_", "check_capturable", "adam_updates", "sgd_updates", "lr_value",
           "traced_value", "count_steps", "adam_traced_updates", "adopt_step", "packed_steps_hold"]

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


# --- one kernel plan per optimizer transform and layout ----------------------------------------------------
#
# An optimizer transform's eager step is its plan's `run`: the plan lists the kernel calls (torch's fused,
# foreach or own kernel, or modopt's formulas when the step returns updates) with the tensors each reads,
# made on the first step of a layout and run by that step and every later one while the state still holds
# exactly those tensors (a load, `add_param_group` or a hand-written state makes new ones: `run` answers
# None and the transform builds the plan again). The test is identity only, at C level: nothing is read
# from the tensors. Each param group's values (lr, betas, ...) are read once per step, at the top of `run`.

_CPU = torch.device("cpu")
_is = operator.is_


def split(ctx: Any, a: int, b: int, kernel: str, required: bool = False) -> list[tuple[list[int] | None, bool, torch.dtype]]:
    """How `ctx.params[a:b]` split into (device, dtype) sub-groups for the kernels, cached per layout.

    Each entry: the indices into `[a:b]` (None: all of them), whether torch's fused `kernel` applies
    (`fused_ok`), and the dtype. With `required` (`fused=True`), parameters torch has no fused kernel for
    are refused, as torch.optim refuses them (a `RuntimeError`, as torch's, that names one); a combination
    `KNOWN_BAD` lists, and a DTensor, take the foreach path instead.
    """
    cache = ctx.layout.cache
    key = ("optimizer_plan", a, b, kernel, required)
    plan = cache.get(key)
    if plan is None:
        by: dict[tuple, list[int]] = {}
        for i, p in enumerate(ctx.params[a:b]):
            by.setdefault((p.device, p.dtype, distributed.is_sharded(p)), []).append(i)
        for (dev, dtype, sharded), idx in by.items() if required else ():
            if not sharded and (kernel, dev.type, dtype) not in KNOWN_BAD and not fused_ok(kernel, dev, dtype):
                name = ctx.names[a + idx[0]] or f"parameter {a + idx[0]}"
                raise RuntimeError(f"fused=True: torch has no fused {kernel} kernel for {name} ({dtype} on "
                                   f"{dev.type}); use fused=None (modopt's default) or fused=False")
        plan = cache[key] = [(None if len(by) == 1 else idx, fused_ok(kernel, dev, dtype, sharded), dtype)
                             for (dev, dtype, sharded), idx in by.items()]
    return plan


def _pick(xs: list, idx: list[int] | None) -> list:
    return xs if idx is None else [xs[i] for i in idx]


def _zeros(i: int, p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _zeros_bf16(i: int, p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)


def adam_state(st: Any, a: int, b: int, amsgrad: bool, steps_on: torch.device | None = None,
               state_dtype: torch.dtype | None = None) -> tuple[Tensors, ...]:
    """Adam's state of `params[a:b]` (`steps, exp_avgs, exp_avg_sqs, max_exp_avg_sqs`, the last empty
    without `amsgrad`), made where missing: moments of zeros (in the parameter's dtype, or bfloat16 with
    `state_dtype=torch.bfloat16`), step counts 0-d float32 on `steps_on` (None: each parameter's device;
    a meta parameter's on the CPU, as torch.optim keeps it: it is read)."""
    def count(i: int, p: torch.Tensor) -> torch.Tensor:
        on = steps_on if steps_on is not None else (p.device if not p.is_meta else _CPU)
        return torch.zeros((), dtype=torch.float32, device=on)

    zeros = _zeros if state_dtype is None else _zeros_bf16
    steps, m, v = (st.buffers("step", count)[a:b], st.buffers("exp_avg", zeros)[a:b],
                   st.buffers("exp_avg_sq", zeros)[a:b])
    return steps, m, v, st.buffers("max_exp_avg_sq", zeros)[a:b] if amsgrad else []


def wide(params: Tensors, *lists: Tensors) -> tuple[Tensors, ...]:
    """Copies of `params` and of each list beside them (gradients, bfloat16 moments) in the dtype the step
    computes in: each parameter's, float32 for float16 ones (their range, down to 6e-8, would lose the small
    second moments bfloat16 keeps). A tensor already in that dtype is itself (`Tensor.to`), so a kernel
    writes it in place; an empty list (no `max_exp_avg_sq`) stays empty."""
    dts = [torch.float32 if p.dtype == torch.float16 else p.dtype for p in params]
    return tuple([x.to(d) for x, d in zip(xs, dts)] for xs in (params,) + lists)


def narrow_(params: Tensors, moments: tuple[Tensors, ...], wide_params: Tensors, wide_moments: tuple[Tensors, ...]) -> None:
    """Write a step computed on `wide` copies back: the moments into their bfloat16 tensors (`copy_` rounds to
    nearest, ties to even, as torch's fused CUDA kernel stores them), the parameters where a copy was made
    (float16: rounded as the kernel rounds its own writes). A skipped step left the copies as they were: the
    same values go back."""
    for dst, src in zip(moments, wide_moments):
        if dst:
            distributed.copy_(dst, src)
    copied = [(p, w) for p, w in zip(params, wide_params) if w is not p]
    if copied:
        distributed.copy_([p for p, _ in copied], [w for _, w in copied])


def check_capturable(named: list[tuple[str | None, torch.Tensor]]) -> None:
    """`capturable=True` with torch's non-fused kernels: refuse parameters on a device torch cannot
    capture on (a CPU), naming one, as a `ValueError` before anything moves."""
    ok = _get_capturable_supported_devices()
    for i, (name, p) in enumerate(named):
        if p.device.type not in ok:
            raise ValueError(f"capturable=True: torch's non-fused kernels capture only on {', '.join(ok)}, and "
                             f"{name or f'parameter {i}'} is on {p.device.type}; use capturable=False there")


def _move(st: Any, name: str, states: list[dict], ts: Tensors, where: list[torch.device]) -> None:
    """Move the saved tensors `ts` (`name` of `states`) that are not on `where` there, in the state too: a
    step count saved by the other layout (a checkpoint of the other kernel, a torch optimizer's) moves once."""
    k = value_key(st.key, name)
    for i, (t, dev) in enumerate(zip(ts, where)):
        if t.device != dev:
            ts[i] = states[i][k] = t.to(dev)


def _packed(st: Any, tag: tuple, steps: Tensors, states: list[dict], params: Tensors) -> torch.Tensor | None:
    """The step counts of one fused call as views of one 1-D tensor (so one op advances them all), made
    the first time and saved in the state; None when they differ in dtype or shape (a hand-made state:
    they are advanced one by one). The packed tensor is kept in the runtime store
    (`("packed_steps", *tag)`, which `compile_step`'s graph and `packed_steps_hold` read)."""
    rt, k = st.runtime, value_key(st.key, "step")
    ent = rt.get(("packed_steps",) + tag)
    if ent is not None and len(ent[1]) == len(steps) and all(map(_is, ent[1], steps)):
        return ent[0]
    s0 = steps[0]
    if any(s.dim() != 0 or s.dtype != s0.dtype or s.device != s0.device for s in steps):
        return None
    flat = torch.stack(steps)
    views = list(flat.unbind(0))
    for s, view in zip(states, views):
        s[k] = view
    steps[:] = views
    rt[("packed_steps",) + tag] = (flat, views, params, k)
    return flat


class _Call:
    """One kernel call of a plan: its kind, which of its group's parameters (`idx` into `[a:b]`, None:
    all) and the state tensors it reads and writes."""

    __slots__ = ("kind", "idx", "params", "steps", "flat", "m", "v", "vmax", "lr_dtype", "bufs", "flags", "same",
                 "first", "wide")

    def __init__(self, kind: str, idx: list[int] | None, params: Tensors, **tensors: Any) -> None:
        self.kind, self.idx, self.params = kind, idx, params
        self.steps = self.flat = self.m = self.v = self.vmax = self.lr_dtype = self.flags = None
        self.bufs, self.same, self.first, self.wide = None, False, False, False
        for k, t in tensors.items():
            setattr(self, k, t)


def _watch(st: Any, states: list[dict], names: tuple[str, ...]) -> list[tuple[Any, list[dict], Tensors]]:
    """What `run` checks is still in `states`: per name, the getter, the states and the tensors now there."""
    out = []
    for name in names:
        get = operator.itemgetter(value_key(st.key, name))
        out.append((get, states, list(map(get, states))))
    return out


class AdamPlan:
    """The kernel calls of one `Adam`/`AdamW` transform over one layout (see above).

    With `write` (the last transform) per (device, dtype) sub-group of each param group: torch's fused kernel
    (the step counts packed, advanced by one op, by `~skip` where the device decides the skip, which the
    kernel takes as `found_inf`), or torch's foreach kernel; with torch's own kernel choice (`fused=False`,
    `foreach`) torch's functional step per group (`torch_adam_`, counts on the CPU unless `capturable`).
    Without `write`, modopt's formulas (`adam_updates`) per group, which return the updates.
    """

    __slots__ = ("write", "torch", "decoupled", "foreach", "capturable", "states", "watch", "groups", "fused",
                 "scalable", "foldable")
    write: bool  # the last transform: it writes the parameters (else `run` returns the updates)
    torch: bool  # torch's own kernel choice (`fused=False`, `foreach`): `torch_adam_` per group
    decoupled: bool
    foreach: bool | None
    capturable: bool
    states: list[dict[str, Any]]  # the per-parameter state dicts the plan read (checked by identity)
    watch: list[tuple[Any, list[dict[str, Any]], Tensors]]  # (getter, states, the tensors they must still hold)
    groups: list[tuple[int, int, bool, list[_Call]]]  # per param group: (a, b, amsgrad, calls)
    fused: bool  # every call is torch's fused kernel (it can skip on the device)
    scalable: bool  # ... and takes a tensor learning rate exactly (not float64 on CUDA)
    foldable: bool  # ... and takes a clip's scale as `grad_scale` (no float64)

    def __init__(self, ctx: Any, st: Any, write: bool, *, decoupled: bool, fused: bool | None,
                 foreach: bool | None, capturable: bool, state_dtype: torch.dtype | None = None) -> None:
        self.write, self.decoupled, self.foreach, self.capturable = write, decoupled, foreach, capturable
        self.torch = write and (fused is False or (fused is None and foreach is not None))
        steps_on = (None if capturable else _CPU) if self.torch else None
        if self.torch and capturable:  # (checked when the optimizer is built too: this is for a group added later)
            check_capturable(list(zip(ctx.names, ctx.params)))
        self.states = now = list(ctx.param_states())
        self.watch, self.groups = [], []
        self.fused = self.scalable = self.foldable = True
        for g, a, b in ctx.per_group():
            amsgrad = bool(g["amsgrad"])
            steps, m, v, vmax = adam_state(st, a, b, amsgrad, steps_on, state_dtype)
            states, params = now[a:b], ctx.params[a:b]
            calls = []
            if self.torch:  # (torch keeps the counts of these kernels on the CPU unless capturable)
                _move(st, "step", states, steps, [p.device if steps_on is None else steps_on for p in params])
                calls.append(_Call("torch", None, params, steps=steps, m=m, v=v, vmax=vmax))
            elif not write:  # (bfloat16 moments: the formulas run on copies in the parameters' dtypes, `wide`)
                calls.append(_Call("updates", None, params, steps=steps, m=m, v=v, vmax=vmax,
                                   wide=state_dtype is not None))
            for idx, fused_, dtype in () if calls else split(ctx, a, b, "adamw" if decoupled else "adam", fused is True):
                ps, sts = _pick(params, idx), _pick(states, idx)
                c = _Call("fused" if fused_ else "foreach", idx, ps, steps=_pick(steps, idx), m=_pick(m, idx),
                          v=_pick(v, idx), vmax=_pick(vmax, idx) if amsgrad else [],
                          lr_dtype=torch.float64 if dtype == torch.float64 else torch.float32)
                # bfloat16 moments of other parameters: torch's fused CUDA kernel takes them with float32
                # parameters (its mixed-precision path: it computes in float32 and stores the moments
                # rounded); elsewhere the kernel runs on `wide` copies, written back rounded (`narrow_`)
                c.wide = state_dtype is not None and dtype != state_dtype and not (
                    fused_ and dtype == torch.float32 and ps[0].device.type == "cuda")
                if fused_:  # (the fused kernels read the counts on the parameters' device)
                    _move(st, "step", sts, c.steps, [ps[0].device] * len(ps))
                    c.flat = _packed(st, (a, b, None if idx is None else idx[0]), c.steps, sts, ps)
                self.fused = self.fused and fused_
                self.scalable = self.scalable and fused_ and (dtype != torch.float64 or ps[0].device.type == "cpu")
                self.foldable = self.foldable and fused_ and dtype != torch.float64
                calls.append(c)
            self.groups.append((a, b, amsgrad, calls))
            self.watch += _watch(st, states, ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()))

    def run(self, ctx: Any, st: Any, updates: Tensors) -> Tensors | bool | None:
        """This step's kernel calls: True (the parameters are written), the updates (not `write`), False
        (nothing done: the step's skip or learning-rate factor needs modopt's formulas, `adam_updates`), or
        None (nothing done: the state no longer holds the plan's tensors; build it again)."""
        # (the state check is written out here and in SGDPlan.run: a shared function would be one Python call
        # more in every step, which the optimizers' own loop is kept free of; docs/performance.md, "Python calls")
        now, states = ctx.param_states(), self.states
        if len(now) != len(states) or not all(map(_is, now, states)):
            return None
        try:
            for get, sts, ts in self.watch:
                if not all(map(_is, map(get, sts), ts)):
                    return None
        except KeyError:
            return None
        values = []  # each group's values, read once
        for g, (_, _, amsgrad, _) in zip(ctx.groups, self.groups):
            beta1, beta2 = g["betas"]
            values.append((g["lr"], beta1, beta2, g["eps"], g["weight_decay"], g["amsgrad"], g["maximize"]))
            if bool(values[-1][5]) is not amsgrad:
                return None
        skip, asked = ctx.skip, ctx.moment_requests.get(st.key)
        scaled = None if asked is None else asked.get("lr_scale")  # (`modopt.core.moments.lr_scale`)
        if not self.write:
            out: Tensors = []
            for vals, (a, b, _, (c,)) in zip(values, self.groups):
                if c.wide:  # (bfloat16 moments: the formulas on `wide` copies, stored rounded; each update in
                    # its parameter's dtype)
                    ps, gs, m, v, vmax = wide(c.params, updates[a:b], c.m, c.v, c.vmax)
                    u = adam_updates(ctx, ps, gs, c.steps, m, v, vmax, *vals, decoupled=self.decoupled, scaled=scaled)
                    narrow_(c.params, (c.m, c.v, c.vmax), c.params, (m, v, vmax))
                    out += [x.to(p.dtype) for x, p in zip(u, c.params)]
                    continue
                out += adam_updates(ctx, c.params, updates[a:b], c.steps, c.m, c.v, c.vmax, *vals,
                                    decoupled=self.decoupled, scaled=scaled)
            return out
        if self.torch:  # (the host decided the skip: `skips_on_device` is False for these kernels)
            ctx.flush_(updates)  # (nothing folds into these kernels; `fold_clip` is refused with them)
            for (lr, beta1, beta2, eps, wd, amsgrad, maximize), (a, b, _, (c,)) in zip(values, self.groups):
                torch_adam_(c.params, updates[a:b], c.m, c.v, c.vmax, c.steps, foreach=self.foreach,
                            capturable=self.capturable, decoupled=self.decoupled, beta1=beta1, beta2=beta2,
                            lr=lr if scaled is None else lr * float(scaled),  # (a host read: these take a number)
                            weight_decay=wd, eps=eps, amsgrad=amsgrad, maximize=maximize)
            return True
        if (skip is not None or scaled is not None) and not (self.fused if scaled is None else self.scalable):
            # torch's foreach kernel cannot skip on the device or take a tensor lr, and CUDA's fused kernel reads
            # a tensor lr in float32 only (float64 parameters would lose the lr's precision): the formulas can
            return False
        found_inf = by = grad_scale = None
        if skip is not None:  # the fused kernels skip on the device, as under GradScaler
            found_inf, by = skip.to(torch.float32), ~skip if ctx.proceed is None else ctx.proceed
        if ctx.pending is not None:  # a clip's scale `c` folded into the kernels' `grad_scale`, 1/c (float32)
            if not self.foldable:  # (float64 parameters, or a non-fused sub-group: the clip's multiply runs)
                ctx.flush_(updates)
            else:
                seg, scale = ctx.pending
                ctx.pending = None
                if seg.active[0]:  # (a global segment below min_size: the clip leaves it as it is)
                    grad_scale = scale.reshape(()).reciprocal().to(torch.float32)
        for (lr, beta1, beta2, eps, wd, amsgrad, maximize), (a, b, _, calls) in zip(values, self.groups):
            for c in calls:
                grads = updates[a:b] if c.idx is None else [updates[a + i] for i in c.idx]
                ps, m, v, vmax = c.params, c.m, c.v, c.vmax
                if c.wide:  # bfloat16 moments: the kernel on `wide` copies (its new moments, unrounded, make this
                    # step's update), stored back rounded to nearest after the call (`narrow_`)
                    ps, grads, m, v, vmax = wide(ps, grads, m, v, vmax)
                if c.kind == "foreach":  # (no skip, no factor here; it advances the counts itself)
                    foreach_adam_(ps, grads, m, v, vmax, c.steps, decoupled=self.decoupled,
                                  amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, weight_decay=wd, eps=eps,
                                  maximize=maximize)
                    if c.wide:
                        narrow_(c.params, (c.m, c.v, c.vmax), ps, (m, v, vmax))
                    continue
                if c.flat is not None:
                    c.flat.add_(const(1.0, c.flat) if by is None else by)  # (a cached 1: no scalar tensor per call)
                else:
                    torch._foreach_add_(c.steps, 1 if by is None else by)
                dev = c.params[0].device
                fused_adam_(  # (the kernel reads a tensor lr in float64 for float64 parameters, else in float32)
                    ps, grads, m, v, vmax, c.steps, decoupled=self.decoupled,
                    lr=lr if scaled is None else (scaled * lr).to(dev, c.lr_dtype), beta1=beta1, beta2=beta2,
                    weight_decay=wd, eps=eps, amsgrad=amsgrad, found_inf=found_inf, maximize=maximize,
                    grad_scale=None if grad_scale is None else grad_scale.to(dev))
                if c.wide:
                    narrow_(c.params, (c.m, c.v, c.vmax), ps, (m, v, vmax))
        return True


def adam_updates(ctx: Any, params: Tensors, grads: Tensors, steps: Tensors, m: Tensors, v: Tensors, vmax: Tensors,
                 lr: Scalar, beta1: Scalar, beta2: Scalar, eps: float, weight_decay: float, amsgrad: bool,
                 maximize: bool, *, decoupled: bool, scaled: torch.Tensor | None = None) -> Tensors:
    """modopt's multi-tensor Adam (AdamW: `decoupled`) on one param group: the moments and step counts
    advance (kept as they were on a step the device skips, `ctx.skip`), and the updates are returned
    (`lr` times `scaled`, a factor a transform before asked for, when given)."""
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0 and not decoupled:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if ctx.skip is None:
        torch._foreach_add_(steps, 1)
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
    else:  # the same arithmetic on copies (the same rounding, in every dtype), then the old moments and step
        # counts where the step is skipped
        skip = ctx.skip
        torch._foreach_add_(steps, [(~skip).to(torch.float32)] * len(steps))
        safe = [torch.where(skip, 0.0, gi) for gi in grads]  # (not in place: the gradients stay the user's)
        m_new = [mi.clone() for mi in m]
        torch._foreach_lerp_(m_new, safe, 1 - beta1)
        v_new = [vi.clone() for vi in v]
        torch._foreach_mul_(v_new, beta2)
        torch._foreach_addcmul_(v_new, safe, safe, 1 - beta2)
        distributed.copy_(m, [ctx.keep(new, old) for old, new in zip(m, m_new)])
        distributed.copy_(v, [ctx.keep(new, old) for old, new in zip(v, v_new)])
    if amsgrad:
        torch._foreach_maximum_(vmax, v)
    t = torch.stack(steps)  # (float32 counts; float64 parameters take their bias corrections in float64,
    if params[0].dtype == torch.float64:  # as torch's fused kernels do)
        t = t.to(torch.float64)
    lr_v = lr if scaled is None else scaled * lr
    step_size = (lr_v / (1 - beta1**t)).unbind(0)
    bc2_sqrt = (1 - beta2**t).sqrt().unbind(0)
    denom = torch._foreach_sqrt(vmax if amsgrad else v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    u = torch._foreach_div(m, denom)
    torch._foreach_mul_(u, step_size)
    if weight_decay != 0 and decoupled:
        if isinstance(lr_v, torch.Tensor):
            torch._foreach_add_(u, torch._foreach_mul(params, lr_v * weight_decay))
        else:
            torch._foreach_add_(u, params, alpha=lr_v * weight_decay)
    return u


def lr_value(lr: Scalar, like: torch.Tensor) -> Scalar:
    """`lr` for a foreach multiply. Compiled, a 0-d tensor: a scheduler's new value is then
    a graph input, not a constant that forces a recompile (a Python scalar is specialised)."""
    if torch.compiler.is_compiling() and not isinstance(lr, torch.Tensor):
        return torch.ones((), dtype=torch.float32, device=like.device) * lr  # tensor * float: tensorified
    return lr


#: `start(ctx, st, a, b, dampening, bufs, grads) -> (flags, fresh)`: `SGD`'s `started` flags of a group
#: (`modopt.core.state`, which this module cannot import: it imports the runner, which imports this)
Start = Callable[..., tuple[list[Any], bool]]


class SGDPlan:
    """The kernel calls of one `SGD` transform over one layout (see above).

    With `write`, per (device, dtype) sub-group of each param group: torch's fused kernel (the buffers a
    first step starts: a call with `is_first_step`, after which the plan is built again) or torch's foreach
    kernel (a step the device decides: `foreach_sgd_skip_`); buffers with a `started` flag (dampening on
    the device path) their own call (`fused_sgd_started_`, `foreach_sgd_started_`), the flags settled after;
    with torch's own kernel choice torch's functional step per group (`torch_sgd_`). Without `write`,
    modopt's formulas (`sgd_updates`) per group.
    """

    __slots__ = ("write", "torch", "foreach", "reads", "states", "watch", "groups", "stale", "renew", "start", "same",
                 "settle")
    write: bool  # the last transform: it writes the parameters (else `run` returns the updates)
    torch: bool  # torch's own kernel choice (`fused=False`, `foreach`): `torch_sgd_` per group
    foreach: bool | None
    reads: bool  # a group keeps momentum buffers: the state is read (else `states` are placeholders)
    states: list[dict[str, Any]]  # the per-parameter state dicts the plan read (checked by identity)
    watch: list[tuple[Any, list[dict[str, Any]], Tensors]]  # (getter, states, the tensors they must still hold)
    #: per param group: (a, b, momentum on, calls, the `started` flags or None, whether all were made now)
    groups: list[tuple[int, int, bool, list[_Call], list[Any] | None, bool]]
    stale: bool  # set by a run whose calls started buffers (`renew`): the next step builds the plan again
    renew: bool
    start: Start
    same: Callable[..., bool]
    settle: Callable[..., None]

    def __init__(self, ctx: Any, st: Any, updates: Tensors, write: bool, *, fused: bool | None,
                 foreach: bool | None, start: Start, same: Callable[..., bool], settle: Callable[..., None]) -> None:
        self.write, self.foreach, self.start, self.same, self.settle = write, foreach, start, same, settle
        self.torch = write and (fused is False or (fused is None and foreach is not None))
        # the state is read only where a group keeps buffers: without momentum SGD leaves `opt.state` empty, as
        # torch's does (reading `state[p]` would make an empty entry per parameter)
        self.reads = any(g["momentum"] != 0 for g in ctx.groups)
        self.states = now = list(ctx.param_states()) if self.reads else [{} for _ in ctx.params]
        self.watch, self.groups, self.stale, self.renew = [], [], False, False
        k = value_key(st.key, "momentum_buffer")
        for g, a, b in ctx.per_group():
            on, states, params, grads = bool(g["momentum"] != 0), now[a:b], ctx.params[a:b], updates[a:b]
            bufs = [s.get(k) for s in states] if on else [None] * (b - a)
            flags, fresh = ([None] * (b - a), True) if not (on and write) or self.torch else \
                start(ctx, st, a, b, g["dampening"], bufs, grads)
            calls = []
            for idx, fused_, _ in () if self.torch or not write else split(ctx, a, b, "sgd", fused is True):
                sel = list(range(b - a)) if idx is None else idx
                mine = [i for i in sel if flags[i] is not None]
                if mine:  # buffers that may not have started (see `SGD`)
                    fs = [flags[i] for i in mine]
                    calls.append(_Call("fused_started" if fused_ else "foreach_started", mine,
                                       [params[i] for i in mine], bufs=[bufs[i] for i in mine], flags=fs,
                                       same=fused_ and same(st, (a, b), fs, fresh)))
                    if len(mine) == len(sel):
                        continue
                    idx = sel = [i for i in sel if flags[i] is None]
                if not fused_:  # (a missing buffer is filled by the call: see `run`)
                    calls.append(_Call("foreach", idx, _pick(params, idx), bufs=_pick(bufs, idx)))
                    continue
                if not on:
                    calls.append(_Call("fused", idx, _pick(params, idx), bufs=[]))
                    continue
                new = [i for i in sel if bufs[i] is None]
                for i in new:  # a zero buffer on the device path (no dampening here): a step like any other;
                    # else torch's first step, where the buffer starts as the (scaled) gradient
                    bufs[i] = (torch.zeros_like if ctx.skip is not None else torch.empty_like)(grads[i])
                if new and ctx.skip is None:
                    old = [i for i in sel if i not in set(new)]
                    calls += [_Call("fused", js, [params[i] for i in js], bufs=[bufs[i] for i in js], first=first)
                              for js, first in ((new, True), (old, False)) if js]
                    continue
                calls.append(_Call("fused", idx, _pick(params, idx), bufs=_pick(bufs, idx)))
            if self.torch or not write:
                calls.append(_Call("torch" if write else "updates", None, params, bufs=bufs))
            for s, buf in zip(states, bufs) if on else ():
                if buf is not None:
                    s[k] = buf
            for c in calls if on and write else ():  # (`first`: the call starts a buffer: the plan is built again)
                c.first = c.first or any(buf is None for buf in c.bufs)
            self.renew = self.renew or any(c.first for c in calls)
            self.groups.append((a, b, on, calls, flags if any(f is not None for f in flags) else None, fresh))
            have = [s for s, buf in zip(states, bufs) if buf is not None] if on and write else []
            self.watch += _watch(st, have, ("momentum_buffer",)) if have else []
            flagged = [s for s, f in zip(states, flags) if f is not None]
            self.watch += _watch(st, flagged, ("started",)) if flagged else []

    def run(self, ctx: Any, st: Any, updates: Tensors) -> Tensors | bool | None:
        """This step's kernel calls: True (the parameters are written), the updates (not `write`), or None
        (nothing done: the state no longer holds the plan's tensors, or a first step started buffers;
        build it again)."""
        states = self.states
        now = ctx.param_states() if self.reads else states
        if self.stale or len(now) != len(states) or not all(map(_is, now, states)):
            return None
        try:
            for get, sts, ts in self.watch:
                if not all(map(_is, map(get, sts), ts)):
                    return None
        except KeyError:
            return None
        values = []  # each group's values, read once
        for g, (_, _, on, _, _, _) in zip(ctx.groups, self.groups):
            values.append((g["lr"], g["momentum"], g["dampening"], g["nesterov"], g["weight_decay"], g["maximize"]))
            if bool(values[-1][1] != 0) is not on:
                return None
        self.stale = self.renew
        skip = ctx.skip
        found_inf = None if skip is None else skip.to(torch.float32)
        k, out = value_key(st.key, "momentum_buffer"), []
        for (lr, mu, dampening, nesterov, wd, maximize), (a, b, on, calls, flags, fresh) in zip(values, self.groups):
            hyper = dict(lr=lr, weight_decay=wd, momentum=mu, dampening=dampening, nesterov=nesterov, maximize=maximize)
            for c in calls:
                grads = updates[a:b] if c.idx is None else [updates[a + i] for i in c.idx]
                if c.kind == "updates":
                    out += sgd_updates(ctx, st, a, b, grads, lr, mu, dampening, nesterov, wd, maximize,
                                       start=self.start, settle=self.settle)
                elif c.kind == "fused":
                    fused_sgd_(c.params, grads, c.bufs, is_first_step=c.first, grad_scale=None, found_inf=found_inf,
                               **hyper)
                elif c.kind == "fused_started":
                    fused_sgd_started_(c.params, grads, c.bufs, c.flags, skip, c.same, **hyper)
                elif c.kind == "foreach_started":
                    foreach_sgd_started_(c.params, grads, c.bufs, c.flags, skip, **hyper)
                elif c.kind == "torch":  # (the host decided the skip)
                    torch_sgd_(c.params, grads, c.bufs, foreach=self.foreach, **hyper)
                elif skip is None:
                    foreach_sgd_(c.params, grads, c.bufs, **hyper)
                else:
                    foreach_sgd_skip_(c.params, grads, c.bufs, skip, **hyper)
                if on and c.first and c.kind in ("torch", "foreach"):  # buffers the call started
                    for i, buf in zip(range(a, b) if c.idx is None else [a + i for i in c.idx], c.bufs):
                        now[i][k] = buf
            if flags is not None:
                self.settle(st, (a, b), now[a:b], flags, None if skip is None else
                            ctx.proceed if ctx.proceed is not None else ~skip, fresh)
        return out if not self.write else True


def sgd_updates(ctx: Any, st: Any, a: int, b: int, grads: Tensors, lr: Scalar, momentum: float, dampening: float,
                nesterov: bool, weight_decay: float, maximize: bool, *, start: Start,
                settle: Callable[..., None]) -> Tensors:
    """modopt's SGD on the param group `params[a:b]`: the momentum buffers advance (kept as they were on a
    step the device skips; a buffer with a `started` flag is torch's first buffer, the gradient, until it
    has started), and the updates are returned. Eager and traced alike."""
    params = ctx.params[a:b]
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    skip = ctx.skip
    if skip is not None:  # a skipped step: zeros (new tensors: the gradients stay the user's)
        grads = [torch.where(skip, 0.0, gi) for gi in grads]
    if momentum != 0:
        k, states = value_key(st.key, "momentum_buffer"), ctx.param_states()[a:b]
        bufs = [s.get(k) for s in states]
        flags, _ = start(ctx, st, a, b, dampening, bufs, grads)
        for i, (buf, grad) in enumerate(zip(bufs, grads)):
            if skip is None and flags[i] is None:
                if buf is None:
                    bufs[i] = grad.detach().clone()
                else:
                    buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                continue
            if buf is None:  # a zero buffer, which `mu * 0 + g` fills as torch's first step
                buf = bufs[i] = torch.zeros_like(grad)
            # the same in-place arithmetic on a copy (the same rounding as above, in every dtype), torch's
            # first buffer (the gradient) where it has not started, and the old buffer where the step is skipped
            new = buf.clone().mul_(momentum).add_(grad, alpha=1 - dampening)
            if flags[i] is not None:
                new = torch.where(flags[i], new, grad)
            buf.copy_(ctx.keep(new, buf))
        for s, buf in zip(states, bufs):
            s[k] = buf
        settle(st, ("apply", a, b), states, flags,
               None if skip is None else ctx.proceed if ctx.proceed is not None else ~skip)
        grads = torch._foreach_add(grads, bufs, alpha=momentum) if nesterov else bufs
    return torch._foreach_mul(grads, lr_value(lr, grads[0]))


def packed_steps_hold(opt: Any) -> int:
    """The number of packed step-count entries (`AdamPlan`'s) whose views are still the state's step
    tensors. A compiled step whose graph advances the packed tensor (`Adam` under `compile_step`)
    decided at trace time that they are; `CompiledStep` runs a call eagerly, which packs the counts
    again, whenever fewer hold than after the last eager call (a step tensor or a state dict replaced
    by hand; a state dict loaded, which drops the entries)."""
    state, n = opt.state, 0
    for store in opt._runtime.values():
        for key, ent in store.items():
            if type(key) is tuple and key[:1] == ("packed_steps",):
                _, views, params, k = ent
                n += all(map(_is, views, [state.get(p, _NO_STATE).get(k) for p in params]))
    return n


_NO_STATE: dict = {}


# --- the formulas traced by torch.compile, and ADOPT's -------------------------------------------------------


def traced_value(x: Scalar, like: torch.Tensor) -> torch.Tensor:
    """A group value as a 0-d float32 tensor of a traced graph (a graph input, not a constant)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=like.device, dtype=torch.float32)
    return torch.ones((), dtype=torch.float32, device=like.device) * x


def count_steps(steps: Tensors, by: torch.Tensor | None = None) -> Tensors:
    """`step += by` (1 when None, else a 0-d tensor) for the 0-d step tensors; the new counts.

    Compiled, each new count is its own value, copied into its step tensor, and the bias corrections
    read those values, one per tensor as torch's compiled Adam does, never a `stack` of the step
    tensors: inductor's CUDA code read stale counts from a stack of step tensors mutated in the same
    graph (torch 2.11: wrong bias corrections, and counts left behind on skipped steps)."""
    if not torch.compiler.is_compiling():
        torch._foreach_add_(steps, 1 if by is None else [by] * len(steps))
        return steps
    new = [s + (1.0 if by is None else by) for s in steps]
    for s, x in zip(steps, new):
        s.copy_(x)
    return new


def adam_traced_updates(ctx: Any, params: Tensors, grads: Tensors, steps: Tensors, m: Tensors, v: Tensors,
                        vmax: Tensors, lr: Scalar, beta1: Scalar, beta2: Scalar, eps: Scalar, weight_decay: Scalar,
                        amsgrad: bool, maximize: bool, *, decoupled: bool,
                        scaled: torch.Tensor | None = None) -> Tensors:
    """`adam_updates` as `torch.compile` traces it: every group value (lr, betas, eps, weight_decay) a 0-d
    tensor of the graph, so a scheduler that changes any of them (OneCycleLR cycles beta1) reruns the graph
    instead of recompiling it (a Python float would be baked in as a constant). Equal to the eager formulas
    up to rounding (inductor fuses and reorders them)."""
    n, skip = len(params), ctx.skip
    lr_t, b1, b2, eps_t, wd_t = (traced_value(x, params[0]) for x in (lr, beta1, beta2, eps, weight_decay))
    if scaled is not None:  # a transform before asked for a factor on this step (modopt.core.moments)
        lr_t = lr_t * scaled.to(lr_t.dtype)
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0 and not decoupled:
        grads = torch._foreach_add(grads, torch._foreach_mul(params, [wd_t] * n))
    counts = count_steps(steps, None if skip is None else (~skip).to(torch.float32))
    step_size = [lr_t / (1 - b1**t) for t in counts]
    bc2_sqrt = [(1 - b2**t).sqrt() for t in counts]
    u, new_m, new_v, new_vmax = [], [], [], []
    # per tensor, plain ops: inductor fuses each tensor's chain into one kernel (lists of 0-d
    # tensors in foreach ops compiled to code three times slower on a CPU)
    for i in range(n):
        gi = grads[i]  # (on a skipped step possibly NaN: the kept m and v never take it in)
        mi = ctx.keep(torch.lerp(m[i], gi, 1 - b1), m[i])
        vi = ctx.keep(v[i] * b2 + gi * gi * (1 - b2), v[i])
        new_m.append(mi)
        new_v.append(vi)
        if amsgrad:
            vi = torch.maximum(vmax[i], vi)
            new_vmax.append(vi)
        ui = mi / (vi.sqrt() / bc2_sqrt[i] + eps_t) * step_size[i]
        if weight_decay != 0 and decoupled:
            ui = ui + params[i] * (lr_t * wd_t)
        u.append(ui)
    # the state written once, after the new values are computed (no read of a buffer written above)
    distributed.copy_(m, new_m)
    distributed.copy_(v, new_v)
    if amsgrad:
        distributed.copy_(vmax, new_vmax)
    return u


def _count(i: int, p: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=p.device if not p.is_meta else _CPU)


#: Adam's per-parameter state made where missing (`GroupPlan`): a 0-d float32 step count, two moments of zeros
ADAM_BUFFERS: dict[str, Callable[[int, torch.Tensor], torch.Tensor]] = {
    "step": _count, "exp_avg": _zeros, "exp_avg_sq": _zeros}


def held(ctx: Any, states: list[dict[str, Any]], watch: list[tuple[Any, list[dict[str, Any]], Tensors]]) -> bool:
    """Whether the step's per-parameter state dicts are still `states` and hold the tensors `watch` lists (a load
    or a hand replaces them: the plan is built again). `AdamPlan.run` and `SGDPlan.run` write this out (a call
    fewer in the default step)."""
    now = ctx.param_states()
    if len(now) != len(states) or not all(map(_is, now, states)):
        return False
    try:
        for get, sts, ts in watch:  # (a loop, not a generator: no call per entry)
            if not all(map(_is, map(get, sts), ts)):
                return False
    except KeyError:
        return False
    return True


class GroupPlan:
    """The kernel plan of an optimizer that runs modopt's own formulas (`ADOPT`, `Muon`, `AdaMuon`, the
    Schedule-Free pair) over one layout: per param group its slice of the parameters and its state tensors
    by name (`buffers`: each made where missing by its function of `(index, parameter)`), looked up once.

    `run` checks that the state still holds those tensors, reads each group's scheduled values (`keys`)
    once, and hands both to the transform's formulas: `step(ctx, st, plan, values, updates, write)`, whose
    result it returns (True, the updates, or False: see `modopt.core.roles.Planned`)."""

    __slots__ = ("write", "keys", "step", "states", "watch", "groups")
    write: bool  # the last transform: it writes the parameters (else the step returns the updates)
    keys: tuple[str, ...]  # the group values read once per step, in this order
    step: Callable[..., Any]
    states: list[dict[str, Any]] | None  # the per-parameter state dicts the plan read (checked by identity)
    watch: list[tuple[Any, list[dict[str, Any]], Tensors]]
    groups: list[tuple[int, int, dict[str, Tensors]]]  # per param group: (a, b, its state tensors by name)

    def __init__(self, ctx: Any, st: Any, write: bool, keys: tuple[str, ...], step: Callable[..., Any],
                 buffers: dict[str, Callable[[int, torch.Tensor], torch.Tensor]]) -> None:
        self.write, self.keys, self.step = write, keys, step
        made = {name: st.buffers(name, make) for name, make in buffers.items()}
        self.groups = [(a, b, {name: ts[a:b] for name, ts in made.items()}) for a, b in ctx.ranges]
        # (a plan built for a trace runs once, with nothing to check: `states` None)
        self.states = None if torch.compiler.is_compiling() else list(ctx.param_states())
        self.watch = [] if self.states is None else _watch(st, self.states, tuple(buffers))

    def run(self, ctx: Any, st: Any, updates: Tensors) -> Tensors | bool | None:
        """The transform's step on this layout; None (nothing done) when the state no longer holds the
        plan's tensors (a load replaced them): build it again."""
        if self.states is not None and not held(ctx, self.states, self.watch):
            return None
        keys = self.keys
        values = [{k: g[k] for k in keys} for g in ctx.groups]  # (each group's values, read once)
        return self.step(ctx, st, self, values, updates, self.write)


def adopt_step(ctx: Any, params: Tensors, grads: Tensors, steps: Tensors, m: Tensors, v: Tensors, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool, *, decoupled: bool,
               fixed: bool, clip_power: float | None, write: bool) -> Tensors:
    """ADOPT on one param group (`modopt.ADOPT`): the moments and step counts advance (kept as they were on
    a step the device skips); with `write` the parameters move as the reference moves them (nothing is
    returned), else the updates are returned. Eager and traced alike."""
    skip = ctx.skip
    grads = torch._foreach_neg(grads) if maximize else grads
    if weight_decay != 0 and not decoupled:
        grads = [x.clone() for x in grads]  # (in place on copies, as the reference: its rounding in every dtype)
        torch._foreach_add_(grads, params, alpha=weight_decay)
    if skip is not None:  # a skipped step's gradient never reaches the moments (new tensors)
        grads = [torch.where(skip, 0.0, x) for x in grads]
    first = [s == 0 for s in steps]  # per parameter, on the device: its first step sets v only
    denom = torch._foreach_sqrt(v)  # the previous second moment
    torch._foreach_clamp_min_(denom, eps)
    normed = torch._foreach_div(grads, denom)
    if clip_power is not None:
        for x, s in zip(normed, steps):
            c = (s.to(torch.float64) + 1).pow(clip_power).to(x.dtype)  # (t**p, rounded once)
            torch.clamp(x, -c, c, out=x)
    new_m = [x.clone() for x in m]
    torch._foreach_lerp_(new_m, normed, 1.0 - beta1)
    new_m = [torch.where(f, old, x) for f, old, x in zip(first, m, new_m)]
    later_v = [x.clone() for x in v]
    torch._foreach_mul_(later_v, beta2)
    torch._foreach_addcmul_(later_v, grads, grads, value=1.0 - beta2)
    first_v = [x.clone() for x in v]
    torch._foreach_addcmul_(first_v, grads, grads)
    new_v = [torch.where(f, x, y) for f, x, y in zip(first, first_v, later_v)]
    go = None if skip is None else ctx.proceed if ctx.proceed is not None else ~skip
    count_steps(steps, None if go is None else go.to(torch.float32))
    distributed.copy_(m, [ctx.keep(x, old) for x, old in zip(new_m, m)])
    distributed.copy_(v, [ctx.keep(x, old) for x, old in zip(new_v, v)])
    decay = 0.0
    if weight_decay != 0 and decoupled:
        decay = weight_decay if fixed else weight_decay * lr
    if write:  # the reference's writes: p *= 1 - decay, then p += -lr * m (not on a first step)
        decayed = [x.clone() for x in params]
        if decay:
            torch._foreach_mul_(decayed, 1.0 - decay)
        moved = [x.clone() for x in decayed]
        torch._foreach_add_(moved, new_m, alpha=-lr)
        new_p = [torch.where(f, d, x) for f, d, x in zip(first, decayed, moved)]
        distributed.copy_(params, [ctx.keep(x, p) for x, p in zip(new_p, params)])
        return []
    u = [torch.where(f, 0.0, x) for f, x in zip(first, torch._foreach_mul(new_m, lr))]
    if decay:
        torch._foreach_add_(u, params, alpha=decay)
    return u
