"""The module families, one file each."""

from .clipping import ClipNorm, ClipValue
from .accumulate import Accumulate
from .adaptive import AutoClip, EMACriterion, HistClip, ZClip, ZScoreNormalize, ZStatCriterion
from .agc import AGC
from .ema import ClipNormByEMA, ClipValueByEMA, NormalizeByEMA
from .growth import ClipNormGrowth, ClipValueGrowth
from .guards import Identity, ZeroNonFinite
from .percentile import ClipValueByPercentile
from .normalization import Centralize, GradientCentralization, Normalize
from .optimizers import LR, SGD, Adam, AdamW, TorchOptimizer
from .masked import Masked

__all__ = [
    "ClipNorm", "ClipValue", "Identity", "Centralize", "GradientCentralization", "Normalize",
    "LR", "SGD", "Adam", "AdamW", "TorchOptimizer",
    "ClipNormByEMA", "NormalizeByEMA", "ClipValueByEMA", "ClipNormGrowth", "ClipValueGrowth",
    "HistClip", "EMACriterion", "ZStatCriterion", "ZClip", "AutoClip", "ZScoreNormalize",
    "ClipValueByPercentile", "AGC", "ZeroNonFinite", "Accumulate", "Masked",
]
