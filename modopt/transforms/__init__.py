"""The module families, one file each.

What a family module lists in its `__all__` is exported from here, and flat
from `modopt` (`mo.ClipNorm`): a new transform goes in its family module and in
that module's `__all__`, with no change here. A new family module gets its two
lines below (`tests/test_spec_coverage.py` fails until it has them). The star
imports and `+=` are written out so that type checkers and the API docs see
every name without running the package.
"""

from __future__ import annotations

from . import (accumulate, adaptive, agc, caution, clipping, ema, growth, guards, masked, matrix_scale, normalization,
               optimizers, orthogonal, percentile, spam, stability, torch_optimizer, weights, wrappers)
from .accumulate import *  # noqa: F403
from .adaptive import *  # noqa: F403
from .agc import *  # noqa: F403
from .caution import *  # noqa: F403
from .clipping import *  # noqa: F403
from .ema import *  # noqa: F403
from .growth import *  # noqa: F403
from .guards import *  # noqa: F403
from .masked import *  # noqa: F403
from .matrix_scale import *  # noqa: F403
from .normalization import *  # noqa: F403
from .optimizers import *  # noqa: F403
from .orthogonal import *  # noqa: F403
from .percentile import *  # noqa: F403
from .spam import *  # noqa: F403
from .stability import *  # noqa: F403
from .torch_optimizer import *  # noqa: F403
from .weights import *  # noqa: F403
from .wrappers import *  # noqa: F403

__all__: list[str] = []
__all__ += accumulate.__all__
__all__ += adaptive.__all__
__all__ += agc.__all__
__all__ += caution.__all__
__all__ += clipping.__all__
__all__ += ema.__all__
__all__ += growth.__all__
__all__ += guards.__all__
__all__ += masked.__all__
__all__ += matrix_scale.__all__
__all__ += normalization.__all__
__all__ += optimizers.__all__
__all__ += orthogonal.__all__
__all__ += percentile.__all__
__all__ += spam.__all__
__all__ += stability.__all__
__all__ += torch_optimizer.__all__
__all__ += weights.__all__
__all__ += wrappers.__all__
