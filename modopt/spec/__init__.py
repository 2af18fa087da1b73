"""The spec layer: reference definitions in plain float64 PyTorch.

Readable, one segment at a time, written for clarity rather than speed. It
documents the math and is the oracle of the runtime tests.
"""

from . import core, scope, stats

__all__ = ["core", "scope", "stats"]
