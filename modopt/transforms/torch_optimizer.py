"""`TorchOptimizer`: any `torch.optim.Optimizer` class as the last transform of a `Modular`.

The wrapped optimizer is built once per `Modular` over its param groups, keeps its state in the
`Modular`'s (under one key per parameter, `_NamespacedState`), and is stepped on the updates as
gradients, outside any compiled graph (`compile_marks.torch_optimizer_step`). On a step the device
skips it is undone on the device (`_skipping_step`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any, ClassVar

import torch
from pydantic import PrivateAttr, field_validator, model_validator

from ..core import compile_marks
from ..core.keys import value_key
from ..core.registry import class_path, given_in_code, resolve_optimizer
from ..core.step import Step, TransformState
from ..core.roles import LastWriter, Optimizer, ShapeDependent
from ..core.state import Buffer
from ..core.transform import Transform

__all__ = ["TorchOptimizer"]


class _FirstValues(dict):
    """A wrapped optimizer's new per-parameter state dict during a step the device decides: it keeps a
    copy of each tensor as the optimizer first stores it (its initial value, before the update)."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict = {}

    def __setitem__(self, k, v) -> None:
        if k not in self.first and isinstance(v, torch.Tensor):
            self.first[k] = v.clone()
        super().__setitem__(k, v)


class _NamespacedState:
    """`opt.state`-like view that keeps a wrapped torch optimizer's state under one key per parameter.

    With `recording` (a dict) a parameter without state gets a `_FirstValues` dict, noted there."""

    def __init__(self, state, key: str):
        self._state, self._key = state, key
        self.recording: dict | None = None

    def __getitem__(self, p):
        s = self._state[p].setdefault(self._key, {})
        if self.recording is not None and not s and not isinstance(s, _FirstValues):
            s = self._state[p][self._key] = self.recording[p] = _FirstValues()
        return s

    def __setitem__(self, p, value):
        self._state[p][self._key] = value

    def __contains__(self, p):
        return p in self._state and self._key in self._state[p]

    def get(self, p, default=None):
        return self[p] if p in self else default

    def keys(self):
        return [p for p, s in self._state.items() if self._key in s]

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return len(self.keys())

    def items(self):
        return [(p, self[p]) for p in self.keys()]

    def values(self):
        return [self[p] for p in self.keys()]


#: the class of each `TorchOptimizer.cls` path, as the last built instance resolved it, and its
#: constructor's defaults (what a compiled step reads: it can neither read a private attribute nor inspect)
_RESOLVED: dict[str, type] = {}
_DEFAULTS: dict[str, tuple[type, dict[str, Any]]] = {}


