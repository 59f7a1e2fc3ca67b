"""Pure unit tests of the literature drafters (issue 8) on hand-written token lists: Token Recycling's template
and adjacency, LogitSpec's n-gram index and tree, REST's suffix-array datastore, SAM's suffix automaton
against brute force, Graft's prune / refill budget, the store's probability table and the relaxed-acceptance
gate."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from racer_batch.drafters import make_drafter, make_state
from racer_batch.drafters.base import TrieBuilder, Verified
from racer_batch.drafters.copy_logits import CopyLogitStore, grow_logits_tree
from racer_batch.drafters.graft import (
    ConfidenceCalibrator,
    GraftDrafter,
    grow_pruned_logits_tree,
)
from racer_batch.drafters.literature_state import LiteratureState
from racer_batch.drafters.logitspec import NgramIndex, logitspec_tree, rank_cut
from racer_batch.drafters.rest import (
    RestDatastore,
    SuffixIndex,
    build_suffix_array,
    count_trie_tree,
    load_corpus,
    rest_query,
)
from racer_batch.drafters.sam import SamMatcher, SuffixAutomaton, build_corpus_sam
from racer_batch.drafters.token_recycling import (
    TR_TEMPLATE,
    TokenRecyclingDrafter,
    expand_template,
    template_parents,
)
from racer_batch.service.job.spec import check_relaxed_allowed
from racer_batch.values import (
    METHODS,
    SOURCE_CORPUS,
    SOURCE_LASTLOGIT,
    SOURCE_NGRAM,
    SOURCE_RETRIEVAL,
    DecodingConfig,
)

tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=40)


def _paths(draft):
    """Set of root-to-node token paths (root excluded) of a draft."""
    out = set()
    for i in range(1, len(draft)):
        path, node = [], i
        while node > 0:
            path.append(draft.token_ids[node])
            node = draft.parents[node]
        out.add(tuple(reversed(path)))
    return out


# ---------------------------------------------------------------- Token Recycling


def test_tr_template_shape():
    assert len(TR_TEMPLATE) == 80  # 81 nodes with the root
    parents = template_parents(TR_TEMPLATE)  # raises if not ancestor-closed / parents first
    assert len(set(TR_TEMPLATE)) == 80
    widths = [sum(1 for p in TR_TEMPLATE if len(p) == d) for d in range(1, 8)]
    assert widths == [8, 20, 19, 15, 11, 7, 0]  # wide near the root, thin below
    assert max(max(p) for p in TR_TEMPLATE) == 7  # ranks fit the default k = 8
    assert all(parents[i] < i for i in range(80))
    # best first: every prefix of the template is itself a valid template
    for n in (1, 7, 15, 63):
        template_parents(TR_TEMPLATE[:n])


def test_tr_template_rejects_bad_data():
    with pytest.raises(ValueError, match="parent"):
        template_parents(((0, 1), (0,)))
    with pytest.raises(ValueError, match="repeated"):
        template_parents(((0,), (0,)))


def test_tr_expand_template_worked_example():
    table = np.full((10, 2), -1)
    table[5] = [7, 8]
    table[7] = [9, 5]
    table[8] = [6, 1]
    tmpl = ((0,), (1,), (0, 0), (1, 0))
    d = expand_template(table, 5, template=tmpl, parents=template_parents(tmpl), capacity=10, max_depth=5)
    assert d.token_ids == [5, 7, 8, 9, 6] and d.parents == [-1, 0, 0, 1, 2]
    d3 = expand_template(table, 5, template=tmpl, parents=template_parents(tmpl), capacity=3, max_depth=5)
    assert d3.token_ids == [5, 7, 8]
    d1 = expand_template(table, 5, template=tmpl, parents=template_parents(tmpl), capacity=10, max_depth=1)
    assert d1.token_ids == [5, 7, 8]
    # unknown adjacency entries drop their subtree
    table[7] = [-1, -1]
    d = expand_template(table, 5, template=tmpl, parents=template_parents(tmpl), capacity=10, max_depth=5)
    assert _paths(d) == {(7,), (8,), (8, 6)}


def test_tr_adjacency_refreshed_from_every_verified_node():
    cfg = DecodingConfig(method="tr", max_breadth=2)
    state = make_state(cfg, vocab_size=10)
    dr = make_drafter(cfg, state)
    assert isinstance(dr, TokenRecyclingDrafter)
    dr.start([1, 2, 1], np.array([[2, 3], [1, 4], [5, 6]]))
    assert state.store.row(1).tolist() == [5, 6]  # the later position wins
    assert state.store.row(2).tolist() == [1, 4]
    dr.update(Verified(np.array([1, 7, 2]), np.array([[8, 9], [1, 2], [3, 3]]), [7, 1]))
    assert state.store.row(1).tolist() == [8, 9] and state.store.row(7).tolist() == [1, 2]
    assert state.store.row(2).tolist() == [3, 3]
    d = dr.propose(1, capacity=81, max_depth=10)
    assert d.token_ids[1:3] == [8, 9]  # the root's first layer is its refreshed row


# ---------------------------------------------------------------- LogitSpec


def _brute_lookup(ctx, query, max_ngram, num):
    for n in range(min(max_ngram, len(query)), 0, -1):
        q = list(query[len(query) - n :])
        for start in range(len(ctx) - n - 1, -1, -1):  # latest occurrence followed by a token
            if ctx[start : start + n] == q:
                return ctx[start + n : start + n + num], n
    return [], 0


@settings(max_examples=200, deadline=None)
@given(ctx=tokens_st, query=st.lists(st.integers(0, 3), min_size=1, max_size=5), max_ngram=st.integers(1, 4))
def test_ngram_index_matches_brute_force(ctx, query, max_ngram):
    ix = NgramIndex(max_ngram=max_ngram)
    ix.extend(ctx[: len(ctx) // 2])
    ix.extend(ctx[len(ctx) // 2 :])  # incremental == all at once
    assert ix.lookup(query, num_tokens=3) == _brute_lookup(ctx, query, max_ngram, 3)


def test_ngram_index_docstring_example():
    ix = NgramIndex(max_ngram=2)
    ix.extend([1, 2, 3, 1, 2, 4, 1])
    assert ix.lookup([4, 1, 2], num_tokens=3) == ([4, 1], 2)
    assert ix.lookup([9], num_tokens=3) == ([], 0)


def test_logitspec_rank_cut_and_tree():
    assert [rank_cut(12, r) for r in range(5)] == [12, 6, 4, 3, 3]
    ix = NgramIndex(max_ngram=3)
    ix.extend([5, 6, 7, 8, 9, 7])
    d = logitspec_tree(ix, 7, [7, 9], capacity=64, max_depth=10, branch_tokens=4)
    paths = _paths(d)
    assert (8, 9, 7) in paths  # the root's own prompt-lookup chain ("7" was followed by "8 9 7")
    assert (9, 7) in paths  # guess 9 extended by what followed "9"
    assert (7,) in paths  # rank-0 guess in the first layer
    first = {d.token_ids[i]: d.sources[i] for i in range(1, len(d)) if d.parents[i] == 0}
    assert first[9] == SOURCE_LASTLOGIT and first[8] == SOURCE_NGRAM
    small = logitspec_tree(ix, 7, [7, 9, 3, 4], capacity=4, max_depth=10, branch_tokens=4)
    assert len(small) == 4  # capacity respected (root included)


def test_logitspec_first_layer_comes_from_the_last_accepted_node():
    cfg = DecodingConfig(method="logitspec")
    state = make_state(cfg, vocab_size=20)
    dr = make_drafter(cfg, state)
    dr.start([1, 2, 3], np.array([[2, 0], [3, 0], [4, 11]]))
    dr.update(Verified(np.zeros(0, np.int64), np.zeros((0, 2), np.int64), [4]))  # prefill: last_node -1
    d = dr.propose(4, capacity=8, max_depth=4)
    assert {d.token_ids[i] for i in range(1, len(d)) if d.parents[i] == 0} >= {4, 11}  # last prompt row
    topk = np.array([[5, 6], [12, 13], [14, 15]])
    dr.update(Verified(np.array([4, 5, 6]), topk, [5, 12], last_node=1))
    d = dr.propose(12, capacity=8, max_depth=4)
    assert {d.token_ids[i] for i in range(1, len(d)) if d.parents[i] == 0} == {12, 13}


# ---------------------------------------------------------------- REST


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.integers(-1, 3), min_size=0, max_size=50), depth=st.integers(1, 6))
def test_suffix_array_sorted_by_first_depth_tokens(text, depth):
    arr = np.array(text, dtype=np.int32)
    sa = build_suffix_array(arr, depth=depth)
    assert sorted(sa.tolist()) == list(range(len(text)))
    keys = [text[p : p + depth] for p in sa.tolist()]
    assert keys == sorted(keys)  # Python list order: a prefix sorts first, -1 below every token


def test_suffix_array_docstring_example():
    assert build_suffix_array(np.array([3, 1, 3, 2]), depth=2).tolist() == [1, 3, 0, 2]


@settings(max_examples=150, deadline=None)
@given(docs=st.lists(tokens_st, min_size=0, max_size=4), query=st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_rest_datastore_query_matches_brute_force(docs, query):
    ix = SuffixIndex(docs, max_query=4)
    occ = [(d, i) for d, doc in enumerate(docs) for i in range(len(doc) - len(query) + 1)
           if doc[i : i + len(query)] == query]
    assert ix.find(query) == len(occ)
    conts = ix.continuations(query, depth=2, max_occurrences=1000)
    want = sorted(tuple((docs[d][i + len(query) : i + len(query) + 2] + [-1, -1])[:2]) for d, i in occ)
    assert sorted(map(tuple, conts.tolist())) == want


def test_rest_query_longest_suffix_and_tree():
    ix = SuffixIndex([[4, 1, 2, 3], [1, 2, 3], [7, 1, 2, 5]], max_query=4)
    assert rest_query([ix], [9, 1, 2], max_query=4, min_query=2) == [1, 2]
    assert rest_query([ix], [4, 1, 2], max_query=4, min_query=2) == [4, 1, 2]
    assert rest_query([ix], [9, 9, 2], max_query=4, min_query=2) == []
    conts = ix.continuations([1, 2], depth=2, max_occurrences=10)
    d = count_trie_tree([conts], 2, capacity=3, max_depth=5)
    assert d.token_ids == [2, 3, 5] and all(s == SOURCE_CORPUS for s in d.sources[1:])  # 3 (x2) before 5 (x1)
    # count_trie_tree docstring example
    rows = np.array([[7, 8], [7, 9], [7, 8], [5, -1]])
    d = count_trie_tree([rows], 0, capacity=3, max_depth=5)
    assert d.token_ids == [0, 7, 8] and d.parents == [-1, 0, 1]


@settings(max_examples=150, deadline=None)
@given(docs=st.lists(tokens_st, min_size=1, max_size=3), context=tokens_st, min_q=st.integers(1, 3))
def test_rest_query_is_the_longest_occurring_suffix(docs, context, min_q):
    ix = SuffixIndex(docs, max_query=6)
    want = []
    for m in range(min(6, len(context)), min_q - 1, -1):
        q = context[len(context) - m :]
        if any(doc[i : i + m] == q for doc in docs for i in range(len(doc) - m + 1)):
            want = q
            break
    assert rest_query([ix], context, max_query=6, min_query=min_q) == want


def test_rest_max_occurrences_keeps_the_latest():
    ix = SuffixIndex([[1, 2, 10], [1, 2, 11], [1, 2, 12]], max_query=2)
    conts = ix.continuations([1, 2], depth=1, max_occurrences=2)
    assert conts[:, 0].tolist() == [12, 11]


def test_rest_corpus_formats(tmp_path):
    class Tok:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) - 97 for c in text if c.isalpha()]}

    j = tmp_path / "c.jsonl"
    j.write_text("\n".join([json.dumps({"text": "abc"}), json.dumps({"token_ids": [3, 4]}), json.dumps("ba"), ""]))
    docs = load_corpus(j, Tok(), max_tokens=100, vocab_size=26)
    assert [d.tolist() for d in docs] == [[0, 1, 2], [3, 4], [1, 0]]
    assert [d.tolist() for d in load_corpus(j, Tok(), max_tokens=4, vocab_size=26)] == [[0, 1, 2], [3]]
    t = tmp_path / "c.txt"
    t.write_text("ab\nc\n\nba\n")
    assert [d.tolist() for d in load_corpus(t, Tok(), max_tokens=100, vocab_size=26)] == [[0, 1, 2], [1, 0]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"foo": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_corpus(bad, Tok(), max_tokens=100, vocab_size=26)
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"token_ids": [1, 99]}))
    with pytest.raises(ValueError, match="0..25"):
        load_corpus(big, Tok(), max_tokens=100, vocab_size=26)
    with pytest.raises(ValueError, match="no such file"):
        load_corpus(tmp_path / "missing.jsonl", Tok(), max_tokens=100, vocab_size=26)


def test_rest_learns_finished_rows_with_bounded_memory():
    store = RestDatastore(static=None, learn=True, max_tokens=10, max_query=4)
    row1 = [1, 2, 3, 4]
    store.add_row(row1)
    assert store.indices() == []  # the current row is not indexed
    row1.extend([5, 6])  # the row keeps growing while it decodes
    store.refresh()
    assert store.indices()[0].find([5, 6]) == 1
    store.add_row([7, 8, 9, 1, 2, 3])
    store.refresh()  # 6 + 6 tokens > 10: the oldest row is dropped
    assert store.indices()[0].find([5, 6]) == 0 and store.indices()[0].find([8, 9]) == 1
    assert sum(len(r) for r in store.rows) <= 10


# ---------------------------------------------------------------- SAM


@settings(max_examples=200, deadline=None)
@given(text=tokens_st)
def test_suffix_automaton_matches_brute_force(text):
    sam = SuffixAutomaton()
    sam.extend(text)
    subs = {tuple(text[i:j]) for i in range(len(text)) for j in range(i + 1, len(text) + 1)}
    for s in subs:
        assert sam.contains(s)
        # first_end of the state reached by s is where s first ends in the text
        state = 0
        for t in s:
            state = sam.next[state][t]
        first = min(i + len(s) - 1 for i in range(len(text)) if tuple(text[i : i + len(s)]) == s)
        assert sam.first_end[state] == first
    for probe in [(0, 0, 0, 0, 0), (3, 2, 1), (1,)]:
        assert sam.contains(probe) == (probe in subs)
    assert sam.num_states <= max(2 * len(text) - 1, 1) + 1


@settings(max_examples=200, deadline=None)
@given(text=tokens_st)
def test_sam_matcher_longest_earlier_suffix(text):
    """Interleaved as in the drafter: advance on t (SAM of the text before t), extend, normalise."""
    sam = SuffixAutomaton()
    m = SamMatcher(sam)
    for n, t in enumerate(text):
        m.advance(t)
        sam.extend([t])
        m.normalize()
        seen = text[:n]  # the text before t
        best = 0
        for length in range(1, n + 1):
            suf = text[n + 1 - length : n + 1]
            if any(seen[i : i + length] == suf for i in range(n - length + 1)):
                best = length
        assert m.length == best, (text, n)
        if best:
            cont = m.continuation(3)
            start = sam.first_end[m.state] + 1
            assert cont == text[: n + 1][start : start + 3] and cont  # a continuation always exists
            assert text[start - best : start] == text[n + 1 - best : n + 1]


def test_corpus_sam_never_spans_documents():
    sam = build_corpus_sam([[1, 2], [3, 4]])
    assert sam.contains([1, 2]) and sam.contains([3, 4]) and not sam.contains([2, 3])
    m = SamMatcher(sam)
    m.advance(1)
    assert m.continuation(5) == [2]  # stops at the separator


# ---------------------------------------------------------------- Graft


def test_store_probability_table_is_optional_and_parallel():
    plain = CopyLogitStore(vocab_size=5, k=2)
    plain.update(np.array([1]), np.array([[2, 3]]))  # the existing two-argument call keeps working
    assert plain.probs is None
    st_ = CopyLogitStore(vocab_size=5, k=2, with_probs=True)
    st_.update(np.array([1, 2]), np.array([[2, 3], [4, 0]]), np.array([[0.7, 0.2], [0.9, 0.05]], np.float32))
    assert st_.row(1).tolist() == [2, 3] and st_.probs[1].tolist() == pytest.approx([0.7, 0.2])
    st_.update(np.array([1]), np.array([[4, 4]]))  # no probabilities: unknown
    assert np.isnan(st_.probs[1]).all() and st_.probs[2][0] == pytest.approx(0.9)
    assert st_.nbytes == st_.table.nbytes + st_.probs.nbytes


def test_calibrator_learns_from_outcomes():
    cal = ConfidenceCalibrator()
    assert cal.estimate(0.5, 0) == pytest.approx(0.5, rel=0.2)
    assert cal.estimate(math.nan, 0) == pytest.approx(0.5) and cal.estimate(math.nan, 3) == pytest.approx(0.125)
    for _ in range(100):
        cal.observe(cal.bin(0.5, 0), False)
    assert cal.estimate(0.5, 0) < 0.05
    for _ in range(100):
        cal.observe(cal.bin(0.002, 4), True)
    assert cal.estimate(0.002, 4) > 0.9


def _graft_store():
    store = CopyLogitStore(vocab_size=20, k=2, with_probs=True)
    store.update(np.array([5, 7, 8]), np.array([[7, 8], [9, 10], [11, 12]]),
                 np.array([[0.9, 0.01], [0.6, 0.3], [0.5, 0.4]], np.float32))
    return store


def test_graft_prunes_low_confidence_branches():
    store = _graft_store()
    b = TrieBuilder(root=5, capacity=64)
    pruned = grow_pruned_logits_tree(b, store, calibrator=ConfidenceCalibrator(), threshold=0.05, max_breadth=2,
                                     max_depth=5)
    d = b.build()
    assert (7,) in _paths(d) and (7, 9) in _paths(d) and (8,) not in _paths(d)
    assert pruned >= 1
    # threshold 0: nothing pruned, the same tree as RACER's logits tree
    b0, b1 = TrieBuilder(root=5, capacity=64), TrieBuilder(root=5, capacity=64)
    assert grow_pruned_logits_tree(b0, store, calibrator=ConfidenceCalibrator(), threshold=0.0, max_breadth=2,
                                   max_depth=5) == 0
    grow_logits_tree(b1, store, max_breadth=2, max_depth=5, source=2)
    assert b0.build() == b1.build()


def _graft_drafter(threshold):
    """Root 5: store row 5 -> 7 (p .9), 8 (p .01); the text "1 5 13 14 1 5 13 16 1" + first token 5 makes
    "1 5" a border whose continuations are 13 -> {14, 16}."""
    cfg = DecodingConfig(method="graft", max_breadth=2, graft_threshold=threshold, ngram=4)
    state = make_state(cfg, vocab_size=20)
    assert isinstance(state, LiteratureState) and state.store.probs is not None
    dr = make_drafter(cfg, state)
    assert isinstance(dr, GraftDrafter) and dr.needs_topk_probs
    dr.start([1, 5, 13, 14, 1, 5, 13, 16, 1], None)
    state.store.update(np.array([5, 7, 8]), np.array([[7, 8], [9, 10], [11, 12]]),
                       np.array([[0.9, 0.01], [0.6, 0.3], [0.5, 0.4]], np.float32))
    dr.update(Verified(np.zeros(0, np.int64), np.zeros((0, 2), np.int64), [5]))  # prefill: first token 5
    return dr


@pytest.mark.parametrize("cap", [1, 2, 4, 6, 10, 64])
def test_graft_refill_budget_accounting(cap):
    dr = _graft_drafter(0.05)
    d = dr.propose(5, capacity=cap, max_depth=10)
    acc = dr.last_accounting
    assert len(d) <= cap
    assert 1 + acc.logits_nodes + acc.refilled == len(d)  # every node is paid for once
    assert (8,) not in _paths(d) or cap < 2  # the low-confidence branch is gone
    if cap >= 6:
        assert acc.pruned >= 1 and acc.refilled >= 1  # the freed budget went to retrieval
        assert {(13,), (13, 14), (13, 16)} <= _paths(d) or cap < 10
        assert any(s & SOURCE_RETRIEVAL for s in d.sources)
    # without pruning the logits tree takes the budget first and retrieval only gets what is left
    dr0 = _graft_drafter(0.0)
    d0 = dr0.propose(5, capacity=cap, max_depth=10)
    assert dr0.last_accounting.pruned == 0
    assert dr0.last_accounting.logits_nodes >= acc.logits_nodes
    assert len(d0) <= cap


def test_graft_learns_calibration_from_accepted_paths():
    cfg = DecodingConfig(method="graft", max_breadth=2, graft_threshold=0.0)
    state = make_state(cfg, vocab_size=20)
    dr = make_drafter(cfg, state)
    dr.start([1, 2], None)
    state.store.update(np.array([5]), np.array([[7, 8]]), np.array([[0.9, 0.05]], np.float32))
    dr.update(Verified(np.zeros(0, np.int64), np.zeros((0, 2), np.int64), [5]))
    dr.propose(5, capacity=3, max_depth=1)
    dr.update(Verified(np.array([5, 7, 8]), np.zeros((3, 2), np.int64), [8, 3]))  # 8 accepted, 7 rejected
    cal = state.calibrator
    assert cal.offered.sum() == 2 and cal.accepted.sum() == 1
    assert cal.accepted[cal.bin(0.05, 1)] == 1 and cal.accepted[cal.bin(0.9, 0)] == 0


# ---------------------------------------------------------------- config and the relaxed gate


def test_new_methods_registered_and_config_hash_of_old_configs_unchanged():
    for m in ("tr", "logitspec", "rest", "sam", "graft"):
        assert m in METHODS
        cfg = DecodingConfig(method=m)
        make_drafter(cfg, make_state(cfg, vocab_size=16))
    # hashes computed before the literature fields existed: stored outputs and job specs stay valid
    assert DecodingConfig().config_hash() == "b2cb380b125a1624"
    assert DecodingConfig(method="pld", capacity=8).config_hash() == "c76cd67bac829d81"
    assert "acceptance" not in DecodingConfig().model_dump()
    relaxed = DecodingConfig(acceptance="topk")
    assert relaxed.model_dump()["acceptance"] == "topk"
    assert DecodingConfig.model_validate(relaxed.model_dump()) == relaxed


def test_check_relaxed_allowed():
    check_relaxed_allowed(DecodingConfig(), None)  # lossless needs nothing
    relaxed = DecodingConfig(acceptance="threshold", relaxed_threshold=0.2)
    with pytest.raises(ValueError, match="shadow comparison against lossless"):
        check_relaxed_allowed(relaxed, None)
    check_relaxed_allowed(relaxed, DecodingConfig(method="ar"))
    check_relaxed_allowed(relaxed, {"config": {"method": "ar"}})

    class Shadow:  # the shape of service.spec.ShadowSpec: decoding() returns the baseline config
        def __init__(self, cfg):
            self.config = cfg

        def decoding(self):
            return self.config

    check_relaxed_allowed(relaxed, Shadow(DecodingConfig(method="racer")))
    with pytest.raises(ValueError, match="must decode losslessly"):
        check_relaxed_allowed(relaxed, Shadow(DecodingConfig(acceptance="topk")))
    with pytest.raises(ValueError, match="no decoding config"):
        check_relaxed_allowed(relaxed, {"fraction": 0.1})


def test_rest_without_any_source_is_refused():
    from pydantic import ValidationError

    from racer_batch.values import DecodingConfig

    assert DecodingConfig(method="rest").rest_learn_outputs  # learns the job's rows by default
    with pytest.raises(ValidationError, match="nothing to retrieve from"):
        DecodingConfig(method="rest", rest_learn_outputs=False)
    assert DecodingConfig(method="rest", rest_learn_outputs=False, corpus_path="c.jsonl").corpus_path == "c.jsonl"
    assert DecodingConfig(method="racer", rest_learn_outputs=False).method == "racer"  # other methods ignore it
