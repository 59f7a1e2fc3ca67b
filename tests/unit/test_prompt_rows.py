"""The prefill computes the prompt's top-k only at each token's last position (engine.last_positions); the
copy-logit store must come out exactly as if every position had been computed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from racer_batch.drafters.copy_logits import CopyLogitStore
from racer_batch.engine.engine import last_positions


def _last_by_hand(ids: list[int]) -> list[int]:
    last = {t: i for i, t in enumerate(ids)}
    return sorted(last.values())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 12), max_size=60))
def test_last_positions_are_each_tokens_last_occurrence(ids):
    got = last_positions(ids)
    assert got.dtype == np.int64
    assert got.tolist() == _last_by_hand(ids)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=60), st.integers(0, 2**31 - 1))
def test_store_from_last_rows_equals_store_from_every_row(ids, seed):
    rng = np.random.default_rng(seed)
    tokens = np.asarray(ids, dtype=np.int64)
    topk = rng.integers(0, 13, size=(len(ids), 3))  # the model's top-3 after every position
    full = CopyLogitStore(vocab_size=13, k=2)
    full.table[:] = rng.integers(-1, 13, size=full.table.shape)  # what earlier rows of the job left
    lean = CopyLogitStore(vocab_size=13, k=2)
    lean.table[:] = full.table
    full.update(tokens, topk)
    partial = np.full_like(topk, -1)
    rows = last_positions(ids)
    partial[rows] = topk[rows]
    lean.update(tokens, partial)
    assert np.array_equal(lean.table, full.table)


def test_unknown_rows_leave_the_store_and_its_probabilities_alone():
    store = CopyLogitStore(vocab_size=5, k=2, with_probs=True)
    store.update(np.array([1, 2]), np.array([[3, 4], [0, 1]]), np.array([[0.5, 0.25], [0.6, 0.1]], np.float32))
    store.update(np.array([1, 2, 3]), np.array([[-1, -1], [4, 3], [-1, -1]]))
    assert store.table[1].tolist() == [3, 4] and store.probs[1].tolist() == [0.5, 0.25]
    assert store.table[2].tolist() == [4, 3] and np.isnan(store.probs[2]).all()
    assert store.table[3].tolist() == [-1, -1]


# ---------------------------------------------------------------- a row's own layer over a shared store

def _logits_drafter(state):
    from racer_batch.drafters import make_drafter
    from racer_batch.values import DecodingConfig

    return make_drafter(DecodingConfig(method="logits", max_breadth=2, scope=state.scope), state)


def _shared(scope: str = "job"):
    from racer_batch.drafters import make_state
    from racer_batch.values import DecodingConfig

    return make_state(DecodingConfig(method="logits", max_breadth=2, scope=scope), vocab_size=20, scope=scope)


@pytest.mark.parametrize("core", ["native", "python"])
def test_rows_decoded_together_draft_from_their_own_predictions_first(core, monkeypatch):
    if core == "python":
        monkeypatch.setenv("RACER_NATIVE_DRAFT", "off")
    from racer_batch.drafters.base import Verified

    state = _shared()
    assert (state.native is not None) == (core == "native")
    a, b = _logits_drafter(state), _logits_drafter(state)
    a.start([1, 2], np.array([[3, 4], [5, 6]]))
    b.start([1, 9], np.array([[7, 8], [10, 11]]))  # b's prompt overwrites the shared rows of token 1
    assert state.store_row(1).tolist() == [7, 8]
    assert a.propose(1, capacity=3, max_depth=1).token_ids == [1, 3, 4]  # a's own prediction after 1
    assert b.propose(1, capacity=3, max_depth=1).token_ids == [1, 7, 8]
    assert a.propose(9, capacity=3, max_depth=1).token_ids == [9, 10, 11]  # unseen by a: the shared row
    b.update(Verified(np.array([2]), np.array([[12, 13]]), [12]))
    assert a.propose(2, capacity=3, max_depth=1).token_ids == [2, 5, 6]  # a keeps its own row of token 2
    a.close()
    assert a.own is None and a.native is None
    # the shared store still learns from every row, for the rows that come later
    c = _logits_drafter(state)
    c.start([5], np.array([[1, 1]]))
    assert c.propose(2, capacity=3, max_depth=1).token_ids == [2, 12, 13]


def test_one_row_at_a_time_drafts_as_from_the_shared_store_alone(monkeypatch):
    """Sequential rows: the own layer changes no draft (each token's shared row is then the row's own). The
    Python drafter's own layer; the native core is held to it node for node (test_native_draft.py)."""
    monkeypatch.setenv("RACER_NATIVE_DRAFT", "off")
    from racer_batch.drafters.base import Verified

    rng = np.random.default_rng(5)
    state = _shared()
    for row in range(4):
        d = _logits_drafter(state)
        ids = rng.integers(0, 20, size=12)
        d.start(ids.tolist(), rng.integers(0, 20, size=(12, 2)))
        for _ in range(6):
            root = int(rng.integers(0, 20))
            got = d.propose(root, capacity=6, max_depth=3)
            own, d.own = d.own, None
            plain = d.propose(root, capacity=6, max_depth=3)
            d.own = own
            assert got.token_ids == plain.token_ids and got.parents == plain.parents, row
            nodes = np.array(got.token_ids, dtype=np.int64)
            d.update(Verified(nodes, rng.integers(0, 20, size=(len(nodes), 2)), [int(nodes[-1])]))
        d.close()


def test_a_private_state_has_no_second_layer(monkeypatch):
    monkeypatch.setenv("RACER_NATIVE_DRAFT", "off")
    state = _shared("request")
    d = _logits_drafter(state)
    d.start([1, 2], np.array([[3, 4], [5, 6]]))
    assert d.own is None and d.native is None
