"""Engine layer: model runner, draft-tree verification, stop rules, reference decoding."""

from .engine import Engine, encode_prompt
from .reference import generate_reference

__all__ = ["Engine", "encode_prompt", "generate_reference"]
