"""Warm draft state across shards, actors and resumed runs (``resources.warm_draft_state``, on by default).

A RowRunner keeps each job's draft state in memory (scope ``job``). With this on, it also

- after each committed shard, folds what the state learned since it last loaded or saved into the job's saved
  snapshot (``<output>/_draft_state.npz``, ``drafters/snapshot.py``: format, key, merge rule), under a file lock
  so that two actors of the job never interleave their writes;
- before each shard, loads the saved snapshot into a fresh state when it holds commits this runner's state does
  not (another actor's shards, or an earlier run of the job), so the shard starts from everything the job
  learned so far.

Loading only changes the drafts, never an output. A snapshot that is missing, unreadable or saved under another
model, tokenizer or output-relevant config is not loaded (the last two with a log line); a failed save is logged
and the job goes on.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from racer_batch.drafters.registry import make_drafter
from racer_batch.drafters.snapshot import FILE_NAME, capture, load, merge, save, warm

log = logging.getLogger(__name__)

LOCK_NAME = "_draft_state.lock"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of the tokenizer's vocabulary (token -> id) and its class: another tokenizer, another key."""
    try:
        vocab = sorted(tokenizer.get_vocab().items())
    except (AttributeError, NotImplementedError, TypeError):
        vocab = []
    text = json.dumps([type(tokenizer).__name__, len(vocab), vocab], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _config(engine: Any, method: Optional[str]) -> Any:
    """The engine's config, or its config for method auto's candidate ``method`` (``Engine.config_for``)."""
    return engine.config if method is None else engine.config_for(method)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``<folder>/_draft_state.lock`` (one job's actors on one file system)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_NAME, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class WarmStates:
    """Loads and saves one runner's job draft states (module docstring)."""

    def __init__(self) -> None:
        self._commits: dict[str, int] = {}  # job id -> commits of the saved snapshot its state equals (-1: none)
        self._fingerprints: dict[int, str] = {}  # id(tokenizer) -> fingerprint
        self._started: dict[str, int] = {}  # job id -> commits in the state its current shard started from

    @staticmethod
    def applies(spec: Any, state: Any) -> bool:
        """Whether the job's state can be saved: the setting is on and the state keeps a history (the automaton
        methods at scope ``job``)."""
        return bool(spec.resources.warm_draft_state) and getattr(state, "history", None) is not None

    def key(self, spec: Any, engine: Any, method: Optional[str] = None) -> dict:
        """What a saved state must match to be loaded: model, tokenizer, vocabulary size and the output-relevant
        config of the engine (with method auto, the candidate ``method``'s)."""
        tok = engine.bundle.tokenizer
        if id(tok) not in self._fingerprints:
            self._fingerprints[id(tok)] = tokenizer_fingerprint(tok)
        return {"model": spec.model.name, "tokenizer": self._fingerprints[id(tok)],
                "vocab_size": int(engine.bundle.vocab_size), "config_hash": _config(engine, method).config_hash()}

    @staticmethod
    def path(spec: Any, engine: Any, method: Optional[str] = None) -> Path:
        """The job's saved state for this engine: ``<output>/_draft_state.npz``; with method auto, one file per
        candidate ``method`` (``_draft_state-<method>.npz``)."""
        method = _config(engine, method).method
        name = FILE_NAME if method == spec.decoding.method else FILE_NAME.replace(".npz", f"-{method}.npz")
        return Path(spec.output.path) / name

    def before_shard(self, job_id: str, spec: Any, engine: Any, state: Any, method: Optional[str] = None) -> Any:
        """The state the shard should use: ``state``, or a fresh one warmed from a saved snapshot holding commits
        ``state`` does not (``state`` is then freed). ``job_id``: the key the runner keeps the state under;
        ``method``: method auto's candidate the state drafts for on ``engine`` (None: the engine's method)."""
        self._started[job_id] = 0
        if not self.applies(spec, state):
            return state
        path = self.path(spec, engine, method)
        snap = load(path, self.key(spec, engine, method))
        if snap is None or snap.commits == self._commits.get(job_id):
            self._started[job_id] = max(0, self._commits.get(job_id) or 0)
            return state
        fresh = engine.new_state() if method is None else engine.new_state(method)
        warm(fresh, snap, lambda st: make_drafter(_config(engine, method), st))
        engine.free_state(state)
        self._commits[job_id] = self._started[job_id] = snap.commits
        log.info("job %s: draft state warmed from %s (%d commits, %d tokens of text, %d store rows)", job_id, path,
                 snap.commits, snap.tokens, len(snap.store_tokens))
        return fresh

    def after_commit(self, job_id: str, spec: Any, engine: Any, state: Any, *, label: str,
                     method: Optional[str] = None) -> Optional[int]:
        """Fold what ``state`` learned into the saved snapshot; returns its commits, None when nothing was saved.
        ``method`` as in ``before_shard``."""
        if not self.applies(spec, state):
            return None
        path = self.path(spec, engine, method)
        folder = path.parent
        key = self.key(spec, engine, method)
        try:
            with _locked(folder):
                base = load(path, key)
                snap = merge(base, capture(state, label=label), key=key, budget=state.history.budget)
                save(path, snap)
        except OSError as exc:
            log.warning("job %s: could not save the draft state in %s (%s); going on", job_id, folder, exc)
            return None
        # the state equals the snapshot only when nobody committed since it last loaded or saved
        before = base.commits if base is not None else 0
        self._commits[job_id] = snap.commits if before == self._commits.get(job_id, 0) else -1
        return snap.commits

    def commits_at_start(self, job_id: str) -> int:
        """The commits folded into the state the job's current shard started from (0: it started cold)."""
        return self._started.get(job_id, 0)

    def forget(self, job_id: str) -> None:
        self._started.pop(job_id, None)
        self._commits.pop(job_id, None)
