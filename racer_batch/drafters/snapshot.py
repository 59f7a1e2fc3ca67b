"""Warm draft state: a job's learned automaton and copy-logit store, saved with each shard's commit and loaded by
the next shard on any actor and by a resumed run (docs/method.md section 7.1).

What is saved (format version 1, one ``.npz`` file, written to a temporary name and renamed into place):

- ``texts``: the token-id texts the job's rows taught the automaton (each row's prompt followed by its output,
  in the order the rows ended), oldest first, at most ``max_nodes`` tokens in all (the oldest texts are
  dropped first). The automaton itself is not written out: loading replays these texts into a fresh one,
  whose own bounds (node budget, LRU eviction) then hold as they do in memory.
- ``store_tokens [n]`` / ``store_rows [n, k]``: every known row of the copy-logit store (a ``[vocab, k]``
  table in memory), at most ``vocab`` rows.
- ``meta``: the format version, the key and the commits folded in so far.

The **key** is the model, the tokenizer and the output-relevant config hash (``DecodingConfig.config_hash``)
with the vocabulary size; a snapshot under any other key is refused with a log line and never loaded. A missing
snapshot is a cold start; an unreadable one is logged and skipped. Loading never changes an output, only the
drafts (every drafted token is verified by the target model).

**Merge rule** (several actors commit shards of one job): the saved snapshot is a fold over commits in the
order they were written. Folding a commit appends the texts its actor's rows ended with since that actor last
loaded or saved (oldest first) and drops the oldest texts past the budget; its store rows overwrite the saved
rows of the same tokens (the newer prediction wins, as in memory), others are kept. The result depends only on
the order of the commits, and stays within the same bounds as one state in memory.
"""

from __future__ import annotations

import io
import json
import logging
import os
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FILE_NAME = "_draft_state.npz"
MAX_COMMITS_LISTED = 64  # the newest commits named in ``meta`` (the count is kept whole)


class TextHistory:
    """The texts a DraftState learned from, newest last, at most ``budget`` tokens in all (0: none kept).

    ``mark`` counts the texts added since the last :meth:`take_new` (what a commit folds in)."""

    def __init__(self, budget: int) -> None:
        self.budget = int(budget)
        self.texts: deque[np.ndarray] = deque()
        self.tokens = 0
        self.new = 0  # texts added since the last take_new (at most len(texts))

    def add(self, ids: Sequence[int]) -> None:
        """Keep one more text (int32 ids); drop the oldest while over the budget."""
        if self.budget <= 0 or len(ids) == 0:
            return
        text = np.asarray(ids, dtype=np.int32)[-self.budget:]
        self.texts.append(text)
        self.tokens += len(text)
        self.new += 1
        while self.tokens > self.budget:
            self.tokens -= len(self.texts.popleft())
        self.new = min(self.new, len(self.texts))

    def take_new(self) -> list[np.ndarray]:
        """The texts added since the last call, oldest first; resets the count."""
        out = list(self.texts)[len(self.texts) - self.new:] if self.new else []
        self.new = 0
        return out


@dataclass
class DraftSnapshot:
    """One saved draft state (module docstring). ``commits``: how many commits are folded in; ``recent``: the
    newest of them named (at most ``MAX_COMMITS_LISTED``)."""

    key: dict
    texts: list[np.ndarray] = field(default_factory=list)
    store_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    store_rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))
    commits: int = 0
    recent: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return int(sum(len(t) for t in self.texts))


@dataclass
class DraftDelta:
    """What one commit adds: the texts its rows ended with since the actor last loaded or saved, and its whole
    store (known rows)."""

    texts: list[np.ndarray]
    store_tokens: np.ndarray
    store_rows: np.ndarray
    label: str = ""


def merge(base: Optional[DraftSnapshot], delta: DraftDelta, *, key: dict, budget: int) -> DraftSnapshot:
    """``base`` with ``delta`` folded in (the module docstring's rule); ``base`` None: the first commit.

    Raises:
        ValueError: the delta's store rows have another width than the base's.
    """
    texts = list(base.texts) if base is not None else []
    texts += [np.asarray(t, dtype=np.int32) for t in delta.texts if len(t)]
    total = sum(len(t) for t in texts)
    start = 0
    while start < len(texts) and total > budget:
        total -= len(texts[start])
        start += 1
    tokens, rows = delta.store_tokens.astype(np.int32), delta.store_rows.astype(np.int32)
    if base is not None and len(base.store_tokens):
        if rows.size and rows.shape[1] != base.store_rows.shape[1]:
            raise ValueError(f"store rows of width {rows.shape[1]} cannot merge into width {base.store_rows.shape[1]}")
        keep = ~np.isin(base.store_tokens, tokens)
        tokens = np.concatenate([base.store_tokens[keep], tokens])
        rows = np.concatenate([base.store_rows[keep], rows]) if rows.size else base.store_rows[keep]
        order = np.argsort(tokens, kind="stable")
        tokens, rows = tokens[order], rows[order]
    commits = (base.commits if base is not None else 0) + 1
    recent = ((base.recent if base is not None else []) + [delta.label or f"commit {commits}"])[-MAX_COMMITS_LISTED:]
    return DraftSnapshot(key=dict(key), texts=texts[start:], store_tokens=tokens, store_rows=rows, commits=commits,
                         recent=recent)


