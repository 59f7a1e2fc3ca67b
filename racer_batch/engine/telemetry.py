"""Per-row telemetry of the batched decode step (engine/step.py): a row of counters per stream in flight, added
to once per step for all rows, moved into the row's ``RowStats`` when it ends."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..values import StepRecord

# the counters of one row's telemetry (Telemetry columns)
TEL_FIELDS = ("steps", "emitted", "accepted", "retrieval", "logits", "both", "other", "tree_tokens",
              "draft_ms", "verify_ms", "update_ms")
_HIST = 65  # accepted-length histogram bins (0 .. 64; longer lengths go in the last)
_DRAFT_MS = TEL_FIELDS.index("draft_ms")  # draft_ms, verify_ms, update_ms: the last three columns, in that order
_STEPS, _EMITTED, _TREE = TEL_FIELDS.index("steps"), TEL_FIELDS.index("emitted"), TEL_FIELDS.index("tree_tokens")


class Telemetry:
    """Per-row counters of every row in flight: one ``[rows, len(TEL_FIELDS)]`` float table and one accepted-
    length histogram ``[rows, 65]``, each added to once per step for all rows (``np.add.at``)."""

    def __init__(self) -> None:
        self.table = np.zeros((8, len(TEL_FIELDS)))
        self.hist = np.zeros((8, _HIST), dtype=np.int64)
        self._free = list(range(7, -1, -1))

    def open(self) -> int:
        """A zeroed row for a new stream; returns its index."""
        if not self._free:
            n = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.hist = np.concatenate([self.hist, np.zeros_like(self.hist)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        tid = self._free.pop()
        self.table[tid] = 0.0
        self.hist[tid] = 0
        return tid

    def close(self, tid: int, stats: Any) -> None:
        """Add row ``tid``'s counters into ``stats`` (a ``RowStats``) and free the row."""
        v = dict(zip(TEL_FIELDS, self.table[tid].tolist()))
        stats.steps += int(v["steps"])
        stats.emitted_tokens += int(v["emitted"])
        stats.accepted_retrieval += int(v["retrieval"])
        stats.accepted_logits += int(v["logits"])
        stats.accepted_both += int(v["both"])
        stats.accepted_other += int(v["other"])
        stats.tree_tokens += int(v["tree_tokens"])
        stats.draft_ms += v["draft_ms"]
        stats.verify_ms += v["verify_ms"]
        stats.update_ms += v["update_ms"]
        for n in np.nonzero(self.hist[tid])[0]:
            stats.accepted_hist[int(n)] = stats.accepted_hist.get(int(n), 0) + int(self.hist[tid, n])
        self._free.append(tid)

    def add_times(self, tids: np.ndarray, ms: tuple[float, float, float]) -> None:
        """Add ``ms`` (each row's draft, verify and update ms of one step) to the rows ``tids [B]`` (distinct),
        whose other counters the native commit already added (``drafters.native.commit_greedy_batch``)."""
        if len(tids) <= 4:  # a few rows: plain indexing (an index array with a slice costs ~10 us)
            for t in tids.tolist():
                row = self.table[t]
                row[_DRAFT_MS] += ms[0]
                row[_DRAFT_MS + 1] += ms[1]
                row[_DRAFT_MS + 2] += ms[2]
        else:
            self.table[tids, _DRAFT_MS: _DRAFT_MS + 3] += ms

    def add_roots(self, tids: list[int], emitted: list[int], tree_tokens: list[int],
                  ms: tuple[float, float, float]) -> None:
        """One step of rows ``tids`` (distinct) that accepted no draft node (AR's roots, or trees none of whose
        nodes was taken): steps + 1, ``emitted [B]`` and ``tree_tokens [B]`` added, nothing accepted (histogram
        bin 0), and each row's draft, verify and update ``ms``. The same counts as :meth:`add` with a values
        block of those columns, without building it (the AR step's telemetry was ~60 us at B = 1 of numpy calls;
        benchmarks/README.md, "The standing Decode, AR's telemetry, and numpy calls after a cold forward")."""
        if len(tids) <= 4:  # a few rows: plain indexing
            table, hist = self.table, self.hist
            for t, e, n in zip(tids, emitted, tree_tokens):
                row = table[t]
                row[_STEPS] += 1.0
                row[_EMITTED] += e
                row[_TREE] += n
                row[_DRAFT_MS] += ms[0]
                row[_DRAFT_MS + 1] += ms[1]
                row[_DRAFT_MS + 2] += ms[2]
                hist[t, 0] += 1
            return
        idx = np.asarray(tids, dtype=np.int64)
        self.table[idx, _STEPS] += 1.0
        self.table[idx, _EMITTED] += np.asarray(emitted, dtype=np.float64)
        self.table[idx, _TREE] += np.asarray(tree_tokens, dtype=np.float64)
        self.table[idx, _DRAFT_MS: _DRAFT_MS + 3] += ms
        self.hist[idx, 0] += 1

    def add(self, tids: np.ndarray, values: np.ndarray, accepted: np.ndarray) -> None:
        """Add ``values [B, len(TEL_FIELDS)]`` to the rows ``tids [B]`` (distinct: one per stream of a step) and
        count ``accepted [B]`` lengths."""
        self.table[tids] += values
        self.hist[tids, np.minimum(accepted, _HIST - 1)] += 1


def keep_records(rows: list[Any], vals: np.ndarray) -> None:
    """A StepRecord of this step for every row that keeps them (``DecodeRow.keep_steps``), from its ``vals`` row."""
    for i, r in enumerate(rows):
        if r.keep_steps:
            v = vals[i]
            r.records.append(StepRecord(int(v[7]), int(v[2]), int(v[1]), int(v[3]), int(v[4]), int(v[5]), int(v[6]),
                                        float(v[8]), float(v[9]), float(v[10])))
