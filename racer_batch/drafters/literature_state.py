"""Draft state of the literature drafters (issue 8): the DraftState plus what they keep per scope.

Same scopes and lifecycle as ``DraftState`` (state.py); ``free`` also drops these parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .state import DraftState


@dataclass
class LiteratureState(DraftState):
    """Attributes beyond DraftState:

    rest: the REST datastores of the scope (static corpus + learned rows), or None.
    sam_corpus: the read-only suffix automaton of the static corpus (shared across states), or None.
    calibrator: graft's confidence calibration, learned across the rows of the scope, or None.
    """

    rest: Any = None
    sam_corpus: Any = None
    calibrator: Any = None

    def free(self) -> None:
        super().free()
        self.rest = None
        self.sam_corpus = None
        self.calibrator = None

    @property
    def memory_bytes(self) -> int:
        n = super().memory_bytes
        if self.rest is not None:
            n += self.rest.nbytes
        return n
