"""Drafters (pure: torch/numpy only): draft trees from retrieval, copy logits and prompt lookup.

Every decoding method is one ``DecodingMethod`` in the registry (registry.py); ``make_state`` / ``make_drafter``
dispatch through it.
"""

from .base import Draft, TrieBuilder, Verified
from .registry import (
    DecodingMethod,
    get_method,
    make_drafter,
    make_state,
    method_names,
    register_method,
    unregister_method,
)
from .state import DraftState

__all__ = [
    "Draft",
    "DraftState",
    "DecodingMethod",
    "TrieBuilder",
    "Verified",
    "make_drafter",
    "make_state",
    "method_names",
    "get_method",
    "register_method",
    "unregister_method",
]