class TorchOptimizer(Optimizer, LastWriter, ShapeDependent):
    """Any `torch.optim.Optimizer` class as the last transform.

    `mo.TorchOptimizer(torch.optim.RMSprop, lr=1e-2)`; in a config
    `{type: TorchOptimizer, cls: torch.optim.RMSprop, kwargs: {lr: 0.01}}`.
    The class's constructor arguments become param-group keys, so schedulers
    drive it; its state lives in the `Modular`'s state (checkpointed with it).
    From a config, only `torch.optim.*` and classes registered with
    `modopt.register_optimizer()` are imported, unless `trust_imports=True`.
    A class object given in code is used by that instance only: building it
    never widens what a config may import, so the config of such an instance
    loads back only after `mo.register_optimizer(TheClass)`.
    Closure-based optimizers (LBFGS) are not supported.

    A step the device skips (`nonfinite="skip"`) leaves the parameters and the wrapped
    optimizer's state bit for bit as they were, with no host sync, for the `torch.optim`
    classes whose state is all tensors (`ASGD`, `Adadelta`, `Adafactor`, `Adagrad`, `Adam`,
    `AdamW`, `Adamax`, `NAdam`, `RAdam`, `RMSprop`, `Rprop`, `SGD`):

    * `Adam`, `AdamW`, `Adagrad` and `SGD` with `fused=True`: torch's fused kernels skip on
      the device (`found_inf`, as under `GradScaler`); no pass more.
    * otherwise a snapshot: before the wrapped step a copy of every parameter with a gradient
      and every tensor of its state (one more pass over them; new state is copied as the
      optimizer creates it, so a skipped first step leaves the initial values), and after it
      `where(skip, copy, new)` into each (a second pass). The copies live during the step.
    * `SGD` with momentum: a missing momentum buffer is created as zeros first, which torch's
      update fills exactly as its first step (`momentum * 0 + g`) unless `dampening` is set.

    The host decides (one sync per step) for every other class (its state may hold Python
    numbers, which a device decision cannot keep) and for `SGD` with momentum and dampening
    (its first buffer is `g`, which a zero buffer does not reproduce).
    """

    positional: ClassVar[str | None] = "cls"
    device_skip = True  # for the classes in _TENSOR_STATE (skips_on_device)

    cls: str
    kwargs: dict[str, Any] = {}
    state_buffers: ClassVar[dict[str, str | Buffer]] = {"inner": "torch"}
    skip_reads_groups: ClassVar[bool] = True  # torch.optim.SGD's answer reads momentum and dampening
    _cls: type = PrivateAttr()

    def __init__(self, cls: Any = None, /, **kwargs: Any) -> None:
        given = cls if cls is not None else kwargs.get("cls")
        # a class object given in code is usable by this instance (kept in ``_cls``); it is not
        # registered, so configs may not name it unless mo.register_optimizer / trust_imports allow it
        with given_in_code(given) if isinstance(given, type) else contextlib.nullcontext():
            if cls is None and "cls" in kwargs:  # TorchOptimizer(cls=..., kwargs={...})
                super(Transform, self).__init__(**kwargs)
            else:
                super(Transform, self).__init__(cls=cls, kwargs=kwargs)

    def _copy_context(self):
        return given_in_code(self._cls)

    @field_validator("cls", mode="before")
    @classmethod
    def _path(cls, v):
        if isinstance(v, type):
            if not issubclass(v, torch.optim.Optimizer):
                raise ValueError(f"cls must be a torch.optim.Optimizer subclass, got {v.__qualname__}")
            return class_path(v)
        if not isinstance(v, str):
            raise ValueError("cls must be a torch.optim.Optimizer subclass or its import path")
        resolve_optimizer(v)
        return v

    @model_validator(mode="after")
    def _resolve(self):
        self._cls = resolve_optimizer(self.cls)
        _RESOLVED[self.cls] = self._cls  # what a compiled step reads (it cannot read a private attribute)
        names = self._signature_defaults()
        bad = sorted(set(self.kwargs) - set(names))
        if bad:
            raise ValueError(f"{self.cls} does not take argument(s) {bad}; it takes {sorted(names)}")
        self._probe(self.kwargs)
        return self

    def _probe(self, kwargs: dict[str, Any]) -> None:
        """Let the class check its arguments as it would at the first step: build it over one
        probe parameter (a 1x1 matrix). A non-finite number is refused first: torch checks ranges
        for some arguments only, and `inf` passes a check written as `0.0 <= lr`."""
        for k, v in kwargs.items():
            if any(isinstance(x, float) and not math.isfinite(x) for x in (v if isinstance(v, (tuple, list)) else (v,))):
                raise ValueError(f"{k!r} = {v!r}: a hyperparameter must be finite")
        try:
            self._cls([torch.zeros(1, 1, requires_grad=True)], **kwargs)
        except (ValueError, TypeError, RuntimeError, AssertionError) as e:
            defaults = self._signature_defaults()
            given = ", ".join(f"{k!r} = {v!r}" for k, v in kwargs.items() if k not in defaults or defaults[k] != v)
            raise ValueError(f"{self.cls} refused {given or 'its default arguments'}: {e}") from None

    @property
    def torch_class(self) -> type[torch.optim.Optimizer]:
        """The wrapped class, whose `state_dict()` it continues (`modopt.core.torch_checkpoint` reads it)."""
        return self._cls

    def check_group_values(self, values: dict[str, Any]) -> None:
        """Refuse param-group values that the wrapped torch optimizer's constructor refuses."""
        if values:
            self._probe({**self.kwargs, **values})

    def _signature_defaults(self) -> dict[str, Any]:
        """The class's constructor defaults (read once per class path: a compiled step looks them up)."""
        found = _DEFAULTS.get(self.cls)
        if found is None or found[0] is not _RESOLVED.get(self.cls):
            sig = inspect.signature(self._cls.__init__)
            found = _DEFAULTS[self.cls] = (self._cls, {
                n: p.default
                for n, p in sig.parameters.items()
                if n not in ("self", "params") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and p.default is not inspect.Parameter.empty
            })
        return found[1]

    def hyperparams(self) -> dict[str, Any]:
        """The wrapped class's constructor defaults, overridden by `kwargs`."""
        return {**self._signature_defaults(), **self.kwargs}

    def shape_dependence(self) -> str | None:
        """None for the torch.optim classes whose update is elementwise; any other class (`Muon` reads each
        parameter as a matrix, `Adafactor` factors a matrix's second moment by rows and columns, a class of
        your own is not known) is refused on a flat partition."""
        if self._cls in _ELEMENTWISE:
            return None
        return (f"steps with {self._cls.__module__}.{self._cls.__qualname__}, whose update is not known to be "
                "elementwise (torch's Muon and Adafactor read a parameter's shape)")

    def skips_on_device(self, groups: list[dict[str, Any]] | None = None) -> bool:
        """True for the wrapped classes whose state is all tensors (`torch.optim.SGD`: where momentum or
        dampening is 0)."""
        cls = _RESOLVED[self.cls]
        if cls not in _TENSOR_STATE:
            return False
        if cls is torch.optim.SGD:  # a zero buffer is torch's first one only without dampening
            h = self.hyperparams()
            return all(g.get("momentum", h["momentum"]) == 0 or g.get("dampening", h["dampening"]) == 0
                       for g in (groups if groups is not None else [{}]))
        return True

    def apply(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Always raises: a wrapped torch optimizer writes the parameters itself, so it must come last."""
        raise RuntimeError("TorchOptimizer must be the last transform of a Modular")

    def apply_final(self, ctx: Step, st: TransformState, updates: list[torch.Tensor]) -> bool:
        """Step the wrapped torch optimizer on the updates; True."""
        # never traced; without torch._dynamo loaded nothing can be, and the plain function saves its import
        step = compile_marks.torch_optimizer_step if torch.compiler.is_compiling() or compile_marks.dynamo_loaded() \
            else _run_inner
        step(self, ctx, st, updates)
        return True


#: what dynamo prints when `fullgraph=True` meets a wrapped torch optimizer
TORCH_OPTIMIZER_HINT = (
    "modopt: TorchOptimizer runs the wrapped torch.optim optimizer's own step outside the graph (torch "
    "builds it and keeps its state in Python objects a graph cannot hold): plain torch.compile(opt.step) "
    "compiles the transforms before it, with one graph break at the optimizer; for fullgraph=True use "
    "modopt's own optimizer transforms (Adam, AdamW, SGD, LR)"
)


def _run_inner(self, ctx, st, updates) -> None:
    """`TorchOptimizer.apply_final`'s work: build the wrapped optimizer once, hand it the group values and
    the updates as gradients, and step it (on a step the device skips: `_skipping_step`)."""
    inner = st.runtime.get("inner")
    keys = list(self.hyperparams())
    groups = ctx.host.param_groups
    if inner is None:
        inner = _RESOLVED[self.cls]([{"params": list(g["params"]), **{k: g[k] for k in keys}} for g in groups])
        inner.state = _NamespacedState(ctx.host.state, value_key(st.key, "inner"))
        st.runtime["inner"] = inner
    for ig, g in zip(inner.param_groups, groups):
        for k in keys:
            ig[k] = g[k]
    for p, u in zip(ctx.params, updates):
        if p.grad is not u:
            p.grad = u
    if ctx.skip is None:
        inner.step()
    else:
        _skipping_step(inner, ctx.params, ctx.skip)


#: `_run_inner` wrapped in `torch.compiler.disable` (`compile_marks.torch_optimizer_step`)
compile_marks.disabled("torch_optimizer_step", _run_inner, TORCH_OPTIMIZER_HINT)


#: the torch.optim classes whose update is elementwise (no statistic of a tensor's shape): a flat partition
#: steps as the whole tensor would (`TorchOptimizer.shape_dependence`)
_ELEMENTWISE = frozenset(getattr(torch.optim, n) for n in (
    "ASGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam",
) if hasattr(torch.optim, n))


#: the torch.optim classes whose state is all tensors, made before the update and updated in place:
#: a step the device skips can be undone on the device (`TorchOptimizer.skips_on_device`)
_TENSOR_STATE = frozenset(getattr(torch.optim, n) for n in (
    "ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD",
) if hasattr(torch.optim, n))
#: ... and those whose fused kernels skip on `found_inf` (the attribute `GradScaler` sets)
_FOUND_INF = frozenset(getattr(torch.optim, n) for n in ("Adam", "AdamW", "Adagrad", "SGD"))


def _skipping_step(inner: torch.optim.Optimizer, params: list[torch.Tensor], skip: torch.Tensor) -> None:
    """`inner.step()` on a step whose skip the device decides (`skip`, a 0-d bool tensor): where it is
    true the parameters and `inner`'s state stay bit for bit as they were (see `TorchOptimizer`)."""
    ns = inner.state
    if type(inner) is torch.optim.SGD:  # zero momentum buffers first: torch's first step, skippable
        for g in inner.param_groups:
            if g["momentum"] != 0:
                for p in g["params"]:
                    if p.grad is not None and ns[p].get("momentum_buffer") is None:
                        ns[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if type(inner) in _FOUND_INF and all(g.get("fused") for g in inner.param_groups):
        inner.found_inf = skip.to(torch.float32)  # torch's fused kernels skip where it is 1
        try:
            inner.step()
        finally:
            del inner.found_inf
        return
    # a snapshot of the parameters and every state tensor, then the old values where skipped
    saved = [(None, None, p) for p in params]
    for p in params:
        s = ns._state[p].get(ns._key)
        if s:
            saved.extend((s, k, v) for k, v in s.items() if isinstance(v, torch.Tensor))
    copies = [t.clone() for _, _, t in saved]  # (torch._foreach_clone is new in 2.13; this path is not a hot one)
    ns.recording = {}
    try:
        inner.step()
    finally:
        created, ns.recording = ns.recording, None
    restore = [(t if s is None else s[k], old) for (s, k, t), old in zip(saved, copies)]
    for p, s in created.items():
        ns._state[p][ns._key] = dict(s)  # a plain dict again (it is saved)
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                if k not in s.first:  # (written around __setitem__: nothing to restore it to)
                    raise RuntimeError(f"{type(inner).__name__} created its state {k!r} in a way a step the "
                                       "device skips cannot undo")
                restore.append((v, s.first[k]))
    by_device = {skip.device: skip}
    for new, old in restore:
        # (torch keeps some counts on the CPU for CUDA parameters, e.g. Adam's `step` unless capturable:
        # restoring those reads the decision on the host, one sync a step)
        w = by_device.get(new.device)
        if w is None:
            w = by_device[new.device] = skip.to(new.device)
        torch.where(w, old, new, out=new)
