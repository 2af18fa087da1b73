"""The moment contract: what an optimizer transform offers to the transforms that run before it.

Some rules need the optimizer's own statistics: SPAM clips each gradient element
against the optimizer's second moment `v`, and SPAM and Stable-SPAM reset the
optimizer's moments every `DeltaT` steps (SPAM then warms the learning rate up
again). No transform reads another's state by name; the two sides declare what
they offer and need, and `mo.Modular` links them once, when it is built.

* **The optimizer offers** (a class variable of `modopt.core.roles.Optimizer`): `offers = Offer(moments={"second_moment":
  "exp_avg_sq", ...}, resets=(...), count="step", lr_scale=True)`. `moments` maps a role
  (`ROLES`) to the name of its own per-parameter buffer (the parameter's shape, zeros when
  created); `resets` are the buffers a reset zeroes; `count` is its step counter (the bias
  correction's `t`), which a reset may restart; `lr_scale` says that it multiplies its
  learning rate by the factor a transform asks for on a step (`lr_scale(ctx, st)` reads it).
* **A transform needs** (`modopt.core.roles.NeedsMoments.needs()`, by its fields): roles and the
  capabilities `"reset"`, `"restart_count"`, `"lr_scale"`. At step time it asks through
  `Moments(ctx, st)`: `get(role)`, `reset(when, restart_count)`, `scale_lr(factor)`.
* **The link** (`modopt.core.plan.link`, when the optimizer is built): a transform's provider is the first
  optimizer transform that runs after it: its later siblings, then those of the chains around
  it (a plain `Chain` is looked into). It must offer everything the transform needs; an
  optimizer inside a `Masked` branch steps only its selection and cannot be the provider.
  Either failure is a `ValueError` that names both transforms, before any state exists.

Decisions on the device: `reset(when)` takes a 0-d bool tensor (the transform's own device
step counter says when; a step the device skips passes False) and zeroes with
`masked_fill_`, so no step synchronises with the host and a skipped step changes nothing.
The price is one pass over the reset buffers on every step, also on the steps that do not
reset (docs/modules/spam.md, "Cost").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .keys import transform_key, value_key
from .step import Step, TransformState

#: the moments an optimizer may offer by role
ROLES = ("first_moment", "second_moment")
#: what else a transform may need from its optimizer
CAPABILITIES = ("reset", "restart_count", "lr_scale")


@dataclass(frozen=True)
class Offer:
    """What an optimizer transform offers to the transforms before it (its class variable `offers`)."""

    #: role (`ROLES`) -> the name of its per-parameter buffer (the parameter's shape, zeros when created)
    moments: dict[str, str] = field(default_factory=dict)
    #: the per-parameter buffers a reset zeroes (those it has not created yet are zeros already)
    resets: tuple[str, ...] = ()
    #: its per-parameter step counter (the `t` of its bias corrections), which a reset may restart
    count: str | None = None
    #: whether it multiplies its learning rate by the factor a transform asks for (`lr_scale`)
    lr_scale: bool = False

    def provides(self) -> tuple[str, ...]:
        """Every role and capability it offers."""
        caps = [("reset", bool(self.resets)), ("restart_count", self.count is not None), ("lr_scale", self.lr_scale)]
        return tuple(self.moments) + tuple(c for c, on in caps if on)


class Link(NamedTuple):
    """A transform's provider: its key and its offer."""

    key: str
    offer: Offer


# --- the step: what a transform asks of its provider -------------------------------------------------
class Moments:
    """A transform's handle on its provider for one step (`ctx`, the transform's state `st`).

    Raises `RuntimeError` when the host linked none (the transform runs outside `mo.Modular`:
    `mo.attach`, a bare `Step`)."""

    __slots__ = ("ctx", "key", "offer")

    #: the step it was made for
    ctx: Step
    #: the provider's transform key
    key: str
    #: what the provider offers
    offer: Offer

    def __init__(self, ctx: Step, st: TransformState) -> None:
        plan = ctx.host.plan
        found = plan.moment_links.get(st.key) if plan is not None else None
        if found is None:
            raise RuntimeError(
                f"{st.key}: this transform reads its optimizer's moments (modopt.core.moments), which mo.Modular "
                "links when it is built; run it in a mo.Modular with the optimizer transform after it"
            )
        self.ctx, self.key, self.offer = ctx, found.key, found.offer

    def get(self, role: str) -> list[torch.Tensor]:
        """The provider's buffer of `role` for every parameter of the step (zeros where it has none yet,
        created in its state, as it would create them)."""
        zeros = lambda i, p: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
        return TransformState(self.ctx, self.key).buffers(self.offer.moments[role], zeros)

    def reset(self, when: torch.Tensor, restart_count: bool = False) -> None:
        """Zero the provider's reset buffers (and, with `restart_count`, its step counters) of the step's
        parameters where `when` (a 0-d bool tensor) is true, in place; nothing where it is false."""
        names = list(self.offer.resets) + ([self.offer.count] if restart_count and self.offer.count else [])
        if self.ctx.host_reads:
            # read where reading is free (the step's `host_reads`): a step
            # without a reset makes no pass over the moments, one with it zeroes them (the same bits)
            if not when.item():
                return
        by_device: dict[torch.device, torch.Tensor] = {when.device: when}
        for s in self.ctx.param_states():
            for name in names:
                b = s.get(value_key(self.key, name))
                if b is None:
                    continue
                w = by_device.get(b.device)
                if w is None:  # (a step count torch's non-fused kernels keep on the CPU: a copy, one sync)
                    w = by_device[b.device] = when.to(b.device)
                b.masked_fill_(w, 0)

    def scale_lr(self, factor: torch.Tensor) -> None:
        """Ask the provider to multiply its learning rate by `factor` (a 0-d tensor) on this step."""
        self.ctx.moment_requests.setdefault(self.key, {})["lr_scale"] = factor


def lr_scale(ctx: Step, st: TransformState) -> torch.Tensor | None:
    """The factor a transform asked the optimizer `st` to multiply its learning rate by on this step, or None."""
    asked = ctx.moment_requests.get(st.key)
    return None if asked is None else asked.get("lr_scale")