# ---- files ---------------------------------------------------------------------------------------------------
def save(path: str | Path, snap: DraftSnapshot) -> Path:
    """Write ``snap`` to ``path`` atomically (a temporary file in the same folder, then a rename)."""
    path = Path(path)
    cu = np.zeros(len(snap.texts) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in snap.texts], out=cu[1:])
    meta = {"version": FORMAT_VERSION, "key": snap.key, "commits": snap.commits, "recent": snap.recent}
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8),
             texts=np.concatenate(snap.texts) if snap.texts else np.zeros(0, dtype=np.int32), cu=cu,
             store_tokens=snap.store_tokens, store_rows=snap.store_rows)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(buf.getvalue())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def load(path: str | Path, key: dict) -> Optional[DraftSnapshot]:
    """The snapshot at ``path`` if it is readable and saved under ``key``; None otherwise: missing (a cold start,
    nothing logged), unreadable or of another format version (a warning, skipped), or under another key (a
    warning naming the fields that differ: never loaded)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("version") != FORMAT_VERSION:
                log.warning("draft state %s: format version %r, not %d; skipped (starting cold)", path,
                            meta.get("version"), FORMAT_VERSION)
                return None
            cu, flat = z["cu"], z["texts"]
            texts = [flat[cu[i]: cu[i + 1]].astype(np.int32) for i in range(len(cu) - 1)]
            snap = DraftSnapshot(key=meta["key"], texts=texts, store_tokens=z["store_tokens"].astype(np.int32),
                                 store_rows=z["store_rows"].astype(np.int32), commits=int(meta["commits"]),
                                 recent=list(meta.get("recent", [])))
    except Exception as exc:  # noqa: BLE001 - a corrupt snapshot of any kind is skipped, never fatal
        log.warning("draft state %s is unreadable (%s: %s); skipped (starting cold)", path, type(exc).__name__, exc)
        return None
    if snap.key != key:
        diff = sorted(k for k in set(snap.key) | set(key) if snap.key.get(k) != key.get(k))
        log.warning("draft state %s was saved under another %s; refused (starting cold)", path, ", ".join(diff))
        return None
    return snap


# ---- a DraftState in and out ---------------------------------------------------------------------------------
def capture(state: Any, *, label: str = "") -> DraftDelta:
    """What ``state`` (a DraftState) learned since it last loaded or was captured: its new texts and the store
    rows that changed (so an actor's rows loaded from an older snapshot never overwrite a newer commit's)."""
    history: Optional[TextHistory] = getattr(state, "history", None)
    texts = history.take_new() if history is not None else []
    table = _store_table(state)
    if table is None:
        return DraftDelta(texts, np.zeros(0, dtype=np.int32), np.zeros((0, 0), dtype=np.int32), label)
    table = np.asarray(table, dtype=np.int32)
    base = getattr(state, "store_base", None)
    changed = (table[:, 0] >= 0) if base is None else ((table != base).any(axis=1) & (table[:, 0] >= 0))
    state.store_base = table.copy()
    rows = np.flatnonzero(changed).astype(np.int32)
    return DraftDelta(texts, rows, table[rows], label)


def warm(state: Any, snap: DraftSnapshot, make_drafter: Any) -> None:
    """Teach a fresh ``state`` the snapshot: each text replayed through a drafter of the state as one row's
    prompt (``make_drafter(state)``; the automaton learns it as it learned the rows), then the store rows
    written. The replayed texts become the state's history (so a later capture adds only new ones)."""
    for text in snap.texts:
        drafter = make_drafter(state)
        drafter.start(text.astype(np.int64), None)
        drafter.close()
    state.rows = 0
    if len(snap.store_tokens):
        if state.native is not None and state.native.use_logits:
            state.native.load_store(snap.store_tokens, snap.store_rows)
        elif state.store is not None:
            state.store.update(snap.store_tokens.astype(np.int64), snap.store_rows.astype(np.int64))
    history: Optional[TextHistory] = getattr(state, "history", None)
    if history is not None:
        for text in snap.texts:
            history.add(text)
        history.new = 0
    table = _store_table(state)
    state.store_base = None if table is None else np.asarray(table, dtype=np.int32).copy()


def _store_table(state: Any) -> Optional[np.ndarray]:
    if state.native is not None:
        return state.native.store_table() if state.native.use_logits else None
    return state.store.table if state.store is not None else None
