"""Draft state scopes (docs/method.md section 7): who shares the automaton and the copy-logit store.

* ``job`` (default): one state for the rows of one job on one worker; created at the job's first row,
  freed at its end.
* ``request``: a fresh state for every row.
* ``global``: one state for the whole process (the reference code's behaviour; opt-in, because it lets
  one job's text shape another job's drafts).

Memory is bounded in every scope: the automaton never holds more than ``max_nodes`` nodes and the store
is a fixed ``[vocab, k]`` table.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .automaton import Automaton
from .copy_logits import CopyLogitStore
from .snapshot import TextHistory

_ids = itertools.count(1)


@dataclass
class DraftState:
    """The long-lived drafting state of one scope.

    Attributes:
        scope: ``job``, ``request`` or ``global``.
        store: the copy-logit store (None for drafters that do not use it).
        automaton: the retrieval automaton (None for drafters that do not use it).
        native: RACER's automaton and copy-logit store on the native draft core (``drafters.native``), which
            the engine proposes from and updates for all rows of a step at once; None where the Python
            ``automaton`` / ``store`` serve (other drafters, or ``RACER_NATIVE_DRAFT=off``).
        state_id: process-unique id, for telemetry and tests of isolation.
    """

    scope: str
    store: CopyLogitStore | None = None
    automaton: Automaton | None = None
    native: Any = None  # drafters.native.NativeDraftState: RACER's automaton and store in C++ (instead of the two)
    state_id: int = field(default_factory=lambda: next(_ids))
    freed: bool = False
    rows: int = 0
    # the texts it learned from, kept where the state can be saved (scope job; drafters/snapshot.py), and the
    # store as it was when last loaded or saved (what a save compares against)
    history: TextHistory | None = None
    store_base: Any = None

    def check_alive(self) -> None:
        if self.freed:
            raise ValueError(f"draft state {self.state_id} ({self.scope} scope) was freed and cannot be reused")

    def start_row(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        """A drafter of this state starts a row: the state must be alive; the row is counted and, given the
        prompt's top-k, the copy-logit store learns it (the ``start`` of the drafters that use the store alone)."""
        self.check_alive()
        self.rows += 1
        if prompt_topk is not None and len(prompt_ids):
            self.store.update(np.asarray(prompt_ids, dtype=np.int64), prompt_topk)

    def learned(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """A row ended: keep its text (prompt, then output) where the state keeps a history."""
        if self.history is not None:
            self.history.add([*prompt_ids, *output_ids])

    def free(self) -> None:
        """Drop the automaton and the store; the state cannot be used afterwards."""
        self.store = None
        self.automaton = None
        self.history = None
        self.store_base = None
        if self.native is not None:
            self.native.free()
        self.native = None
        self.freed = True

    @property
    def memory_bytes(self) -> int:
        """Approximate bytes held (store table plus automaton nodes at ~200 bytes each)."""
        n = self.store.nbytes if self.store is not None else 0
        if self.automaton is not None:
            n += 200 * self.automaton.num_nodes
        if self.native is not None:
            n += self.native.memory_bytes
        return n

    def store_row(self, token: int) -> np.ndarray:
        """``[k]`` the shared copy-logit store's row of ``token`` (Python or native; -1: nothing known)."""
        if self.native is not None:
            return self.native.store_row(token)
        if self.store is None:
            raise ValueError("this draft state has no copy-logit store")
        return self.store.row(token)

    @property
    def store_known(self) -> int:
        """Tokens whose shared store row holds a prediction (0 without a store)."""
        if self.native is not None:
            return self.native.store_known if self.native.use_logits else 0
        return int((self.store.table[:, 0] >= 0).sum()) if self.store is not None else 0

    @property
    def automaton_nodes(self) -> int:
        """Live automaton nodes (Python or native); 0 without an automaton."""
        if self.native is not None:
            return self.native.num_nodes if self.native.use_retrieval else 0
        return self.automaton.num_nodes if self.automaton is not None else 0
