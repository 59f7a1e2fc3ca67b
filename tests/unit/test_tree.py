"""Pure unit tests on hand-written token lists: trie builder, breadth rule, flattening, acceptance, PLD."""

import numpy as np
import pytest
import torch

from racer_batch.drafters.base import Draft, TrieBuilder
from racer_batch.drafters.copy_logits import CopyLogitStore, child_breadth, grow_logits_tree
from racer_batch.drafters.pld import prompt_lookup
from racer_batch.engine.sampling import draw, make_generator, processed_probs
from racer_batch.engine.tree import accept_greedy, accept_sampling, flatten_tree
from racer_batch.values import GenerationParams


def test_trie_builder_merges_duplicates_and_counts_capacity_after_merge():
    b = TrieBuilder(root=5, capacity=4)
    a = b.add(0, 7, source=1)
    assert b.add(0, 7, source=2) == a  # duplicate costs nothing, sources merge
    assert b.sources[a] == 3
    b.add(a, 9, source=2)
    b.add(0, 8, source=2)
    assert len(b) == 4 and b.full
    assert b.add(0, 6, source=2) == -1
    assert b.add(a, 9, source=1) == 2  # existing node still found when full
    d = b.build()
    assert d.token_ids == [5, 7, 9, 8] and d.parents == [-1, 0, 1, 0]


def test_draft_rejects_child_before_parent():
    with pytest.raises(AssertionError):
        Draft([1, 2, 3], [-1, 2, 0], [0, 0, 0])


def test_breadth_rule_matches_paper_formula():
    # root (depth 0), breadth 8: children get 8 >> j
    assert [child_breadth(8, child_rank=j, parent_depth=0) for j in range(5)] == [8, 4, 2, 1, 1]
    # non-root parent: one extra halving
    assert [child_breadth(8, child_rank=j, parent_depth=1) for j in range(4)] == [4, 2, 1, 1]
    assert child_breadth(1, child_rank=0, parent_depth=3) == 1


def test_logits_tree_fills_budget_breadth_first_and_skips_retrieval_duplicates():
    store = CopyLogitStore(vocab_size=100, k=4)
    store.update(np.array([1, 10, 11]), np.array([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]))
    b = TrieBuilder(root=1, capacity=7)
    b.add(0, 10, source=1)  # retrieval already placed token 10 under the root
    grow_logits_tree(b, store, max_breadth=4, max_depth=5, source=2)
    d = b.build()
    assert len(d) == 7
    # root children 10 (both sources), 11, 12, 13; then 10's children 20, 21 (breadth 4 >> 1 = 2... then budget)
    assert d.token_ids[:5] == [1, 10, 11, 12, 13]
    assert d.sources[1] == 3
    assert d.token_ids[5:] == [20, 21]
    assert d.parents[5:] == [1, 1]


def test_logits_tree_respects_max_depth_and_unknown_rows():
    store = CopyLogitStore(vocab_size=10, k=2)
    store.update(np.array([1, 2]), np.array([[2, 3], [1, 4]]))
    b = TrieBuilder(root=1, capacity=64)
    grow_logits_tree(b, store, max_breadth=2, max_depth=2, source=2)
    d = b.build()
    depth = [0] * len(d)
    for i in range(1, len(d)):
        depth[i] = depth[d.parents[i]] + 1
    assert max(depth) == 2
    # token 3 and 4 have empty rows (-1): they are leaves
    for i, t in enumerate(d.token_ids):
        if t in (3, 4):
            assert i not in d.parents


def test_store_last_occurrence_wins():
    store = CopyLogitStore(vocab_size=10, k=2)
    store.update(np.array([3, 3]), np.array([[1, 2], [5, 6]]))
    assert store.row(3).tolist() == [5, 6]
    assert store.row(4).tolist() == [-1, -1]


def _example_tree():
    # root 5; 7 (parent root), 8 (parent root), 9 (parent 7)  -- creation order 0,1,2,3
    return Draft([5, 7, 9, 8], [-1, 0, 1, 0], [0, 1, 2, 2])


