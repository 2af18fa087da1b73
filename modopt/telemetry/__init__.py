"""Training telemetry that reaches loggers without syncing: a `History` of every step's stats on
the device, read back in one copy, and the sinks its rows go to (docs/howto/telemetry.md).

`LightningTelemetry` (needs lightning) and `HFTelemetry` (needs transformers) are imported on
first use.
"""

from __future__ import annotations

from typing import Any

from .history import DERIVED, MODULE, History, Sink, column_name, module_of
from .sinks import PREFIX, CsvSink, JsonlSink, TensorBoardSink, WandbSink, tag

__all__ = ["History", "Sink", "JsonlSink", "CsvSink", "TensorBoardSink", "WandbSink", "LightningTelemetry",
           "HFTelemetry", "DERIVED", "MODULE", "PREFIX", "tag", "column_name", "module_of"]


def __getattr__(name: str) -> Any:
    if name == "LightningTelemetry":
        from .lightning import LightningTelemetry

        return LightningTelemetry
    if name == "HFTelemetry":
        from .hf import HFTelemetry

        return HFTelemetry
    raise AttributeError(f"module 'modopt.telemetry' has no attribute {name!r}")
