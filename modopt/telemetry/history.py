"""`History`: every step's telemetry in a fixed-size buffer on the device, read back in one copy.

A step appends one row: the values of `opt.stats` (each transform's `"<key>.<name>"`
telemetry, `skipped`, `skipped_steps`, `nonfinite`, ...), the values derived from them
(`DERIVED`) and, opt in, the gradient norm of each module. The row is written into a
ring buffer of `capacity` rows with ordinary device ops: no `.item()`, no host copy. A
read (`read()`, `flush()`, automatically every `every` steps) copies the whole buffer to
the host in one transfer and returns host rows; sinks receive rows only then.

```python
import torch
import modopt as mo

model = torch.nn.Linear(4, 2)
opt = mo.Modular(model.named_parameters(), mo.ClipNorm(1.0), mo.Adam(lr=1e-2))
history = mo.History.attach(opt, capacity=64)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
rows = history.read()
assert [r["step"] for r in rows] == [1, 2, 3]
assert rows[-1]["clip_scale"] <= 1.0
```
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from typing import Any, Iterable, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from ..core.hostdata import on_device
from ..core.keys import split_value_key
from ..core.reduce import common_acc_dtype

#: the values the history derives from a step's stats, in row order, and what each means
DERIVED = {
    "grad_norm": "pre-clip global L2 norm of the gradients the step saw (every parameter with a gradient)",
    "post_clip_norm": "grad_norm x clip_scale; 0 on a skipped step",
    "clip_scale": "product of the global-scope `scale` telemetry of the pipeline's transforms (1 if none records one)",
    "clipped": "1 when any transform reports a clipped segment (`clipped` telemetry), else 0",
    "skipped": "1 when the step was skipped (non-finite gradient under nonfinite='skip'), else 0",
    "nonfinite": "1 when the step's gradients held inf/NaN (as the non-finite policy saw them), else 0",
    "clipped_steps": "steps with clipped = 1 since the history started (a running count)",
    "nonfinite_steps": "steps with nonfinite = 1 since the history started (a running count)",
}
#: the prefix of a per-module norm column: `module_norm/<name prefix>`
MODULE = "module_norm/"
#: the key of `optimizer.state_dict()["param_groups"][0]` that carries an attached history (the first one
#: attached; the n-th after it: `entry_key(n)`)
ENTRY = "modopt_telemetry"
#: the most a count in a history's state may be (as `Rewind`'s: far past any run, and exact in an int64)
COUNT_MAX = 2**62


def entry_key(slot: int) -> str:
    """The param-group key carrying the history attached in `slot` (0: the first): `"modopt_telemetry"`,
    `"modopt_telemetry.1"`, ..."""
    return ENTRY if slot == 0 else f"{ENTRY}.{slot}"
_VERSION = 1
#: the most elements one `note` value may have: each element is a column of every row
NOTE_MAX = 1024
#: the most rows a history keeps (its buffer is `capacity x columns x 8` bytes on the device)
CAPACITY_MAX = 10_000_000
#: stats that become derived columns of their own (not copied as they are)
_DERIVED_FROM = ("grad_norm", MODULE.rstrip("/"), "skipped", "nonfinite")


def column_name(stat_key: str) -> str:
    """The row name of an `opt.stats` key: `"0:ClipNorm.norm"` -> `"0:ClipNorm/norm"`; others as they are."""
    parts = split_value_key(stat_key)
    return f"{parts[0]}/{parts[1]}" if parts else stat_key


def module_of(name: str, depth: int) -> str:
    """The first `depth` dotted parts of a parameter name: `module_of("enc.layers.0.w", 2) == "enc.layers"`.

    A name with `depth` parts or fewer is its own module minus its last part (`"bias"` of
    `"fc.bias"` names a tensor, not a module); a one-part name is its own module."""
    parts = name.split(".")
    keep = min(depth, max(1, len(parts) - 1))
    return ".".join(parts[:keep])


class Sink(Protocol):
    """What a `History` delivers rows to: any object with `write(rows)` (`JsonlSink`, `CsvSink`, the
    Lightning and HF callbacks, one of your own). A `close()` it also has is called by `History.close`."""

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Take the rows not yet delivered to this sink, oldest first (`{"step": n, column: value, ...}`);
        one that raises keeps them pending, to be offered again at the next delivery."""
        ...


