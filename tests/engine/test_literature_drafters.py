"""The literature drafters (tr, logitspec, rest, sam, graft) and relaxed acceptance on tiny random Llamas."""

import json

import numpy as np
import pytest

from racer_batch import DecodingConfig, Engine, GenerationParams, generate_reference
from racer_batch.drafters import make_drafter
from racer_batch.drafters.base import Draft
from tests.helpers import check_greedy_equals_reference, tiny_bundle

NEW_METHODS = ["tr", "logitspec", "rest", "sam", "graft"]
PROMPTS = ["abcabcabd", "hello world, hello", "0123012301", "the cat sat on the mat. the cat"]


@pytest.mark.parametrize("method", NEW_METHODS)
@pytest.mark.parametrize("capacity", [4, 16, 64])
def test_greedy_equals_reference(tiny, method, capacity):
    check_greedy_equals_reference(tiny, method, capacity, PROMPTS)


@pytest.mark.parametrize("method", NEW_METHODS)
def test_drafts_are_accepted(tiny, method):
    """Each method really speculates on a repetitive row (rest: after learning an earlier row of the job)."""
    engine = Engine(tiny, DecodingConfig(method=method, capacity=32))
    state = engine.new_state()
    params = GenerationParams(max_new_tokens=100)
    first = engine.generate("abcabcabd", params, state=state)
    again = engine.generate("abcabcabd", params, state=state)
    assert again.token_ids == first.token_ids == generate_reference(tiny, "abcabcabd", params).token_ids
    assert again.stats.mat > 1.3, (method, again.stats.mat)


@pytest.mark.parametrize("method", NEW_METHODS)
def test_max_new_tokens_and_eos_mid_block(method):
    bundle = tiny_bundle(eos=False)
    prompt = "0123012301"
    base = generate_reference(bundle, prompt, GenerationParams(max_new_tokens=60))
    engine = Engine(bundle, DecodingConfig(method=method, capacity=32))
    for cap in [1, 2, 7, 13, 60]:
        out = engine.generate(prompt, GenerationParams(max_new_tokens=cap))
        assert out.token_ids == base.token_ids[:cap] and out.output_tokens == cap
    fresh = next((i, t) for i, t in enumerate(base.token_ids) if i >= 5 and t not in base.token_ids[:i])
    idx, tok = fresh
    out = engine.generate(prompt, GenerationParams(max_new_tokens=60, extra_eos_ids=[tok]))
    assert out.finish_reason == "eos" and out.token_ids == base.token_ids[: idx + 1]
    assert out.stats.emitted_tokens == idx + 1


@pytest.mark.parametrize("method", NEW_METHODS)
def test_seeded_sampling_matches_reference(method):
    bundle = tiny_bundle(head_scale=3.0, eos=False)
    engine = Engine(bundle, DecodingConfig(method=method, capacity=16))
    for seed in range(3):
        params = GenerationParams(max_new_tokens=40, temperature=1.0, top_p=0.95, top_k=20, seed=seed)
        out = engine.generate("abcab", params)
        assert out.token_ids == generate_reference(bundle, "abcab", params).token_ids


