"""`Rewind`: go back to a recent snapshot when training blows up, and continue past it.

PaLM's recipe for loss spikes (Chowdhery et al. 2022, arXiv:2204.02311,
section 5.1): restart from a checkpoint taken shortly before the spike and
skip the batches that were fed around it. `Rewind` does that inside one
process, opt in:

* every `every` steps it keeps a snapshot of the parameters (and the model's
  buffers), the whole optimizer state and the objects of `also` (a learning-rate
  scheduler, a `GradScaler`), in buffers allocated once and filled with `copy_`,
  on the accelerator (`where="device"`) or in CPU memory (`where="cpu"`,
  pinned when the parameters are on CUDA);
* each step it tests the loss (and, if given, the gradient norm) on the
  device, with no host sync: a non-finite loss, or a value above
  `mean + z * max(std, rel_std_floor * |mean|)` of the last `window` accepted
  values (once `min_count` are in);
* the host reads one number at each check point (every `every` steps, when a
  snapshot is due): if a step since the last snapshot triggered, the snapshot
  is restored bit for bit and training continues from it with the batches that
  come next (the batches of the rewound window are skipped, not replayed);
  otherwise the snapshot is refreshed.

```pycon
>>> import torch, modopt as mo
>>> model = torch.nn.Linear(3, 1)
>>> opt = mo.Modular(model.parameters(), mo.Adam(lr=0.1))
>>> guard = mo.Rewind(opt, model=model, every=2)
>>> for loss in [1.0, 0.9, float("nan"), 0.8]:
...     opt.zero_grad()
...     model(torch.ones(1, 3)).sum().backward()
...     opt.step()
...     event = guard.step(torch.tensor(loss))
>>> guard.steps_done, guard.batches_seen, guard.rewinds[0].trigger
(2, 4, 'non-finite loss')

```
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Iterable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .core import distributed
from .core.checkpoint import TORCH_SQUARES
from .core.modular import Modular
from .core.step import check_loss

__all__ = ["Rewind", "RewindConfig", "RewindError", "RewindEvent"]

#: trigger kinds, as the packed check code stores them (code = step * 4 + kind)
TRIGGERS = {1: "non-finite loss", 2: "loss spike", 3: "grad-norm spike"}
#: the version of `Rewind.state_dict()`
FORMAT_VERSION = 1
#: how a snapshot marks a tensor in `state_dict()` (its buffer and the device it came from)
_TENSOR = "__rewind_tensor__"
#: the layout of a DTensor whose local shard a snapshot entry holds (in memory only; `state_dict()` gives the DTensor)
_SHARDED = "__rewind_dtensor__"
#: state keys of torch.optim optimizers whose values are never negative (counts, second moments, sums of squares)
_NONNEGATIVE_TORCH_STATE = frozenset({"step", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum", "exp_inf"})


class RewindConfig(BaseModel):
    """The guard's settings (`modopt run` reads them from `train.rewind`).

    Defaults: a snapshot every 100 steps in CPU memory; a rewind on a
    non-finite loss or on a loss more than 6 standard deviations above the mean
    of the last 50 accepted losses (after 20 of them, the deviation at least
    1% of the mean); no gradient-norm rule; no learning-rate cut; 3 rewinds to
    the same snapshot before giving up.
    """

    model_config: ClassVar[ConfigDict] = ConfigDict(extra="forbid", frozen=True)

    every: int = Field(100, ge=1, description="steps between snapshots (and between the host's reads of the trigger)")
    where: Literal["cpu", "device"] = Field(
        "cpu", description="where snapshots live: 'cpu' (pinned when the parameters are on CUDA) or 'device' (next to them)")
    loss_z: float | None = Field(6.0, gt=0, description="the loss spike rule's z (None: only a non-finite loss triggers)")
    grad_norm_z: float | None = Field(None, gt=0, description="the same rule on the gradient norm passed to step() (None: off)")
    window: int = Field(50, ge=2, le=1_000_000, description="how many past accepted values the spike rule's mean and std are taken over")
    min_count: int = Field(20, ge=2, description="the spike rule is active once this many values are in the window")
    rel_std_floor: float = Field(0.01, ge=0, description="the std used is at least this fraction of |mean|")
    lr_factor: float = Field(1.0, gt=0, le=1, description="after a rewind, the learning rate is multiplied by this ...")
    lr_steps: int = Field(0, ge=0, description="... for this many steps (0: not lowered)")
    max_tries: int = Field(3, ge=1, description="rewinds to the same snapshot before giving up with RewindError")

    @model_validator(mode="after")
    def _min_count_fits(self) -> "RewindConfig":
        if self.min_count > self.window:
            raise ValueError(f"min_count ({self.min_count}) must be <= window ({self.window})")
        return self


@dataclass(frozen=True)
class RewindEvent:
    """One rewind: the first step that triggered since the last snapshot, and what was done.

    `step`/`batch`: the optimizer step and the batch number (1-based, counting
    every batch fed) whose loss triggered; `checked_at`: the step of the check
    that found it; `restored_to`: the step of the snapshot restored;
    `skipped`: the first and last batch numbers of the rewound window, which
    are not fed again; `attempt`: the how-manyth rewind to this snapshot.
    """

    step: int
    batch: int
    trigger: str
    checked_at: int
    restored_to: int
    skipped: tuple[int, int]
    attempt: int

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON): `skipped` as a list."""
        d = asdict(self)
        d["skipped"] = list(self.skipped)
        return d


class RewindError(RuntimeError):
    """The guard gave up: the same snapshot was restored `max_tries` times and training triggered again."""


