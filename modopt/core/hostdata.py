"""Values the host knows (Python numbers, index lists) as tensors on the device, without a host sync.

`torch.tensor(values, device="cuda")` copies from pageable host memory with a blocking copy: a sync, which
`torch.cuda.set_sync_debug_mode("error")` refuses and the default step never makes. Here the values are
made on the CPU and sent with `non_blocking=True` (from pageable memory CUDA stages the source before the
call returns, so the CPU tensor may go at once); a 0-d value is filled on the device instead.

And where the host may read a value instead (`reads_on_host`): on the CPU, where a read only reads memory,
unless `device_path()` asks for what a GPU runs.
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


#: A step over parameters on the CPU reads the device's non-finite decision back on the host (where that
#: only reads memory) when its plan allows it (`Plan.host_on_cpu`), and transforms read other values there
#: to skip work (`reads_on_host`). False keeps the device path on the CPU too (`device_path`).
HOST_ON_CPU = True


def reads_on_host(t: torch.Tensor) -> bool:
    """Whether the step may read `t`'s values on the host to leave out work the value makes useless (a
    moment reset that is not due, a clip that cuts nothing): `t` on the CPU, where a read only reads memory,
    outside a compiled step, unless `device_path` is in force. Either way the results are the same bits."""
    return HOST_ON_CPU and t.device.type == "cpu" and not torch.compiler.is_compiling()


def cpu_kernels(t: torch.Tensor) -> bool:
    """Whether work on `t` is planned for a CPU (where a call costs about a memory sweep of a few thousand
    elements) rather than a GPU (where a launch costs about a sweep of millions): `t` on the CPU, unless
    `device_path` asks for what a GPU runs. Only the speed differs, never the values."""
    return HOST_ON_CPU and t.device.type == "cpu"


@contextlib.contextmanager
def device_path() -> Iterator[None]:
    """Inside it, steps on the CPU take the device path (no host read of any decision, kernels chosen as for
    a GPU, `cpu_kernels`): what a GPU runs.
    The tests and benchmarks that count syncs, ops and bytes run their steps inside it."""
    global HOST_ON_CPU
    was, HOST_ON_CPU = HOST_ON_CPU, False
    try:
        yield
    finally:
        HOST_ON_CPU = was