def test_flatten_breadth_first_positions_mask_paths():
    t = flatten_tree(_example_tree(), committed_len=10, device="cpu", dtype=torch.float32)
    assert t.tokens.tolist() == [5, 7, 8, 9]  # breadth-first
    assert t.order.tolist() == [0, 1, 3, 2]
    assert t.position_ids.tolist() == [[10, 11, 11, 12]]
    assert t.parents.tolist() == [-1, 0, 0, 1]
    m = t.attention_mask[0, 0]
    assert m.shape == (4, 14)
    assert torch.all(m[:, :10] == 0)  # every node sees the committed prefix
    visible = (m[:, 10:] == 0).int().tolist()
    assert visible == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert sorted(map(tuple, t.paths.tolist())) == [(0, 1, 3), (0, 2, -1)]  # -1 padding, never a token id
    assert m.dtype == torch.float32 and m.min() == torch.finfo(torch.float32).min


def test_accept_greedy_longest_matching_path_and_bonus():
    t = flatten_tree(_example_tree(), committed_len=0, device="cpu", dtype=torch.float32)
    # choices per flattened node [5,7,8,9]: root picks 7, node 7 picks 9, node 9 picks 4
    path, bonus = accept_greedy(t, np.array([7, 9, 0, 4]))
    assert path == [0, 1, 3] and bonus == 4
    path, bonus = accept_greedy(t, np.array([8, 9, 6, 4]))
    assert path == [0, 2] and bonus == 6
    path, bonus = accept_greedy(t, np.array([1, 9, 6, 4]))
    assert path == [0] and bonus == 1


def test_accept_greedy_never_accepts_padding_even_if_model_predicts_minus_one_like_ids():
    # A model predicting the id that a pad would carry must not extend a path past its leaf (pitfall 9.1).
    d = Draft([5, 0], [-1, 0], [0, 1])  # chain root -> token 0
    t = flatten_tree(d, committed_len=0, device="cpu", dtype=torch.float32)
    # target predicts 0 everywhere: accept node 1, then bonus 0; the path stops at the leaf
    path, bonus = accept_greedy(t, np.array([0, 0]))
    assert path == [0, 1] and bonus == 0


def test_accept_sampling_descends_while_draw_matches_child():
    t = flatten_tree(_example_tree(), committed_len=0, device="cpu", dtype=torch.float32)
    onehot = {0: 7, 1: 9, 2: 3, 3: 4}

    def probs(node):
        p = torch.zeros(16)
        p[onehot[node]] = 1.0
        return p

    path, bonus = accept_sampling(t, probs, make_generator(0))
    assert path == [0, 1, 3] and bonus == 4


def test_processed_probs_top_k_top_p():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0])
    p = processed_probs(logits, GenerationParams(temperature=1.0, top_k=2))
    assert p[2] == 0 and p[3] == 0 and torch.isclose(p.sum(), torch.tensor(1.0))
    p = processed_probs(logits, GenerationParams(temperature=1.0, top_p=0.5))
    assert p[0] == 1.0  # the top token alone holds > 0.5 of the mass
    p = processed_probs(logits, GenerationParams(temperature=1.0, top_p=0.8))
    assert p[0] > 0 and p[1] > 0 and p[2] == 0


def test_draw_is_seeded_and_follows_distribution():
    p = torch.tensor([0.1, 0.6, 0.3])
    g1, g2 = make_generator(7), make_generator(7)
    a = [draw(p, g1) for _ in range(200)]
    assert a == [draw(p, g2) for _ in range(200)]
    counts = np.bincount(a, minlength=3) / 200
    assert abs(counts[1] - 0.6) < 0.12


def test_prompt_lookup_examples():
    assert prompt_lookup([1, 2, 3, 9, 1, 2], max_ngram=3, num_tokens=2) == [3, 9]
    assert prompt_lookup([1, 2, 3, 4], max_ngram=3, num_tokens=5) == []
    # prefers the longest suffix match: [7, 1, 2] matches at 4; plain [2] would match at 1 first
    assert prompt_lookup([0, 2, 5, 9, 7, 1, 2, 8, 3, 7, 1, 2], max_ngram=3, num_tokens=2) == [8, 3]
