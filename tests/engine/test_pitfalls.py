"""Regression tests for the pitfalls of public implementations (docs/method.md section 9) not covered elsewhere.

Covered elsewhere: 9.3 lossy sampling (test_engine_tiny::test_lossless_sampling...), 9.4/9.5 LRU order and
failure links (tests/unit/test_automaton.py), 9.6 shared state (test_engine_tiny::test_state_scopes),
9.10 float32 equality (tests/integration), 9.11 EOS mid-block and cap mid-block
(test_engine_tiny::test_eos_mid_generation_and_mid_block, ::test_max_new_tokens_exact_including_one),
9.12 emitted-only counters (asserted in the greedy tests)."""

import numpy as np
import pytest
import torch

from racer_batch import DecodingConfig, Engine, GenerationParams, generate_reference
from racer_batch.drafters.base import Draft
from racer_batch.engine.runner import PREFILL_TOPK_CHUNK, ModelRunner
from racer_batch.engine.tree import flatten_tree
from tests.helpers import ContextFreeDrafter, tiny_bundle


class RaggedDrafter(ContextFreeDrafter):
    """Ragged trees whose short paths end where the model will predict token 0 (a typical pad id)."""

    name = "ragged"

    def propose(self, root, *, capacity, max_depth):
        if max_depth < 3:
            return Draft.root_only(root)
        return Draft([root, 0, 5, 0, 7, 0], [-1, 0, 0, 2, 3, 4], [0, 2, 2, 2, 2, 2])


def test_9_1_path_padding_is_never_accepted_as_a_token():
    bundle = tiny_bundle(eos=False, seed=5)
    # make token 0 the model's favourite everywhere, as a pad id predicted by the model would be
    with torch.no_grad():
        bundle.model.lm_head.weight[0] += 5.0
    prompt = "abcabc"
    ref = generate_reference(bundle, prompt, GenerationParams(max_new_tokens=30))
    eng = Engine(bundle, DecodingConfig(method="ar"), drafter_factory=lambda c, s: RaggedDrafter())
    out = eng.generate(prompt, GenerationParams(max_new_tokens=30))
    assert out.token_ids == ref.token_ids
    assert out.stats.mat > 1.0  # the ragged drafts were really accepted somewhere


def test_9_2_tree_logits_equal_sequential_logits_on_every_path():
    bundle = tiny_bundle(seed=1)
    runner = ModelRunner(bundle)
    prompt = [5, 6, 7, 8, 9, 10]
    draft = Draft([11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 2], [0, 2, 2, 2, 2, 2])
    cache = runner.new_cache()
    runner.prefill(prompt, cache=cache, topk=0)
    tree = flatten_tree(draft, committed_len=len(prompt), device="cpu", dtype=torch.float32)
    logits = runner.verify(input_ids=tree.input_ids, position_ids=tree.position_ids,
                           attention_mask=tree.attention_mask, cache=cache)
    for path in tree.paths:
        nodes = [int(n) for n in path if n >= 0]
        seq = prompt + [int(tree.tokens[n]) for n in nodes]
        with torch.no_grad():
            full = bundle.model(torch.tensor([seq])).logits[0, len(prompt):]
        torch.testing.assert_close(logits[nodes], full, rtol=1e-4, atol=1e-4)


def test_9_7_racer_tree_fills_capacity_counted_after_merging():
    bundle = tiny_bundle(seed=2)
    eng = Engine(bundle, DecodingConfig(method="racer", capacity=24))
    out = eng.generate("abcabcabcabd", GenerationParams(max_new_tokens=60), keep_steps=True)
    sizes = [r.tree_size for r in out.stats.step_records[1:]]  # step 0 is the prefill
    # once the store knows the frequent tokens, trees use the whole budget of unique nodes
    assert max(sizes) == 24
    assert all(s <= 24 for s in sizes)
    assert np.mean(np.array(sizes) == 24) > 0.5


def test_9_8_special_tokens_are_expanded_and_every_eos_id_stops():
    bundle = tiny_bundle(seed=3)
    eng = Engine(bundle, DecodingConfig(method="racer"))
    state = eng.new_state()
    vocab = state.native.vocab_size if state.native is not None else state.store.table.shape[0]
    assert vocab == bundle.vocab_size  # sized by the full output vocabulary
    with pytest.raises(ValueError):
        state.store_row(bundle.vocab_size)
    # after a prompt containing the special EOS id (2), its store row holds real predictions
    eng.generate([5, 2, 6, 7], GenerationParams(max_new_tokens=5), state=state)
    assert (state.store_row(2) >= 0).all()
    # any EOS id stops, not only the first one
    base = generate_reference(tiny_bundle(seed=3, eos=False), "abcabc", GenerationParams(max_new_tokens=30))
    second = next(t for i, t in enumerate(base.token_ids) if i >= 3 and t not in base.token_ids[:i])
    out = Engine(tiny_bundle(seed=3, eos=False), DecodingConfig(method="racer")).generate(
        "abcabc", GenerationParams(max_new_tokens=30, extra_eos_ids=[63, second]))
    assert out.finish_reason == "eos" and out.token_ids[-1] == second


def test_9_9_prefill_topk_is_chunked_and_exact():
    bundle = tiny_bundle(seed=4, context_length=2048)
    runner = ModelRunner(bundle)
    prompt = (list(range(3, 60)) * 20)[: PREFILL_TOPK_CHUNK * 2 + 37]
    last, top = runner.prefill(prompt, cache=runner.new_cache(), topk=8)
    with torch.no_grad():
        full = bundle.model(torch.tensor([prompt])).logits[0]
    assert top.shape == (len(prompt), 8)
    torch.testing.assert_close(last, full[-1])
    assert torch.equal(top, torch.topk(full, 8, dim=-1).indices)
