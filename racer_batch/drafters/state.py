"""Draft state scopes (RACER.md section 7): who shares the automaton and the copy-logit store.

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

from .automaton import Automaton
from .copy_logits import CopyLogitStore

_ids = itertools.count(1)


@dataclass
class DraftState:
    """The long-lived drafting state of one scope.

    Attributes:
        scope: ``job``, ``request`` or ``global``.
        store: the copy-logit store (None for drafters that do not use it).
        automaton: the retrieval automaton (None for drafters that do not use it).
        state_id: process-unique id, for telemetry and tests of isolation.
    """

    scope: str
    store: CopyLogitStore | None = None
    automaton: Automaton | None = None
    state_id: int = field(default_factory=lambda: next(_ids))
    freed: bool = False
    rows: int = 0

    def check_alive(self) -> None:
        if self.freed:
            raise ValueError(f"draft state {self.state_id} ({self.scope} scope) was freed and cannot be reused")

    def free(self) -> None:
        """Drop the automaton and the store; the state cannot be used afterwards."""
        self.store = None
        self.automaton = None
        self.freed = True

    @property
    def memory_bytes(self) -> int:
        """Approximate bytes held (store table plus automaton nodes at ~200 bytes each)."""
        n = self.store.nbytes if self.store is not None else 0
        if self.automaton is not None:
            n += 200 * self.automaton.num_nodes
        return n
