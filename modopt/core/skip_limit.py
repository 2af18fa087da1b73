"""The consecutive-skip limit: stop a run whose steps are all skipped (`max_consecutive_skips`).

A step is skipped for non-finite gradients (`nonfinite="skip"`) or by a transform that decides to skip it
(`SkipNorm`, `SkipStep`). A run whose gradients stay NaN, or whose norm stays above a threshold, would
otherwise skip every step for ever and still look like training. `Modular(..., max_consecutive_skips=N)`
(or the config's field) keeps, on the device, the length of the current run of skipped steps and, within
it, how many were skipped for each cause; when it reaches N the run stops with `SkipLimitError`.

The count costs no host sync in the step (a few ops on 0-d tensors, on the device). The host learns it:

* on the CPU (unless the optimizer takes the device path, `hostdata.Host`), by reading it as the step ends (a read of memory): the error comes
  from the Nth skipped call itself;
* on CUDA, the step ends by copying the count (three int64) to pinned host memory without blocking,
  and the next `opt.step()` reads that copy first, before it changes anything: the error comes from
  the call after the Nth skipped one, with the parameters as the Nth skip left them. The host waits
  there for the copy's event, that is for the device to finish the previous step, which sits before
  this step's forward and backward in the device's queue: the host never waits for those. Every rank
  reads the same count at the same call (the skip decision is the same on every rank), so every rank
  stops at the same call. On another accelerator (no event here) that read waits for the device;
* `check()` reads the count at once (one wait): after the last step (the CLI calls it), and after
  compiled steps or a CUDA graph's replays, which keep the count on the device and leave the host's
  part out.
"""

from __future__ import annotations

from typing import Any

import torch

from .runner import CPU_FALSE

__all__ = ["SkipLimit", "SkipLimitError"]


class SkipLimitError(FloatingPointError):
    """`max_consecutive_skips` steps in a row were skipped: the run stops (a `FloatingPointError`, as
    `nonfinite="raise"`'s error, so the CLI exits with status 4, a stop the config asked for).

    `limit`: N; `skipped`: the skips of the run counted when it was read (N on the CPU); `nonfinite`,
    `by_rule`: how many of them were skipped for non-finite gradients and by a skip transform."""

    def __init__(self, message: str, limit: int, skipped: int, nonfinite: int, by_rule: int) -> None:
        super().__init__(message)
        self.limit, self.skipped, self.nonfinite, self.by_rule = limit, skipped, nonfinite, by_rule


#: `consecutive_skips` of a step that went ahead by the host's decision (a shared value: never written)
_CPU_ZERO = torch.zeros((), dtype=torch.int64)


def consecutive_skips_ok(t: Any) -> bool:
    """Whether a checkpoint's `consecutive_skips` is a count this class keeps: a 1-D integer tensor of 3
    values >= 0, the first (skips in a row) the sum of the others (of them non-finite, by a rule). Read on
    the host: a load is not a step."""
    if (not isinstance(t, torch.Tensor) or t.shape != (3,) or t.is_floating_point() or t.is_complex()
            or t.dtype == torch.bool or t.is_meta):
        return False
    run, nonfinite, by_rule = t.tolist()
    return min(run, nonfinite, by_rule) >= 0 and run == nonfinite + by_rule


