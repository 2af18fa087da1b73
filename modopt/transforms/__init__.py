"""The module families, one file each."""

from .clipping import ClipNorm, ClipValue
from .guards import Identity
from .normalization import Centralize, GradientCentralization, Normalize
from .optimizers import LR, SGD, Adam, AdamW, TorchOptimizer

__all__ = [
    "ClipNorm", "ClipValue", "Identity", "Centralize", "GradientCentralization", "Normalize",
    "LR", "SGD", "Adam", "AdamW", "TorchOptimizer",
]
