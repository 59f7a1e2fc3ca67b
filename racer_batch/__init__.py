"""racer-batch: batch generation with RACER lossless speculative decoding.

Public names live here (STYLE.md habit 1); layers: cli -> service -> engine -> drafters.
"""

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