class SkipLimit:
    """The consecutive-skip count of one optimizer and its host check (see the module's docs).

    `limit`: N >= 1. `nonfinite`: whether the step's `nonfinite` telemetry is a cause of skips (the
    `"skip"` policy). `rules`: the state keys of the transforms that skip steps (`SkipDecider`s), named
    in the error."""

    def __init__(self, limit: int, nonfinite: bool, rules: tuple[str, ...]) -> None:
        self.limit = limit
        self.nonfinite = nonfinite
        self.rules = rules
        #: on the device: (skips in a row, of them non-finite, of them by a rule), int64; None: no skip yet
        self.counts: torch.Tensor | None = None
        self._host: torch.Tensor | None = None  # the host copy of `counts` (pinned on CUDA)
        self._event: Any = None  # marks the end of the copy into `_host` (CUDA)
        self._last: torch.Tensor | None = None  # the count to read at the next step, elsewhere
        self._pending = False  # a count the host has not read yet

    @classmethod
    def of(cls, limit: int | None, plan: Any) -> "SkipLimit | None":
        """The limit of a pipeline's `plan` (`modopt.core.plan.Plan`), or None for no limit."""
        if limit is None:
            return None
        from .roles import SkipDecider  # (roles imports the runner, as this module does: no cycle at load)

        rules = tuple(f"{i}:{type(t).__name__}" for i, t in enumerate(plan.transforms) if isinstance(t, SkipDecider))
        return cls(limit, plan.nonfinite == "skip", rules)

    # --- in the step ------------------------------------------------------------------------------
    def before_step(self) -> None:
        """Read the count the previous step copied (an accelerator), before this step changes anything;
        raise `SkipLimitError` when the limit is reached."""
        if self._pending and self._host_side():
            self._read()

    def after_step(self, stats: dict[str, torch.Tensor], device_path: bool = False) -> None:
        """Count this step (its `skipped`, `nonfinite` and `skipped_steps` telemetry): on the device, no
        sync. Adds `consecutive_skips` to `stats`. On the CPU, raise `SkipLimitError` now when the limit
        is reached; elsewhere (or with the optimizer's `device_path`) start the copy the next step reads."""
        skipped = stats.get("skipped")
        if skipped is None:  # no parameter had a gradient: nothing was stepped, nothing counts
            return
        if skipped is CPU_FALSE:  # the host decided, and the step went ahead: the run is broken (no op)
            self.counts = None
            stats["consecutive_skips"] = _CPU_ZERO
            return
        dev = stats["skipped_steps"].device  # (where the optimizer counts its skips)
        s = skipped.to(dev, non_blocking=True)
        nf = stats.get("nonfinite") if self.nonfinite else None
        nf = s & nf.to(dev, non_blocking=True) if nf is not None else torch.zeros_like(s)
        inc = torch.stack([s, nf, s & ~nf]).to(torch.int64)
        counts = inc if self.counts is None else (self.counts + inc) * s
        self.counts = counts
        stats["consecutive_skips"] = counts[0]
        if not self._host_side():
            return
        if counts.device.type == "cpu" and not device_path:  # the CPU: reading is free
            self._raise_if_over(counts.tolist(), "this opt.step() was the last of them")
        else:
            self._copy(counts)

    def check(self) -> None:
        """Read the count now and raise `SkipLimitError` when the limit is reached (one wait for the
        device); call it after the last step, and after compiled or captured steps, which leave the
        count on the device."""
        if self.counts is not None:
            self._pending = False
            self._raise_if_over(self.counts.tolist(), "read by check() after the steps")

    def restore(self, counts: torch.Tensor | None, device: torch.device) -> None:
        """Continue the run of skipped steps a checkpoint recorded (`consecutive_skips_ok`), or none."""
        self.counts = None if counts is None else counts.to(device)
        self._last, self._pending = None, False

    # --- the host's side ------------------------------------------------------------------------------
    def _host_side(self) -> bool:
        """Whether this code runs on the host: not traced, not captured into a CUDA graph."""
        if torch.compiler.is_compiling():
            return False
        c = self.counts
        return not (c is not None and c.device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def _copy(self, counts: torch.Tensor) -> None:
        """Start the host's copy of `counts`, which the next step reads (`_read`)."""
        if counts.device.type == "cuda":  # into pinned memory, without blocking; an event marks its end
            if self._host is None:
                self._host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
                self._event = torch.cuda.Event()
            self._host.copy_(counts, non_blocking=True)
            self._event.record(torch.cuda.current_stream(counts.device))
            self._last = None
        else:  # the CPU's device path (what the tests count) or another accelerator: the next step reads it
            self._last = counts  # (never written in place: each step's count is a new tensor)
        self._pending = True

    def _read(self) -> None:
        """Read the copy the previous step started and raise when the limit is reached."""
        self._pending = False
        if self._last is not None:  # (on another accelerator than CUDA this read waits for the device)
            values = self._last.tolist()
        elif self._host is None:  # (unpickled with a copy pending: the count itself, once)
            assert self.counts is not None
            values = self.counts.tolist()
        else:
            self._event.synchronize()  # the previous step's copy, not this step's work
            values = self._host.tolist()
        self._raise_if_over(values, "read at the start of the next opt.step(), which changed nothing (on an "
                                    "accelerator the count is read one step late)")

    def _raise_if_over(self, values: list[int], when: str) -> None:
        run, nonfinite, by_rule = values
        if run < self.limit:
            return
        causes = []
        if nonfinite:
            causes.append(f"{nonfinite} for a non-finite gradient norm (nonfinite='skip')")
        if by_rule:
            causes.append(f"{by_rule} by {' / '.join(self.rules) or 'a skip transform'} (its telemetry says why)")
        raise SkipLimitError(
            f"{run} steps in a row were skipped (max_consecutive_skips={self.limit}), so the run stops: "
            f"{', '.join(causes)}; {when}. The parameters are as the last step that went ahead left them. "
            "The run is diverging, or a skip threshold is below its norms: see the telemetry (opt.stats, "
            "metrics.jsonl), or raise max_consecutive_skips (null: no limit)",
            self.limit, run, nonfinite, by_rule)

    def __getstate__(self) -> dict[str, Any]:
        # (a CUDA event and pinned memory do not pickle: the next step reads the count itself, once)
        state = dict(self.__dict__)
        state.update(_host=None, _event=None)
        return state
