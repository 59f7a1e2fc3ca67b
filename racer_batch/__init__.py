"""racer-batch: batch generation with RACER lossless speculative decoding.

Public names live here (docs/method.md 10.1); layers: cli -> service -> engine -> drafters.
"""

from .drafters import registry as _registry  # noqa: F401 - installs the decoding methods into values (DecodingConfig)
from .engine import Engine, generate_reference
from .models import DEFAULT_MODEL, ModelBundle, ModelLoadError, load_model
from .values import METHODS, DecodingConfig, GenerationParams, GenerationResult, RowStats

__all__ = [
    "DEFAULT_MODEL",
    "METHODS",
    "DecodingConfig",
    "Engine",
    "GenerationParams",
    "GenerationResult",
    "ModelBundle",
    "ModelLoadError",
    "RowStats",
    "generate_reference",
    "load_model",
]
__version__ = "0.1.0"
