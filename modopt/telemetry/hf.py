"""`HFTelemetry`: a Hugging Face `TrainerCallback` that records a `History` of the Trainer's
`mo.Modular` and appends its rows to the Trainer's own `state.log_history`."""

from __future__ import annotations

from typing import Any, Iterable

from transformers import TrainerCallback

from .history import History, Sink
from .history import find_modular
from .sinks import tagged


class HFTelemetry(TrainerCallback):
    """`HFTelemetry(capacity=1024, every=50, module_depth=None, sinks=())`.

    At `on_train_begin` it attaches a `History` to the Trainer's optimizer (a `mo.Modular`,
    possibly wrapped by accelerate), with the model's parameter names. Every `every` steps and
    at the end of training the new rows are appended to `state.log_history` as
    `{"modopt/<column>": value, ..., "step": n}` (saved in `trainer_state.json` with each
    checkpoint), and go to `sinks`. The history rides in `optimizer.pt`, so
    `resume_from_checkpoint` continues it.
    """

    def __init__(self, capacity: int = 1024, every: int | None = 50, module_depth: int | None = None,
                 sinks: Iterable[Sink] = ()):
        self.history: History = History(capacity, every, module_depth, [*sinks, self])
        self._pending: list[dict[str, Any]] = []
        self._state: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, model: Any = None,
                       **kwargs: Any) -> None:
        """Attach the history to the Trainer's `mo.Modular`, with the model's parameter names."""
        opt = find_modular(optimizer)
        if opt is None:
            raise TypeError("HFTelemetry: the Trainer's optimizer is not a modopt.Modular "
                            "(pass optimizer_cls_and_kwargs=(mo.Modular, {...}))")
        self._state = state
        if not self.history._handles:
            self.history.attach_to(opt, names=model.named_parameters() if model is not None else None)

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Append the rows to the Trainer's `state.log_history`."""
        if self._state is not None:
            self._state.log_history.extend({**tagged(r), "step": r["step"]} for r in rows)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Deliver the last rows."""
        self.history.close()
