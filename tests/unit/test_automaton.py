"""Unit tests for the retrieval automaton (racer_batch/drafters/automaton.py), on plain token lists.

The oracle is a brute-force n-gram index over the text fed so far: occurrence counts of every substring of
length <= ngram, and the set of those substrings.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from racer_batch.drafters.automaton import Automaton, RetrievalCandidates, prefill_automaton

# ---------------------------------------------------------------- brute force


class NgramIndex:
    """Occurrence counts of every substring of length <= ngram of a growing text."""

    def __init__(self, ngram: int) -> None:
        self.ngram = ngram
        self.text: list[int] = []
        self.counts: Counter[tuple[int, ...]] = Counter()

    def add(self, tokens) -> None:
        for t in tokens:
            self.text.append(t)
            n = len(self.text)
            for k in range(1, min(self.ngram, n) + 1):
                self.counts[tuple(self.text[n - k:])] += 1


def longest_proper_suffix(path: tuple[int, ...], present) -> tuple[int, ...]:
    for i in range(1, len(path)):
        if path[i:] in present:
            return path[i:]
    return ()


def check_trie(a: Automaton, index: NgramIndex, *, exact: bool) -> dict:
    """Brute-force checks of the whole trie; ``exact`` when nothing was ever evicted or dropped."""
    a.check_invariants()
    snap = a.snapshot()
    assert len(snap) == a.num_nodes <= a.max_nodes  # every live node reachable: no orphans
    for path, view in snap.items():
        assert 1 <= len(path) <= a.ngram
        assert len(path) == 1 or path[:-1] in snap, f"{path}: parent missing"
        assert index.counts[path] >= 1, f"{path} is not a substring of the text"
        assert view.failure == longest_proper_suffix(path, snap), f"{path}: failure {view.failure}"
        assert 1 <= view.freq <= index.counts[path]
        if len(path) > 1:
            assert view.freq <= snap[path[:-1]].freq
        if exact:
            assert view.freq == index.counts[path], f"{path}: freq {view.freq} != {index.counts[path]}"
    if exact:
        assert set(snap) == set(index.counts)
    return snap


def pooled_from_trie(snap: dict, border_paths: list[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    pooled: Counter[tuple[int, ...]] = Counter()
    for b in border_paths:
        for path, view in snap.items():
            if len(path) > len(b) and path[: len(b)] == b:
                pooled[path[len(b):]] += view.freq
    return dict(pooled)


def pooled_from_counts(index: NgramIndex, border_paths: list[tuple[int, ...]], vocab: int) -> dict:
    """Pooled scores when the trie holds every substring: sum over borders of the count of border + rel."""
    pooled: dict[tuple[int, ...], int] = {}
    frontier = [()]
    while frontier:
        rel = frontier.pop()
        for tok in range(vocab):
            r = rel + (tok,)
            score = sum(index.counts.get(b + r, 0) for b in border_paths if len(b) + len(r) <= index.ngram)
            if score:
                pooled[r] = score
                frontier.append(r)
    return pooled


def check_candidates(cands: RetrievalCandidates, *, budget: int, border_paths, pooled: dict, index: NgramIndex):
    n = len(cands.tokens)
    assert len(cands.parents) == len(cands.scores) == n
    if budget <= 0 or not border_paths:
        assert n == 0
        return
    assert n <= budget
    rels: list[tuple[int, ...]] = []
    for i, (tok, par, score) in enumerate(zip(cands.tokens, cands.parents, cands.scores)):
        assert -1 <= par < i, "parents must come first (ancestor-closed)"
        rel = (rels[par] if par >= 0 else ()) + (tok,)
        rels.append(rel)
        assert score == pooled.get(rel), f"{rel}: score {score}, pooled {pooled.get(rel)}"
        if par >= 0:
            assert score <= cands.scores[par], "scores must not increase going down"
        # The proposed continuation occurs in the text after at least one border.
        assert any(index.counts[b + rel] for b in border_paths), f"{rel} follows no border in the text"
    assert len(set(rels)) == n, "duplicate candidate paths"
    keys = [(-s, len(r)) for s, r in zip(cands.scores, rels)]
    assert keys == sorted(keys), "not best-first"
    kept = set(rels)
    if n < budget:
        assert kept == set(pooled), "budget left but candidates missing"
    else:
        last = keys[-1]
        for rel, score in pooled.items():
            if rel not in kept and (len(rel) == 1 or rel[:-1] in kept):
                assert (-score, len(rel)) >= last, f"{rel} (score {score}) beats the last kept {last}"


def check_borders(a: Automaton, borders: list[int], advanced: list[int], *, complete: bool) -> list[tuple]:
    paths = [a.node_path(b) for b in borders]
    depths = [len(p) for p in paths]
    assert depths == sorted(depths, reverse=True) and len(set(depths)) == len(depths), "deepest first"
    lo = max(2, a.min_border_depth)
    for p in paths:
        assert lo <= len(p) <= a.ngram
        assert tuple(advanced[len(advanced) - len(p):]) == p, f"border {p} is not a suffix of the matched text"
    if borders:
        assert a.state == borders[0]
    if complete:  # nothing evicted: every suffix of the matched text of border depth is a border
        hi = min(a.ngram, len(advanced))
        assert depths == list(range(hi, lo - 1, -1))
    return paths


# ---------------------------------------------------------------- property tests


def sized_lists(elements, max_size: int):
    """Lists whose length is drawn uniformly (hypothesis otherwise favours very short lists)."""
    return st.integers(1, max_size).flatmap(lambda n: st.lists(elements, min_size=n, max_size=n))


@st.composite
def streams(draw):
    vocab = draw(st.integers(3, 6))
    ngram = draw(st.integers(2, 6))
    text = draw(sized_lists(st.integers(0, vocab - 1), 300))
    return {
        "vocab": vocab,
        "ngram": ngram,
        "text": text,
        "max_nodes": draw(st.sampled_from([1, 5, 12, 30, 80, 10_000])),
        "min_border_depth": draw(st.integers(1, min(3, ngram))),
        "prompt_len": draw(st.integers(0, len(text) - 1)),
        "chunks": draw(st.lists(st.integers(1, 6), min_size=1, max_size=20)),
        "budget": draw(st.integers(-1, 24)),
    }


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_engine_usage_matches_brute_force(case):
    """Drive the automaton as the engine does and check it against the brute-force index at every step."""
    text, ngram, vocab, budget = case["text"], case["ngram"], case["vocab"], case["budget"]
    a = Automaton(max_nodes=case["max_nodes"], ngram=ngram, min_border_depth=case["min_border_depth"])
    index = NgramIndex(ngram)
    p = case["prompt_len"]

    def exact() -> bool:  # the pool never filled up, so nothing was evicted or dropped
        return len(index.counts) <= a.max_nodes

    borders = prefill_automaton(a, text[:p])
    index.add(text[:p])
    advanced = list(text[:p])
    check_borders(a, borders, advanced, complete=exact())
    check_trie(a, index, exact=exact())
    if p == len(text):
        return
    a.extend([text[p]])  # the first root, chosen from the prompt logits
    index.add([text[p]])
    root, pos, step = text[p], p + 1, 0
    while True:
        borders = a.advance(root)
        advanced.append(root)
        paths = check_borders(a, borders, advanced, complete=exact())
        cands = a.candidates(borders, budget)
        if a.num_nodes <= 200 or step % 10 == 0:
            snap = check_trie(a, index, exact=exact())
            pooled = pooled_from_trie(snap, paths)
        else:
            assert exact()
            pooled = pooled_from_counts(index, paths, vocab)
        check_candidates(cands, budget=budget, border_paths=paths, pooled=pooled, index=index)
        committed = text[pos: pos + case["chunks"][step % len(case["chunks"])]]
        if not committed:
            break
        a.extend(committed)
        index.add(committed)
        assert a.num_nodes <= a.max_nodes
        for tok in committed[:-1]:
            a.advance(tok)
            advanced.append(tok)
        root, pos, step = committed[-1], pos + len(committed), step + 1
    check_trie(a, index, exact=exact())


@settings(max_examples=40, deadline=None)
@given(
    text=sized_lists(st.integers(0, 4), 250),
    ngram=st.integers(2, 5),
    slack=st.integers(1, 20),
    advance_every=st.integers(1, 7),
)
def test_recent_windows_survive_eviction(text, ngram, slack, advance_every):
    """With room for the windows in use, eviction never loses the last ngram tokens' substrings."""
    a = Automaton(max_nodes=ngram * (ngram + 1) + slack, ngram=ngram)
    for i, tok in enumerate(text):
        a.extend([tok])
        if i % advance_every == 0:
            a.advance(tok)
        snap = a.snapshot()
        tail = text[max(0, i + 1 - ngram): i + 1]
        for s in range(len(tail)):
            for e in range(s + 1, len(tail) + 1):
                assert tuple(tail[s:e]) in snap, f"recent substring {tail[s:e]} evicted at {i}"
        assert a.num_nodes <= a.max_nodes
    a.check_invariants()


