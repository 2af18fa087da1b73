"""`attach`: run transforms in front of an existing torch optimizer (a step pre-hook)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from .pipeline import apply_nonfinite_policy, collect, run_chain
from .transform import Transform, walk


class AttachHandle:
    """What `attach()` returns: holds the transforms' state; `remove()` detaches them.

    Its `state_dict()` / `load_state_dict()` checkpoint the attached
    transforms' state (the torch optimizer checkpoints its own).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, transforms: tuple[Transform, ...], nonfinite: str):
        self.optimizer = optimizer
        self.transforms = transforms
        self.nonfinite = nonfinite
        self.state: defaultdict = defaultdict(dict)
        self._store: dict[str, dict] = {}
        self._runtime: dict[str, dict] = {}
        self.stats: dict[str, torch.Tensor] = {}
        self._hook = optimizer.register_step_pre_hook(self._pre_step)

    def __repr__(self) -> str:
        """`AttachHandle(AdamW, ClipNorm(max_norm=1.0))`: the optimizer's class, the transforms, non-defaults."""
        parts = [type(self.optimizer).__name__, *(repr(t) for t in self.transforms)]
        if self.nonfinite != "skip":
            parts.append(f"nonfinite={self.nonfinite!r}")
        hook = getattr(self, "_hook", None)
        removed = hook is not None and getattr(hook, "id", None) not in getattr(self.optimizer, "_optimizer_step_pre_hooks", {})
        return f"AttachHandle({', '.join(parts)}{'; removed' if removed else ''})"

    def transform_store(self, key: str) -> dict:
        return self._store.setdefault(key, {})

    def runtime_store(self, key: str) -> dict:
        return self._runtime.setdefault(key, {})

    @torch.no_grad()
    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stats: dict[str, torch.Tensor] = {}
        ctx = collect(self, optimizer.param_groups, stats)
        if ctx.params:
            grads = [p.grad for p in ctx.params]
            if apply_nonfinite_policy(self.nonfinite, ctx, grads):
                out = run_chain(self, ctx, self.transforms, write=False)
                for p, u in zip(ctx.params, out or []):
                    if u is not p.grad:
                        p.grad = u
                stats["skipped"] = torch.zeros((), dtype=torch.bool)
            else:  # torch optimizers leave params without a grad (and their state) alone
                for p in ctx.params:
                    p.grad = None
                stats["skipped"] = torch.ones((), dtype=torch.bool)
        self.stats = stats

    def remove(self) -> None:
        """Detach: the optimizer steps as if nothing had been attached."""
        self._hook.remove()

    def __enter__(self) -> "AttachHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def state_dict(self) -> dict[str, Any]:
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        return {
            "state": {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index},
            "transforms": {k: dict(v) for k, v in self._store.items()},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        try:
            new_state = {params[i]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                         for i, s in sd["state"].items()}
            new_store = {k: dict(v) for k, v in sd["transforms"].items()}
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise ValueError(f"AttachHandle.load_state_dict: malformed state dict ({e!r})") from None
        self.state.clear()
        self.state.update(new_state)
        self._store = new_store


def attach(optimizer: torch.optim.Optimizer, *transforms: Transform, nonfinite: str = "skip") -> AttachHandle:
    """Run `transforms` on the gradients before every `optimizer.step()`.

    ```pycon
    >>> import torch, modopt as mo
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> handle = mo.attach(opt, mo.ClipNorm(1.0))
    >>> handle.remove()

    ```

    `nonfinite="skip"` (default) skips a step with an inf/NaN gradient by
    clearing the gradients, so the optimizer leaves parameters and state alone.
    Optimizer transforms cannot be attached; `step(closure)` is not supported
    (the gradients must exist before `step`).
    """
    from ..config import PipelineConfig

    PipelineConfig(transforms=list(transforms), nonfinite=nonfinite)  # validate
    for key, t in walk(transforms):
        if t.is_optimizer or not t.attachable:
            raise ValueError(f"{key}: {type(t).__name__} cannot be attached in front of a torch optimizer")
    return AttachHandle(optimizer, tuple(transforms), nonfinite)
