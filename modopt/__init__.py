"""modopt: composable optimizer modules for PyTorch.

    import modopt as mo
    opt = mo.Modular(model.parameters(), mo.ClipNorm(1.0), mo.Normalize(), mo.Adam(lr=1e-3))
"""

from . import attention
from .attention import AttentionLogits
from .config import ConfigError, PipelineConfig, config_schema, load_config
from .core.attach import attach
from .core.compiled import compile_step, cuda_graph_step, tensor_hyperparams
from .core.modular import Modular
from .core.registry import available, register_optimizer, trust_imports
from .core.scope import Scoped
from .core.select import Select
from .core.state import Buffer
from .core import roles
from .core.roles import Chain
from .core.transform import Transform
from .lint import LintWarning
from .functional import clip_grad_norm_, clip_grad_percentile_, clip_grad_value_, grad_norm, normalize_grads_
from .rewind import Rewind, RewindConfig, RewindError, RewindEvent
from .telemetry import History
from .transforms import *  # noqa: F401,F403  (every transform, flat, like optax)
from .transforms import __all__ as _transforms_all

__version__ = "0.1.0"

__all__ = [
    "Transform", "Chain", "roles", "Modular", "Scoped", "Select", "PipelineConfig", "ConfigError", "load_config", "config_schema",
    "available", "register_optimizer", "trust_imports", "attach",
    "compile_step", "cuda_graph_step", "tensor_hyperparams",
    "clip_grad_norm_", "clip_grad_value_", "grad_norm", "normalize_grads_", "clip_grad_percentile_",
    *_transforms_all,
    "Buffer", "History", "LintWarning", "AttentionLogits",
    "Rewind", "RewindConfig", "RewindError", "RewindEvent",
]