@settings(max_examples=30, deadline=None)
@given(
    text=sized_lists(st.integers(0, 3), 200),
    ops=sized_lists(st.sampled_from(["extend", "extend", "advance", "advance", "reset", "start"]), 200),
    max_nodes=st.integers(1, 40),
    ngram=st.integers(2, 4),
)
def test_arbitrary_call_order_keeps_invariants(text, ops, max_nodes, ngram):
    """Any mix of extend / advance / reset_state / start_text keeps the structure valid."""
    a = Automaton(max_nodes=max_nodes, ngram=ngram)
    index = NgramIndex(ngram)
    for i, op in enumerate(ops):
        tok = text[i % len(text)]
        if op == "extend":
            a.extend([tok])
            index.add([tok])
        elif op == "advance":
            for b in a.advance(tok):
                assert a.node_path(b)[-1] == tok
        elif op == "reset":
            a.reset_state()
        else:
            a.start_text()
            index = NgramIndex(ngram)  # counts are no longer comparable; keep only structural checks
        a.check_invariants()
        assert a.num_nodes <= max_nodes
        snap = a.snapshot()
        assert len(snap) == a.num_nodes
        for path, view in snap.items():
            assert view.failure == longest_proper_suffix(path, snap)


# ---------------------------------------------------------------- worked examples