class History:
    """A ring buffer of step telemetry on the device; see the module docstring.

    * `capacity`: rows kept (the last `capacity` steps); memory `capacity x columns x 8` bytes
      (float64) on the parameters' device.
    * `every`: read back and deliver the new rows to `sinks` every `every` steps (None: only
      when `flush()` is called). At most `capacity`, so that no row is overwritten unread.
    * `module_depth`: also record `module_norm/<prefix>`, the L2 norm of the gradients of
      each module, the parameter names cut to `module_depth` dotted parts (None: off). Needs
      names: build the optimizer from `model.named_parameters()`.
    * `sinks`: objects with `write(rows)` (and optionally `close()`), e.g. `JsonlSink`.
    """

    def __init__(self, capacity: int = 1024, every: int | None = None, module_depth: int | None = None,
                 sinks: Iterable[Sink] = ()):
        for field, v, low in (("capacity", capacity, 1), ("every", every, 1), ("module_depth", module_depth, 1)):
            if v is None and field != "capacity":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"History: {field} must be an integer >= {low}, got {v!r}")
        if capacity > CAPACITY_MAX:
            raise ValueError(f"History: capacity must be at most {CAPACITY_MAX:,} rows (the buffer is capacity x "
                             f"columns x 8 bytes on the device), got {capacity:,}; flush to sinks more often instead")
        if every is not None and every > capacity:
            raise ValueError(f"History: every ({every}) must be at most capacity ({capacity}): rows would be "
                             "overwritten before they are read")
        self.capacity: int = capacity
        self.every: int | None = every
        self.module_depth: int | None = module_depth
        self.sinks: list[Sink] = list(sinks)
        for s in self.sinks:
            if not callable(getattr(s, "write", None)):
                raise TypeError(f"History: sink {s!r} has no write(rows) method")
        self.columns: list[str] = []
        self._index: dict[str, int] = {}
        self._values: torch.Tensor | None = None  # (capacity, len(columns)) float64
        self._totals: torch.Tensor | None = None  # running counts: clipped_steps, nonfinite_steps
        self._plans: list[tuple[int, ...]] = []  # the columns a row holds (plans[slot_plan[slot]])
        self._plan_ids: dict[tuple[int, ...], int] = {}
        self._slot_plan: list[int] = [-1] * capacity
        self._col_cache: dict[tuple, tuple[int, torch.Tensor]] = {}
        self.count: int = 0  # rows recorded (the step number of the last row)
        self.delivered: int = 0  # rows every sink has taken (the oldest of `_sink_done`)
        self._sink_done = [0] * len(self.sinks)  # per sink: the last step it wrote without raising
        self._sink_failing: set[int] = set()  # sinks whose last write raised (reported once until one succeeds)
        self._base = 0  # steps before the first row (start_at)
        self._extra: dict[str, Any] = {}
        self._modules: list[str] | None = None
        self._handles: list[Any] = []
        self._lost_warned = False
        self._by_id: dict[int, str] = {}
        self._entry = ENTRY  # (its key in a state dict's param_groups[0]: see attach_to)

    # --- attaching ---------------------------------------------------------------------------
    @classmethod
    def attach(cls, optimizer: Any, capacity: int = 1024, every: int | None = None,
               module_depth: int | None = None, sinks: Iterable[Sink] = (), save: bool = True,
               names: Any = None) -> "History":
        """A new history recording every `optimizer.step()` of a `mo.Modular` (see `attach_to`)."""
        return cls(capacity, every, module_depth, sinks).attach_to(optimizer, save=save, names=names)

    def attach_to(self, optimizer: Any, save: bool = True, names: Any = None) -> "History":
        """Record every step of `optimizer` (a `mo.Modular`): a step tap inside the step takes the
        gradient norms, torch's step post-hook records the row. Returns self; `detach()` undoes it.

        With `save` the history travels in `optimizer.state_dict()` (in `param_groups[0]`
        under `"modopt_telemetry"`, a group key torch keeps) and comes back with
        `load_state_dict()`, before or after attaching: a load before it leaves the entry in
        `optimizer.param_groups[0]`, where attaching picks it up. `names`: `named_parameters()`
        pairs naming the parameters for `module_depth` when the param groups have no names
        (an HF Trainer's groups)."""
        from ..core.modular import Modular

        if not isinstance(optimizer, Modular):
            raise TypeError(f"History.attach: expected a modopt.Modular, got {type(optimizer).__name__} "
                            "(for another optimizer, call history.record(stats) yourself)")
        if self._handles:
            raise RuntimeError("History.attach: this history is already attached; detach() it first")
        by_id = {id(p): n for n, p in names} if names is not None else {}
        if self.module_depth is not None:
            found = [by_id.get(id(p)) or n for g in optimizer.param_groups
                     for p, n in zip(g["params"], g.get("param_names") or [None] * len(g["params"]))]
            if not found or any(n is None for n in found):
                raise ValueError("History(module_depth=...) needs parameter names: build the optimizer from "
                                 "model.named_parameters() (or give each param group 'param_names', or pass names=)")
            self._modules = sorted({module_of(n, self.module_depth) for n in found})
        self._by_id = by_id
        # each saved history has a key of its own: the lowest slot no other history of this optimizer holds,
        # so histories attached in the same order come back each with its own state
        taken = {getattr(h, "__self__", None)._entry for h in optimizer._optimizer_state_dict_post_hooks.values()
                 if getattr(h, "__func__", None) is History._sd_post}
        self._entry = next(entry_key(n) for n in range(len(taken) + 1) if entry_key(n) not in taken)
        waiting = optimizer.param_groups[0].get(self._entry) if save and optimizer.param_groups else None
        if waiting is not None:  # loaded before this history was attached
            self.load_state_dict(waiting)
            self._to_device(optimizer)
            del optimizer.param_groups[0][self._entry]
        self._handles = [optimizer.add_step_tap(self._tap), optimizer.register_step_post_hook(self._post_step)]
        if save:
            self._handles += [optimizer.register_state_dict_post_hook(self._sd_post),
                              optimizer.register_load_state_dict_pre_hook(self._load_pre),
                              optimizer.register_load_state_dict_post_hook(self._load_post)]
        self._pending_load: dict | None = None
        return self

    def detach(self) -> None:
        """Stop recording (the rows stay)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _tap(self, ctx: Any) -> None:
        """Inside the step, after the non-finite check: the gradient norms into the step's stats.

        The per-tensor 2-norms come from the step's norm memo (`modopt.core.reduce.NormMemo`): the
        default non-finite check (`nonfinite="skip"`/`"raise"`) has already computed them, so this
        costs no pass over the gradients; under `"zero"`/`"ignore"` it is one `_foreach_norm` pass,
        which a following global or per-tensor 2-norm clip then reads from the memo in turn."""
        grads = [p.grad for p in ctx.params]
        if not grads:
            return
        acc = common_acc_dtype(grads)
        ctx.stats["grad_norm"] = ctx.memo.total(grads, 2.0, acc)
        if self._modules is not None:
            ctx.stats[MODULE.rstrip("/")] = self._module_norms(ctx, ctx.memo.pnorms(grads, 2.0, acc))

    def _module_norms(self, ctx: Any, parts: torch.Tensor) -> torch.Tensor:
        """The L2 norm of each module's gradients from the per-tensor norms (one index_add)."""
        index = ctx.layout.cache.get(("telemetry", id(self)))
        if index is None or index.device != parts.device:
            where = {m: i for i, m in enumerate(self._modules)}
            names = [self._by_id.get(id(p)) or n for p, n in zip(ctx.params, ctx.names)]
            index = on_device([where[module_of(n, self.module_depth)] for n in names], torch.int64, parts.device)
            ctx.layout.cache[("telemetry", id(self))] = index
        sq = parts.new_zeros(len(self._modules)).index_add_(0, index, parts * parts)
        return sq.sqrt()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.record(optimizer.stats)

    # --- recording --------------------------------------------------------------------------
    def note(self, **values: Any) -> None:
        """Values to add to the next recorded row (`history.note(loss=loss.detach())` before
        `opt.step()`): 0-d or 1-D tensors (kept on the device) or numbers.

        Checked here, before the step: a value that could not be recorded would fail the step's
        recording after the parameters moved."""
        for k, v in values.items():
            if k == "step" or k in DERIVED or k.startswith(MODULE):
                raise ValueError(f"History.note: {k!r} is a column the history fills itself; give the value another name")
            if isinstance(v, bool) or not isinstance(v, (torch.Tensor, int, float)):
                raise TypeError(f"History.note: {k} must be a tensor or a number, got {type(v).__name__}")
            if isinstance(v, torch.Tensor):
                if v.dim() > 1 or v.numel() > NOTE_MAX or v.is_complex() or v.device.type == "meta":
                    raise ValueError(f"History.note: {k} must be a real 0-d or 1-D tensor of at most {NOTE_MAX} "
                                     f"elements (each is a column of every row), got shape {tuple(v.shape)}, "
                                     f"{v.dtype} on {v.device.type}")
        self._extra.update(values)

    def record(self, stats: dict[str, torch.Tensor], **extra: Any) -> None:
        """Append one row from a step's `stats` (and `extra`, as in `note`); no host sync."""
        extra = {**self._extra, **extra}
        self._extra = {}
        named: list[tuple[str, torch.Tensor]] = []
        device = None
        for k, v in stats.items():
            if k in _DERIVED_FROM or not isinstance(v, torch.Tensor):
                continue
            named.append((column_name(k), v))
            device = device or v.device
        if self._values is None:
            g = stats.get("grad_norm")
            device = g.device if isinstance(g, torch.Tensor) else device or torch.device("cpu")
            self._values = torch.full((self.capacity, 0), math.nan, dtype=torch.float64, device=device)
        dev = self._values.device
        derived, have = self._derive(stats, dev)
        parts = [derived]
        names = list(have)
        mods = stats.get(MODULE.rstrip("/"))
        if isinstance(mods, torch.Tensor) and self._modules is not None:
            parts.append(mods.reshape(-1))
            names += [MODULE + m for m in self._modules]
        for name, v in named:
            parts.append(v.reshape(-1))
            names += [name] if v.numel() == 1 else [f"{name}[{i}]" for i in range(v.numel())]
        for k, v in extra.items():
            if not isinstance(v, torch.Tensor):
                v = torch.tensor(float(v), dtype=torch.float64)
            parts.append(v.reshape(-1))
            names += [k] if v.numel() == 1 else [f"{k}[{i}]" for i in range(v.numel())]
        cols, index = self._columns_for(tuple(names), dev)
        row = torch.cat([_as(p, dev, torch.float64) for p in parts])
        slot = self.count % self.capacity
        self._values.select(0, slot).fill_(math.nan).index_copy_(0, index, row)
        self._slot_plan[slot] = cols
        self.count += 1
        if self.every is not None and self.count % self.every == 0:
            self._deliver(raise_errors=False)  # (during the step: a failing sink reports, never raises)

    def _derive(self, stats: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[str]]:
        """`DERIVED` of one step as a float64 vector on `device`, and the names it holds."""
        f64 = torch.float64
        one = torch.ones((), dtype=f64, device=device)
        scale, clipped = one, torch.zeros((), dtype=torch.bool, device=device)
        for k, v in stats.items():
            name = (split_value_key(k) or (None, k))[1]
            if name == "scale" and v.numel() == 1:
                scale = scale * _as(v.reshape(()), device, f64)
            elif name == "clipped":
                clipped = clipped | _as(v.any(), device, torch.bool)
        skipped = stats.get("skipped")
        skipped = _as(skipped.reshape(()), device, torch.bool) if isinstance(skipped, torch.Tensor) else None
        nonfinite = stats.get("nonfinite")
        nonfinite = _as(nonfinite.reshape(()), device, torch.bool) if isinstance(nonfinite, torch.Tensor) else None
        if self._totals is None:
            self._totals = torch.zeros(2, dtype=f64, device=device)
        flags = torch.stack([clipped, nonfinite if nonfinite is not None else torch.zeros_like(clipped)]).to(f64)
        self._totals = self._totals + flags
        values, names = [], []
        g = stats.get("grad_norm")
        if isinstance(g, torch.Tensor):
            g = _as(g.reshape(()), device, f64)
            post = g * scale
            if skipped is not None:
                post = torch.where(skipped, torch.zeros((), dtype=f64, device=device), post)
            values += [g, post]
            names += ["grad_norm", "post_clip_norm"]
        values += [scale, clipped.to(f64)]
        names += ["clip_scale", "clipped"]
        if skipped is not None:
            values.append(skipped.to(f64))
            names.append("skipped")
        if nonfinite is not None:
            values.append(nonfinite.to(f64))
            names.append("nonfinite")
        values.append(self._totals)
        names += ["clipped_steps", "nonfinite_steps"]
        return torch.cat([torch.stack(values[:-1]), values[-1]]), names

    def _columns_for(self, names: tuple[str, ...], device: torch.device) -> tuple[int, torch.Tensor]:
        """The plan id of a row holding `names`, and the device index of its columns (cached)."""
        hit = self._col_cache.get(names)
        if hit is not None and hit[1].device == device:
            return hit
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"History: the row names {sorted(dup)} twice (a note() name that a stat also has?)")
        new = [n for n in names if n not in self._index]
        if new:
            for n in new:
                self._index[n] = len(self.columns)
                self.columns.append(n)
            assert self._values is not None
            pad = self._values.new_full((self.capacity, len(new)), math.nan)
            self._values = torch.cat([self._values, pad], 1)
        cols = tuple(self._index[n] for n in names)
        plan = self._plan_ids.get(cols)
        if plan is None:
            plan = self._plan_ids[cols] = len(self._plans)
            self._plans.append(cols)
        hit = (plan, on_device(list(cols), torch.int64, device))
        self._col_cache[names] = hit
        return hit

    # --- reading ------------------------------------------------------------------------------
    def start_at(self, step: int) -> None:
        """Number the next row `step + 1`: a history that starts in the middle of a run (resumed from a
        checkpoint that did not carry one). Only before the first row."""
        if self.count != self._base:
            raise RuntimeError(f"History.start_at: the history already holds rows (up to step {self.count})")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"History.start_at: step must be an integer >= 0, got {step!r}")
        self.count = self.delivered = self._base = step
        self._sink_done = [step] * len(self.sinks)

    def _held(self) -> list[tuple[int, int]]:
        """`(step, slot)` of every row held, oldest first."""
        first = max(self._base + 1, self.count - self.capacity + 1)
        return [(s, (s - 1) % self.capacity) for s in range(first, self.count + 1)]

    def read(self, since: int = 0) -> list[dict[str, Any]]:
        """The rows held with `step > since`, oldest first: `{"step": n, column: float, ...}`, a row
        holding the columns its step recorded. One device-to-host copy of the whole buffer."""
        held = [(s, slot) for s, slot in self._held() if s > since]
        if not held or self._values is None:
            return []
        host = self._values.to("cpu", copy=True).tolist()  # the one transfer
        rows = []
        for s, slot in held:
            vals = host[slot]
            row: dict[str, Any] = {"step": s}
            for c in self._plans[self._slot_plan[slot]]:
                row[self.columns[c]] = vals[c]
            rows.append(row)
        return rows

    def flush(self) -> list[dict[str, Any]]:
        """Read the rows not yet delivered (one copy), hand each sink the rows it has not taken, and
        return the rows read. A row counts as delivered to a sink only once its `write` returned: a sink
        that raises gets the same rows again at the next flush. Here the first such error is raised,
        after every sink was tried; the automatic flush (`every`) warns instead, once until it recovers."""
        return self._deliver(raise_errors=True)

    def _deliver(self, raise_errors: bool) -> list[dict[str, Any]]:
        if self.count == self.delivered:
            return []
        lost = self.count - self.delivered - self.capacity
        if lost > 0 and not self._lost_warned:
            self._lost_warned = True
            warnings.warn(f"History: {lost} rows were overwritten before they were read (capacity "
                          f"{self.capacity}); flush more often or raise capacity", UserWarning, stacklevel=3)
        rows = self.read(since=self.delivered)
        self._sink_done = (self._sink_done + [self.delivered] * len(self.sinks))[:len(self.sinks)]  # (sinks added)
        error = None
        for i, sink in enumerate(self.sinks):
            todo = [r for r in rows if r["step"] > self._sink_done[i]]
            if not todo:
                continue
            try:
                sink.write(todo)
            except Exception as e:  # (the rows stay pending for this sink)
                if i not in self._sink_failing:
                    self._sink_failing.add(i)
                    if not raise_errors:
                        warnings.warn(f"History: sink {sink!r} failed to write {len(todo)} rows "
                                      f"({type(e).__name__}: {e}); they are kept and written again at the next "
                                      "flush (the step went on)", UserWarning, stacklevel=3)
                error = error or (sink, e)
                continue
            self._sink_failing.discard(i)
            self._sink_done[i] = todo[-1]["step"]
        self.delivered = min(self._sink_done, default=self.count) if self.sinks else self.count
        if error is not None and raise_errors:
            sink, e = error
            raise RuntimeError(f"History.flush: sink {sink!r} failed ({type(e).__name__}: {e}); its rows are kept "
                               "and written again at the next flush") from e
        return rows

    def close(self) -> list[dict[str, Any]]:
        """`flush()`, then close every sink that has `close()`."""
        rows = self.flush()
        for s in self.sinks:
            close = getattr(s, "close", None)  # (optional: not part of `Sink`)
            if callable(close):
                close()
        return rows

    def window(self, column: str, n: int | None = None) -> torch.Tensor:
        """The last `n` values (default: every row held) of `column` as a 1-D float64 tensor on
        the device, oldest first; no host sync (for a guard that decides on the device). A row that
        did not record the column holds NaN."""
        if column not in self._index:
            raise KeyError(f"History.window: no column {column!r}; the history has: {', '.join(self.columns) or 'none'}")
        held = self._held()[-n:] if n else self._held()
        assert self._values is not None
        col = self._values[:, self._index[column]]
        if not held:
            return col[:0]
        a, b = held[0][1], held[-1][1]
        return col[a:b + 1] if a <= b else torch.cat([col[a:], col[:b + 1]])

    def last(self) -> dict[str, torch.Tensor]:
        """The last row as 0-d float64 device tensors by column (no sync); empty before any step."""
        if not self.count or self._values is None:
            return {}
        slot = (self.count - 1) % self.capacity
        row = self._values[slot]
        return {self.columns[c]: row[c] for c in self._plans[self._slot_plan[slot]]}

    def summary(self, window: int | None = None, quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, Any]:
        """Rolling summary of the last `window` rows (default all held), from one read:

        `steps` (rows summarised), `clip_fraction` and `skip_fraction` (mean of `clipped` /
        `skipped` over them), `nonfinite_steps` (how many were non-finite), `grad_norm_max` and
        `grad_norm_q` (`{q: value}`, linear interpolation between order statistics, as
        `torch.quantile`) over the finite `grad_norm` values. None where there is nothing to summarise."""
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"History.summary: window must be an integer >= 1, got {window!r}")
        rows = self.read(since=max(0, self.count - window) if window else 0)
        out: dict[str, Any] = {"steps": len(rows)}

        def mean(key: str) -> float | None:
            vals = [r[key] for r in rows if key in r]
            return sum(vals) / len(vals) if vals else None

        out["clip_fraction"] = mean("clipped")
        out["skip_fraction"] = mean("skipped")
        out["nonfinite_steps"] = int(sum(r.get("nonfinite", 0.0) for r in rows))
        norms = [r["grad_norm"] for r in rows if "grad_norm" in r and math.isfinite(r["grad_norm"])]
        if norms:
            t = torch.tensor(norms, dtype=torch.float64)
            out["grad_norm_max"] = max(norms)
            out["grad_norm_q"] = dict(zip(quantiles, torch.quantile(t, torch.tensor(quantiles, dtype=torch.float64)).tolist()))
        else:
            out["grad_norm_max"], out["grad_norm_q"] = None, {q: None for q in quantiles}
        return out

    @property
    def nbytes(self) -> int:
        """Device memory of the buffer now: `capacity x columns x 8`."""
        return 0 if self._values is None else self._values.numel() * self._values.element_size()

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything that makes the rows: plain data and tensors (`torch.load(weights_only=True)` reads it)."""
        return {
            "version": _VERSION,
            "capacity": self.capacity,
            "columns": list(self.columns),
            "plans": [list(p) for p in self._plans],
            "slot_plan": list(self._slot_plan),
            "count": self.count,
            "delivered": self.delivered,
            "base": self._base,
            "values": None if self._values is None else self._values.clone(),
            "totals": None if self._totals is None else self._totals.clone(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore `state_dict()`; everything is checked before anything changes."""
        _check_state(sd, self.capacity)
        if sd["capacity"] != self.capacity:  # every row delivered: keep the numbering and the running counts
            self._load_resized(sd)
            return
        self.columns = list(sd["columns"])
        self._index = {n: i for i, n in enumerate(self.columns)}
        self._plans = [tuple(p) for p in sd["plans"]]
        self._plan_ids = {p: i for i, p in enumerate(self._plans)}
        self._slot_plan = list(sd["slot_plan"])
        self._col_cache = {}
        self.count, self.delivered, self._base = sd["count"], sd["delivered"], sd["base"]
        self._sink_done = [self.delivered] * len(self.sinks)
        self._sink_failing = set()
        self._values = None if sd["values"] is None else sd["values"].clone()
        self._totals = None if sd["totals"] is None else sd["totals"].to(torch.float64, copy=True)

    def _load_resized(self, sd: dict[str, Any]) -> None:
        """A checkpoint of a history of another capacity whose rows were all delivered (a run resumed
        with another `read_every`): the row numbering and the running counts continue; the rows held
        start again from the checkpoint's step (`read`, `window` see only the rows recorded since)."""
        self.columns, self._index = [], {}
        self._plans, self._plan_ids, self._col_cache = [], {}, {}
        self._slot_plan = [-1] * self.capacity
        self._values = None
        self.count = self.delivered = self._base = sd["count"]
        self._sink_done = [self.count] * len(self.sinks)
        self._sink_failing = set()
        self._totals = None if sd["totals"] is None else sd["totals"].to(torch.float64, copy=True)

    def _sd_post(self, optimizer: Any, sd: dict[str, Any]) -> dict[str, Any]:
        if sd["param_groups"]:
            sd["param_groups"][0][self._entry] = self.state_dict()
        return sd

    def _load_pre(self, optimizer: Any, sd: dict[str, Any]) -> dict[str, Any]:
        groups = sd.get("param_groups") if isinstance(sd, dict) else None
        entry = None
        key = self._entry
        if isinstance(groups, list) and groups and isinstance(groups[0], dict) and key in groups[0]:
            entry = groups[0][key]
            _check_state(entry, self.capacity)  # (before the optimizer changes: a refused load changes nothing)
            sd["param_groups"] = [{k: v for k, v in groups[0].items() if k != key}, *groups[1:]]
        self._pending_load = entry
        return sd

    def _load_post(self, optimizer: Any) -> None:
        if self._pending_load is not None:  # (the optimizer's load succeeded: all or nothing)
            self.load_state_dict(self._pending_load)
            self._to_device(optimizer)
        self._pending_load = None

    def _to_device(self, optimizer: Any) -> None:
        """The buffers on the device of the optimizer's parameters (a checkpoint loaded elsewhere)."""
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
        if device is not None and self._values is not None:
            self._values = self._values.to(device)
            self._totals = None if self._totals is None else self._totals.to(device)


