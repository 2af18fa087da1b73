"""Values the host knows (Python numbers, index lists) as tensors on the device, without a host sync.

`torch.tensor(values, device="cuda")` copies from pageable host memory with a blocking copy: a sync, which
`torch.cuda.set_sync_debug_mode("error")` refuses and the default step never makes. Here the values are
made on the CPU and sent with `non_blocking=True` (from pageable memory CUDA stages the source before the
call returns, so the CPU tensor may go at once); a 0-d value is filled on the device instead.
"""

from __future__ import annotations

from typing import Any

import torch


def on_device(values: Any, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """`values` (a number or nested lists of numbers) as a tensor of `dtype` on `device`, with no sync."""
    if isinstance(values, (int, float, bool)):
        return torch.full((), values, dtype=dtype, device=device)
    t = torch.tensor(values, dtype=dtype)
    return t if t.device == torch.device(device) else t.to(device, non_blocking=True)
