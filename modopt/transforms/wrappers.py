"""Transforms that keep their own copy of the parameters: Lookahead (around an inner chain) and
Schedule-Free (whose parameters have a train and an eval form)."""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt, field_validator

from ..core import distributed, kernels
from ..core.hostdata import on_device
from ..core.keys import group_key, value_key
from ..core.step import Step, TransformState, run
from ..core.roles import LastWriter, Planned, SeesHostSkips, WeightSwap
from ..core.state import Buffer
from ..core.transform import Transform, TransformField, variadic_transforms

__all__ = ["Lookahead", "ScheduleFreeAdamW", "ScheduleFreeSGD"]


class Lookahead(LastWriter, SeesHostSkips):
    r"""Lookahead: the inner chain steps the (fast) weights; every `k` calls they are pulled toward slow
    weights, which then take their value.

    $$
    \text{on every } k\text{-th call:}\quad
    p \leftarrow p + (1 - \alpha)\,(\phi - p), \qquad \phi \leftarrow p
    $$

    with $\phi$ the slow weights, equal to the parameters when first seen (before the first update).
    `alpha` is the weight kept by the fast weights (`alpha=1`: plain inner optimizer; the paper's
    $\alpha$ weighs the fast weights too: $\phi + \alpha(p - \phi)$, the same number). The inner
    transforms run as a pipeline of their own on this step, ending in the optimizer transform that
    writes the parameters; `Lookahead` comes last.

    Defaults `k=5`, `alpha=0.5`, as pytorch-optimizer's `Lookahead` (Zhang et al. 2019, "Lookahead
    Optimizer: k steps forward, 1 step back"), which it reproduces bit for bit (its `pullback_momentum`
    `'none'`): the interpolation is torch's `lerp` with weight `1 - alpha`, the parameters then copied
    into the slow weights. Every `opt.step()` call counts toward `k`, also one the non-finite policy
    skips (as pytorch-optimizer counts every call of its wrapped optimizer, counted on the host: no
    sync), and one counter serves every param group. A skipped `k`-th call changes nothing: the
    parameters and the slow weights keep every bit, and the count starts again. Parameters with no
    gradient on a `k`-th call are not pulled (as there). State: one slow copy per parameter (1P).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(1))
    >>> opt = mo.Modular([p], mo.Lookahead(mo.SGD(lr=1.0), k=2, alpha=0.5))
    >>> p.grad = torch.tensor([1.0]); opt.step(); p.data     # fast step
    tensor([-1.])
    >>> p.grad = torch.tensor([1.0]); opt.step(); p.data     # fast step to -2, then halfway back to 0
    tensor([-1.])

    ```
    """

    positional: ClassVar[str | None] = "transforms"  # variadic: mo.Lookahead(mo.Adam(), k=5)
    transforms: list[TransformField] = Field(min_length=1)
    k: PositiveInt = 5
    alpha: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5

    device_skip: ClassVar[bool] = True  # a skipped k-th call keeps every bit (a where); the host counts calls
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"slow": "param", "calls": "counter"}

    def __init__(self, *transforms: Any, **kwargs: Any) -> None:
        super().__init__(**variadic_transforms(type(self).__name__, transforms, kwargs))

    def __repr__(self) -> str:
        inner = ", ".join(repr(t) for t in self.transforms)
        extra = "".join(f", {k}={v!r}" for k, v in self.__repr_args__() if k != "transforms")
        return f"Lookahead({inner}{extra})"

    def children(self) -> tuple[Transform, ...]:
        """The inner transforms, in order."""
        return tuple(self.transforms)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Always raises: Lookahead writes the parameters after its inner chain, so it must come last."""
        raise RuntimeError("Lookahead must be the last transform of a Modular")

    def apply_final(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> bool:
        """The inner chain writes the parameters; on every `k`-th call they are pulled toward the slow ones."""
        slow = st.buffers("slow", lambda i, p: p.detach().clone())  # (first seen: before any update)
        run(self.transforms, ctx, updates, parent=st.key, final=True)
        if self._counts(st):
            self._pull(ctx, slow)
        return True

    def on_host_skip(self, ctx: Step, st: TransformState) -> None:
        """A call the host skipped counts toward `k`; a skipped `k`-th call pulls nothing."""
        self._counts(st)

    def check_loaded(self, values: dict[str, Any], where: str) -> None:
        """`calls` is a whole count >= 0, a Python int as `Lookahead` saves it (the `counter` declaration
        takes any finite number >= 0; a count of 2.5 would never reach `k` on a whole call, and a tensor
        would be read on the host at every step)."""
        calls = values.get("calls")
        if calls is not None and (type(calls) is not int or calls < 0):
            raise ValueError(f"{where}: 'calls' is {calls!r}; it counts the calls since the last pull, a whole "
                             "number >= 0 (a Python int, as Lookahead saves it). Nothing was loaded")

    def _counts(self, st: TransformState) -> bool:
        """Count this call on the host; True on the `k`-th (the count starts again)."""
        calls = int(st.store.get("calls", 0)) + 1
        st.store["calls"] = 0 if calls >= self.k else calls
        return calls >= self.k

    def _pull(self, ctx: Step, slow: list[torch.Tensor]) -> None:
        params, w = ctx.params, 1.0 - self.alpha
        if ctx.skip is None:  # pytorch-optimizer's two ops
            torch._foreach_lerp_(params, slow, w)
            torch._foreach_copy_(slow, params)
            return
        # the device decides: the pull computed aside, kept only where the step goes ahead (every bit kept)
        pulled = torch._foreach_lerp(params, slow, w)
        for p, s, q in zip(params, slow, pulled):
            p.copy_(torch.where(ctx.skip, p, q))
            s.copy_(torch.where(ctx.skip, s, p))


# --- Schedule-Free ------------------------------------------------------------------------------------
_F64 = torch.float64

# Bounds that keep the schedule finite (the float64 arithmetic of `_schedule`). The averaging weight is
# w_t = t**r * lr_max**weight_lr_power, and the weight sum adds one per step. A float64 count stops at
# 2**53 (k + 1 == k), so with lr <= 2**64, weight_lr_power <= 8 and r <= 8 every weight is at most
# 2**(8*64 + 8*53) = 2**936 and the sum of 2**53 of them at most 2**989, far below float64's 2**1024:
# no inf, so no inf/inf = NaN in c = w / sum. (A negative r or an lr below 1 only makes weights smaller:
# 0 at worst, and c = 0 where the sum is 0.)
LR_MAX = 2.0**64
POWER_MAX = 8.0
R_MAX = 8.0
STEPS_MAX = 2.0**53
_WEIGHT_MAX = LR_MAX**POWER_MAX * STEPS_MAX**R_MAX  # 2**936
# The eval form divides by the interpolation momentum (x = y + (1 - 1/beta)(z - y)); torch's lerp takes
# that weight as a float32 for float32 and half parameters, so 1/beta must be a finite float32: beta at
# least float32's smallest normal number, 2**-126 (then 1/beta - 1 < 2**126).
BETA_MIN = 2.0**-126


def _f64(x: Any, device: torch.device) -> torch.Tensor:
    """A host number (a group value) as a 0-d float64 tensor on `device`, exactly. Compiled, a product with
    a tensor, so that a scheduler's new value is a graph input and not a constant that recompiles."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(device=device, dtype=_F64)
    if torch.compiler.is_compiling():
        return torch.ones((), dtype=_F64, device=device) * x
    return on_device(float(x), _F64, device)