def find_modular(optimizer: Any) -> Any:
    """The `mo.Modular` inside a wrapper (`LightningOptimizer`, accelerate's `AcceleratedOptimizer`), or None."""
    from ..core.modular import Modular

    for _ in range(8):
        if optimizer is None or isinstance(optimizer, Modular):
            break
        optimizer = getattr(optimizer, "optimizer", getattr(optimizer, "_optimizer", None))
    return optimizer if isinstance(optimizer, Modular) else None


def _as(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype` on `device`, naming the device only when it differs (a same-device cast is no transfer)."""
    if t.device != device:
        return t.to(device, dtype)
    return t if t.dtype == dtype else t.to(dtype)


def _check_state(sd: Any, capacity: int) -> None:
    """A history state dict that this history can take, or a ValueError naming the entry."""
    try:
        _check_entries(sd, capacity)
    except ValueError as e:
        raise ValueError(f"{e} (nothing was changed)") from None


def _check_entries(sd: Any, capacity: int) -> None:
    need = ("version", "capacity", "columns", "plans", "slot_plan", "count", "delivered", "base", "values", "totals")
    if not isinstance(sd, dict) or any(k not in sd for k in need):
        missing = [k for k in need if not isinstance(sd, dict) or k not in sd]
        raise ValueError(f"History.load_state_dict: not a history state dict (missing {', '.join(missing)})")
    if sd["version"] != _VERSION:
        raise ValueError(f"History.load_state_dict: unsupported version {sd['version']!r} (this modopt reads {_VERSION})")
    if not isinstance(sd["capacity"], int) or isinstance(sd["capacity"], bool) or sd["capacity"] < 1:
        raise ValueError(f"History.load_state_dict: capacity must be an integer >= 1, got {sd['capacity']!r}")
    ints = ("count", "delivered", "base")
    for k in ints:
        if not isinstance(sd[k], int) or isinstance(sd[k], bool) or not 0 <= sd[k] < COUNT_MAX:
            raise ValueError(f"History.load_state_dict: {k} must be an integer in [0, 2**62), got {sd[k]!r:.60}")
    if sd["capacity"] != capacity and sd["count"] != sd["delivered"]:
        raise ValueError(f"History.load_state_dict: capacity {sd['capacity']!r} in the checkpoint, {capacity} here, "
                         f"with {sd['count'] - sd['delivered']} rows not yet delivered; build the history with the "
                         "checkpoint's capacity (or flush before saving)")
    capacity = sd["capacity"]  # (the saved buffer's own layout is checked below)
    if not sd["base"] <= sd["delivered"] <= sd["count"]:
        raise ValueError("History.load_state_dict: base <= delivered <= count does not hold")
    cols, plans, slots, values = sd["columns"], sd["plans"], sd["slot_plan"], sd["values"]
    if not isinstance(cols, list) or not all(isinstance(c, str) for c in cols) or len(set(cols)) != len(cols):
        raise ValueError("History.load_state_dict: columns must be a list of distinct strings")
    if not isinstance(plans, list) or not all(isinstance(p, list) and len(set(p)) == len(p) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(cols) for i in p) for p in plans):
        raise ValueError("History.load_state_dict: plans must be lists of distinct column indices")
    if not isinstance(slots, list) or len(slots) != capacity or not all(
            isinstance(i, int) and not isinstance(i, bool) and -1 <= i < len(plans) for i in slots):
        raise ValueError(f"History.load_state_dict: slot_plan must be {capacity} plan indices")
    held = range(max(sd["base"] + 1, sd["count"] - capacity + 1), sd["count"] + 1)  # (as `History._held`)
    empty = [s for s in held if slots[(s - 1) % capacity] < 0]
    if empty:
        raise ValueError(f"History.load_state_dict: the rows of steps {empty[0]}..{empty[-1]} are held (count "
                         f"{sd['count']}, base {sd['base']}) but slot_plan says they were never recorded")
    if values is None:
        if cols or len(held):
            raise ValueError(f"History.load_state_dict: values is None, but the history has {len(cols)} columns "
                             f"and {len(held)} rows")
    elif (not isinstance(values, torch.Tensor) or values.dtype != torch.float64 or values.is_meta
          or tuple(values.shape) != (capacity, len(cols))):
        raise ValueError(f"History.load_state_dict: values must be a float64 tensor of shape ({capacity}, {len(cols)})"
                         " holding values (not on the meta device)")
    totals = sd["totals"]
    if totals is None:
        return
    if (not isinstance(totals, torch.Tensor) or tuple(totals.shape) != (2,) or not totals.is_floating_point()
            or totals.is_meta):
        raise ValueError("History.load_state_dict: totals must be a floating-point tensor of 2 counts "
                         "(clipped_steps, nonfinite_steps)")
    t = totals.detach().to("cpu", torch.float64)  # (a load: read on the host)
    if not (torch.isfinite(t).all() and (t >= 0).all() and (t == t.round()).all() and (t <= sd["count"]).all()):
        raise ValueError(f"History.load_state_dict: totals must be whole counts in [0, count={sd['count']}], got "
                         f"{t.tolist()}")