def test_worked_example_from_docstring():
    a = Automaton(max_nodes=100, ngram=4)
    a.extend([1, 2, 3, 1, 2, 4, 1, 2])
    assert a.advance(1) == []
    assert a.node_path(a.state) == (1,)
    borders = a.advance(2)
    assert [a.node_path(b) for b in borders] == [(1, 2)]
    assert a.snapshot()[(1, 2)].freq == 3
    c = a.candidates(borders, 4)
    assert c.tokens == [3, 4, 1, 1]
    assert c.parents == [-1, -1, 0, 1]
    assert c.scores == [1, 1, 1, 1]
    assert a.candidates(borders, 2).tokens == [3, 4]
    # The state then follows the text: "1 2 3" -> borders "1 2 3", "2 3".
    assert [a.node_path(b) for b in a.advance(3)] == [(1, 2, 3), (2, 3)]
    a.check_invariants()


def test_class_docstring_example():
    a = Automaton(max_nodes=100, ngram=3)
    a.extend([7, 8, 9, 7, 8])
    assert a.advance(7) == []
    borders = a.advance(8)
    assert [a.node_path(b) for b in borders] == [(7, 8)]
    assert a.candidates(borders, 2) == RetrievalCandidates([9], [-1], [1])


def test_extend_counts_windows_and_sets_failure_links():
    a = Automaton(max_nodes=100, ngram=3)
    a.extend([1, 2])
    assert set(a.snapshot()) == {(1,), (2,), (1, 2)}
    a.extend([1])
    snap = a.snapshot()
    assert set(snap) == {(1,), (2,), (1, 2), (2, 1), (1, 2, 1)}
    assert snap[(1,)].freq == 2 and snap[(1, 2, 1)].freq == 1
    assert snap[(1, 2, 1)].failure == (2, 1) and snap[(2, 1)].failure == (1,) and snap[(1,)].failure == ()
    a.extend([2, 1, 2])  # windows of length <= 3 only
    assert max(len(p) for p in a.snapshot()) == 3
    assert a.snapshot()[(1, 2)].freq == 3
    assert a.state == 0, "extend must not move the matching state"


def _read_then_match_5_1_2(text: list[int]):
    """An automaton (ngram 4) that has read ``text``, then matched 5 1 2: (it, the borders of the last step)."""
    a = Automaton(max_nodes=100, ngram=4)
    a.extend(text)
    a.advance(5)
    a.advance(1)
    return a, a.advance(2)


