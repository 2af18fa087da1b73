"""Optimizer transforms: they carry the learning rate and produce the step.

Their fields are the *defaults* of param-group keys: `Modular` exposes them as
`group["lr"]`, `group["betas"]`, ... so torch's LR schedulers and per-group
overrides drive them. As the last transform they write the parameters with
torch's fused (or foreach) kernels; elsewhere in a chain they return the update
`lr * direction` for the transforms after them.
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar

import torch

from pydantic import field_validator, model_validator
from ..core import compiled, distributed, kernels
from ..core.distributed import is_sharded
from torch.optim.optimizer import _get_capturable_supported_devices as _capturable_devices
from ..core.keys import value_key
from ..core.moments import Offer, lr_scale
from ..core.runner import Step, TransformState
from ..core.roles import Optimizer, Scale, ScaleFact, Writer
from ..core.state import STARTED, Buffer, new_flag, proceed_flag, same_flags, settle_flags, started_flags
from ..core.transform import Transform
from ._util import FiniteFloat, FiniteNonNegativeFloat
# (not in __all__: `TorchOptimizer` is exported from its own module; a Modular pickled before the adapter moved
# names it by this path, which keeps resolving)
from .torch_optimizer import TorchOptimizer  # noqa: F401

__all__ = ["LR", "SGD", "Adam", "AdamW", "ADOPT"]

NonNegativeFloat = FiniteNonNegativeFloat  # (finite: see `_util`)

_CPU = torch.device("cpu")


def _step_tensor(p: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    if device is None:  # (a meta parameter's count lives on the CPU, as torch.optim keeps it: it is read)
        device = p.device if not p.is_meta else torch.device("cpu")
    return torch.zeros((), dtype=torch.float32, device=device)


def _placed(st, a: int, b: int, steps: list[torch.Tensor], device: torch.device | None) -> list[torch.Tensor]:
    """`steps` of `params[a:b]` on `device` (None: each parameter's own), where the kernel reads them:
    torch's non-fused kernels keep the step count on the CPU unless `capturable` (they read it on the
    host), the fused ones on the parameter's device. A step tensor saved by the other layout (a
    checkpoint of the other kernel, a torch optimizer's) moves once, in the state itself."""
    params = st.step.params[a:b]
    bad = [i for i, (t, p) in enumerate(zip(steps, params)) if t.device != (p.device if device is None else device)]
    if bad:
        k, states = value_key(st.key, "step"), st.step.param_states()[a:b]
        for i in bad:
            steps[i] = states[i][k] = steps[i].to(params[i].device if device is None else device)
    return steps


def _check_capturable(named) -> None:
    """`capturable=True` with torch's non-fused kernels: refuse parameters on a device torch cannot
    capture on (a CPU), naming one, as a `ValueError` before anything moves."""
    ok = _capturable_devices()
    for i, (name, p) in enumerate(named):
        if p.device.type not in ok:
            raise ValueError(f"capturable=True: torch's non-fused kernels capture only on {', '.join(ok)}, and "
                             f"{name or f'parameter {i}'} is on {p.device.type}; use capturable=False there")


def _plan(ctx, a: int, b: int, kernel: str, required: bool = False) -> list[tuple[list[int] | None, bool, torch.dtype]]:
    """How `ctx.params[a:b]` split into (device, dtype) sub-groups for the kernels, cached per layout.

    Each entry: the indices into `[a:b]` (None: all of them), whether torch's
    fused `kernel` applies (decided by `modopt.core.kernels.fused_ok`), and the dtype.
    With `required` (`fused=True`), parameters torch has no fused kernel for are refused, as
    torch.optim refuses them (a `RuntimeError`, as torch's, that names one); a combination `kernels.KNOWN_BAD`
    lists, and a DTensor, take the foreach path instead (see `modopt.core.kernels`).
    """
    cache = ctx.layout.cache
    key = ("optimizer_plan", a, b, kernel, required)
    plan = cache.get(key)
    if plan is None:
        by: dict[tuple, list[int]] = {}
        for i, p in enumerate(ctx.params[a:b]):
            by.setdefault((p.device, p.dtype, is_sharded(p)), []).append(i)
        plan = [
            (None if len(by) == 1 else idx, kernels.fused_ok(kernel, dev, dtype, sharded), dtype)
            for (dev, dtype, sharded), idx in by.items()
        ]
        for (dev, dtype, sharded), idx in by.items() if required else ():
            if not sharded and (kernel, dev.type, dtype) not in kernels.KNOWN_BAD \
                    and not kernels.fused_ok(kernel, dev, dtype, sharded):
                name = ctx.names[a + idx[0]] or f"parameter {a + idx[0]}"
                raise RuntimeError(f"fused=True: torch has no fused {kernel} kernel for {name} ({dtype} on "
                                 f"{dev.type}); use fused=None (modopt's default) or fused=False")
        cache[key] = plan
    return plan


def _lr_value(lr, like: torch.Tensor):
    """`lr` for a foreach multiply. Compiled, a 0-d tensor: a scheduler's new value is then
    a graph input, not a constant that forces a recompile (a Python scalar is specialised)."""
    if torch.compiler.is_compiling() and not isinstance(lr, torch.Tensor):
        return torch.ones((), dtype=torch.float32, device=like.device) * lr  # tensor * float: tensorified
    return lr


