"""Drafters (pure: torch/numpy only): draft trees from retrieval, copy logits and prompt lookup."""

from .base import Draft, TrieBuilder, Verified
from .methods import make_drafter, make_state
from .state import DraftState

__all__ = ["Draft", "DraftState", "TrieBuilder", "Verified", "make_drafter", "make_state"]