def test_borders_pool_scores_across_borders():
    a, borders = _read_then_match_5_1_2([5, 1, 2, 3, 6, 1, 2, 3, 5, 1, 2])
    assert [a.node_path(b) for b in borders] == [(5, 1, 2), (1, 2)]
    snap = a.snapshot()
    assert snap[(5, 1, 2, 3)].freq == 1 and snap[(1, 2, 3)].freq == 2
    c = a.candidates(borders, 3)
    assert c.tokens == [3, 6, 5]  # "1 2 3" was followed by 6 and by 5
    assert c.scores == [1 + 2, 1, 1]  # token 3 pooled over "5 1 2" and "1 2"
    assert c.parents == [-1, 0, 0]


def test_pooling_orders_by_summed_frequency():
    a, borders = _read_then_match_5_1_2([5, 1, 2, 3, 6, 1, 2, 4, 5, 1, 2])
    c = a.candidates(borders, 2)
    assert c.tokens == [3, 4] and c.scores == [2, 1] and c.parents == [-1, -1]


def test_min_border_depth_filters_shallow_matches():
    a = Automaton(max_nodes=100, ngram=4, min_border_depth=3)
    a.extend([1, 2, 3, 1, 2, 3])
    for tok in (1, 2):
        assert a.advance(tok) == []
    assert [a.node_path(b) for b in a.advance(3)] == [(1, 2, 3)]
    assert a.node_path(a.state) == (1, 2, 3)


def test_no_match_falls_back_to_shallower_state():
    a = Automaton(max_nodes=100, ngram=3)
    a.extend([1, 2, 3, 9])
    a.advance(1)
    a.advance(2)
    assert a.node_path(a.state) == (1, 2)
    assert a.advance(9) == []  # no "1 2 9" nor "2 9": only the depth-1 node "9"
    assert a.node_path(a.state) == (9,)
    assert a.advance(7) == [] and a.state == 0  # unseen token: back to the trie root


def test_prefill_sets_state_and_returns_borders():
    a = Automaton(max_nodes=100, ngram=3)
    borders = prefill_automaton(a, [1, 2, 3, 1, 2])
    assert [a.node_path(b) for b in borders] == [(3, 1, 2), (1, 2)]
    assert a.node_path(a.state) == (3, 1, 2)
    assert prefill_automaton(Automaton(), []) == []


def test_prefill_starts_a_new_text():
    a = Automaton(max_nodes=100, ngram=3)
    prefill_automaton(a, [1, 2])
    prefill_automaton(a, [3, 4])
    assert (2, 3) not in a.snapshot(), "a window spanned two rows"
    assert a.snapshot()[(3, 4)].freq == 1


def test_candidates_empty_cases():
    a = Automaton(max_nodes=100, ngram=3)
    a.extend([1, 2, 3, 1, 2])
    a.advance(1)
    borders = a.advance(2)
    assert borders
    assert a.candidates(borders, 0) == RetrievalCandidates([], [], [])
    assert a.candidates(borders, -3) == RetrievalCandidates([], [], [])
    assert a.candidates([], 10) == RetrievalCandidates([], [], [])


def test_eviction_takes_least_recent_leaves():
    a = Automaton(max_nodes=6, ngram=2)
    a.extend([1, 2, 3, 4])  # 1 2 12 3 23 4 34: the 7th node evicts the oldest leaf "1 2"
    assert set(a.snapshot()) == {(1,), (2,), (3,), (2, 3), (4,), (3, 4)}
    a.extend([5])  # "5": "1" is now the oldest leaf; "4 5": then "2 3"
    assert set(a.snapshot()) == {(2,), (3,), (4,), (3, 4), (5,), (4, 5)}
    assert a.num_evicted == 3
    a.check_invariants()


def test_advance_touch_protects_matched_nodes():
    a = Automaton(max_nodes=7, ngram=2)
    a.extend([1, 2, 3, 4])  # full: 1 2 12 3 23 4 34
    a.advance(1)
    a.advance(2)  # touches "1" and "1 2": now the most recent
    a.reset_state()
    a.extend([5])  # needs "5" and "4 5": evicts two leaves, not "1 2"
    snap = a.snapshot()
    assert (1, 2) in snap
    assert (2, 3) not in snap
    a.check_invariants()


