"""The spec layer: reference definitions in plain float64 PyTorch.

Readable, one segment at a time, written for clarity rather than speed. It
documents the math and is the oracle of the runtime tests. One file per
family, mirroring `modopt/transforms`.
"""

from . import adaptive, agc, caution, core, ema, growth, guards, orthogonal, percentile, scope, spam, stability, stats

__all__ = ["adaptive", "agc", "caution", "core", "ema", "growth", "guards", "orthogonal", "percentile", "scope", "spam", "stability",
           "stats"]
