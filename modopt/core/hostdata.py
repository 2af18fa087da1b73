"""Values the host knows (Python numbers, index lists) as tensors on the device, without a host sync.

`torch.tensor(values, device="cuda")` copies from pageable host memory with a blocking copy: a sync, which
`torch.cuda.set_sync_debug_mode("error")` refuses and the default step never makes. Here the values are
made on the CPU and sent with `non_blocking=True` (from pageable memory CUDA stages the source before the
call returns, so the CPU tensor may go at once); a 0-d value is filled on the device instead.

And where the host may read a value instead: on the CPU, where a read only reads memory, unless the host
takes the device path (`Host.device_path`, what a GPU runs). Each step reads that once, when it is made
(`modopt.core.step.Step.host_reads`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def on_device(values: Any, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """`values` (a number or nested lists of numbers) as a tensor of `dtype` on `device`, with no sync."""
    if isinstance(values, (int, float, bool)):
        return torch.full((), values, dtype=dtype, device=device)
    t = torch.tensor(values, dtype=dtype)
    return t if t.device == torch.device(device) else t.to(device, non_blocking=True)


class Host:
    """What every state host (`Modular`, an `attach` handle, a `ScratchHost`) says about where its steps read
    values. `device_path`: take what a GPU runs on the CPU too (no host read of any decision, kernels chosen
    as for a GPU), for the tests and benchmarks that count what a GPU pays for; the results are the same bits
    either way. Read once per step, when the step is made (`modopt.core.step.Step`: `host_reads`,
    `cpu_kernels`); set it on one optimizer (`opt.device_path = True`) or for every host inside
    `device_path()`."""

    device_path: bool = False


def refuse_device_path(value: Any) -> None:
    """Raise for a `device_path` that is not True or False (set by hand on an optimizer): a `TypeError` naming
    it, before the step changes anything. The readers test `value is True or value is False` inline first."""
    raise TypeError(f"device_path is {value!r}: set opt.device_path to True (take a GPU's path on the CPU too) "
                    "or False (the default); nothing was stepped")


@contextlib.contextmanager
def device_path() -> Iterator[None]:
    """Inside it, every host that does not set its own `device_path` takes the device path on the CPU too
    (what a GPU runs: `Host`). The tests and benchmarks that count syncs, ops and bytes run their steps inside it."""
    was, Host.device_path = Host.device_path, True
    try:
        yield
    finally:
        Host.device_path = was
