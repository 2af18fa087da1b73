"""The roles a transform may play beyond the base contract, each a type it takes by inheriting it.

`Transform` holds what every transform has: its fields, `positional`, `state_buffers`,
`update_access`, `device_skip`, `apply`, `children`, `check_params` and `check_loaded`. A rarer part is
a role below; the plan (`modopt.core.plan`) finds them with `isinstance`, never by looking for a method:

| role | what the transform is | its hooks |
|---|---|---|
| `Optimizer` | produces the step: reads the lr and the other group keys a scheduler drives | `group_keys`, `offers`, `skip_reads_groups`, `hyperparams`, `check_group_values`, `skips_on_device` |
| `Writer` | as the last transform, writes the parameters itself (a fused kernel) | `apply_final`, `takes_scale`, `folds_clip` |
| `Planned` | an `Optimizer` and `Writer` that steps through one kernel plan per layout (`modopt.core.kernels`) | `make_plan`, `traced_step` |
| `LastWriter` | a `Writer` that must end the pipeline (it steps every parameter) | — |
| `Router` | a `Writer` whose branches write their own selections (`Masked`) | `routes`, `write_branch` |
| `SelectsByName` | selects parameters by name (checked when the optimizer is built) | `name_selection` |
| `WeightStage` | acts on the weights after the optimizer wrote them | `prepare_weights`, `apply_weights` |
| `WeightSwap` | its parameters have a train and an eval form (Schedule-Free) | `weights_mode`, `swap_weights` |
| `StepStopper` | its `apply` may return None (stop the step) | — |
| `SkipDecider` | a `StepStopper` that skips the whole step, first in the pipeline | — |
| `SeesHostSkips` | keeps state that counts every `opt.step()`, skipped or not | `on_host_skip` |
| `ScaleFact` | its last touch of the updates is one multiply per segment | `scale_fact` |
| `NeedsMoments` | reads its optimizer's moments (`modopt.core.moments`) | `needs` |
| `PostOptimizer` | acts on the optimizer's step, after it (decoupled weight decay) | — |
| `Segmented` | saves per-segment values of a shape it states | `segment_shape` |
| `StageLimited` | cannot take its statistics over pipeline stages in some settings | `check_stages` |
| `ShapeDependent` | its result depends on each tensor's shape (refused for flat partitions) | `shape_dependence` |

A role that keeps order or state a skipped step could change (`LastWriter`, `WeightStage`,
`WeightSwap`, `StepStopper`, `SeesHostSkips`) declares `device_skip = False`; a transform that does keep
its state bit-identical on a step the device skips declares `device_skip = True` itself.
`attachable(t)` (may it run in front of another optimizer, `mo.attach`) follows from the roles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, ValidationError

from .moments import Offer
from .step import Step, TransformState, run
from .transform import ROLE_HOOKS, Transform, TransformField, to_plain, variadic_transforms
from .values import host_number

Segments = tuple[str, Any, bool]  # (scope, dim, inverse_dims)


@dataclass(frozen=True)
class Scale:
    """What a `ScaleFact` transform states of its last touch of the updates: one multiply of each segment
    of `(scope, dim, inverse_dims)` by a factor, with nothing read from the updates after it.

    `positive`: the factor is > 0 for finite gradients and the transform does nothing else (a clip by norm,
    `LR`): it may be left out before a normalization that cancels it, or folded into a fused kernel.
    `sets_norm`: the multiply sets each segment to one norm whatever positive factor multiplied it
    before (`Normalize` with `eps=0`)."""

    scope: str
    dim: Any = None
    inverse_dims: bool = False
    positive: bool = False
    sets_norm: bool = False

    @property
    def segments(self) -> Segments:
        """`(scope, dim, inverse_dims)`."""
        return (self.scope, self.dim, self.inverse_dims)


class Optimizer(Transform, abstract=True):
    """Produces the step: it reads the learning rate, and exposes the param-group keys a scheduler drives."""

    #: fields exposed as param-group keys (so torch schedulers can drive them)
    group_keys: ClassVar[tuple[str, ...]] = ()
    #: what it offers the transforms before it (`modopt.core.moments`), or None
    offers: ClassVar[Offer | None] = None
    #: True when `skips_on_device` reads param-group values (a scheduler may change them): the plan then
    #: asks every step instead of once
    skip_reads_groups: ClassVar[bool] = False

    def hyperparams(self) -> dict[str, Any]:
        """Default param-group values this transform exposes."""
        return {k: getattr(self, k) for k in self.group_keys}

    def check_group_values(self, values: dict[str, Any]) -> None:
        """Refuse param-group values (of keys in `hyperparams()`) that this transform's own fields would
        refuse: `ValueError` naming each key, its value and the rule (`modopt.core.hyper`).

        A one-element tensor (of any shape, as torch.optim takes) or a NumPy scalar is checked by its value
        (`host_number`: a host read, only at the doors, never in a step on a device). A value the field
        would only accept by converting it (the string `"0.1"` for a float) is refused too: the kernels
        receive the group's value as it is.
        """
        if not values:
            return
        plain = {k: host_number(v, k) for k, v in values.items()}
        try:
            new = self.model_copy(update=plain)
        except ValidationError as e:
            parts = []
            for err in e.errors(include_url=False):
                k = err["loc"][0] if err["loc"] else None
                msg = err["msg"].removeprefix("Value error, ")
                parts.append(f"{k!r} = {values[k]!r}: {msg}" if k in values else msg)
            raise ValueError("; ".join(parts)) from None
        for k, v in plain.items():
            if isinstance(v, str) and to_plain(getattr(new, k)) != v:
                raise ValueError(f"{k!r} = {v!r}: a string where a number is needed")

    def skips_on_device(self, groups: list[dict[str, Any]] | None = None) -> bool:
        """Whether `nonfinite="skip"` may decide on the device with this optimizer (`groups`: the param
        groups as they are now, for an answer that reads them). Default: `device_skip`, and its children's."""
        return self.device_skip and all(skips_on_device(c, groups) for c in self.children())


