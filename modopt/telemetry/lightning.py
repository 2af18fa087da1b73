"""`LightningTelemetry`: a Lightning `Callback` that records a `History` of every `Modular` the
trainer drives and writes its rows into the trainer's own loggers (`logger.log_metrics`)."""

from __future__ import annotations

from typing import Any, Iterable

import lightning.pytorch as pl

from .history import History, Sink, find_modular
from .sinks import tagged


class LightningTelemetry(pl.Callback):
    """`LightningTelemetry(capacity=1024, every=50, module_depth=None, sinks=())`.

    On `fit` it attaches a `History` to the first `mo.Modular` of `trainer.optimizers`; every
    `every` steps (and at the end of training) the new rows go to each of `trainer.loggers`
    as `modopt/<column>` at the row's step (the optimizer step count), and to `sinks`. The
    history rides in the optimizer's state dict, so a Lightning checkpoint carries it and a
    resumed fit continues it.
    """

    def __init__(self, capacity: int = 1024, every: int | None = 50, module_depth: int | None = None,
                 sinks: Iterable[Sink] = ()):
        super().__init__()
        self.history: History = History(capacity, every, module_depth, [*sinks, self])
        self._trainer: Any = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Remember the trainer (its loggers receive the rows)."""
        self._trainer = trainer

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Attach the history to the first `mo.Modular` of `trainer.optimizers`."""
        opt = next((m for m in map(find_modular, trainer.optimizers) if m is not None), None)
        if opt is None:
            raise TypeError("LightningTelemetry: configure_optimizers returned no modopt.Modular")
        self.history.attach_to(opt, names=pl_module.named_parameters())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Deliver the last rows and detach."""
        self.history.close()
        self.history.detach()

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Log each row into every logger of the trainer (`log_metrics`, at the row's step)."""
        for logger in self._trainer.loggers if self._trainer is not None else ():
            for r in rows:
                logger.log_metrics(tagged(r), step=r["step"])
