"""Saved draft state (drafters/snapshot.py): bounded history, the merge rule, the file format and its refusals,
and a warm state on the real engine: same outputs, fewer steps."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from racer_batch.drafters import snapshot as sn
from racer_batch.drafters.registry import make_drafter
from racer_batch.engine import Engine
from racer_batch.values import DecodingConfig, GenerationParams
from tests.helpers import tiny_bundle

KEY = {"model": "m", "tokenizer": "t", "vocab_size": 64, "config_hash": "c"}


def _delta(texts, tokens=(), rows=(), label=""):
    rows = np.asarray(rows, dtype=np.int32).reshape(len(tokens), -1) if len(tokens) else np.zeros((0, 2), np.int32)
    return sn.DraftDelta([np.asarray(t, dtype=np.int32) for t in texts], np.asarray(tokens, dtype=np.int32), rows,
                         label)


def test_text_history_keeps_the_newest_texts_within_its_budget():
    h = sn.TextHistory(10)
    h.add([1, 2, 3, 4])
    h.add([5, 6, 7])
    assert [t.tolist() for t in h.take_new()] == [[1, 2, 3, 4], [5, 6, 7]] and h.take_new() == []
    h.add([8, 9, 10, 11])  # 11 tokens: the oldest text goes
    assert [t.tolist() for t in h.texts] == [[5, 6, 7], [8, 9, 10, 11]] and h.tokens == 7
    h.add(list(range(20, 40)))  # longer than the budget: its last 10 tokens, alone
    assert [t.tolist() for t in h.texts] == [list(range(30, 40))] and [len(t) for t in h.take_new()] == [10]
    off = sn.TextHistory(0)
    off.add([1, 2])
    assert not off.texts


def test_merge_folds_commits_in_order_within_the_bounds():
    a = _delta([[1, 2, 3], [4, 5]], tokens=[3, 7], rows=[[1, 2], [3, 4]], label="a")
    b = _delta([[6, 7, 8, 9]], tokens=[7, 9], rows=[[5, 6], [7, 8]], label="b")
    one = sn.merge(None, a, key=KEY, budget=8)
    two = sn.merge(one, b, key=KEY, budget=8)
    assert [t.tolist() for t in two.texts] == [[4, 5], [6, 7, 8, 9]] and two.tokens <= 8  # oldest text dropped
    assert two.store_tokens.tolist() == [3, 7, 9]
    assert two.store_rows.tolist() == [[1, 2], [5, 6], [7, 8]]  # the newer commit's row of token 7 wins
    assert (two.commits, two.recent) == (2, ["a", "b"])
    again = sn.merge(sn.merge(None, a, key=KEY, budget=8), b, key=KEY, budget=8)
    assert [t.tolist() for t in again.texts] == [t.tolist() for t in two.texts]  # deterministic for an order
    other = sn.merge(sn.merge(None, b, key=KEY, budget=8), a, key=KEY, budget=8)
    assert other.store_rows.tolist()[1] == [3, 4]  # the other order: a's row of token 7 is the newer one


def test_save_and_load_round_trip(tmp_path):
    snap = sn.merge(None, _delta([[1, 2, 3], [4]], tokens=[5], rows=[[6, 7]], label="x"), key=KEY, budget=100)
    path = sn.save(tmp_path / sn.FILE_NAME, snap)
    got = sn.load(path, KEY)
    assert [t.tolist() for t in got.texts] == [[1, 2, 3], [4]] and got.store_tokens.tolist() == [5]
    assert got.store_rows.tolist() == [[6, 7]] and (got.commits, got.recent, got.key) == (1, ["x"], KEY)
    assert sn.load(tmp_path / "missing.npz", KEY) is None
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed into place


def test_a_snapshot_of_another_model_or_config_is_refused_with_a_log_line(tmp_path, caplog):
    path = sn.save(tmp_path / sn.FILE_NAME, sn.merge(None, _delta([[1, 2]]), key=KEY, budget=100))
    with caplog.at_level(logging.WARNING, logger="racer_batch.drafters.snapshot"):
        assert sn.load(path, dict(KEY, config_hash="other")) is None
        assert sn.load(path, dict(KEY, model="other", tokenizer="x")) is None
    msgs = [r.getMessage() for r in caplog.records]
    assert "saved under another config_hash; refused" in msgs[0] and "another model, tokenizer;" in msgs[1]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "version"])
def test_a_corrupt_snapshot_is_skipped_with_a_log_line(tmp_path, caplog, damage):
    path = sn.save(tmp_path / sn.FILE_NAME, sn.merge(None, _delta([[1, 2, 3]]), key=KEY, budget=100))
    if damage == "garbage":
        path.write_bytes(b"not a snapshot at all")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:40])
    else:
        old = sn.FORMAT_VERSION
        sn.FORMAT_VERSION = 99
        try:
            sn.save(path, sn.merge(None, _delta([[1]]), key=KEY, budget=100))
        finally:
            sn.FORMAT_VERSION = old
    with caplog.at_level(logging.WARNING, logger="racer_batch.drafters.snapshot"):
        assert sn.load(path, KEY) is None
    assert "skipped (starting cold)" in caplog.records[-1].getMessage()


@pytest.mark.parametrize("native", [True, False])
def test_a_warm_state_drafts_from_the_saved_text_and_keeps_the_output(monkeypatch, native):
    """Row P on a cold state, saved; a fresh state warmed from the snapshot answers P again with the same tokens
    in fewer steps (the automaton already holds P's answer), and a cold state as the first time. The native
    draft core and the Python drafters alike."""
    import racer_batch.drafters.methods as methods

    if not native:
        monkeypatch.setattr(methods, "native_enabled", lambda: False)
    bundle = tiny_bundle(seed=3, head_scale=60.0)
    engine = Engine(bundle, DecodingConfig(method="racer", capacity=8))
    params = GenerationParams(max_new_tokens=48)
    prompt = "abcabd the cat and the hat abca"
    cold = engine.new_state()
    assert (cold.native is not None) == native and cold.history is not None
    first = engine.generate(prompt, params, state=cold)
    delta = sn.capture(cold, label="row P")
    assert len(delta.texts) == 1 and len(delta.texts[0]) == first.prompt_tokens + len(first.token_ids)
    assert len(delta.store_tokens) > 0 and sn.capture(cold).store_tokens.size == 0  # nothing new since
    snap = sn.merge(None, delta, key=KEY, budget=cold.history.budget)
    warm = engine.new_state()
    sn.warm(warm, snap, lambda st: make_drafter(engine.config, st))
    assert warm.automaton_nodes > 0 and warm.store_known == cold.store_known and not warm.history.new
    again = engine.generate(prompt, params, state=warm)
    fresh = engine.generate(prompt, params, state=engine.new_state())
    assert again.token_ids == first.token_ids == fresh.token_ids
    assert fresh.stats.steps == first.stats.steps and again.stats.steps < first.stats.steps
