"""Optimizer transforms: they carry the learning rate and produce the step.

Their fields are the *defaults* of param-group keys: `Modular` exposes them as
`group["lr"]`, `group["betas"]`, ... so torch's LR schedulers and per-group
overrides drive them. As the last transform they write the parameters with
torch's fused (or foreach) kernels; elsewhere in a chain they return the update
`lr * direction` for the transforms after them.
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar, Literal

import torch

from pydantic import field_validator, model_validator
from ..core import compiled, kernels
from ..core.keys import value_key
from ..core.moments import Offer, lr_scale
from ..core.step import Step, TransformState
from ..core.roles import Optimizer, Planned, Scale, ScaleFact
from ..core.state import STARTED, Buffer, new_flag, same_flags, settle_flags, started_flags
from ._util import FiniteFloat, FiniteNonNegativeFloat
# (not in __all__: `TorchOptimizer` is exported from its own module; a Modular pickled before the adapter moved
# names it by this path, which keeps resolving)
from .torch_optimizer import TorchOptimizer  # noqa: F401

__all__ = ["LR", "SGD", "Adam", "AdamW", "ADOPT"]

NonNegativeFloat = FiniteNonNegativeFloat  # (finite: see `_util`)

#: (kept under its old name: `caution` and `orthogonal` import it from here)
_lr_value = kernels.lr_value

compiled.HOLDS.append(kernels.packed_steps_hold)


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


class _FusedOptimizer(Planned, abstract=True):
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

    def _start(self, ctx, st, a, b, dampening, bufs, grads):
        """The `started` flags of `params[a:b]` (None: started, or no flag needed), and whether every
        flag was created now. On the device path with dampening a missing buffer (in `bufs`) starts
        as zeros with a False flag (torch's first buffer, `g`, is then chosen on the device)."""
        flags = started_flags(st, st.step.param_states()[a:b])
        starts = ctx.skip is not None and dampening != 0
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

    def make_plan(self, ctx, st, updates, write):
        """This layout's kernel calls (`kernels.SGDPlan`)."""
        return kernels.SGDPlan(ctx, st, updates, write, fused=self.fused, foreach=self.foreach, start=self._start,
                               same=same_flags, settle=settle_flags)

    def traced_step(self, ctx, st, updates, write):
        """Traced: the formulas, each group's values read once (False with `write`: torch's fused kernels do
        not functionalize; the runner writes the updates, and the formulas compile and fuse)."""
        if write:
            return False
        out: list[torch.Tensor] = []
        for g, a, b in ctx.per_group():
            out += kernels.sgd_updates(ctx, st, a, b, updates[a:b], g["lr"], g["momentum"], g["dampening"],
                                       g["nesterov"], g["weight_decay"], g["maximize"], start=self._start,
                                       settle=settle_flags)
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

    `state_dtype="bfloat16"` (default `"param"`: the parameter's dtype, torch's) keeps `exp_avg`,
    `exp_avg_sq` and `max_exp_avg_sq` in bfloat16: half their memory for float32 parameters.
    Each step computes in the parameters' dtype (float32 for float16 parameters) from the
    stored moments, makes this step's update from the new moments unrounded, and stores them
    rounded to nearest (ties to even): $m \leftarrow \operatorname{bf16}(\beta_1 m + (1-\beta_1) g)$,
    the same for $v$. float32 parameters on CUDA run torch's fused kernel on the bfloat16
    moments as they are (its mixed-precision path); elsewhere (a CPU, whose fused kernel
    refuses the mix) the kernel runs on float32 copies and the moments are written back. Needs
    modopt's kernel choice (`fused=None` or `True`). A checkpoint's moments are cast to this
    dtype when loaded. Round to nearest drops a change below half a bfloat16 step: with
    `betas[1]=0.999` the second moment's decay is always dropped (it never decreases); use
    0.99 or below. See docs/modules/optimizers.md, "bfloat16 moments".

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(3))
    >>> opt = mo.Modular([p], mo.AdamW(1e-3, state_dtype="bfloat16"))
    >>> p.grad = torch.tensor([0.1, 0.2, 0.3]); opt.step()
    >>> opt.state[p]["0:AdamW.exp_avg"]   # 0.1 * g, rounded to bfloat16
    tensor([0.0100, 0.0200, 0.0300], dtype=torch.bfloat16)

    ```
    """

    positional: ClassVar[str | None] = "lr"
    takes_scale: ClassVar[bool] = True  # (`traced_step` multiplies a deferred scale in its op)
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
    #: the dtype of the moments: "param" (the parameter's, torch's) or "bfloat16" (see the class docstring)
    state_dtype: Literal["param", "bfloat16"] = "param"
    state_buffers: ClassVar[dict[str, str | Buffer]] = {
        "step": Buffer("counter", dtype="float32"),  # torch keeps Adam's step in float32
        # (the moments take the dtype `state_dtype` names: a load casts to it)
        "exp_avg": Buffer("param", dtype="state_dtype"),
        "exp_avg_sq": Buffer("param", dtype="state_dtype", low=0, finite=False),  # squares: +inf after 1e20
        "max_exp_avg_sq": Buffer("param", dtype="state_dtype", low=0, finite=False),
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
            kernels.check_capturable(named)

    @model_validator(mode="after")
    def _state_dtype_kernel(self):
        if self.state_dtype != "param" and self.torch_kernel():
            raise ValueError("state_dtype='bfloat16' runs on modopt's kernel choice (fused=None or True); torch's own "
                             "kernels (fused=False, or foreach given) take no bfloat16 moments for float32 parameters: "
                             "drop fused=False/foreach, or keep state_dtype='param'")
        return self

    @model_validator(mode="after")
    def _fold_needs_fused(self):
        if self.fold_clip and self.torch_kernel():
            raise ValueError("fold_clip=True needs torch's fused kernel (its grad_scale), but fused=False or foreach "
                             "was given: drop one of them")
        return self

    _betas = field_validator("betas")(classmethod(lambda cls, v: _check_betas(v)))

    def make_plan(self, ctx, st, updates, write):
        """This layout's kernel calls (`kernels.AdamPlan`)."""
        return kernels.AdamPlan(ctx, st, write, decoupled=self.decoupled, fused=self.fused, foreach=self.foreach,
                                capturable=self.capturable,
                                state_dtype=None if self.state_dtype == "param" else torch.bfloat16)

    def traced_step(self, ctx, st, updates, write):
        """The step under `torch.compile`. With `write` (traced by `modopt.compile_step`): torch's fused kernel
        as one op of the graph (`compiled.fused_adam_op`) with the arguments the eager plan gives it, so the
        same bits: the counts advanced by `~skip`, the skip as `found_inf`, the learning rate a 0-d tensor
        (float64 on the CPU, whose kernel reads it as a double, as the float; the kernel's math type on
        CUDA); a pending global or per-tensor scale the plan defers to it (`Plan.deferred`) the op multiplies
        in place first. False (the formulas run instead) wherever the eager plan would not call the fused
        kernel plainly: a non-fused sub-group, a kernel of torch's own, a pending folded scale or a
        learning-rate factor asked by a transform before.

        Without `write`: the formulas with every group value (lr, betas, eps, weight_decay) a 0-d tensor of
        the graph, so a scheduler that changes any of them (OneCycleLR cycles beta1) reruns the graph instead
        of recompiling it. Equal to the eager formulas up to rounding (inductor fuses and reorders them)."""
        skip, scaled, grad_mul, op = ctx.skip, lr_scale(ctx, st), None, compiled.FUSED_ADAM
        found_inf = by = None
        wide = None if self.state_dtype == "param" else torch.bfloat16
        if write:
            # (torch's fused kernels do not functionalize: only `compile_step` keeps one, as an op of the graph;
            # bfloat16 moments: the formulas, on copies in the parameters' dtype)
            if not compiled.keeps_fused() or self.torch_kernel() or ctx.moment_requests or op is None or wide:
                return False
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
            if not all(len(s) == 1 and s[0][1] for s in (kernels.split(ctx, a, b, self.kernel, self.fused is True)
                                                          for _, a, b in ctx.per_group())):
                return False
            ctx.pending = None
            if grad_mul is not None and skip is not None:  # a skipped step leaves the gradients as they came
                grad_mul = torch.where(skip, 1.0, grad_mul)
            found_inf = None if skip is None else skip.to(torch.float32)
            by = None if skip is None else (ctx.proceed if ctx.proceed is not None else ~skip).to(torch.float32)
        out: list[torch.Tensor] = []
        for g, a, b in ctx.per_group():
            lr, (beta1, beta2), eps, wd, amsgrad, maximize = (g["lr"], g["betas"], g["eps"], g["weight_decay"],
                                                              g["amsgrad"], g["maximize"])  # (read once)
            steps, m, v, vmax = kernels.adam_state(st, a, b, amsgrad, state_dtype=wide)
            params, grads = ctx.params[a:b], updates[a:b]
            if write:
                packed = st.runtime.get(("packed_steps", a, b, None))
                if packed is not None and len(packed[1]) == len(steps) and all(map(operator.is_, packed[1], steps)):
                    # (the op advances the packed counts: one graph input, no views; `packed_steps_hold` sees to it
                    # that a call whose state no longer holds them runs eagerly, which packs them again)
                    packed, steps = packed[0], []
                else:
                    packed = None
                    kernels.count_steps(steps, by)
                # (the CPU kernel reads a tensor lr as a double, the same bits as the float; the CUDA kernel reads
                # it in float32 but for float64 parameters, as the eager step's scaled lr, and refuses another
                # dtype: there a float lr becomes a float32 tensor, rounded where the eager step's is not)
                wide = params[0].device.type == "cpu" or params[0].dtype == torch.float64
                lr_dtype = torch.float64 if wide else torch.float32
                lr = (lr.to(device=params[0].device, dtype=lr_dtype) if isinstance(lr, torch.Tensor)
                      else torch.ones((), dtype=lr_dtype, device=params[0].device) * lr)
                op(params, list(grads), m, v, vmax, steps, packed, by, lr, float(beta1), float(beta2), float(wd),
                   float(eps), bool(amsgrad), bool(maximize), self.decoupled, found_inf,
                   grad_mul if grad_mul is None or grad_mul.dim() == 0 else grad_mul[a:b])
                continue
            if wide is not None:  # (on `wide` copies, the new moments stored rounded, as the eager step does)
                ps, gs, mw, vw, vmaxw = kernels.wide(params, grads, m, v, vmax)
                u = kernels.adam_traced_updates(ctx, ps, gs, steps, mw, vw, vmaxw, lr, beta1, beta2, eps, wd, amsgrad,
                                                maximize, decoupled=self.decoupled, scaled=scaled)
                kernels.narrow_(params, (m, v, vmax), params, (mw, vw, vmaxw))
                out += [x.to(p.dtype) for x, p in zip(u, params)]
                continue
            out += kernels.adam_traced_updates(ctx, params, grads, steps, m, v, vmax, lr, beta1, beta2, eps, wd,
                                               amsgrad, maximize, decoupled=self.decoupled, scaled=scaled)
        return True if write else out


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


class ADOPT(Planned):
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

    def make_plan(self, ctx: Step, st: TransformState, updates: list[torch.Tensor], write: bool) -> Any:
        """This layout's groups and state (`kernels.GroupPlan`), stepped by `_step`."""
        return kernels.GroupPlan(ctx, st, write, self.group_keys, self._step, kernels.ADAM_BUFFERS)

    def _step(self, ctx: Step, st: TransformState, plan: kernels.GroupPlan, values: list[dict[str, Any]],
              updates: list[torch.Tensor], write: bool) -> list[torch.Tensor] | bool:
        """Update the moments and step counts (kept where the device skips); with `write` move the
        parameters as the reference does (True), else return the updates."""
        ctx.flush_(updates)
        out: list[torch.Tensor] = []
        for v, (a, b, state) in zip(values, plan.groups):
            (beta1, beta2) = v["betas"]
            out += kernels.adopt_step(ctx, ctx.params[a:b], updates[a:b], state["step"], state["exp_avg"],
                                      state["exp_avg_sq"], v["lr"], beta1, beta2, v["eps"], v["weight_decay"],
                                      v["maximize"], decoupled=self.decoupled_weight_decay, fixed=self.fixed_decay,
                                      clip_power=self.clip_power, write=write)
        return True if write else out