def _pow(base: torch.Tensor, exponent: float) -> torch.Tensor:
    """`base ** exponent` for a 0-d float64 tensor, as Python's `float ** float` (C's `pow`): the exponent
    goes in as a tensor, since torch computes `x ** 2.0` (and 0.5, 3, -1, ...) another way, which can
    differ in the last bit."""
    return torch.pow(base, on_device(float(exponent), _F64, base.device))


# (declared ranges: the gate holds a param group's lr, and a scheduler's, to the same one)
_Lr = Annotated[float, Field(ge=0.0, le=LR_MAX)]
_R = Annotated[float, Field(le=R_MAX, allow_inf_nan=False)]
_Power = Annotated[float, Field(ge=0.0, le=POWER_MAX, allow_inf_nan=False)]


class _ScheduleFree(Planned, LastWriter, WeightSwap, abstract=True):
    """What Schedule-Free SGD and AdamW share: the schedule, the interpolation, the train and eval forms."""

    device_skip: ClassVar[bool] = True  # a skipped step keeps every bit (a where), the schedule included

    #: the param-group key of the interpolation momentum, and where it sits in it
    _momentum_key: ClassVar[str] = "momentum"
    _momentum_index: ClassVar[int | None] = None

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Always raises: Schedule-Free writes the parameters and its own sequence, so it comes last."""
        raise RuntimeError(f"{type(self).__name__} must be the last transform of a Modular")

    def _beta(self, g: dict[str, Any]) -> float:
        v = g[self._momentum_key]
        return v if self._momentum_index is None else v[self._momentum_index]

    # --- the train and eval forms ------------------------------------------------------------------
    def weights_mode(self, host: Any, key: str) -> Literal["train", "eval"]:
        """`"train"` (the parameters hold y; a new optimizer starts there) or `"eval"` (they hold x)."""
        return "train" if host.transform_store(key).get("train_mode", 1) else "eval"

    def swap_weights(self, host: Any, key: str, to: Literal["train", "eval"]) -> None:
        """`x -> y`: `p <- p + (1 - beta) (z - p)`; `y -> x`: `p <- p + (1 - 1/beta) (z - p)` (the
        package's two lerps), for every parameter that has a z; nothing when they hold `to` already.

        The host (`Modular`) has checked every group's values through its gate; the weights of every
        group are computed (as Python floats, a host read of a tensor or NumPy momentum) before the
        first parameter is written, so nothing is written when one cannot be."""
        if self.weights_mode(host, key) == to:
            return
        zk = value_key(key, "z")
        weights = []
        for g in host.param_groups:
            beta = float(self._beta(g))
            weights.append(1 - beta if to == "train" else 1 - 1 / beta)
        for g, w in zip(host.param_groups, weights):
            for p in g["params"]:
                z = host.state.get(p, {}).get(zk)
                if z is not None:
                    p.lerp_(z.to(p.device), weight=w)
        host.transform_store(key)["train_mode"] = 1 if to == "train" else 0

    def check_loaded(self, values: dict[str, Any], where: str) -> None:
        """`train_mode` is the int 0 or 1; a group's step count `k` a whole number in [0, 2**53], its
        largest lr `lr_max` in [0, 2**64] (the bounds of `lr`) and its weight sum in [0, k * 2**936]
        (each weight is at most 2**936): the bounds that keep the schedule finite (see `LR_MAX`)."""
        mode = values.get("train_mode")
        if mode is not None and (type(mode) is not int or mode not in (0, 1)):
            raise ValueError(f"{where}: train_mode is {mode!r}; it is 1 (training form) or 0 (eval form). "
                             "Nothing was loaded")
        host = {n: float(v) for n, v in values.items()  # (a meta copy holds no values: a dry run)
                if n in ("k", "weight_sum", "lr_max") and isinstance(v, torch.Tensor) and not v.is_meta}
        k = host.get("k")
        if k is not None and not (0 <= k <= STEPS_MAX and k == math.floor(k)):
            raise ValueError(f"{where}: the step count k is {k!r}; it is a whole number in [0, 2**53]. "
                             "Nothing was loaded")
        lr_max = host.get("lr_max")
        if lr_max is not None and not 0 <= lr_max <= LR_MAX:
            raise ValueError(f"{where}: lr_max is {lr_max!r}; it is the largest lr so far, in [0, 2**64] as lr is "
                             "(larger ones overflow the averaging weight). Nothing was loaded")
        total = host.get("weight_sum")
        if total is not None and not 0 <= total <= (k if k is not None else STEPS_MAX) * _WEIGHT_MAX:
            raise ValueError(f"{where}: weight_sum is {total!r}; it sums k = {k!r} averaging weights of at most "
                             "2**936 each. Nothing was loaded")

    # --- the step ------------------------------------------------------------------------------------
    #: the per-parameter state the step makes where missing (`kernels.GroupPlan`): z starts at the parameter
    _buffers: ClassVar[dict[str, Any]] = {"z": lambda i, p: p.detach().clone(memory_format=torch.preserve_format)}

    def make_plan(self, ctx: Step, st: TransformState, updates: list[torch.Tensor], write: bool) -> Any:
        """This layout's groups and per-parameter state (`kernels.GroupPlan`), stepped by `_step`."""
        return kernels.GroupPlan(ctx, st, write, self.group_keys, self._step, self._buffers)

    def _step(self, ctx: Step, st: TransformState, plan: kernels.GroupPlan, values: list[dict[str, Any]],
              updates: list[torch.Tensor], write: bool) -> bool:
        """Step every param group: the schedule, then the parameters (y) and z, as the package does."""
        ctx.flush_(updates)
        skip = ctx.skip
        lrs, cs = [], []
        for g, (a, b, state), gid in zip(values, plan.groups, ctx.group_ids):
            params = ctx.params[a:b]
            lr, ckp1, k1 = self._schedule(ctx, st, g, gid, params[0].device)
            beta = self._beta(g)
            alpha = lr * (beta * (1.0 - ckp1) - 1.0)  # y's step, the package's arithmetic in float64
            by_dtype = {dt: (ckp1.to(dt), alpha.to(dt), (-lr).to(dt)) for dt in {p.dtype for p in params}}
            cw = [by_dtype[p.dtype][0] for p in params]
            aw = [by_dtype[p.dtype][1] for p in params]
            zw = [by_dtype[p.dtype][2] for p in params]
            grads = self._direction(ctx, g, state, k1, updates[a:b])
            if g["weight_decay"] != 0:  # weight decay at y
                torch._foreach_add_(grads, params, alpha=g["weight_decay"])
            zs = state["z"]
            if skip is None:  # in place, the package's order: y toward z, y's step, z's step
                torch._foreach_lerp_(params, zs, cw)
                torch._foreach_addcmul_(params, grads, aw)
                torch._foreach_addcmul_(zs, grads, zw)
            else:  # aside, kept only where the step goes ahead (every bit kept on a skipped step)
                new_y = torch._foreach_lerp(params, zs, cw)
                torch._foreach_addcmul_(new_y, grads, aw)
                new_z = torch._foreach_addcmul(zs, grads, zw)
                distributed.copy_(params, [torch.where(skip, p, y) for p, y in zip(params, new_y)])
                distributed.copy_(zs, [torch.where(skip, o, n) for o, n in zip(zs, new_z)])
            lrs.append(lr)
            cs.append(ckp1)
        if lrs and len({x.device for x in lrs}) == 1:
            st.record("scheduled_lr", torch.stack(lrs))
            st.record("ckp1", torch.stack(cs))
        return True

    def _schedule(self, ctx: Step, st: TransformState, g: dict[str, Any], gid: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This group's warmed-up lr, averaging weight `ckp1` and step number (from 1), as 0-d float64
        tensors, computed as the package computes its Python floats; the saved count, weight sum and
        largest lr advance (kept on a step the device skips)."""
        store = st.store

        def saved(name: str) -> torch.Tensor:
            k = group_key(name, gid)
            v = store.get(k)
            if v is None:
                v = store[k] = torch.zeros((), dtype=_F64, device=device)
            return v

        k, weight_sum, lr_max = saved("k"), saved("weight_sum"), saved("lr_max")
        k1 = k + 1.0
        lr = _f64(g["lr"], device)
        if self.warmup_steps:
            lr = lr * torch.where(k < self.warmup_steps, k1 / self.warmup_steps, 1.0)
        new_max = torch.maximum(lr_max, lr)
        weight = _pow(new_max, self.weight_lr_power)
        if self.r != 0:  # ((k+1)**0 is 1.0: the product is the other factor, every bit)
            weight = _pow(k1, self.r) * weight
        new_sum = weight_sum + weight
        ckp1 = torch.where(new_sum == 0, 0.0, weight / new_sum)  # (the package: 0 on a ZeroDivisionError)
        for name, new, old in (("k", k1, k), ("weight_sum", new_sum, weight_sum), ("lr_max", new_max, lr_max)):
            store[group_key(name, gid)] = ctx.keep(new, old)  # (new tensors: a state dict taken earlier keeps its own)
        return lr, ckp1, k1

    def _direction(self, ctx: Step, g: dict[str, Any], state: dict[str, list[torch.Tensor]], k1: torch.Tensor,
                   grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The base optimizer's direction at y, before the weight decay (may work in place on `grads`); `g` the
        group's values, `state` its state tensors by name."""
        return grads


class ScheduleFreeSGD(_ScheduleFree):
    r"""Schedule-Free SGD (Defazio et al. 2024, "The Road Less Scheduled", arXiv 2405.15682): no learning-rate
    schedule; the gradient is taken at an interpolation `y` of a plain SGD sequence `z` and its running
    average `x`, which is the point to evaluate.

    $$
    \begin{aligned}
    y_t &= (1-\beta)\, z_t + \beta\, x_t, \qquad g_t = \nabla f(y_t) + \lambda\, y_t \\
    z_{t+1} &= z_t - \gamma_t\, g_t, \qquad
    x_{t+1} = (1 - c_{t+1})\, x_t + c_{t+1}\, z_{t+1} \\
    \gamma_t &= \text{lr}\cdot\min\!\big(1, t / \text{warmup\_steps}\big), \quad
    c_{t+1} = \frac{w_t}{\sum_{i \le t} w_i}, \quad w_t = t^{\,r}\, \big(\max_{i \le t} \gamma_i\big)^{\text{weight\_lr\_power}}
    \end{aligned}
    $$

    with $t$ the step (from 1), $\beta$ `momentum` and $\lambda$ `weight_decay` (applied at $y$). The
    parameters hold $y$ while training; `opt.eval()` puts $x$ in them, `opt.train()` $y$ again
    (`with opt.evaluating(): ...` does both). State: $z$ per parameter (1P, the only copy: $x$ is
    recovered from $y$ and $z$), and per param group the step count, the weight sum and the largest
    lr (float64 tensors on the device: no host sync; a step the device skips leaves every bit).

    Defaults (the package's): `lr=1.0`, `momentum=0.9`, `weight_decay=0`, `warmup_steps=0`, `r=0`,
    `weight_lr_power=2`. Bounds that keep the schedule finite in float64 (see `LR_MAX`): `lr <= 2**64`,
    `weight_lr_power <= 8`, `r <= 8`, `momentum` in `[2**-126, 1)` (the eval form divides by it).
    Reproduces `schedulefree.SGDScheduleFree` bit for bit in float32 (on the
    CPU; the y update is the package's: $y \leftarrow y + c\,(z - y) + \gamma(\beta(1-c) - 1)\, g$),
    the schedule computed on the device in float64 as the package computes its Python floats.
    Exposes `lr`, `momentum`, `weight_decay` as group keys. Telemetry: `scheduled_lr`, `ckp1` (one
    per param group).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(1))
    >>> opt = mo.Modular([p], mo.ScheduleFreeSGD(lr=1.0, momentum=0.5))
    >>> p.grad = torch.tensor([1.0]); opt.step(); p.data   # z = -1, x = z (c = 1), y = (z + x) / 2
    tensor([-1.])
    >>> p.grad = torch.tensor([1.0]); opt.step(); p.data   # z = -2, x = -1.5 (c = 1/2), y = -1.75
    tensor([-1.7500])
    >>> with opt.evaluating(): p.data                      # x
    tensor([-1.5000])

    ```
    """

    positional: ClassVar[str | None] = "lr"
    lr: _Lr = 1.0
    momentum: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.9
    weight_decay: NonNegativeFloat = 0.0
    warmup_steps: NonNegativeInt = 0
    r: _R = 0.0
    weight_lr_power: _Power = 2.0

    state_buffers: ClassVar[dict[str, str | Buffer]] = {
        "z": "param",
        "k": Buffer("counter", dtype="float64"),  # per param group (`k@group0`): the steps taken
        "weight_sum": Buffer("counter", dtype="float64"),
        "lr_max": Buffer("counter", dtype="float64"),
        "train_mode": Buffer("counter", device="cpu"),  # 1: the parameters hold y, 0: x
    }
    group_keys: ClassVar[tuple[str, ...]] = ("lr", "momentum", "weight_decay")

    @field_validator("momentum")
    @classmethod
    def _momentum(cls, v: float) -> float:
        if v < BETA_MIN:  # (the eval form divides by it: see BETA_MIN)
            raise ValueError("momentum is the interpolation momentum, in [2**-126, 1) (opt.eval() divides by it)")
        return v


class ScheduleFreeAdamW(_ScheduleFree):
    r"""Schedule-Free AdamW (Defazio et al. 2024, arXiv 2405.15682): `ScheduleFreeSGD` whose `z` steps along
    the gradient divided by Adam's bias-corrected root mean square (no first moment: $\beta_1$ is the
    interpolation momentum), weight decay at $y$.

    $$
    \begin{aligned}
    v_t &= \beta_2\, v_{t-1} + (1-\beta_2)\, \nabla f(y_t)^2, \qquad
    g_t = \frac{\nabla f(y_t)}{\sqrt{v_t / (1 - \beta_2^{\,t})} + \epsilon} + \lambda\, y_t \\
    z_{t+1} &= z_t - \gamma_t\, g_t, \qquad x_{t+1} = (1 - c_{t+1})\, x_t + c_{t+1}\, z_{t+1}, \qquad
    y_{t+1} = (1-\beta_1)\, z_{t+1} + \beta_1\, x_{t+1}
    \end{aligned}
    $$

    with $\gamma_t$ (warm-up) and $c_{t+1}$ (the averaging weight) as in `ScheduleFreeSGD`, and $t$ the
    param group's step (the bias correction counts the group's steps, as the package does). State: $z$
    and $v$ per parameter (2P), the group's schedule (float64, on the device: no host sync; a step the
    device skips leaves every bit). `opt.eval()` / `opt.train()` / `opt.evaluating()` swap $x$ and $y$.

    Defaults (the package's): `lr=0.0025`, `betas=(0.9, 0.999)`, `eps=1e-8`, `weight_decay=0`,
    `warmup_steps=0`, `r=0`, `weight_lr_power=2`; the bounds of `ScheduleFreeSGD`, with `betas[0]` in
    `[2**-126, 1)`. Reproduces `schedulefree.AdamWScheduleFree` bit for bit in float32 (on the CPU). Exposes `lr`, `betas`, `eps`, `weight_decay` as group keys.
    Telemetry: `scheduled_lr`, `ckp1` (one per param group).

    ```pycon
    >>> import torch, modopt as mo
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> opt = mo.Modular([p], mo.ScheduleFreeAdamW(lr=0.1))
    >>> p.grad = torch.tensor([3.0, -0.5]); opt.step(); p.data   # g / |g|: z = x = -0.1 sign(g), y too
    tensor([-0.1000,  0.1000])

    ```
    """

    positional: ClassVar[str | None] = "lr"
    lr: _Lr = 0.0025
    betas: tuple[float, float] = (0.9, 0.999)
    eps: NonNegativeFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0
    warmup_steps: NonNegativeInt = 0
    r: _R = 0.0
    weight_lr_power: _Power = 2.0

    state_buffers: ClassVar[dict[str, str | Buffer]] = {
        "z": "param",
        "exp_avg_sq": Buffer("param", low=0, finite=False),  # squares: +inf after gradients of 1e20
        "k": Buffer("counter", dtype="float64"),  # per param group (`k@group0`): the steps taken
        "weight_sum": Buffer("counter", dtype="float64"),
        "lr_max": Buffer("counter", dtype="float64"),
        "train_mode": Buffer("counter", device="cpu"),  # 1: the parameters hold y, 0: x
    }
    group_keys: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay")
    _momentum_key: ClassVar[str] = "betas"
    _momentum_index: ClassVar[int | None] = 0
    _buffers: ClassVar[dict[str, Any]] = {
        **_ScheduleFree._buffers, "exp_avg_sq": lambda i, p: torch.zeros_like(p, memory_format=torch.preserve_format)}

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not BETA_MIN <= v[0] < 1.0:  # (the eval form divides by it: see BETA_MIN)
            raise ValueError(f"betas[0] is the interpolation momentum, in [2**-126, 1) (opt.eval() divides by it); "
                             f"got {v[0]}")
        if not 0.0 <= v[1] < 1.0:
            raise ValueError(f"betas[1] must be in [0, 1), got {v[1]}")
        return v

    def _direction(self, ctx: Step, g: dict[str, Any], state: dict[str, list[torch.Tensor]], k1: torch.Tensor,
                   grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """`grad / (sqrt(v / (1 - beta2**k)) + eps)`, v updated (kept where the device skips), in place on `grads`."""
        v = state["exp_avg_sq"]
        beta2 = g["betas"][1]
        bc2 = 1.0 - torch.pow(beta2, k1)  # (float ** tensor: C's pow, as Python's beta2 ** (k+1))
        if ctx.skip is None:
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
            new_v = v
        else:
            new_v = torch._foreach_mul(v, beta2)
            torch._foreach_addcmul_(new_v, grads, grads, value=1 - beta2)
        by_dtype = {dt: bc2.to(dt) for dt in {x.dtype for x in v}}
        denom = torch._foreach_div(new_v, [by_dtype[x.dtype] for x in new_v])
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, g["eps"])
        if ctx.skip is not None:
            distributed.copy_(v, [torch.where(ctx.skip, o, n) for o, n in zip(v, new_v)])
        torch._foreach_div_(grads, denom)
        return grads