def _corpus_file(tmp_path, bundle, prompts, max_new):
    """A JSONL corpus of earlier outputs of the same route: the reference continuations of ``prompts``."""
    path = tmp_path / "route.jsonl"
    lines = []
    for p in prompts:
        ids = (bundle.tokenizer(p)["input_ids"]
               + generate_reference(bundle, p, GenerationParams(max_new_tokens=max_new)).token_ids)
        lines.append(json.dumps({"token_ids": ids}))
    lines.append(json.dumps({"text": "some unrelated text."}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("method", ["rest", "sam"])
def test_static_corpus_drafts_are_lossless_and_accepted(tiny, tmp_path, method):
    corpus = _corpus_file(tmp_path, tiny, ["the cat sat on the mat. the cat", "hello world, hello"], 80)
    cfg = DecodingConfig(method=method, capacity=16, corpus_path=corpus, scope="request", rest_learn_outputs=False)
    engine = Engine(tiny, cfg)
    params = GenerationParams(max_new_tokens=80)
    out = engine.generate("the cat sat on the mat. the cat", params)
    assert out.token_ids == generate_reference(tiny, "the cat sat on the mat. the cat", params).token_ids
    assert out.stats.mat > 3.0  # the corpus holds this very continuation
    other = engine.generate("zz9", params)  # nothing in the corpus: still exact
    assert other.token_ids == generate_reference(tiny, "zz9", params).token_ids


def test_bad_corpus_is_a_value_error(tiny, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        Engine(tiny, DecodingConfig(method="rest", corpus_path=str(bad))).new_state()
    with pytest.raises(ValueError, match="no such file"):
        Engine(tiny, DecodingConfig(method="sam", corpus_path=str(tmp_path / "none.jsonl"))).generate("ab")


def test_rest_state_scopes_do_not_leak(tiny):
    engine = Engine(tiny, DecodingConfig(method="rest", capacity=16))
    s1, s2 = engine.new_state(), engine.new_state()
    engine.generate("abcabc", GenerationParams(max_new_tokens=10), state=s1)
    engine.generate("abcabc", GenerationParams(max_new_tokens=10), state=s1)  # indexes the first row
    assert s1.rest.indices() and not s2.rest.indices()
    engine.free_state(s1)
    assert s1.rest is None


class _Spy:
    """Wraps a drafter and records what the engine hands to update()."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []
        self.name, self.needs_topk = inner.name, inner.needs_topk
        self.needs_topk_probs = getattr(inner, "needs_topk_probs", False)

    def start(self, *a):
        self.inner.start(*a)

    def propose(self, root, **kw):
        return self.inner.propose(root, **kw)

    def update(self, v):
        self.seen.append(v)
        self.inner.update(v)


@pytest.mark.parametrize("method", ["logitspec", "graft", "racer"])
def test_engine_hands_last_node_and_probabilities(tiny, method):
    spies = []

    def factory(cfg, st):
        spies.append(_Spy(make_drafter(cfg, st)))
        return spies[-1]

    engine = Engine(tiny, DecodingConfig(method=method, capacity=16), drafter_factory=factory)
    out = engine.generate("abcabcabd", GenerationParams(max_new_tokens=40))
    seen = spies[0].seen
    assert seen[0].last_node == -1  # the prefill update
    for v in seen[1:]:
        # greedy: the last accepted node's top-1 is the bonus token (the last committed token)
        assert v.node_topk[v.last_node][0] == v.committed[-1] or v is seen[-1]
        if method == "graft":
            p = v.node_topk_probs
            assert p.shape == v.node_topk.shape and p.dtype == np.float32
            assert np.all(np.diff(p, axis=1) <= 1e-6) and np.all(p.sum(axis=1) <= 1.0 + 1e-5)
        else:
            assert v.node_topk_probs is None  # nobody else pays for the softmax
    assert out.output_tokens == 40


# ---------------------------------------------------------------- relaxed acceptance


def test_lossless_default_is_unchanged(tiny):
    for method in ["racer", "tr"]:
        plain = Engine(tiny, DecodingConfig(method=method, capacity=16))
        explicit = Engine(tiny, DecodingConfig(method=method, capacity=16, acceptance="lossless"))
        for prompt in PROMPTS[:2]:
            a = plain.generate(prompt, GenerationParams(max_new_tokens=60), keep_steps=True)
            b = explicit.generate(prompt, GenerationParams(max_new_tokens=60), keep_steps=True)
            assert a.token_ids == b.token_ids == generate_reference(
                tiny, prompt, GenerationParams(max_new_tokens=60)).token_ids
            assert [(r.tree_size, r.accepted_length) for r in a.stats.step_records] == \
                   [(r.tree_size, r.accepted_length) for r in b.stats.step_records]


class SecondChoiceDrafter:
    """Drafts a chain of the target's *second* most likely tokens (runs the tiny model itself): lossless
    acceptance never takes them, top-2 acceptance always does."""

    name = "second"
    needs_topk = False

    def __init__(self, bundle, length=4):
        self.model, self.length, self.ctx = bundle.model, length, []

    def start(self, prompt_ids, prompt_topk):
        self.ctx = list(prompt_ids)

    def propose(self, root, *, capacity, max_depth):
        import torch

        seq, chain = list(self.ctx), []
        with torch.no_grad():
            for _ in range(min(self.length, capacity - 1, max_depth)):
                logits = self.model(torch.tensor([seq])).logits[0, -1]
                chain.append(int(torch.topk(logits, 2).indices[1]))
                seq.append(chain[-1])
        return Draft([root, *chain], list(range(-1, len(chain))), [0] + [4] * len(chain))

    def update(self, verified):
        self.ctx.extend(verified.committed)


def test_relaxed_acceptance_accepts_more_and_changes_outputs(tiny):
    params = GenerationParams(max_new_tokens=30)
    ref = generate_reference(tiny, "hello world", params)
    mats = {}
    for acceptance, extra in [("lossless", {}), ("topk", {"relaxed_topk": 2}),
                              ("threshold", {"relaxed_threshold": 1e-4})]:
        cfg = DecodingConfig(method="pld", capacity=8, acceptance=acceptance, **extra)
        engine = Engine(tiny, cfg, drafter_factory=lambda c, st: SecondChoiceDrafter(tiny))
        out = engine.generate("hello world", params)
        mats[acceptance] = out.stats.mat
        assert out.output_tokens == 30 and out.stats.emitted_tokens == 30
        if acceptance == "lossless":
            assert out.token_ids == ref.token_ids
            assert out.stats.mat < 1.1  # second choices are (almost) never the target's argmax
        else:
            assert out.token_ids != ref.token_ids  # relaxed acceptance changes the output
            assert out.stats.mat > 3.0, (acceptance, out.stats.mat)
    # with a real drafter relaxed acceptance never accepts less than lossless on these rows
    steps = {}
    for acceptance in ["lossless", "topk"]:
        engine = Engine(tiny, DecodingConfig(method="racer", capacity=16, acceptance=acceptance, relaxed_topk=4))
        steps[acceptance] = sum(engine.generate(p, params).stats.steps for p in PROMPTS)
    assert steps["topk"] <= steps["lossless"]


def test_relaxed_sampling_runs_and_repeats():
    bundle = tiny_bundle(head_scale=3.0, eos=False)
    engine = Engine(bundle, DecodingConfig(method="racer", capacity=16, acceptance="topk", relaxed_topk=3))
    p = GenerationParams(max_new_tokens=40, temperature=1.0, seed=5)
    a, b = engine.generate("abcab", p), engine.generate("abcab", p)
    assert a.token_ids == b.token_ids and a.output_tokens == 40