class Writer(Transform, abstract=True):
    """As the last transform of a chain, writes the parameters itself (a fused kernel, a branch's optimizer)."""

    #: True when `apply_final`, traced by `modopt.compile_step`, multiplies the updates by a scale the step
    #: left pending (`Step.pending`) itself, or applies it (`Step.flush_`) before anything else reads them
    #: (`Adam`, `AdamW`; `modopt.core.plan.deferrable_scale`)
    takes_scale: ClassVar[bool] = False

    def apply_final(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> bool:
        """Write the parameters; return False when not supported here (the runner then writes `apply`'s
        updates itself)."""
        return False

    @property
    def folds_clip(self) -> bool:
        """True when it takes the global scale before it into its fused kernel (`Adam(fold_clip=True)`;
        `modopt.core.plan.folded_scale`)."""
        return False


class Planned(Optimizer, Writer, abstract=True):
    """An optimizer that steps through one kernel plan per layout (`modopt.core.kernels`): `make_plan` builds it
    at the layout's first step, and that step and every later one run it; the plan reads each group's values
    once per step. Two step paths: eager (the plan) and traced (`traced_step`, under `torch.compile`)."""

    def make_plan(self, ctx: Step, st: TransformState, updates: list[torch.Tensor], write: bool) -> Any:
        """This layout's plan: an object whose `run(ctx, st, updates)` steps and returns True (the parameters
        are written), the updates (not `write`), False (nothing done: the runner writes `apply`'s updates
        instead) or None (nothing done: the state no longer holds the plan's tensors, a plan is built again)."""
        raise NotImplementedError(f"{type(self).__name__}.make_plan")

    def traced_step(self, ctx: Step, st: TransformState, updates: list[torch.Tensor], write: bool) -> Any:
        """The step under `torch.compile` (what `run` returns). Default: a plan built for the trace, run once."""
        return self.make_plan(ctx, st, updates, write).run(ctx, st, updates)

    def apply_final(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> bool:
        """Write the parameters with this layout's plan: True; False where the runner writes `apply`'s update
        instead."""
        if torch.compiler.is_compiling():
            return self.traced_step(ctx, st, updates, True)
        plan = ctx.layout.cache.get(("kernel_plan", st.key, True))
        done = None if plan is None else plan.run(ctx, st, updates)
        # (None: the layout's first step, or a state that no longer holds the plan's tensors)
        return self._new_plan(ctx, st, updates, True) if done is None else done

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The step as updates, with this layout's plan."""
        if torch.compiler.is_compiling():
            return self.traced_step(ctx, st, updates, False)
        plan = ctx.layout.cache.get(("kernel_plan", st.key, False))
        done = None if plan is None else plan.run(ctx, st, updates)
        return self._new_plan(ctx, st, updates, False) if done is None else done

    def _new_plan(self, ctx: Step, st: TransformState, updates: list[torch.Tensor], write: bool) -> Any:
        """Build this layout's plan, keep it for the steps after, and run it on this one."""
        plan = ctx.layout.cache[("kernel_plan", st.key, write)] = self.make_plan(ctx, st, updates, write)
        done = plan.run(ctx, st, updates)
        if done is None:  # (a new plan that asks for a new plan would stop the step unseen: `apply`'s None)
            raise RuntimeError(f"{type(self).__name__}: the plan make_plan just built returned None from run(), "
                               "which asks for a new plan; a new plan steps (True, the updates, or False)")
        return done


class LastWriter(Writer, abstract=True):
    """A writer that steps every parameter of the optimizer itself, so it ends the pipeline
    (`TorchOptimizer`, `Lookahead`, Schedule-Free)."""

    device_skip = False


class Router(Writer, abstract=True):
    """A writer whose branch may end in its own optimizer, which writes the parameters it selects
    (`Masked`; `modopt.core.step.run`)."""

    def routes(self) -> bool:
        """Whether the branch ends in an optimizer transform that writes its own selection."""
        return False

    def write_branch(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[int] | None:
        """Run the branch with its optimizer writing the selected parameters; the indices written, or None
        when an inner transform stopped the step."""
        raise NotImplementedError(f"{type(self).__name__}.write_branch")


class SelectsByName(Transform, abstract=True):
    """Selects parameters by name: its selection is checked against the optimizer's names when built."""

    def name_selection(self, key: str) -> Any:
        """`(select, owner)`: the `modopt.Select` and the label its errors use, or None for no selection."""
        return None


class WeightStage(Transform, abstract=True):
    """Acts on the weights after the optimizer wrote them; weight stages end the pipeline, at its top level."""

    device_skip = False

    def prepare_weights(self, ctx: Step, st: TransformState) -> None:
        """Before the step's update transforms run: read what it needs of the weights as they are."""

    def apply_weights(self, ctx: Step, st: TransformState) -> None:
        """After the optimizer wrote `ctx.params`: write them in place. On a step the device skips
        (`ctx.skip`), every bit of the parameters and of the state must stay."""
        raise NotImplementedError(f"{type(self).__name__}.apply_weights")


class WeightSwap(Transform, abstract=True):
    """Its parameters have a train and an eval form: `Modular.train()` / `eval()` / `evaluating()` swap them
    (a step refuses to run in eval mode). It sits at the top level, with no weight stage after it."""

    device_skip = False

    def weights_mode(self, host: Any, key: str) -> Literal["train", "eval"]:
        """Which form the parameters hold now (`host`: the optimizer, `key`: this transform's state key)."""
        raise NotImplementedError(f"{type(self).__name__}.weights_mode")

    def swap_weights(self, host: Any, key: str, to: Literal["train", "eval"]) -> None:
        """Put the parameters in the form `to` (nothing when they hold it), outside a step."""
        raise NotImplementedError(f"{type(self).__name__}.swap_weights")


class StepStopper(Transform, abstract=True):
    """Its `apply` may return None: the step stops, nothing after it runs and the parameters do not move.
    Routed branches after the first may not stop the step (their parameters could not be taken back)."""

    device_skip = False


class SkipDecider(StepStopper, abstract=True):
    """Skips the whole step (`SkipStep`): first in the pipeline, before any state; it adds to the non-finite
    decision, so a CPU step does not read the device's decision back on the host."""


class SeesHostSkips(Transform, abstract=True):
    """Keeps state that must see every `opt.step()` call, skipped or not (`Accumulate`'s cycle)."""

    device_skip = False

    def on_host_skip(self, ctx: Step, st: TransformState) -> None:
        """The host skipped this step (the chain did not run). Change nothing here that a step the device
        skips (`ctx.skip`) would not change too."""


class ScaleFact(Transform, abstract=True):
    """States that its last touch of the updates is one multiply per segment (`Scale`), which the plan uses
    to leave a cancelled scale out, fold one into a fused kernel and tell the user (`modopt.lint`)."""

    def scale_fact(self) -> Scale | None:
        """The `Scale` of its last touch, or None (for these field values it states nothing)."""
        return None


class NeedsMoments(Transform, abstract=True):
    """Reads its optimizer's moments or asks it for a reset or an lr factor (`modopt.core.moments`): linked
    once, when the optimizer is built, to the first optimizer transform after it."""

    def needs(self) -> tuple[str, ...]:
        """The roles and capabilities it needs (`modopt.core.moments.ROLES`, `CAPABILITIES`)."""
        return ()


class PostOptimizer(Transform, abstract=True):
    """Acts on the optimizer's step, after it (`WeightDecay`): in front of another optimizer it would mean
    something else, so it is not attachable."""


class Segmented(Transform, abstract=True):
    """Saves per-segment values whose shape it states (checked when a checkpoint is loaded)."""

    def segment_shape(self, p: torch.Tensor) -> tuple[int, ...] | None:
        """The shape of its per-segment values saved for `p` (None: kept transform-wide)."""
        return None


class StageLimited(Transform, abstract=True):
    """Cannot take its statistics over pipeline stages (`Modular(..., stage_group=)`) in some settings."""

    def check_stages(self) -> None:
        """Raise `ValueError` (why, and what to use instead) when these fields cannot span the stages."""


class ShapeDependent(Transform, abstract=True):
    """Its result depends on each parameter's shape (a matrix reading, a per-tensor or per-slice statistic, a
    selection by number of dims): a flat partition (DeepSpeed ZeRO's 1-D shards, FSDP1's `FlatParameter`) would
    make it silently wrong, so `modopt.core.partitions` refuses one when the optimizer is built."""

    def shape_dependence(self) -> str | None:
        """Why these fields make the result depend on a tensor's shape (a clause: "reads each parameter as a
        matrix"), or None when they do not (`scope="global"`: elementwise over every tensor)."""
        return None


ROLES: tuple[type[Transform], ...] = (Optimizer, Writer, Planned, LastWriter, Router, SelectsByName, WeightStage,
                                     WeightSwap, StepStopper, SkipDecider, SeesHostSkips, ScaleFact, NeedsMoments,
                                     PostOptimizer, Segmented, StageLimited, ShapeDependent)
for _role in ROLES:  # (so that a class defining a role's hook without the role is named when it is defined)
    for _name in _role.__dict__:
        if not _name.startswith("_") and _name not in Transform.__dict__ and _name not in ("model_config",
                                                                                          "model_fields"):
            ROLE_HOOKS.setdefault(_name, _role.__name__)

#: roles whose transforms cannot run in front of another optimizer (`mo.attach`)
NOT_ATTACHABLE: tuple[type, ...] = (Optimizer, LastWriter, WeightStage, StepStopper, SeesHostSkips, NeedsMoments,
                                    PostOptimizer)


def attachable(t: Transform) -> bool:
    """Whether `t` (and every transform inside it) may run in front of another optimizer (`mo.attach`)."""
    return not isinstance(t, NOT_ATTACHABLE) and all(attachable(c) for c in t.children())


def skips_on_device(t: Transform, groups: list[dict[str, Any]] | None = None) -> bool:
    """Whether `nonfinite="skip"` may decide on the device with `t` in the pipeline (`groups`: the param
    groups as they are now, for an optimizer whose answer reads them; None asks about the fields alone).

    On such a step the chain runs with `ctx.skip` set (a 0-d bool tensor, true to skip): per-segment values
    saved with `st.seg_set` keep their old values by themselves, the parameters are written only where it
    is false; a transform with other state must keep it too. A pipeline with a transform that does not
    declare `device_skip` decides on the host instead (one sync per step)."""
    if isinstance(t, Optimizer):
        return t.skips_on_device(groups)
    return t.device_skip and all(skips_on_device(c, groups) for c in t.children())


def may_stop(t: Transform) -> bool:
    """Whether `t`, or a transform inside it, may stop the step."""
    return isinstance(t, StepStopper) or any(may_stop(c) for c in t.children())


def holds_optimizer(t: Transform) -> bool:
    """Whether `t` is, or holds, an optimizer transform."""
    return isinstance(t, Optimizer) or any(holds_optimizer(c) for c in t.children())


class Chain(Writer):
    """Run transforms in order; a chain is itself a transform and may be nested.

    `mo.Chain(mo.ClipNorm(1.0), mo.Normalize())`
    """

    transforms: list[TransformField] = Field(default_factory=list)
    positional: ClassVar[str | None] = "transforms"  # variadic: mo.Chain(a, b, c)
    device_skip = True  # when every transform inside does (skips_on_device checks the children)

    def __init__(self, *transforms: Any, **kwargs: Any) -> None:
        super().__init__(**variadic_transforms(type(self).__name__, transforms, kwargs))

    def __repr__(self) -> str:
        inner = [repr(t) for t in self.transforms]
        return f"Chain({', '.join(inner)})"

    def children(self) -> tuple[Transform, ...]:
        """The chained transforms, in order."""
        return tuple(self.transforms)

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Run the chained transforms in order (None when one of them stopped the step)."""
        return run(self.transforms, ctx, updates, parent=st.key)  # type: ignore[return-value]

    def apply_final(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> bool:
        """Run the chained transforms, the last one writing the parameters (False for an empty chain)."""
        if not self.transforms:
            return False
        run(self.transforms, ctx, updates, parent=st.key, final=True)
        return True


__all__ = ["ROLES", "Chain", "LastWriter", "NeedsMoments", "Optimizer", "PostOptimizer", "Router", "Scale", "ScaleFact",
           "SeesHostSkips", "Segmented", "SelectsByName", "ShapeDependent", "SkipDecider", "StageLimited", "StepStopper",
           "WeightStage", "WeightSwap", "Writer", "attachable", "holds_optimizer", "may_stop", "skips_on_device"]