def test_failure_targets_are_never_evicted():
    # "2" is the failure target of "1 2", so it stays while "1 2" lives, however old it is.
    a = Automaton(max_nodes=5, ngram=2)
    a.extend([1, 2])
    a.advance(1)
    a.advance(2)  # state "1 2": kept
    a.extend([3, 4, 5, 6])
    snap = a.snapshot()
    assert (1, 2) in snap and (2,) in snap
    a.check_invariants()


def test_tiny_pool_never_overflows():
    for max_nodes in (1, 2, 3):
        a = Automaton(max_nodes=max_nodes, ngram=10)
        for tok in [1, 2, 3, 1, 2, 3, 4, 5, 1, 2] * 5:
            a.extend([tok])
            a.advance(tok)
            assert a.num_nodes <= max_nodes
            a.check_invariants()


def test_check_invariants_detects_corruption():
    a = Automaton(max_nodes=100, ngram=3)
    a.extend([1, 2, 3, 1, 2])
    a.check_invariants()
    node = a.snapshot()[(1, 2)].node
    a._fail[node] = 0  # corrupt: failure link decays to the trie root
    with pytest.raises(AssertionError, match="failure link"):
        a.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_nodes": 0}, "max_nodes must be >= 1, got 0"),
        ({"ngram": 1}, "ngram must be >= 2, got 1"),
        ({"min_border_depth": 0}, "min_border_depth must be in"),
        ({"ngram": 3, "min_border_depth": 4}, "got 4"),
        ({"max_nodes": 2.5}, "max_nodes must be an int, got 2.5"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Automaton(**kwargs)


def test_bad_tokens_and_borders_raise():
    a = Automaton(max_nodes=100, ngram=3)
    with pytest.raises(ValueError, match="-1"):
        a.extend([1, -1])
    with pytest.raises(ValueError, match="-2"):
        a.advance(-2)
    a.extend([1, 2, 1, 2])
    a.advance(1)
    borders = a.advance(2)
    with pytest.raises(ValueError, match="border 999"):
        a.candidates([999], 4)
    with pytest.raises(ValueError, match="repeated"):
        a.candidates(borders + borders, 4)
    with pytest.raises(ValueError, match="border 0"):
        a.candidates([0], 4)


# ---- cursors: rows decoded together over one job's automaton (issue 14)

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=st.lists(st.integers(0, 4), min_size=1, max_size=40), b=st.lists(st.integers(0, 4), min_size=1, max_size=40),
       max_nodes=st.integers(4, 200), ngram=st.integers(2, 5))
def test_interleaved_cursors_keep_their_own_windows_and_state(a, b, max_nodes, ngram):
    """Two texts read token by token in turn, each on its own cursor: without eviction the trie counts equal
    those of the texts read one after the other; with any pool size the invariants hold (each cursor's windows
    pinned, both states kept) and each cursor's state is a suffix of its own text."""
    shared = Automaton(max_nodes=max_nodes, ngram=ngram)
    ca, cb = shared.new_cursor(), shared.new_cursor()
    for i in range(max(len(a), len(b))):
        for text, cur in ((a, ca), (b, cb)):
            if i < len(text):
                shared.extend([text[i]], cur)
                shared.advance(text[i], cur)
                shared.check_invariants()
                path = shared.node_path(cur.state)
                assert tuple(text[: i + 1][len(text[: i + 1]) - len(path):]) == path
    if max_nodes >= 200 and shared.num_evicted == 0:
        alone = Automaton(max_nodes=max_nodes, ngram=ngram)
        alone.extend(a)
        alone.start_text()
        alone.extend(b)
        assert {p: v.freq for p, v in shared.snapshot().items()} == {p: v.freq for p, v in alone.snapshot().items()}
    shared.close_cursor(ca)
    shared.close_cursor(cb)
    shared.close_cursor(cb)  # idempotent
    shared.check_invariants()
    assert sum(shared._pinned) == 0  # a closed cursor pins nothing
    with pytest.raises(ValueError, match="closed"):
        shared.advance(1, ca)


def test_prefill_on_a_cursor_leaves_the_default_cursor_alone():
    aut = Automaton(ngram=3)
    prefill_automaton(aut, [1, 2, 3, 1, 2])
    state = aut.state
    cur = aut.new_cursor()
    prefill_automaton(aut, [7, 8, 9, 7], cur)
    assert aut.state == state and aut.node_path(cur.state) == (8, 9, 7)