class _Window:
    """The last `size` accepted values of one series, on the device, and the spike test against them."""

    def __init__(self, size: int, device: torch.device, dtype: torch.dtype):
        self.buf = torch.zeros(size, device=device, dtype=dtype)
        self.count = torch.zeros((), device=device, dtype=torch.int64)  # values ever accepted
        self._index = torch.arange(size, device=device)

    def limit(self, z: float, min_count: int, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`(active, mean + z * max(std, floor * |mean|))` over the values held; std with ddof 1."""
        n = self.count.clamp(max=self.buf.numel())
        held = self._index < n
        nd = n.to(self.buf.dtype)
        mean = torch.where(held, self.buf, 0).sum() / nd.clamp(min=1)
        var = torch.where(held, (self.buf - mean) ** 2, 0).sum() / (nd - 1).clamp(min=1)
        std = torch.maximum(var.sqrt(), floor * mean.abs())
        return n >= min_count, mean + z * std

    def accept(self, x: torch.Tensor, ok: torch.Tensor) -> None:
        """Append `x` where `ok` (a 0-d bool), as a ring buffer; nothing changes otherwise."""
        pos = (self.count % self.buf.numel()).view(1)
        self.buf.index_copy_(0, pos, torch.where(ok, x, self.buf.index_select(0, pos).view(())).view(1))
        self.count.add_(ok.to(torch.int64))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"buf": self.buf, "count": self.count}


def _plain_tensor_entry(t: torch.Tensor, device: torch.device | str, spec: tuple | None = None) -> dict[str, Any]:
    """A snapshot entry: the buffer `t` and the device its tensor lives on; for a DTensor (FSDP2) `t`
    is this rank's local shard and `spec` what makes the DTensor again (`_layout`)."""
    entry = {_TENSOR: t, "device": str(device)}
    if spec is not None:
        entry[_SHARDED] = spec
    return entry


def _layout(t: torch.Tensor) -> tuple | None:
    """`(mesh, placements, global shape, global stride)` of a DTensor; None for a plain tensor."""
    if not distributed.is_sharded(t):
        return None
    return (t.device_mesh, tuple(t.placements), t.shape, t.stride())


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (its storage: an in-place write changes the DTensor); `t` otherwise."""
    return t.to_local() if distributed.is_sharded(t) else t


def _sharded(local: torch.Tensor, spec: tuple) -> torch.Tensor:
    """The DTensor of layout `spec` whose shard on this rank is `local` (no communication)."""
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = spec
    return DTensor.from_local(local, mesh, placements, shape=shape, stride=stride, run_check=False)


def _same_layout(a: tuple | None, b: tuple | None) -> bool:
    if a is None or b is None:
        return a is b
    return a[0] == b[0] and a[1] == b[1] and tuple(a[2]) == tuple(b[2])


class _Buffers:
    """Snapshot buffers by path, allocated on first use (or when a shape changes) and refilled with `copy_`."""

    def __init__(self, where: str):
        self.where = where
        self.bufs: dict[tuple, torch.Tensor] = {}
        self.used: set[tuple] = set()

    def put(self, path: tuple, src: torch.Tensor) -> dict[str, Any]:
        """Copy `src` into its buffer; of a DTensor, this rank's shard only (memory per rank: its shards)."""
        src = src.detach()
        spec = _layout(src)
        src = _local(src)
        buf = self.bufs.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.device != self._home(src.device):
            buf = self.bufs[path] = self._empty(src.shape, src.dtype, src.device)
        buf.copy_(src, non_blocking=buf.device.type == "cpu" and src.device.type == "cuda")  # (into pinned memory)
        self.used.add(path)
        return _plain_tensor_entry(buf, src.device, spec)

    def _home(self, device: torch.device) -> torch.device:
        return device if self.where == "device" else torch.device("cpu")

    def _empty(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer for a tensor living on `device`: there (`where="device"`) or in CPU memory, pinned for CUDA."""
        pin = self.where == "cpu" and device.type == "cuda"
        return torch.empty(shape, dtype=dtype, device=self._home(device), pin_memory=pin)

    def start(self) -> None:
        self.used = set()

    def finish(self) -> None:
        """Free the buffers this snapshot did not use (state that no longer exists)."""
        for path in [p for p in self.bufs if p not in self.used]:
            del self.bufs[path]

    def adopt(self, path: tuple, entry: dict[str, Any]) -> dict[str, Any]:
        """Place a loaded snapshot tensor where this guard keeps its buffers."""
        t = entry[_TENSOR]
        spec = _layout(t)  # a DTensor (a sharded tensor's entry in `state_dict()`): keep this rank's shard
        t = _local(t)
        src_dev = torch.device(entry["device"])
        buf = self.bufs[path] = self._empty(t.shape, t.dtype, src_dev)
        buf.copy_(t)
        self.used.add(path)
        return _plain_tensor_entry(buf, src_dev, spec)

    def nbytes(self, first: str | None = None) -> int:
        return sum(b.numel() * b.element_size() for p, b in self.bufs.items() if first is None or p[0] == first)


def _snap_value(bufs: _Buffers, path: tuple, v: Any) -> Any:
    """A snapshot of one state value: a tensor into its buffer; a dict/list/tuple walked; anything else deep-copied."""
    if isinstance(v, torch.Tensor):
        return bufs.put(path, v)
    if isinstance(v, dict):
        return {k: _snap_value(bufs, (*path, k), x) for k, x in v.items()}
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        return type(v)(_snap_value(bufs, (*path, i), x) for i, x in enumerate(v))
    return copy.deepcopy(v)


def _live_value(v: Any) -> Any:
    """The value a snapshot entry restores to: a fresh tensor on the device it came from."""
    if isinstance(v, dict) and _TENSOR in v:
        t = v[_TENSOR].to(torch.device(v["device"]), copy=True, non_blocking=True)
        return _sharded(t, v[_SHARDED]) if _SHARDED in v else t
    if isinstance(v, dict):
        return {k: _live_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_live_value(x) for x in v)
    return copy.deepcopy(v)


def _exported(v: Any) -> Any:
    """A snapshot as `state_dict()` gives it: every value copied; a sharded tensor's entry holds the
    DTensor made of (a copy of) this rank's shard, so that torch.distributed.checkpoint saves each
    rank's shard (a plain tensor would be taken as replicated and saved from one rank only)."""
    if isinstance(v, dict) and _TENSOR in v:
        t = v[_TENSOR].clone()
        return {_TENSOR: _sharded(t, v[_SHARDED]) if _SHARDED in v else t, "device": v["device"]}
    if isinstance(v, dict):
        return {k: _exported(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_exported(x) for x in v)
    if isinstance(v, torch.Tensor):
        return v.clone()
    return copy.deepcopy(v)


def _map_tensors(v: Any, fn: Any, path: tuple = ()) -> Any:
    """`v` rebuilt with every snapshot tensor entry replaced by `fn(path, entry)`; other values as they are."""
    if isinstance(v, dict) and _TENSOR in v:
        return fn(path, v)
    if isinstance(v, dict):
        return {k: _map_tensors(x, fn, (*path, k)) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_map_tensors(x, fn, (*path, i)) for i, x in enumerate(v))
    return v


class _UndoCutOnRaise:
    """`optimizer.step` of an optimizer whose guard lowers the learning rate: the optimizer's own step
    (`inner`: what `optimizer.step` was, None for the class's method), and when it raises, the guard's
    cut put back before the exception leaves. It stands in for a bound method: torch's LR schedulers
    wrap `optimizer.step` through `__func__` and `__get__`; it pickles with the guard."""

    def __init__(self, guard: "Rewind", inner: Any) -> None:
        self.guard, self.inner = guard, inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        opt = self.guard.optimizer
        try:
            return self.inner(*args, **kwargs) if self.inner is not None else type(opt).step(opt, *args, **kwargs)
        except BaseException:
            self.guard._undo_cut()
            raise

    @property
    def __func__(self) -> "_UndoCutOnRaise":
        return self

    def __getattr__(self, name: str) -> Any:  # (the marks of what it wraps: a scheduler's `_wrapped_by_lr_sched`)
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def __get__(self, obj: Any, objtype: Any = None) -> "_UndoCutOnRaise":
        return self


class Rewind:
    """Snapshots every `every` steps; on a trigger, restore the last one and continue past the bad batches.

    `Rewind(optimizer, model=None, also=(), **settings)`, the settings those
    of `RewindConfig` (or `config=RewindConfig(...)`). Call `step(loss)`
    once per training step, after `optimizer.step()` (and after the
    schedulers' `step()`); `loss` is the step's loss tensor (what the closure
    returned, or what you called `backward` on), `grad_norm` optionally the
    gradient norm (for `grad_norm_z`).

    * `optimizer`: any `torch.optim.Optimizer`; a `Modular`'s whole state
      (per-parameter buffers, every transform's state, the skipped-step count)
      is kept. The snapshot holds its parameters.
    * `model`: its buffers (BatchNorm statistics) and parameters are kept too.
    * `also`: other objects with `state_dict()`/`load_state_dict()` restored
      with the optimizer: a learning-rate scheduler, a `GradScaler`, an
      `attach()` handle. Their state is deep-copied (not preallocated).

    `step()` returns None, or the `RewindEvent` of a rewind it just made (the
    model and optimizer are back at `event.restored_to`). `steps_done` is the
    step the model is at; `batches_seen` counts every batch fed (rewound ones
    included), so batch `batches_seen + 1` comes next; `rewinds` lists every
    rewind. `state_dict()`/`load_state_dict()` carry all of it, the snapshot
    included. Over FSDP2 (DTensor) parameters each rank's snapshot holds its
    own shards, and `state_dict()` gives them as DTensors (for
    `torch.distributed.checkpoint`).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: torch.nn.Module | None = None,
        also: Iterable[Any] = (),
        config: RewindConfig | dict[str, Any] | None = None,
        **settings: Any,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Rewind: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"Rewind: model must be a torch.nn.Module or None, got {type(model).__name__}")
        if config is not None and settings:
            raise TypeError("Rewind: give the settings as config= or as keywords, not both")
        if isinstance(config, RewindConfig):
            self.config: RewindConfig = config
        else:
            self.config = RewindConfig.model_validate(config if config is not None else settings)
        self.also: list[Any] = list(also)
        for i, obj in enumerate(self.also):
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"Rewind: also[{i}] ({type(obj).__name__}) has no state_dict()/load_state_dict()")
        self.optimizer: torch.optim.Optimizer = optimizer
        self.model: torch.nn.Module | None = model
        self._tensors = self._kept_tensors()
        if not self._tensors:
            raise ValueError("Rewind: the optimizer has no parameters to keep")
        self.device: torch.device = self._tensors[0][1].device
        stat_dtype = torch.float32 if self.device.type == "mps" else torch.float64
        cfg = self.config
        self._loss_win = _Window(cfg.window, self.device, stat_dtype)
        self._norm_win = _Window(cfg.window, self.device, stat_dtype)
        # the first trigger since the last snapshot, on the device: code = step * 4 + kind (0: none)
        self._code = torch.zeros((), dtype=torch.int64, device=self.device)
        self._value = torch.zeros((), dtype=stat_dtype, device=self.device)
        self._limit = torch.zeros((), dtype=stat_dtype, device=self.device)
        self._pos = torch.zeros((), dtype=torch.int64, device=self.device)  # steps_done, on the device
        #: the optimizer step the model and optimizer are at
        self.steps_done: int = 0
        #: batches fed so far (each `step()` call), rewound ones included
        self.batches_seen: int = 0
        #: every rewind made, oldest first
        self.rewinds: list[RewindEvent] = []
        self._tries = 0
        self._lowered_left = 0
        self._saved_lrs: list[Any] | None = None
        self._bufs = _Buffers(cfg.where)
        self._snapshot: dict[str, Any] = {}
        self._event: Any = None
        self._hooks: list[Any] = []
        #: what was cut short by an exception (a KeyboardInterrupt, an allocation refused) while it wrote:
        #: "snapshot" (the buffers hold a mix of two steps), "rewind" (the model and optimizer do) or "load"
        #: (the guard does); None when whole. `step()` and `state_dict()` refuse while it is set
        self._torn: str | None = None
        self._step_wrapper: _UndoCutOnRaise | None = None
        if cfg.lr_factor != 1.0 and cfg.lr_steps > 0:
            self._hooks = [optimizer.register_step_pre_hook(self._lower_lr),
                           optimizer.register_step_post_hook(self._restore_lr)]
            # a step that raises (the closure, a hook, the update) skips the post-hook: its cut is undone
            # as the exception leaves `step`, so a scheduler stepping next reads the lr it set itself
            self._step_wrapper = _UndoCutOnRaise(self, optimizer.__dict__.get("step"))
            optimizer.step = self._step_wrapper  # type: ignore[method-assign]
        self._take_snapshot()

    # --- what is kept ---------------------------------------------------------------------
    def _opt_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _kept_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """`(name, tensor)` of the parameters and model buffers a snapshot holds, each once."""
        out: list[tuple[str, torch.Tensor]] = []
        seen: set[int] = set()
        if self.model is not None:
            for name, t in self.model.state_dict(keep_vars=True).items():
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    out.append((name, t))
        for i, p in enumerate(self._opt_params()):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"optimizer parameter {i}", p))
        return out

    # --- the per-step test (on the device) -------------------------------------------------
    def step(self, loss: Any, grad_norm: Any = None) -> RewindEvent | None:
        """Record one training step; at a check point, rewind or refresh the snapshot.

        Returns the `RewindEvent` when this call rewound, else None. No host
        sync except at a check point (one read there). Raises `RewindError`
        when the snapshot was already restored `max_tries` times.
        """
        self._refuse_if_torn("step")
        cfg = self.config
        x = self._scalar(loss, "loss")
        g = None if grad_norm is None else self._scalar(grad_norm, "grad_norm")  # (both checked before any write)
        x = distributed.world_mean(x)  # (every rank decides on the same value)
        self._pos.add_(1)
        kind = torch.where(torch.isfinite(x), 0, 1)
        value, limit = x, torch.full_like(x, math.nan)
        if cfg.loss_z is not None:
            active, lim = self._loss_win.limit(cfg.loss_z, cfg.min_count, cfg.rel_std_floor)
            spike = (kind == 0) & active & (x > lim)
            kind = torch.where(spike, 2, kind)
            limit = torch.where(spike, lim, limit)
        if g is not None:
            g = distributed.world_mean(g)
            if cfg.grad_norm_z is not None:
                active, lim = self._norm_win.limit(cfg.grad_norm_z, cfg.min_count, cfg.rel_std_floor)
                spike = (kind == 0) & active & torch.isfinite(g) & (g > lim)
                kind = torch.where(spike, 3, kind)
                value, limit = torch.where(spike, g, value), torch.where(spike, lim, limit)
        fired = kind > 0
        self._loss_win.accept(x, ~fired)
        if g is not None:
            self._norm_win.accept(g, ~fired & torch.isfinite(g))
        first = fired & (self._code == 0)
        self._code.copy_(torch.where(first, self._pos * 4 + kind, self._code))
        self._value.copy_(torch.where(first, value, self._value))
        self._limit.copy_(torch.where(first, limit, self._limit))
        self.steps_done += 1
        self.batches_seen += 1
        if self.steps_done - self._snapshot["step"] < cfg.every:
            return None
        return self._check()

    def _scalar(self, v: Any, name: str) -> torch.Tensor:
        """`v` as a 0-d tensor of the guard's statistics dtype on its device (a tensor's value is not read)."""
        dtype = self._value.dtype
        if v is None:
            raise TypeError(f"Rewind.step: {name} must be a tensor or a number, got None"
                            + (" (pass the step's loss: the closure's return value, or the tensor you called backward on)"
                               if name == "loss" else ""))
        if isinstance(v, torch.Tensor) and v.numel() != 1:
            raise ValueError(f"Rewind.step: {name} must be a single number, got a tensor of shape {tuple(v.shape)}")
        check_loss(v, "Rewind.step", f"the {name.replace('_', ' ')}")  # (complex, bool, 10**400: refused)
        if isinstance(v, torch.Tensor):
            return v.detach().reshape(()).to(device=self.device, dtype=dtype)
        if hasattr(v, "reshape"):  # a NumPy scalar or one-element array
            v = v.reshape(()).item()
        return torch.tensor(float(v), device=self.device, dtype=dtype)

    # --- check points ----------------------------------------------------------------------
    def _check(self) -> RewindEvent | None:
        code = int(self._code.item())  # the one host read of this check
        if code == 0:
            self._take_snapshot()
            self._tries = 0
            return None
        step, kind = divmod(code, 4)
        snap_step = self._snapshot["step"]
        window = self.steps_done - snap_step
        first_batch = self.batches_seen - window + 1
        batch = first_batch + (step - snap_step - 1)
        if self._tries >= self.config.max_tries:
            raise RewindError(self._give_up_message(step, batch, kind))
        self._tries += 1
        event = RewindEvent(step=step, batch=batch, trigger=TRIGGERS[kind], checked_at=self.steps_done,
                            restored_to=snap_step, skipped=(first_batch, self.batches_seen), attempt=self._tries)
        self._restore()
        self.rewinds.append(event)
        self._lowered_left = self.config.lr_steps if self.config.lr_factor != 1.0 else 0
        return event

    def _give_up_message(self, step: int, batch: int, kind: int) -> str:
        value, limit = float(self._value), float(self._limit)  # (reads on the way out only)
        what = TRIGGERS[kind]
        if kind == 1:
            detail = f"loss {value}"
        else:
            series = "loss" if kind == 2 else "grad norm"
            detail = f"{series} {value:.6g} > limit {limit:.6g}"
        return (
            f"Rewind gave up at step {self.steps_done}: {what} at step {step} (batch {batch}; {detail}), after "
            f"{self._tries} rewind(s) to the snapshot of step {self._snapshot['step']} (max_tries="
            f"{self.config.max_tries}); the run does not get past it (lower the learning rate, raise loss_z, "
            "or look at the data)"
        )

    # --- snapshots ---------------------------------------------------------------------------
    def _take_snapshot(self) -> None:
        self._torn = "snapshot"  # (the buffers are refilled in place: cut short, they hold two steps)
        bufs = self._bufs
        bufs.start()
        opt = self.optimizer
        params = self._opt_params()
        index = {id(p): i for i, p in enumerate(params)}
        snap: dict[str, Any] = {"step": self.steps_done}
        with torch.no_grad():
            snap["tensors"] = [bufs.put(("tensors", i), t) for i, (_, t) in enumerate(self._tensors)]
            snap["state"] = {index[id(p)]: _snap_value(bufs, ("state", index[id(p)]), dict(s))
                             for p, s in opt.state.items() if id(p) in index and s}
            snap["groups"] = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
            if isinstance(opt, Modular):
                snap["store"] = {k: _snap_value(bufs, ("store", k), dict(v)) for k, v in opt._store.items()}
                snap["skipped_steps"] = opt._skipped_steps.detach().clone()
            snap["also"] = [copy.deepcopy(obj.state_dict()) for obj in self.also]
            snap["windows"] = {name: {k: t.clone() for k, t in w.tensors().items()}
                               for name, w in (("loss", self._loss_win), ("grad_norm", self._norm_win))}
        bufs.finish()
        self._snapshot = snap
        self._mark_copies()
        self._code.zero_()
        self._torn = None

    def _mark_copies(self) -> None:
        """With pinned CPU buffers the copies run asynchronously: remember where they end."""
        if self.device.type == "cuda" and self.config.where == "cpu":
            self._event = torch.cuda.Event()
            self._event.record()

    def _wait_copies(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def _restore(self) -> None:
        snap = self._snapshot
        opt = self.optimizer
        params = self._opt_params()
        if len(snap["groups"]) != len(opt.param_groups):
            raise RuntimeError(
                f"Rewind: the optimizer has {len(opt.param_groups)} param groups, its snapshot {len(snap['groups'])}; "
                "a guard cannot restore across add_param_group"
            )
        self._torn = "rewind"
        with torch.no_grad():
            for (_, t), entry in zip(self._tensors, snap["tensors"]):
                _local(t).copy_(entry[_TENSOR], non_blocking=True)  # (of a DTensor: into this rank's shard)
            for p in params:
                opt.state.pop(p, None)
            for i, s in snap["state"].items():
                opt.state[params[i]] = _live_value(s)
            for g, saved in zip(opt.param_groups, snap["groups"]):
                for k in [k for k in g if k != "params" and k not in saved]:
                    del g[k]
                g.update(copy.deepcopy(saved))
            if isinstance(opt, Modular):
                for k in list(opt._store):
                    if k not in snap["store"]:
                        del opt._store[k]
                for k, v in snap["store"].items():
                    live = opt._store.setdefault(k, {})
                    live.clear()
                    live.update(_live_value(v))
                opt._skipped_steps = snap["skipped_steps"].clone()
                opt._runtime.clear()
            for obj, sd in zip(self.also, snap["also"]):
                obj.load_state_dict(copy.deepcopy(sd))
            for name, w in (("loss", self._loss_win), ("grad_norm", self._norm_win)):
                for k, t in w.tensors().items():
                    t.copy_(snap["windows"][name][k])
        self.steps_done = snap["step"]
        self._pos.fill_(self.steps_done)
        self._code.zero_()
        self._saved_lrs = None
        self._torn = None

    def _refuse_if_torn(self, what: str) -> None:
        """After a snapshot or a rewind that an exception cut short, the guard stops: what it holds (or what
        it put back into the model) is a mix of two steps, and a rewind to it, or a checkpoint of it,
        would pass that on silently."""
        if self._torn is None:
            return
        part = {"snapshot": "the snapshot's buffers hold parts of two steps",
                "rewind": "the model and optimizer hold parts of the snapshot and of the step they were at",
                "load": "the guard holds parts of two states"}[self._torn]
        raise RuntimeError(
            f"Rewind.{what}: the last {self._torn} was interrupted partway ({part}); reload the last checkpoint "
            "(model, optimizer and this guard's load_state_dict) to go on"
        )

    # --- the learning-rate cut ---------------------------------------------------------------
    def _lower_lr(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        if self._saved_lrs is not None:  # a step that raised outside `_UndoCutOnRaise` (a compiled one)
            self._undo_cut()
        if self._lowered_left <= 0:
            return
        self._saved_lrs = [g.get("lr") for g in opt.param_groups]
        for g in opt.param_groups:
            if "lr" in g:
                g["lr"] = g["lr"] * self.config.lr_factor

    def _restore_lr(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        if self._saved_lrs is None:
            return
        self._undo_cut()
        self._lowered_left -= 1

    def _undo_cut(self) -> None:
        """Put back the lr the cut replaced; a step that did not finish is not one of the lowered ones."""
        if self._saved_lrs is None:
            return
        for g, lr in zip(self.optimizer.param_groups, self._saved_lrs):
            if "lr" in g:
                g["lr"] = lr
        self._saved_lrs = None

    @property
    def lowered_steps_left(self) -> int:
        """How many more `optimizer.step()` calls run with the learning rate times `lr_factor`."""
        return max(0, self._lowered_left)

    def remove(self) -> None:
        """Unregister the learning-rate hooks (the guard stops changing the optimizer)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        w = self._step_wrapper
        if w is not None and self.optimizer.__dict__.get("step") is w:  # (else wrapped since: it stays, inert)
            if w.inner is None:
                del self.optimizer.step
            else:
                self.optimizer.step = w.inner  # type: ignore[method-assign]
        self._step_wrapper = None

    # --- reports ---------------------------------------------------------------------------
    @property
    def snapshot_step(self) -> int:
        """The step of the snapshot a rewind would restore."""
        return self._snapshot["step"]

    def snapshot_bytes(self) -> dict[str, int]:
        """Bytes the snapshot buffers take: `{"params": ..., "optimizer": ..., "total": ...}`.

        `params` covers the parameters and model buffers; `optimizer` the
        optimizer's tensor state (and a `Modular`'s transform state). The
        spike windows, the param groups and `also` objects (small) are not
        counted.
        """
        params = self._bufs.nbytes("tensors")
        total = self._bufs.nbytes()
        return {"params": params, "optimizer": total - params, "total": total}

    # --- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the guard holds, for `torch.save` (loads with `weights_only=True`).

        It has the records of every rewind, the counters, the spike windows,
        a trigger not yet checked and the snapshot itself (as large as
        `snapshot_bytes()["total"]`), so a resumed run rewinds as the
        uninterrupted one would.
        """
        self._refuse_if_torn("state_dict")
        self._wait_copies()
        snap = _exported(self._snapshot)
        return {
            "format_version": FORMAT_VERSION,
            "config": self.config.model_dump(mode="json"),
            "steps_done": self.steps_done,
            "batches_seen": self.batches_seen,
            "tries": self._tries,
            "lowered_left": self._lowered_left,
            "rewinds": [e.as_dict() for e in self.rewinds],
            "pending": {"code": self._code.clone(), "value": self._value.clone(), "limit": self._limit.clone()},
            "windows": {name: {k: t.clone() for k, t in w.tensors().items()}
                        for name, w in (("loss", self._loss_win), ("grad_norm", self._norm_win))},
            "snapshot": snap,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a `state_dict()` of a guard over the same parameters; checked whole before anything changes."""
        try:
            self._load(sd)
        except (ValueError, TypeError) as e:
            if type(e) not in (ValueError, TypeError):  # (a subclass may take other arguments)
                raise
            raise type(e)(f"{e} (nothing was changed)") from None

    def _load(self, sd: Any) -> None:
        who = "Rewind.load_state_dict"
        if not isinstance(sd, dict):
            raise ValueError(f"{who}: expected the dict of Rewind.state_dict(), got {type(sd).__name__}")
        missing = [k for k in ("format_version", "config", "steps_done", "batches_seen", "tries", "lowered_left",
                               "rewinds", "pending", "windows", "snapshot") if k not in sd]
        if missing:
            raise ValueError(f"{who}: not a Rewind state dict (no {', '.join(map(repr, missing))})")
        if sd["format_version"] != FORMAT_VERSION:
            raise ValueError(f"{who}: unsupported format_version {sd['format_version']!r} (this modopt reads {FORMAT_VERSION})")
        counts = {k: sd[k] for k in ("steps_done", "batches_seen", "tries", "lowered_left")}
        for k, v in counts.items():
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**62:
                raise ValueError(f"{who}: {k!r} must be an int in [0, 2**62), got {v!r}")
        if counts["batches_seen"] < counts["steps_done"]:
            raise ValueError(f"{who}: 'batches_seen' ({counts['batches_seen']}) is below 'steps_done' ({counts['steps_done']})")
        rewinds = self._load_rewinds(sd["rewinds"], who)
        windows = self._load_windows(sd["windows"], who, "windows")
        pending = self._load_pending(sd["pending"], who)
        snap = self._load_snapshot(sd["snapshot"], who, counts["steps_done"])
        # everything checked; the copies made before anything changes (a failed allocation changes nothing)
        bufs = _Buffers(self.config.where)
        snap = _map_tensors(snap, bufs.adopt)
        if "skipped_steps" in snap:
            snap["skipped_steps"] = snap["skipped_steps"].to(self.device, torch.int64, copy=True)
        snap["windows"] = self._window_copies(snap["windows"])
        windows = self._window_copies(windows)
        # now change the guard: plain assignments and copies between tensors of one dtype and device
        self._torn = "load"
        self.steps_done, self.batches_seen = counts["steps_done"], counts["batches_seen"]
        self._tries, self._lowered_left = counts["tries"], counts["lowered_left"]
        self.rewinds = rewinds
        for name, w in (("loss", self._loss_win), ("grad_norm", self._norm_win)):
            for k, t in w.tensors().items():
                t.copy_(windows[name][k])
        self._code.copy_(pending["code"])
        self._value.copy_(pending["value"])
        self._limit.copy_(pending["limit"])
        self._pos.fill_(self.steps_done)
        self._bufs = bufs
        self._snapshot = snap
        self._mark_copies()
        self._saved_lrs = None
        self._torn = None

    def _window_copies(self, windows: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """Checked windows as new tensors of the live windows' dtypes, on the guard's device."""
        return {name: {k: windows[name][k].detach().to(self.device, t.dtype, copy=True) for k, t in w.tensors().items()}
                for name, w in (("loss", self._loss_win), ("grad_norm", self._norm_win))}

    @staticmethod
    def _count_tensor(t: Any, what: str, low: int = 0) -> None:
        """`t` is a 0-d integer tensor holding values (not on the meta device) >= `low` (read on the host: a load)."""
        if (not isinstance(t, torch.Tensor) or t.dim() != 0 or t.is_floating_point() or t.is_complex()
                or t.dtype == torch.bool or t.is_meta):
            raise ValueError(f"{what} must be a 0-d integer tensor, got "
                             f"{f'{tuple(t.shape)} {t.dtype} on {t.device}' if isinstance(t, torch.Tensor) else repr(t)}")
        if int(t) < low:
            raise ValueError(f"{what} must be >= {low}, got {int(t)}")

    @staticmethod
    def _real_tensor(t: Any, what: str, shape: tuple[int, ...]) -> None:
        """`t` is a floating-point tensor of `shape` holding values (not on the meta device)."""
        if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not t.is_floating_point()
                or t.is_meta):
            raise ValueError(f"{what} must be a floating-point tensor of shape {shape}, got "
                             f"{f'{tuple(t.shape)} {t.dtype} on {t.device}' if isinstance(t, torch.Tensor) else repr(t)}")

    def _load_pending(self, pending: Any, who: str) -> dict[str, torch.Tensor]:
        if not isinstance(pending, dict) or set(pending) != {"code", "value", "limit"}:
            raise ValueError(f"{who}: 'pending' must hold the 0-d tensors 'code', 'value' and 'limit'")
        self._count_tensor(pending["code"], f"{who}: pending.code")
        step, kind = divmod(int(pending["code"]), 4)
        if int(pending["code"]) and (kind not in TRIGGERS or step < 1):
            raise ValueError(f"{who}: pending.code {int(pending['code'])} is no trigger (step * 4 + kind, kind 1 to 3)")
        for k in ("value", "limit"):  # (NaN is a value: the loss of a non-finite trigger, no limit)
            self._real_tensor(pending[k], f"{who}: pending.{k}", ())
        return pending

    def _load_rewinds(self, rows: Any, who: str) -> list[RewindEvent]:
        if not isinstance(rows, list):
            raise ValueError(f"{who}: 'rewinds' must be a list")
        out = []
        fields = ("step", "batch", "trigger", "checked_at", "restored_to", "skipped", "attempt")
        for i, r in enumerate(rows):
            ok = isinstance(r, dict) and set(r) == set(fields)
            if ok:
                ints = [r[k] for k in ("step", "batch", "checked_at", "restored_to", "attempt")]
                sk = r["skipped"]
                ok = (all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in ints)
                      and r["attempt"] >= 1 and r["trigger"] in TRIGGERS.values()
                      and isinstance(sk, (list, tuple)) and len(sk) == 2
                      and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in sk)
                      and sk[0] <= sk[1])
            if not ok:
                raise ValueError(f"{who}: rewinds[{i}] is not a rewind record ({', '.join(fields)}: counts >= 0, "
                                 f"attempt >= 1, a trigger of {sorted(TRIGGERS.values())}), got {r!r:.200}")
            out.append(RewindEvent(**{**r, "skipped": tuple(r["skipped"])}))
        return out

    def _load_windows(self, windows: Any, who: str, where: str) -> dict[str, dict[str, torch.Tensor]]:
        if not isinstance(windows, dict) or set(windows) != {"loss", "grad_norm"}:
            raise ValueError(f"{who}: {where!r} must hold the 'loss' and 'grad_norm' windows")
        flags = []
        for name, w in windows.items():
            buf, count = (w.get("buf"), w.get("count")) if isinstance(w, dict) else (None, None)
            if not isinstance(buf, torch.Tensor) or buf.shape != self._loss_win.buf.shape:
                raise ValueError(
                    f"{who}: {where}.{name}.buf must be a tensor of shape ({self.config.window},) "
                    f"(the window of this guard), got {getattr(buf, 'shape', type(buf).__name__)}"
                )
            self._real_tensor(buf, f"{who}: {where}.{name}.buf", (self.config.window,))
            self._count_tensor(count, f"{who}: {where}.{name}.count")
            flags.append((f"{who}: {where}.{name}.buf", torch.isfinite(_local(buf)).all()))
        for what, ok in flags:  # (a window holds accepted values only: finite ones)
            if not bool(ok):
                raise ValueError(f"{what} holds a value that is not finite: the checkpoint is damaged or was edited")
        return windows

    def _load_snapshot(self, snap: Any, who: str, steps_done: int) -> dict[str, Any]:
        if not isinstance(snap, dict) or not {"step", "tensors", "state", "groups", "also", "windows"} <= set(snap):
            raise ValueError(f"{who}: 'snapshot' is not a Rewind snapshot")
        if not isinstance(snap["step"], int) or isinstance(snap["step"], bool) or not 0 <= snap["step"] <= steps_done:
            raise ValueError(f"{who}: snapshot.step must be an int in [0, steps_done={steps_done}], got {snap['step']!r}")
        tensors = snap["tensors"]
        if not isinstance(tensors, list) or len(tensors) != len(self._tensors):
            raise ValueError(f"{who}: the snapshot holds {len(tensors) if isinstance(tensors, list) else '?'} tensors, "
                             f"this guard keeps {len(self._tensors)}")
        for (name, t), e in zip(self._tensors, tensors):
            saved = e.get(_TENSOR) if isinstance(e, dict) else None
            if not isinstance(saved, torch.Tensor) or saved.shape != t.shape or saved.dtype != t.dtype:
                raise ValueError(f"{who}: the snapshot's {name} does not match ({getattr(saved, 'shape', None)} "
                                 f"{getattr(saved, 'dtype', None)} vs {tuple(t.shape)} {t.dtype})")
            self._check_layout(saved, t, f"{who}: the snapshot's {name}")
        n = len(self._opt_params())
        if not isinstance(snap["state"], dict) or any(not isinstance(i, int) or not 0 <= i < n for i in snap["state"]):
            raise ValueError(f"{who}: snapshot.state must map parameter indices 0..{n - 1} to their state")
        params = self._opt_params()
        for i, entry in snap["state"].items():
            def check(path: tuple, e: Any, p: torch.Tensor = params[i]) -> None:
                t, live = e.get(_TENSOR) if isinstance(e, dict) else None, self.optimizer.state.get(p)
                for k in path:
                    live = live.get(k) if isinstance(live, dict) else None
                what = f"{who}: snapshot state {'.'.join(map(str, path))} of parameter {i}"
                if isinstance(t, torch.Tensor) and isinstance(live, torch.Tensor):
                    self._check_layout(t, live, what)
                elif isinstance(t, torch.Tensor) and distributed.is_sharded(t) and not distributed.is_sharded(p):
                    self._check_layout(t, p, what)
            _map_tensors(entry, check)
        if not isinstance(snap["groups"], list) or len(snap["groups"]) != len(self.optimizer.param_groups):
            raise ValueError(f"{who}: the snapshot has {len(snap['groups']) if isinstance(snap['groups'], list) else '?'} "
                             f"param groups, the optimizer {len(self.optimizer.param_groups)}")
        if isinstance(self.optimizer, Modular) != ("store" in snap):
            raise ValueError(f"{who}: the snapshot is of {'a' if 'store' in snap else 'no'} Modular, the optimizer is "
                             f"{type(self.optimizer).__name__}")
        if not isinstance(snap["also"], list) or len(snap["also"]) != len(self.also):
            raise ValueError(f"{who}: the snapshot keeps {len(snap['also']) if isinstance(snap['also'], list) else '?'} "
                             f"'also' objects, this guard {len(self.also)}")
        self._load_windows(snap["windows"], who, "snapshot.windows")
        if "store" in snap:  # (the Modular's skipped-step count)
            self._count_tensor(snap.get("skipped_steps"), f"{who}: snapshot.skipped_steps")
        self._check_snapshot_values(snap, who)
        return snap

    @staticmethod
    def _check_layout(saved: torch.Tensor, live: torch.Tensor, what: str) -> None:
        """A snapshot tensor is laid out over the ranks as the live tensor it restores (FSDP2): both plain,
        or DTensors of the same mesh, placements and shape whose shards on this rank have the same shape
        (a rewind copies shard into shard)."""
        a, b = _layout(saved), _layout(live)
        if not _same_layout(a, b):
            def words(spec: tuple | None) -> str:
                return "a plain tensor" if spec is None else f"a DTensor {list(spec[1])} over {spec[0]}"

            raise ValueError(f"{what} is {words(a)}, the live one {words(b)}: a guard's state loads into the same "
                             "layout (the same FSDP2 sharding, the same number of ranks)")
        if a is not None and _local(saved).shape != _local(live).shape:
            raise ValueError(f"{what}: this rank's shard has shape {tuple(_local(saved).shape)}, the live one "
                             f"{tuple(_local(live).shape)} (another rank's state?)")

    def _check_snapshot_values(self, snap: dict[str, Any], who: str) -> None:
        """The snapshot's values against the live optimizer, as its own `load_state_dict` would check them:
        a rewind writes them into the optimizer, so a wrong shape, dtype, NaN or out-of-range value here
        would crash a fused kernel or turn the parameters into NaN after the next rewind."""

        def plain(path: tuple, e: dict[str, Any]) -> torch.Tensor:
            t = e.get(_TENSOR)
            if not isinstance(t, torch.Tensor) or t.is_meta:
                raise ValueError(f"{who}: snapshot entry {'.'.join(map(str, path))} holds no tensor"
                                 + (" (one on the meta device holds no values)" if isinstance(t, torch.Tensor) else ""))
            try:
                torch.device(e.get("device"))
            except (TypeError, RuntimeError, ValueError):
                raise ValueError(f"{who}: snapshot entry {'.'.join(map(str, path))} names no device "
                                 f"({e.get('device')!r})") from None
            return t

        values = _map_tensors({k: snap[k] for k in ("tensors", "state", "groups") if k in snap} | (
            {"store": snap["store"]} if "store" in snap else {}), plain)
        flags: list[tuple[str, torch.Tensor]] = []
        for (name, _), t in zip(self._tensors, values["tensors"]):
            if t.is_floating_point():  # (of a DTensor: each rank checks its own shard, as Modular's load does)
                flags.append((f"the snapshot's {name}", torch.isfinite(_local(t)).all()))
        opt, params = self.optimizer, self._opt_params()
        if isinstance(opt, Modular):
            from .core.checkpoint import StateLoader

            loader = StateLoader(opt.transforms, f"{who}: snapshot", opt._pipeline.nonfinite)
            groups = []
            for gi, (g, saved) in enumerate(zip(opt.param_groups, values["groups"])):
                if not isinstance(saved, dict):
                    raise ValueError(f"{who}: snapshot param group {gi} is not a dict")
                try:
                    opt._gate.check({**saved, "params": g["params"]}, gi, list(saved))
                except (ValueError, TypeError) as e:
                    raise type(e)(f"{who}: snapshot {e}") from None
                groups += [saved] * len(g["params"])  # (the group each parameter steps with after a rewind)
            for i, entry in values["state"].items():
                loader.param_state(entry, params[i], None, f"parameter {i}", groups[i])
            first = params[0].device if params else torch.device("cpu")
            loader.store(values["store"], [g["params"][0].device if g["params"] else first for g in opt.param_groups])
            loader.finish()
        else:
            for i, entry in values["state"].items():
                live = opt.state.get(params[i])
                if not isinstance(entry, dict):
                    raise ValueError(f"{who}: snapshot state of parameter {i} is not a dict")
                for k, v in entry.items():
                    old = live.get(k) if live else None
                    if isinstance(old, torch.Tensor) and (not isinstance(v, torch.Tensor) or v.shape != old.shape
                                                          or v.dtype != old.dtype):
                        raise ValueError(f"{who}: snapshot state {k!r} of parameter {i} is "
                                         f"{getattr(v, 'shape', type(v).__name__)} {getattr(v, 'dtype', '')}, the "
                                         f"optimizer's is {tuple(old.shape)} {old.dtype}")
                    if isinstance(v, torch.Tensor) and v.is_floating_point():
                        v = _local(v)
                        ok = (~torch.isnan(v) if k in TORCH_SQUARES else torch.isfinite(v)).all()
                        if k in _NONNEGATIVE_TORCH_STATE:
                            ok = ok & (v >= 0).all()
                        flags.append((f"snapshot state {k!r} of parameter {i}", ok))
            for gi, (g, saved) in enumerate(zip(opt.param_groups, values["groups"])):
                for k, v in (saved.items() if isinstance(saved, dict) else ()):
                    old = g.get(k)
                    number = isinstance(old, (int, float)) and not isinstance(old, bool)
                    if number and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                        raise ValueError(f"{who}: snapshot param group {gi} has {k}={v!r}; the optimizer's is the "
                                         f"number {old!r}: a finite number is needed")
        if flags:
            bad = torch.stack([f.cpu() for _, f in flags]).logical_not().nonzero().flatten().tolist()
            if bad:
                raise ValueError(f"{who}: {flags[bad[0]][0]} is not finite (or is negative where it cannot be): "
                                 "the checkpoint is damaged or was edited")