def _traced(x, like: torch.Tensor) -> torch.Tensor:
    """A group hyperparameter as a 0-d float32 tensor of a traced graph (a graph input, not a constant)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=like.device, dtype=torch.float32)
    return torch.ones((), dtype=torch.float32, device=like.device) * x


def _count_steps(steps: list[torch.Tensor], by: torch.Tensor | None = None) -> list[torch.Tensor]:
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


def _pick(xs: list, idx: list[int] | None) -> list:
    return xs if idx is None else [xs[i] for i in idx]


def _bump_steps(st, sub: tuple, steps: list[torch.Tensor], param_states: list[dict], params: list[torch.Tensor],
                by=1, device: torch.device | None = None) -> None:
    """`step += by` (1, or a 0-d tensor: 0 on a step the device skips) for every step tensor of a
    sub-group, as one kernel.

    The per-parameter `step` tensors (torch's state layout, saved per
    parameter) are made views of one packed 1-D tensor the first time a
    layout is seen, so the increment is one op instead of one per tensor.
    Step tensors not on `device` (the kernel's) move there first.
    """
    if not steps:
        return
    rt = st.runtime
    key = ("packed_steps",) + sub
    ent = rt.get(key)
    if ent is not None and len(ent[1]) == len(steps) and all(map(operator.is_, ent[1], steps)):
        ent[0].add_(by)
        return
    if device is not None and any(s.device != device for s in steps):  # (saved by a non-fused layout)
        k = value_key(st.key, "step")
        for i, s in enumerate(param_states):
            steps[i] = s[k] = steps[i].to(device)
    s0 = steps[0]
    if any(s.dim() != 0 or s.dtype != s0.dtype or s.device != s0.device for s in steps):
        torch._foreach_add_(steps, by)
        return
    flat = torch.stack(steps)
    views = list(flat.unbind(0))
    k = value_key(st.key, "step")
    for s, view in zip(param_states, views):
        s[k] = view
    steps[:] = views
    rt[key] = (flat, views, params, k)
    flat.add_(by)


def packed_steps_hold(opt: Any) -> int:
    """The number of packed step-count entries (`_bump_steps`) whose views are still the state's step
    tensors. A compiled step whose graph advances the packed tensor (`Adam._apply_final_traced_fused`)
    decided at trace time that they are; `CompiledStep` runs a call eagerly, which packs the counts
    again, whenever fewer hold than after the last eager call (a step tensor or a state dict replaced
    by hand; a state dict loaded, which drops the entries)."""
    state, n = opt.state, 0
    for store in opt._runtime.values():
        for key, ent in store.items():
            if type(key) is tuple and key[:1] == ("packed_steps",):
                _, views, params, k = ent
                n += all(map(operator.is_, views, [state.get(p, _NO_STATE).get(k) for p in params]))
    return n


_NO_STATE: dict = {}
compiled.HOLDS.append(packed_steps_hold)


class LR(Optimizer, ScaleFact):
    r"""Multiply the update by the learning rate: $u \leftarrow \text{lr}\cdot u$.

    Exposes `group["lr"]`. `Modular(params, mo.LR(0.1))` is plain SGD.
    """

    positional: ClassVar[str | None] = "lr"
    device_skip = True  # keeps its state on a step the device skips

    lr: NonNegativeFloat
    group_keys: ClassVar[tuple[str, ...]] = ("lr",)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The updates times their param group's `lr` (left as they are when a normalization right after cancels it)."""
        if st.key in ctx.cancelled:  # a normalization right after sets the norm (TransformState.scale_)
            return updates
        for g, a, b in ctx.per_group():
            torch._foreach_mul_(updates[a:b], _lr_value(g["lr"], updates[a]))
        return updates

    def scale_fact(self) -> Scale | None:
        """Positive, group scope: it only multiplies each param group's updates by its `lr`."""
        return Scale("group", positive=True)  # one factor per param group (lr = 0 alone would stop the step)


class _FusedOptimizer(Optimizer, Writer, abstract=True):
    """An optimizer transform that, as the last one, writes the parameters with torch's fused kernels.

    By default it never folds a preceding clip's scale into the kernels' `grad_scale`: the
    kernels divide by `1/scale` where torch's `clip_grad_norm_` multiplies by `scale`, which
    rounds differently and moves a long run away from torch's (7e-4 after 55 Adam steps of a
    transformer). The clip multiplies the gradients itself, exactly as `clip_grad_norm_` does:
    bit for bit torch's trajectory, at the cost of one pass over the gradients. `Adam` and
    `AdamW` offer the fold as a setting (`fold_clip=True`).
    """

    #: the name of torch's kernel family (`"sgd"`, `"adam"`, `"adamw"`) for `kernels.fused_ok`
    kernel: ClassVar[str] = ""

    @model_validator(mode="after")
    def _kernel_choice(self):
        if self.fused and self.foreach:
            raise ValueError("fused and foreach cannot both be True (as in torch.optim)")
        if self.differentiable:
            raise ValueError("differentiable=True is not supported: modopt's step runs under torch.no_grad() "
                             "(use torch.optim directly to differentiate through an optimizer step)")
        return self

    def torch_kernel(self) -> bool:
        """True when torch's own non-fused step writes the parameters: `fused=False`, or `foreach`
        given without `fused` (torch's meanings: `foreach=True` the foreach kernel, `False` the
        for-loop kernel, None torch's default for the device: for-loop on a CPU, foreach on CUDA)."""
        return self.fused is False or (self.fused is None and self.foreach is not None)

    def skips_on_device(self, groups: list[dict[str, Any]] | None = None) -> bool:
        """True on torch's fused kernels (they take `found_inf`); torch's other kernels need the host."""
        # torch's non-fused kernels take no `found_inf` and read the step count on the host: the host
        # decides the skip for them (one sync per step); the fused kernels skip on the device
        return not self.torch_kernel() and super().skips_on_device(groups)


class SGD(_FusedOptimizer):
    r"""Stochastic gradient descent: `torch.optim.SGD` with the same kernel, bit for bit.

    $$
    \begin{aligned}
    g &\leftarrow u + \lambda p \\
    b &\leftarrow \mu b + (1 - \tau) g \quad (b = g \text{ on the first step}) \\
    u &\leftarrow \text{lr}\,(g + \mu b \text{ if nesterov else } b)
    \end{aligned}
    $$

    Exposes `lr`, `momentum`, `dampening`, `nesterov`, `weight_decay`, `maximize` as group keys.

    The kernel (as the last transform): by default torch's fused kernel, so it equals
    `torch.optim.SGD(..., fused=True)`; `fused=False` runs torch's own default
    (`torch.optim.SGD(...)`: the for-loop kernel on a CPU, foreach on CUDA), `foreach=True`/`False`
    torch's foreach/for-loop kernel. With a non-fused kernel the host decides a skip (one sync
    per step). See docs/modules/optimizers.md, "Which kernel runs".

    A step the device skips (`nonfinite="skip"`) leaves the parameters and the buffers as they
    were, with no host sync, in every setting. Without dampening a momentum buffer starts at
    zero, which the first step fills exactly as torch's (`momentum * 0 + g`): as the last
    transform, torch's fused kernel skips on the device (`found_inf`). With dampening torch's
    first buffer is `g`, not `(1 - dampening) g`: a buffer the device path creates gets a
    saved `started` flag (a 0-d bool), and while it has one its step runs torch's foreach
    formulas with `where(started, momentum b + (1 - dampening) g, g)`: one more pass over the
    buffers than the fused kernel path, plus one op per step for the flags.
    """

    positional: ClassVar[str | None] = "lr"
    device_skip = True  # keeps its state on a step the device skips (dampening: the started flags)

    lr: NonNegativeFloat = 1e-3
    momentum: NonNegativeFloat = 0.0
    dampening: FiniteFloat = 0.0
    nesterov: bool = False
    weight_decay: NonNegativeFloat = 0.0
    maximize: bool = False
    #: torch's kernel choice, with torch's meanings (see the class docstring): None keeps modopt's default
    fused: bool | None = None
    foreach: bool | None = None
    differentiable: bool = False
    group_keys: ClassVar[tuple[str, ...]] = ("lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize")
    kernel: ClassVar[str] = "sgd"
    #: the torch.optim class whose `state_dict()` it continues (`modopt.core.torch_checkpoint` reads it)
    torch_class: ClassVar[type[torch.optim.Optimizer]] = torch.optim.SGD
    # "started": see `STARTED` (only buffers the device path created with dampening have one)
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"momentum_buffer": "param", "started": STARTED}

    @model_validator(mode="after")
    def _nesterov(self):
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov requires momentum > 0 and dampening = 0 (as torch.optim.SGD)")
        return self

    def _start(self, ctx, st, a, b, g, bufs, grads):
        """The `started` flags of `params[a:b]` (None: started, or no flag needed), and whether every
        flag was created now. On the device path with dampening a missing buffer (in `bufs`) starts
        as zeros with a False flag (torch's first buffer, `g`, is then chosen on the device)."""
        flags = started_flags(st, st.step.param_states()[a:b])
        starts = ctx.skip is not None and g["dampening"] != 0
        fresh = True
        if starts or any(f is not None for f in flags):
            for i, buf in enumerate(bufs):
                if buf is None and (starts or flags[i] is not None):  # (a flag without a buffer: not started)
                    bufs[i] = torch.zeros_like(grads[i])
                    if flags[i] is None:
                        flags[i] = new_flag(grads[i])
                        continue
                fresh = fresh and flags[i] is None
            k = value_key(st.key, "started")
            for s, f in zip(st.step.param_states()[a:b], flags):
                if f is not None:
                    s[k] = f
        return flags, fresh

    def _buffers(self, st, a, b):
        k = value_key(st.key, "momentum_buffer")
        return [s.get(k) for s in st.step.param_states()[a:b]]

    def _save_buffers(self, st, a, b, bufs):
        k = value_key(st.key, "momentum_buffer")
        for s, buf in zip(st.step.param_states()[a:b], bufs):
            if buf is not None:
                s[k] = buf

    def apply_final(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> bool:
        """Write the parameters with torch's SGD kernel (fused where known right): True; False where the
        runner writes `apply`'s update instead (a compiled step)."""
        if torch.compiler.is_compiling():
            return False  # torch's fused kernels do not functionalize; the foreach math compiles (and fuses)
        if self.torch_kernel():
            return self._torch_step(ctx, st, updates)
        skip = ctx.skip
        found_inf = None if skip is None else skip.to(torch.float32)
        for g, a, b in ctx.per_group():
            mu = g["momentum"]
            bufs = self._buffers(st, a, b) if mu != 0 else []
            flags, fresh = self._start(ctx, st, a, b, g, bufs, updates[a:b]) if mu != 0 else ([], True)
            flagged = any(f is not None for f in flags)
            for idx, fused, dtype in _plan(ctx, a, b, "sgd", self.fused is True):
                if flagged:  # buffers that may not have started (see the class docstring)
                    sel = range(b - a) if idx is None else idx
                    mine = [i for i in sel if flags[i] is not None]
                    if mine:
                        ps, gs = [ctx.params[a + i] for i in mine], [updates[a + i] for i in mine]
                        bs, fs = [bufs[i] for i in mine], [flags[i] for i in mine]
                        hyper = dict(lr=g["lr"], weight_decay=g["weight_decay"], momentum=mu,
                                     dampening=g["dampening"], nesterov=g["nesterov"], maximize=g["maximize"])
                        if fused:
                            kernels.fused_sgd_started_(ps, gs, bs, fs, skip, same_flags(st, (a, b), fs, fresh), **hyper)
                        else:
                            kernels.foreach_sgd_started_(ps, gs, bs, fs, skip, **hyper)
                        idx = [i for i in sel if flags[i] is None]
                        if not idx:
                            continue
                params, grads = _pick(ctx.params[a:b], idx), _pick(updates[a:b], idx)
                hyper = dict(weight_decay=g["weight_decay"], momentum=mu, lr=g["lr"], dampening=g["dampening"],
                             nesterov=g["nesterov"], maximize=g["maximize"])
                if not fused:
                    sub_bufs = _pick(bufs, idx)
                    if skip is None:
                        kernels.foreach_sgd_(params, grads, sub_bufs, **hyper)
                    else:
                        kernels.foreach_sgd_skip_(params, grads, sub_bufs, skip, **hyper)
                    if mu != 0:
                        for j, i in enumerate(idx if idx is not None else range(len(params))):
                            bufs[i] = sub_bufs[j]
                    continue
                if mu == 0:
                    kernels.fused_sgd_(params, grads, [], is_first_step=False, grad_scale=None, found_inf=found_inf,
                                       **hyper)
                    continue
                sel = list(range(len(params))) if idx is None else idx
                new = [j for j, i in enumerate(sel) if bufs[i] is None]
                if new and skip is not None:  # a zero buffer (no dampening here): then a step like any other
                    for j in new:
                        bufs[sel[j]] = torch.zeros_like(grads[j])
                    new = []
                if new:  # torch's first step: the buffer starts as the (scaled) gradient
                    for j in new:
                        bufs[sel[j]] = torch.empty_like(grads[j])
                    kernels.fused_sgd_([params[j] for j in new], [grads[j] for j in new], [bufs[sel[j]] for j in new],
                                      is_first_step=True, grad_scale=None, **hyper)
                old = [j for j in range(len(sel)) if j not in set(new)] if new else None
                if old is None:
                    kernels.fused_sgd_(params, grads, [bufs[i] for i in sel], is_first_step=False, grad_scale=None,
                                       found_inf=found_inf, **hyper)
                elif old:
                    kernels.fused_sgd_([params[j] for j in old], [grads[j] for j in old], [bufs[sel[j]] for j in old],
                                      is_first_step=False, grad_scale=None, **hyper)
            if mu != 0:
                self._save_buffers(st, a, b, bufs)
            if flagged:
                settle_flags(st, (a, b), st.step.param_states()[a:b], flags, proceed_flag(ctx), fresh)
        return True

    def _torch_step(self, ctx, st, updates):
        """`fused=False` / `foreach`: torch.optim.SGD's own non-fused step per param group (the host
        has decided the skip: `skips_on_device` is False)."""
        for g, a, b in ctx.per_group():
            mu = g["momentum"]
            bufs = self._buffers(st, a, b) if mu != 0 else [None] * (b - a)
            kernels.torch_sgd_(ctx.params[a:b], updates[a:b], bufs, foreach=self.foreach, lr=g["lr"],
                               weight_decay=g["weight_decay"], momentum=mu, dampening=g["dampening"],
                               nesterov=g["nesterov"], maximize=g["maximize"])
            if mu != 0:
                self._save_buffers(st, a, b, bufs)
        return True

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The SGD step (momentum, dampening, Nesterov, weight decay) as updates."""
        out: list[torch.Tensor] = []
        for g, a, b in ctx.per_group():
            grads = updates[a:b]
            if g["maximize"]:
                grads = torch._foreach_neg(grads)
            if g["weight_decay"] != 0:
                grads = torch._foreach_add(grads, ctx.params[a:b], alpha=g["weight_decay"])
            skip = ctx.skip
            if skip is not None:  # a skipped step: zeros (new tensors: the gradients stay the user's)
                grads = [torch.where(skip, 0.0, gi) for gi in grads]
            mu = g["momentum"]
            if mu != 0:
                bufs = self._buffers(st, a, b)
                flags, _ = self._start(ctx, st, a, b, g, bufs, grads)
                for i, (buf, grad) in enumerate(zip(bufs, grads)):
                    if skip is None and flags[i] is None:
                        if buf is None:
                            bufs[i] = grad.detach().clone()
                        else:
                            buf.mul_(mu).add_(grad, alpha=1 - g["dampening"])
                        continue
                    if buf is None:  # a zero buffer, which `mu * 0 + g` fills as torch's first step
                        buf = bufs[i] = torch.zeros_like(grad)
                    # the same in-place arithmetic on a copy (the same rounding as above, in every dtype),
                    # torch's first buffer (the gradient) where it has not started, and the old buffer
                    # where the step is skipped
                    new = buf.clone().mul_(mu).add_(grad, alpha=1 - g["dampening"])
                    if flags[i] is not None:
                        new = torch.where(flags[i], new, grad)
                    buf.copy_(ctx.keep(new, buf))
                self._save_buffers(st, a, b, bufs)
                settle_flags(st, ("apply", a, b), st.step.param_states()[a:b], flags, proceed_flag(ctx))
                grads = torch._foreach_add(grads, bufs, alpha=mu) if g["nesterov"] else bufs
            out.extend(torch._foreach_mul(grads, _lr_value(g["lr"], grads[0])))
        return out


def _check_betas(v: tuple[float, float]) -> tuple[float, float]:
    """Adam's and ADOPT's `betas`: each in [0, 1) (`ValueError` naming the one that is not)."""
    for i, b in enumerate(v):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
    return v


class Adam(_FusedOptimizer):
    r"""Adam: `torch.optim.Adam` with the same kernel, bit for bit (eps after the bias-corrected square root).

    $$
    \begin{aligned}
    m &\leftarrow \beta_1 m + (1-\beta_1) g, \quad v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
    u &\leftarrow \frac{\text{lr}}{1-\beta_1^t}\,\frac{m}{\sqrt{v}/\sqrt{1-\beta_2^t} + \varepsilon}
    \end{aligned}
    $$

    with `g = u + weight_decay * p` (L2 penalty) and `v` replaced by its
    running maximum when `amsgrad`. Exposes `lr`, `betas`, `eps`,
    `weight_decay`, `amsgrad`, `maximize` as group keys.

    The kernel (as the last transform): by default torch's fused kernel, so it equals
    `torch.optim.Adam(..., fused=True)`, not torch's default. `fused=False` runs torch's own
    default (`torch.optim.Adam(...)`: the for-loop kernel on a CPU, foreach on CUDA);
    `foreach=True`/`False` torch's foreach/for-loop kernel (torch's for-loop on CPU tensors is
    `kernels.loop_adam_`, the same operations in torch's order: the same bits); `capturable` as in torch (for the
    non-fused kernels). With a non-fused kernel the host decides a skip (one sync per step:
    torch's non-fused kernels read the step count on the host). `decoupled_weight_decay=True`
    makes it `AdamW`. See docs/modules/optimizers.md, "Which kernel runs".

    `fold_clip=True` (default False) folds the scale `c` of a global clip right before it
    (`ClipNorm`, `ClipNormByEMA`, ...: a transform that declares one positive factor for all
    parameters) into torch's fused kernel: the kernel divides the gradients by its
    `grad_scale = 1/c`, as it unscales under `GradScaler`, instead of the clip multiplying
    them by `c` in a pass of its own. One pass over the gradients less (read and write); the
    kernel writes the clipped gradients back, so `p.grad` still holds them. Not bit-exact:
    `g / (1/c)` and `g * c` differ in the last bit of some elements (float32; in float16 and
    bfloat16 the kernel also skips the rounding of the clipped gradient to the parameters'
    dtype). Where the kernel is not used (compiled steps, the foreach path, float64, which
    the kernel's float32 `grad_scale` would round) the clip multiplies as usual.
    """

    positional: ClassVar[str | None] = "lr"
    takes_scale: ClassVar[bool] = True  # (`_apply_final_traced_fused` multiplies a deferred scale in its op)
    device_skip = True  # keeps its state on a step the device skips

    lr: NonNegativeFloat = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: NonNegativeFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0
    amsgrad: bool = False
    fold_clip: bool = False
    maximize: bool = False
    #: torch's kernel choice and step layout, with torch's meanings (see the class docstring)
    fused: bool | None = None
    foreach: bool | None = None
    capturable: bool = False
    differentiable: bool = False
    decoupled_weight_decay: bool = False
    state_buffers: ClassVar[dict[str, str | Buffer]] = {
        "step": Buffer("counter", dtype="float32"),  # torch keeps Adam's step in float32
        "exp_avg": "param",
        "exp_avg_sq": Buffer("param", low=0, finite=False),  # squares: +inf after gradients of 1e20
        "max_exp_avg_sq": Buffer("param", low=0, finite=False),
    }
    group_keys: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
    #: what it offers the transforms before it (`modopt.core.moments`: SPAM reads `v`, resets the moments,
    #: scales the learning rate of a step)
    offers: ClassVar[Offer] = Offer(moments={"first_moment": "exp_avg", "second_moment": "exp_avg_sq"},
                                    resets=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), count="step", lr_scale=True)

    @property
    def folds_clip(self) -> bool:
        """`fold_clip` (see the class docstring)."""
        return self.fold_clip

    @property
    def decoupled(self) -> bool:
        """Whether the weight decay is AdamW's, decoupled (`decoupled_weight_decay`, always for `AdamW`)."""
        return self.decoupled_weight_decay

    @property
    def kernel(self) -> str:  # type: ignore[override]
        """The fused kernel's name: `"adamw"` with decoupled weight decay, else `"adam"` (`kernels.fused_ok`)."""
        return "adamw" if self.decoupled else "adam"

    @property
    def torch_class(self) -> type[torch.optim.Optimizer]:
        """The torch.optim class whose `state_dict()` it continues (`modopt.core.torch_checkpoint` reads it):
        `torch.optim.AdamW` with decoupled weight decay, else `torch.optim.Adam`."""
        return torch.optim.AdamW if self.decoupled else torch.optim.Adam

    def check_params(self, named: list[tuple[str | None, torch.Tensor]]) -> None:
        """With `capturable=True` on torch's own kernels, refuse parameters those kernels cannot capture."""
        if self.capturable and self.torch_kernel():
            _check_capturable(named)

    @model_validator(mode="after")
    def _fold_needs_fused(self):
        if self.fold_clip and self.torch_kernel():
            raise ValueError("fold_clip=True needs torch's fused kernel (its grad_scale), but fused=False or foreach "
                             "was given: drop one of them")
        return self

    _betas = field_validator("betas")(classmethod(lambda cls, v: _check_betas(v)))

    def _state(self, st, a, b, amsgrad, steps_on: torch.device | None = None):
        sl = slice(a, b)
        steps = st.buffers("step", lambda i, p: _step_tensor(p, steps_on))[sl]
        m = st.buffers("exp_avg", lambda i, p: torch.zeros_like(p, memory_format=torch.preserve_format))[sl]
        v = st.buffers("exp_avg_sq", lambda i, p: torch.zeros_like(p, memory_format=torch.preserve_format))[sl]
        vmax = (
            st.buffers("max_exp_avg_sq", lambda i, p: torch.zeros_like(p, memory_format=torch.preserve_format))[sl]
            if amsgrad else []
        )
        return steps, m, v, vmax

    def apply_final(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> bool:
        """Write the parameters with torch's Adam/AdamW kernel (fused where known right): True; False where
        the runner writes `apply`'s update instead (a compiled step, or a skip torch's kernel cannot take)."""
        if torch.compiler.is_compiling():
            # torch's fused kernels do not functionalize; the foreach math compiles (and fuses), unless the
            # step was compiled by `modopt.compile_step`, which keeps the fused kernel as one op of the graph
            return compiled.keeps_fused() and self._apply_final_traced_fused(ctx, st, updates)
        calls = ctx.layout.cache.get(("adam_calls", st.key))
        if calls is not None and ctx.pending is None and not ctx.moment_requests and _run_fused_adam(calls, ctx, updates):
            return True
        if self.torch_kernel():
            return self._torch_step(ctx, st, updates)
        skip, scaled = ctx.skip, lr_scale(ctx, st)
        if (skip is not None or scaled is not None) and not all(
                fused and (scaled is None or dtype != torch.float64 or ctx.params[a].device.type == "cpu")
                for _, a, b in ctx.per_group() for _, fused, dtype in _plan(ctx, a, b, self.kernel, self.fused is True)):
            # torch's foreach kernel cannot skip on the device or take a tensor lr, and CUDA's fused kernel
            # reads a tensor lr in float32 only (float64 parameters would lose the lr's precision): the
            # foreach math can
            return False
        found_inf = by = None
        if skip is not None:  # the fused kernels skip on the device, as under GradScaler
            found_inf, by = skip.to(torch.float32), ~skip if ctx.proceed is None else ctx.proceed
        grad_scale = self._folded_scale(ctx, updates)
        # the kernel calls as they are made, for the steps after this one while the state stays these tensors
        calls: list | None = [] if scaled is None and grad_scale is None else None
        for g, a, b in ctx.per_group():
            amsgrad = g["amsgrad"]
            steps, m, v, vmax = self._state(st, a, b, amsgrad)
            beta1, beta2 = g["betas"]
            for idx, fused, dtype in _plan(ctx, a, b, self.kernel, self.fused is True):
                params, grads = _pick(ctx.params[a:b], idx), _pick(updates[a:b], idx)
                sub_m, sub_v, sub_vmax = _pick(m, idx), _pick(v, idx), _pick(vmax, idx) if amsgrad else []
                sub_steps = _pick(steps, idx)
                if not fused:
                    calls = None
                    kernels.foreach_adam_(
                        params, grads, sub_m, sub_v, sub_vmax, sub_steps, decoupled=self.decoupled, amsgrad=amsgrad,
                        beta1=beta1, beta2=beta2, lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"],
                        maximize=g["maximize"],
                    )
                    continue
                states = _pick(ctx.param_states()[a:b], idx)
                _bump_steps(st, (a, b, None if idx is None else idx[0]), sub_steps, states, params, 1 if by is None else by,
                            params[0].device)
                # (the kernel reads a tensor lr in float64 for float64 parameters, in float32 for the others)
                lr = g["lr"] if scaled is None else (scaled * g["lr"]).to(
                    params[0].device, torch.float64 if dtype == torch.float64 else torch.float32)
                kernels.fused_adam_(
                    params, grads, sub_m, sub_v, sub_vmax, sub_steps, decoupled=self.decoupled, lr=lr,
                    beta1=beta1, beta2=beta2, weight_decay=g["weight_decay"], eps=g["eps"], amsgrad=amsgrad,
                    grad_scale=None if grad_scale is None else grad_scale.to(params[0].device), found_inf=found_inf,
                    maximize=g["maximize"],
                )
                packed = st.runtime.get(("packed_steps", a, b, None if idx is None else idx[0]))
                if calls is not None and packed is not None and all(map(operator.is_, packed[1], sub_steps)):
                    calls.append(_FusedAdamCall(g, idx, a, b, params, states, packed[0], sub_steps, sub_m, sub_v, sub_vmax,
                                                value_key(st.key, ""), self.decoupled))
                else:
                    calls = None
        if calls is not None:
            ctx.layout.cache[("adam_calls", st.key)] = calls
        return True

    def _apply_final_traced_fused(self, ctx, st, updates):
        """`apply_final` traced by `modopt.compile_step`: torch's fused kernel as one op of the graph
        (`compiled.fused_adam_op`), with the arguments the eager step gives it, so the same bits: the
        step counts advanced by `~skip`, the skip as `found_inf`, the learning rate a 0-d tensor (float64
        on the CPU, whose kernel reads it as a double, as the float; the kernel's math type on CUDA).
        False (the traced formulas run instead) wherever the eager step would not call the fused kernel
        plainly: a non-fused plan, a kernel of torch's own, a pending folded scale or a learning-rate
        factor asked by a transform before. A pending global or per-tensor scale the plan defers to it
        (`Plan.deferred`) the op multiplies in place first."""
        if self.torch_kernel() or ctx.moment_requests:
            return False
        grad_mul = None
        if ctx.pending is not None:  # the scale the plan left to this op (`Plan.deferred`), not a fold
            seg, scale = ctx.pending
            n = len(updates)
            if ctx.folded is not None:
                return False
            if seg.kind == "global" and list(seg.ranges) == [(0, n)] and seg.active[0]:
                grad_mul = scale.reshape(()).to(ctx.params[0].device)  # (reduce's `mul_` takes the same 0-d value)
            elif seg.kind == "tensor" and seg.all_active and scale.shape == (n,):
                grad_mul = scale  # one per tensor, sliced per group below (reduce's `mul_` unbinds the same)
            else:
                return False
        plans = [(g, a, b, _plan(ctx, a, b, self.kernel, self.fused is True)) for g, a, b in ctx.per_group()]
        if not all(len(pl) == 1 and pl[0][1] for _, _, _, pl in plans):
            return False
        op = compiled.FUSED_ADAM
        if op is None:
            return False
        ctx.pending = None
        skip = ctx.skip
        if grad_mul is not None and skip is not None:  # a skipped step leaves the gradients as they came
            grad_mul = torch.where(skip, 1.0, grad_mul)
        found_inf = None if skip is None else skip.to(torch.float32)
        by = None if skip is None else (ctx.proceed if ctx.proceed is not None else ~skip).to(torch.float32)
        for g, a, b, _ in plans:
            amsgrad = g["amsgrad"]
            steps, m, v, vmax = self._state(st, a, b, amsgrad)
            params = ctx.params[a:b]
            packed = st.runtime.get(("packed_steps", a, b, None))
            if packed is not None and len(packed[1]) == len(steps) and all(map(operator.is_, packed[1], steps)):
                # (the op advances the packed counts: one graph input, no views; `packed_steps_hold` sees to it
                # that a call whose state no longer holds them runs eagerly, which packs them again)
                packed, steps = packed[0], []
            else:
                packed = None
                _count_steps(steps, by)
            lr = g["lr"]
            # (the CPU kernel reads a tensor lr as a double, the same bits as the float; the CUDA kernel reads
            # it in float32 but for float64 parameters, as the eager step's scaled lr, and refuses another
            # dtype: there a float lr becomes a float32 tensor, rounded where the eager step's is not)
            wide = params[0].device.type == "cpu" or params[0].dtype == torch.float64
            lr_dtype = torch.float64 if wide else torch.float32
            lr = (lr.to(device=params[0].device, dtype=lr_dtype) if isinstance(lr, torch.Tensor)
                  else torch.ones((), dtype=lr_dtype, device=params[0].device) * lr)
            beta1, beta2 = g["betas"]
            op(params, list(updates[a:b]), m, v, vmax, steps, packed, by, lr, float(beta1), float(beta2),
               float(g["weight_decay"]), float(g["eps"]), bool(amsgrad), bool(g["maximize"]), self.decoupled,
               found_inf, grad_mul if grad_mul is None or grad_mul.dim() == 0 else grad_mul[a:b])
        return True

    def _torch_step(self, ctx, st, updates):
        """`fused=False` / `foreach`: torch.optim.Adam's own non-fused step per param group, with
        its step layout (the counts on the CPU unless `capturable`). The host has decided the skip
        (`skips_on_device` is False), so a step that gets here goes ahead."""
        ctx.flush_(updates)  # (nothing folds into these kernels; `fold_clip` is refused with them)
        if self.capturable:  # (checked when built too: this is for a param group added later)
            _check_capturable(list(zip(ctx.names, ctx.params)))
        steps_on = None if self.capturable else _CPU
        scaled = lr_scale(ctx, st)  # (a factor on the device is read on the host here: these kernels take a number)
        for g, a, b in ctx.per_group():
            steps, m, v, vmax = self._state(st, a, b, g["amsgrad"], steps_on)
            beta1, beta2 = g["betas"]
            kernels.torch_adam_(
                ctx.params[a:b], updates[a:b], m, v, vmax, _placed(st, a, b, steps, steps_on), foreach=self.foreach,
                capturable=self.capturable, decoupled=self.decoupled, beta1=beta1, beta2=beta2,
                lr=g["lr"] if scaled is None else g["lr"] * float(scaled),
                weight_decay=g["weight_decay"], eps=g["eps"], amsgrad=g["amsgrad"], maximize=g["maximize"],
            )
        return True

    def _folded_scale(self, ctx, updates):
        """The pending clip scale `c` (`fold_clip`, `Step.pending`) as the kernels' `grad_scale`, `1/c`
        (float32), or None; where some parameters do not take the fused kernel, or are
        float64, the clip's multiply runs instead (`Step.flush_`)."""
        if ctx.pending is None:
            return None
        plans = [p for _, a, b in ctx.per_group() for p in _plan(ctx, a, b, self.kernel, self.fused is True)]
        if not all(fused and dtype != torch.float64 for _, fused, dtype in plans):
            ctx.flush_(updates)
            return None
        seg, scale = ctx.pending
        ctx.pending = None
        if not seg.active[0]:  # (a global segment below min_size: the clip leaves it as it is)
            return None
        return scale.reshape(()).reciprocal().to(torch.float32)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The Adam (or AdamW) step as updates."""
        if torch.compiler.is_compiling():
            return self._apply_traced(ctx, st, updates)
        out: list[torch.Tensor] = []
        scaled = lr_scale(ctx, st)
        for g, a, b in ctx.per_group():
            params = ctx.params[a:b]
            steps, m, v, vmax = self._state(st, a, b, g["amsgrad"])
            beta1, beta2 = g["betas"]
            lr, wd = g["lr"], g["weight_decay"]
            grads = updates[a:b]
            if g["maximize"]:
                grads = torch._foreach_neg(grads)
            if wd != 0 and not self.decoupled:
                grads = torch._foreach_add(grads, params, alpha=wd)
            if ctx.skip is None:
                torch._foreach_add_(steps, 1)
                torch._foreach_lerp_(m, grads, 1 - beta1)
                torch._foreach_mul_(v, beta2)
                torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
            else:  # the same arithmetic on copies (the same rounding, in every dtype; scalar weights, which
                # inductor fuses), then the old moments and step counts where the step is skipped
                # (0-d tensors go in as lists: dynamo reads a lone tensor scalar of a foreach op with .item())
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
            if g["amsgrad"]:
                torch._foreach_maximum_(vmax, v)
            t = torch.stack(steps)  # (float32 counts; float64 parameters take their bias corrections in float64,
            if params[0].dtype == torch.float64:  # as torch's fused kernels do)
                t = t.to(torch.float64)
            lr_v = _lr_value(lr, params[0])  # every lr-dependent quantity reads lr through _lr_value
            if scaled is not None:  # a transform before asked for a factor on this step (modopt.core.moments)
                lr_v = scaled * lr_v
            step_size = (lr_v / (1 - beta1**t)).unbind(0)
            bc2_sqrt = (1 - beta2**t).sqrt().unbind(0)
            denom = torch._foreach_sqrt(vmax if g["amsgrad"] else v)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, g["eps"])
            u = torch._foreach_div(m, denom)
            torch._foreach_mul_(u, step_size)
            if wd != 0 and self.decoupled:
                if isinstance(lr_v, torch.Tensor):  # compiled: a Python lr * wd would be baked into the graph
                    torch._foreach_add_(u, torch._foreach_mul(params, lr_v * wd))
                else:
                    torch._foreach_add_(u, params, alpha=lr_v * wd)
            out.extend(u)
        return out


    def _apply_traced(self, ctx, st, updates):
        """`apply` under `torch.compile`: the same algorithm with every group hyperparameter (lr, betas,
        eps, weight_decay) a 0-d tensor of the graph, so a scheduler that changes any of them (OneCycleLR
        cycles beta1) reruns the graph instead of recompiling it; a Python float would be baked in as a
        constant. Equal to the eager formulas up to rounding (inductor fuses and reorders them)."""
        out: list[torch.Tensor] = []
        skip, scaled = ctx.skip, lr_scale(ctx, st)
        for g, a, b in ctx.per_group():
            params, grads = ctx.params[a:b], updates[a:b]
            steps, m, v, vmax = self._state(st, a, b, g["amsgrad"])
            n = len(params)
            lr, b1, b2, eps, wd = (_traced(x, params[0]) for x in (g["lr"], *g["betas"], g["eps"], g["weight_decay"]))
            if scaled is not None:  # a transform before asked for a factor on this step (modopt.core.moments)
                lr = lr * scaled.to(lr.dtype)
            if g["maximize"]:
                grads = torch._foreach_neg(grads)
            if g["weight_decay"] != 0 and not self.decoupled:
                grads = torch._foreach_add(grads, torch._foreach_mul(params, [wd] * n))
            counts = _count_steps(steps, None if skip is None else (~skip).to(torch.float32))
            step_size = [lr / (1 - b1**t) for t in counts]
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
                if g["amsgrad"]:
                    vi = torch.maximum(vmax[i], vi)
                    new_vmax.append(vi)
                ui = mi / (vi.sqrt() / bc2_sqrt[i] + eps) * step_size[i]
                if g["weight_decay"] != 0 and self.decoupled:
                    ui = ui + params[i] * (lr * wd)
                u.append(ui)
            # the state written once, after the new values are computed (no read of a buffer written above)
            distributed.copy_(m, new_m)
            distributed.copy_(v, new_v)
            if g["amsgrad"]:
                distributed.copy_(vmax, new_vmax)
            out.extend(u)
        return out


class _FusedAdamCall:
    """One call of torch's fused Adam kernel as a step made it: its group, parameters (`idx` into the
    group's `[a:b]`, None: all) and the state tensors it read, which later steps reuse while the state
    still holds exactly these tensors (`_run_fused_adam`)."""

    __slots__ = ("group", "idx", "a", "b", "params", "states", "flat", "steps", "m", "v", "vmax", "keys",
                 "decoupled")

    def __init__(self, group, idx, a, b, params, states, flat, steps, m, v, vmax, prefix, decoupled):
        self.group, self.idx, self.a, self.b, self.states = group, idx, a, b, states
        self.params = params
        self.flat, self.steps, self.m, self.v, self.vmax = flat, steps, m, v, vmax
        self.keys = tuple(map(operator.itemgetter, [prefix + "step", prefix + "exp_avg", prefix + "exp_avg_sq",
                                                    prefix + "max_exp_avg_sq"]))
        self.decoupled = decoupled


def _run_fused_adam(calls: list[_FusedAdamCall], ctx: Step, updates: list[torch.Tensor]) -> bool:
    """The fused kernel calls of an earlier step, on this step's gradients and group values: True; False
    (nothing done) unless every per-parameter state dict, and every tensor in it the calls read, is still
    the one they read (a load, `add_param_group` or a hand-written state makes new ones) and `amsgrad` is
    as it was. The test is identity only, at C level: nothing is read from the tensors."""
    is_, now = operator.is_, ctx.param_states()  # (the step's list: an earlier transform may have made it)
    try:
        for c in calls:
            states = c.states
            cur = now[c.a:c.b] if c.idx is None else [now[c.a + i] for i in c.idx]
            if not (bool(c.vmax) == bool(c.group["amsgrad"]) and all(map(is_, cur, states))
                    and all(map(is_, map(c.keys[0], states), c.steps)) and all(map(is_, map(c.keys[1], states), c.m))
                    and all(map(is_, map(c.keys[2], states), c.v))
                    and (not c.vmax or all(map(is_, map(c.keys[3], states), c.vmax)))):
                return False
    except KeyError:
        return False
    skip = ctx.skip
    found_inf = by = None
    if skip is not None:
        found_inf, by = skip.to(torch.float32), ~skip if ctx.proceed is None else ctx.proceed
    for c in calls:
        g = c.group
        grads = updates[c.a:c.b] if c.idx is None else [updates[c.a + i] for i in c.idx]
        c.flat.add_(kernels.const(1.0, c.flat) if by is None else by)  # (a cached 1: no scalar tensor made per call)
        beta1, beta2 = g["betas"]
        kernels.fused_adam_(
            c.params, grads, c.m, c.v, c.vmax, c.steps, decoupled=c.decoupled, lr=g["lr"], beta1=beta1,
            beta2=beta2, weight_decay=g["weight_decay"], eps=g["eps"], amsgrad=g["amsgrad"], grad_scale=None,
            found_inf=found_inf, maximize=g["maximize"],
        )
    return True


class AdamW(Adam):
    r"""AdamW: Adam with decoupled weight decay `p <- p - lr * weight_decay * p` (default
    `weight_decay=1e-2`); `torch.optim.AdamW` with the same kernel, bit for bit. The default
    kernel is torch's fused one (`torch.optim.AdamW(..., fused=True)`); `fused=False` is
    `torch.optim.AdamW(...)` (see `Adam`)."""

    positional: ClassVar[str | None] = "lr"

    weight_decay: NonNegativeFloat = 1e-2
    decoupled_weight_decay: bool = True

    @field_validator("decoupled_weight_decay")
    @classmethod
    def _always_decoupled(cls, v):
        if not v:
            raise ValueError("AdamW always decouples its weight decay: use Adam for the L2 penalty")
        return v


class ADOPT(Optimizer, Writer):
    r"""ADOPT (Taniguchi et al. 2024, arXiv 2411.02853): Adam with the gradient normalised by the *previous*
    second moment and clipped before the momentum; `pytorch_optimizer.ADOPT` with the same arithmetic.

    $$
    \begin{aligned}
    \hat g &= \operatorname{clamp}\big(g / \max(\sqrt{v}, \varepsilon),\ -c_t,\ c_t\big), \quad c_t = t^{\,\text{clip\_power}} \\
    m &\leftarrow \beta_1 m + (1-\beta_1)\,\hat g, \quad u = \text{lr}\cdot m \\
    v &\leftarrow \beta_2 v + (1-\beta_2)\,g^2
    \end{aligned}
    $$

    with $t$ the parameter's step (from 1). Its first step only sets $v = g^2$ (no move, apart
    from a decoupled weight decay). `weight_decay` adds `weight_decay * p` to $g$ (L2, the
    reference's default), or with `decoupled_weight_decay=True` multiplies $p$ by
    `1 - lr * weight_decay` (`fixed_decay=True`: `1 - weight_decay`) before the update. The clip
    is the paper's $t^{1/4}$ (`clip_power=0.25`); `clip_power=None` turns it off.

    Defaults (the reference's): `lr=1e-3`, `betas=(0.9, 0.9999)`, `eps=1e-6`, `weight_decay=0`.
    Exposes `lr`, `betas`, `eps`, `weight_decay`, `maximize` as group keys. As the last transform
    it writes the parameters as the reference does (decay, then `p += -lr * m`: bit for bit in
    float32); elsewhere it returns `lr * m` (plus the decay term). A step the device skips leaves
    the parameters, moments and step counts as they were (no host sync).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> opt = mo.Modular([p], mo.ADOPT(lr=0.1))
    >>> p.grad = torch.tensor([1.0, 2.0]); opt.step()   # v = g**2, no move
    >>> p.grad = torch.tensor([4.0, 2.0]); opt.step()   # g / sqrt(v) = (4, 1), clipped to 2**0.25
    >>> p.data
    tensor([-0.0119, -0.0100])

    ```
    """

    positional: ClassVar[str | None] = "lr"
    device_skip: ClassVar[bool] = True  # keeps its state on a step the device skips

    lr: NonNegativeFloat = 1e-3
    betas: tuple[float, float] = (0.9, 0.9999)
    eps: NonNegativeFloat = 1e-6
    weight_decay: NonNegativeFloat = 0.0
    decoupled_weight_decay: bool = False
    fixed_decay: bool = False
    clip_power: NonNegativeFloat | None = 0.25
    maximize: bool = False
    state_buffers: ClassVar[dict[str, str | Buffer]] = {
        "step": Buffer("counter", dtype="float32"),  # this parameter's steps taken
        "exp_avg": "param",
        "exp_avg_sq": Buffer("param", low=0, finite=False),  # squares: +inf after gradients of 1e20
    }
    group_keys: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay", "maximize")

    _betas = field_validator("betas")(classmethod(lambda cls, v: _check_betas(v)))

    @model_validator(mode="after")
    def _fixed_needs_decoupled(self):
        if self.fixed_decay and not self.decoupled_weight_decay:
            raise ValueError("fixed_decay=True applies to the decoupled weight decay: set decoupled_weight_decay=True")
        return self

    def apply_final(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> bool:
        """Update the moments and step counts and write the parameters as the reference does: True."""
        self._step(ctx, st, updates, write=True)
        return True

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Update the moments and step counts; the step `lr * m` (plus the decoupled decay term)."""
        return self._step(ctx, st, updates, write=False)

    def _step(self, ctx: Step, st: TransformState, updates: list[torch.Tensor], write: bool) -> list[torch.Tensor]:
        """Update the moments and step counts (kept where the device skips); with `write` move the
        parameters as the reference does, else return the updates."""
        ctx.flush_(updates)
        skip, out = ctx.skip, []
        for g, a, b in ctx.per_group():
            params = ctx.params[a:b]
            steps = st.buffers("step", lambda i, p: _step_tensor(p))[a:b]
            m = st.buffers("exp_avg", lambda i, p: torch.zeros_like(p, memory_format=torch.preserve_format))[a:b]
            v = st.buffers("exp_avg_sq", lambda i, p: torch.zeros_like(p, memory_format=torch.preserve_format))[a:b]
            beta1, beta2 = g["betas"]
            lr, wd = g["lr"], g["weight_decay"]
            grads = torch._foreach_neg(updates[a:b]) if g["maximize"] else updates[a:b]
            if wd != 0 and not self.decoupled_weight_decay:
                grads = [x.clone() for x in grads]  # (in place on copies, as the reference: its rounding in every dtype)
                torch._foreach_add_(grads, params, alpha=wd)
            if skip is not None:  # a skipped step's gradient never reaches the moments (new tensors)
                grads = [torch.where(skip, 0.0, x) for x in grads]
            first = [s == 0 for s in steps]  # per parameter, on the device: its first step sets v only
            denom = torch._foreach_sqrt(v)  # the previous second moment
            torch._foreach_clamp_min_(denom, g["eps"])
            normed = torch._foreach_div(grads, denom)
            if self.clip_power is not None:
                for x, s in zip(normed, steps):
                    c = (s.to(torch.float64) + 1).pow(self.clip_power).to(x.dtype)  # (t**p, rounded once)
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
            go = proceed_flag(ctx)
            _count_steps(steps, None if go is None else go.to(torch.float32))
            distributed.copy_(m, [ctx.keep(x, old) for x, old in zip(new_m, m)])
            distributed.copy_(v, [ctx.keep(x, old) for x, old in zip(new_v, v)])
            decay = 0.0
            if wd != 0 and self.decoupled_weight_decay:
                decay = wd if self.fixed_decay else wd * lr
            if write:  # the reference's writes: p *= 1 - decay, then p += -lr * m (not on a first step)
                decayed = [x.clone() for x in params]
                if decay:
                    torch._foreach_mul_(decayed, 1.0 - decay)
                moved = [x.clone() for x in decayed]
                torch._foreach_add_(moved, new_m, alpha=-lr)
                new_p = [torch.where(f, d, x) for f, d, x in zip(first, decayed, moved)]
                distributed.copy_(params, [ctx.keep(x, p) for x, p in zip(new_p, params)])
                continue
            u = [torch.where(f, 0.0, x) for f, x in zip(first, torch._foreach_mul(new_m, lr))]
            if decay:
                torch._foreach_add_(u, params, alpha=decay)
            out.extend(u)
        return out
