"""What `torch.compile` must treat specially (functions it must not trace, results it takes as constants),
marked on first use.

`torch.compiler.disable` and `torch.compiler.assume_constant_result` import `torch._dynamo`, which takes
about as long as `import torch`; called at import they made `import modopt` twice as slow. A module
registers its function here (`disabled`, `constant`) and traced code reads the marked one as an attribute
of this module: dynamo resolves a module attribute it does not find with a real `getattr`, so
`__getattr__` below marks the function while dynamo traces (with `torch._dynamo` loaded by then), and
dynamo sees the same marked function it would have seen had it been marked at import.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

#: True while `modopt.compile_step`'s function traces or runs (`modopt.core.compiled`): traced code then
#: keeps the kernels whose rounding the eager step has (torch's fused optimizer kernel, `_foreach_norm`)
#: as single ops of the graph, so the compiled step gives the eager step's bits. A module global read by
#: traced code: dynamo guards on it.
KEEP_EAGER_KERNELS = False

#: `modopt::norms` (`compiled.stacked_norms`) once `compile_step` declared its ops, else None: the per-tensor
#: norms as one op that returns them stacked (one graph output where `_foreach_norm` gave one per tensor)
NORMS: Any = None

#: name -> (function, how to mark it): filled at import by the modules that own the functions
_PENDING: dict[str, tuple[Callable[..., Any], Callable[[Callable[..., Any]], Callable[..., Any]]]] = {}


def disabled(name: str, fn: Callable[..., Any], reason: str) -> None:
    """`torch.compiler.disable(fn, reason=reason)`, as this module's attribute `name` once first read."""
    _PENDING[name] = (fn, lambda f: torch.compiler.disable(f, reason=reason))


def constant(name: str, fn: Callable[..., Any]) -> None:
    """`torch.compiler.assume_constant_result(fn)`, as this module's attribute `name` once first read."""
    _PENDING[name] = (fn, torch.compiler.assume_constant_result)


def dynamo_loaded() -> bool:
    """Whether `torch._dynamo` is imported: without it no frame can be compiled, so a disabled function
    behaves exactly as the plain one and eager code can skip the wrapper."""
    return "torch._dynamo" in sys.modules


def __getattr__(name: str) -> Callable[..., Any]:
    try:
        fn, mark = _PENDING[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    marked = globals()[name] = mark(fn)  # cached: dynamo's guards then find a plain attribute
    return marked
