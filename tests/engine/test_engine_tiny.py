"""Engine tests on tiny random Llamas with a character tokenizer (no download)."""


import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from racer_batch import DecodingConfig, Engine, GenerationParams, generate_reference
from racer_batch.drafters.base import Draft
from racer_batch.engine.batch import drive
from racer_batch.engine.capacity import CapacityTuner
from racer_batch.engine.kernels import cpu_ops
from tests.helpers import ContextFreeDrafter, check_greedy_equals_reference, tiny_bundle

METHODS = ["ar", "pld", "logits", "retrieval", "racer"]
PROMPTS = ["abcabcabd", "hello world, hello", "0123012301", "the cat sat on the mat. the cat"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("capacity", [4, 64])
def test_greedy_equals_reference(tiny, method, capacity):
    check_greedy_equals_reference(tiny, method, capacity, PROMPTS)


def test_speculation_actually_accepts_drafts(tiny):
    out = Engine(tiny, DecodingConfig(method="racer", capacity=32)).generate(
        "abcabcabd", GenerationParams(max_new_tokens=120))
    assert out.stats.mat > 1.2
    assert out.stats.steps < out.output_tokens


def _first_fresh_token(tokens, at_least):
    for i, t in enumerate(tokens):
        if i >= at_least and t not in tokens[:i]:
            return i, t
    return None


@pytest.mark.parametrize("method", METHODS)
def test_eos_mid_generation_and_mid_block(method):
    bundle = tiny_bundle(eos=False)
    prompt = "0123012301"
    base = generate_reference(bundle, prompt, GenerationParams(max_new_tokens=60))
    hit = _first_fresh_token(base.token_ids, 5)
    assert hit is not None
    idx, tok = hit
    params = GenerationParams(max_new_tokens=60, extra_eos_ids=[tok])
    out = Engine(bundle, DecodingConfig(method=method, capacity=16)).generate(prompt, params)
    assert out.finish_reason == "eos"
    assert out.token_ids == base.token_ids[: idx + 1]
    assert out.output_tokens == idx + 1
    assert out.stats.emitted_tokens == idx + 1


@pytest.mark.parametrize("method", ["ar", "racer", "pld"])
def test_stop_string_spanning_tokens_at_every_position(method):
    bundle = tiny_bundle(eos=False)
    prompt = "hello world, hello"
    base = generate_reference(bundle, prompt, GenerationParams(max_new_tokens=40))
    text = base.text
    engine = Engine(bundle, DecodingConfig(method=method, capacity=16))
    checked = 0
    for j in range(2, len(text)):
        stop = text[j - 2 : j]  # two characters = two tokens: the stop string spans a token boundary
        if stop in text[: j - 1]:
            continue  # an earlier occurrence would stop first
        out = engine.generate(prompt, GenerationParams(max_new_tokens=40, stop=[stop]))
        assert out.finish_reason == "stop", (j, stop)
        assert out.token_ids == base.token_ids[:j]
        assert out.text == text[: j - 2]  # the stop string is cut from the text
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("method", METHODS)
def test_max_new_tokens_exact_including_one(tiny, method):
    prompt = "abcabcabd"
    base = generate_reference(tiny, prompt, GenerationParams(max_new_tokens=50))
    engine = Engine(tiny, DecodingConfig(method=method, capacity=32))
    for cap in [1, 2, 3, 7, 13, 50]:
        if cap > base.output_tokens:
            continue
        out = engine.generate(prompt, GenerationParams(max_new_tokens=cap))
        assert out.token_ids == base.token_ids[:cap]
        assert out.output_tokens == cap
        expected = "eos" if cap == base.output_tokens and base.finish_reason == "eos" else "length"
        assert out.finish_reason == expected


@pytest.mark.parametrize("method", ["ar", "racer"])
def test_context_limit_stops_before_the_model_runs_out_of_positions(method):
    bundle = tiny_bundle(context_length=24, eos=False)
    prompt = "abcabcabcabcabcabcab"  # 20 tokens: 4 free positions, max_new_tokens 10
    out = Engine(bundle, DecodingConfig(method=method, capacity=16)).generate(
        prompt, GenerationParams(max_new_tokens=10))
    ref = generate_reference(bundle, prompt, GenerationParams(max_new_tokens=10))
    assert out.finish_reason == "context" and ref.finish_reason == "context"
    assert out.output_tokens == 4 and out.token_ids == ref.token_ids
    with pytest.raises(ValueError, match="context"):
        Engine(bundle).generate("a" * 24, GenerationParams(max_new_tokens=1))


def test_bad_prompts_raise_value_error(tiny):
    engine = Engine(tiny, DecodingConfig(method="racer"))
    with pytest.raises(ValueError, match="empty"):
        engine.generate("", GenerationParams())
    with pytest.raises(ValueError, match="chat template"):
        engine.generate([{"role": "user", "content": "hi"}], GenerationParams())
    with pytest.raises(ValueError, match="role"):
        engine.generate([{"content": "hi"}], GenerationParams())


@pytest.mark.parametrize("method", ["ar", "racer"])
def test_seeded_sampling_repeats_and_seeds_differ(method):
    bundle = tiny_bundle(head_scale=3.0, eos=False)
    engine = Engine(bundle, DecodingConfig(method=method, capacity=16))
    p = dict(max_new_tokens=40, temperature=1.0, top_p=0.95, top_k=20)
    a = engine.generate("abcab", GenerationParams(seed=1, **p))
    b = engine.generate("abcab", GenerationParams(seed=1, **p))
    c = engine.generate("abcab", GenerationParams(seed=2, **p))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    ref = generate_reference(bundle, "abcab", GenerationParams(seed=1, **p))
    assert ref.token_ids == generate_reference(bundle, "abcab", GenerationParams(seed=1, **p)).token_ids


class FixedTreeDrafter(ContextFreeDrafter):
    """Proposes the same tree every step, whatever the context (tests the acceptance rule alone)."""

    name = "fixed"

    def propose(self, root, *, capacity, max_depth):
        tokens = [root, 1, 3, 4, 1, 5, 0]
        parents = [-1, 0, 0, 1, 1, 3, 2]
        keep = [0]
        depth = [0] * len(tokens)
        for i in range(1, len(tokens)):
            depth[i] = depth[parents[i]] + 1
            if depth[i] <= max_depth:
                keep.append(i)
        remap = {old: new for new, old in enumerate(keep)}
        return Draft([tokens[i] for i in keep], [-1] + [remap[parents[i]] for i in keep[1:]],
                     [0] + [2] * (len(keep) - 1))


def test_lossless_sampling_matches_autoregressive_distribution():
    """Chi-square of the first three emitted tokens (20,000 seeded draws) against the exact AR distribution."""
    V = 6
    bundle = tiny_bundle(vocab_size=V, head_scale=4.0, eos=False, seed=3)
    model = bundle.model
    prompt = [1, 0, 3]
    params_kw = dict(temperature=0.8, max_new_tokens=3)
    # exact AR distribution over V^3 sequences
    with torch.no_grad():
        def probs(seq):
            logits = model(torch.tensor([seq])).logits[0, -1].float() / params_kw["temperature"]
            return torch.softmax(logits, -1).double()
        exact = np.zeros((V, V, V))
        p1 = probs(prompt)
        for a in range(V):
            p2 = probs(prompt + [a])
            for b in range(V):
                p3 = probs(prompt + [a, b])
                exact[a, b] = (p1[a] * p2[b] * p3).numpy()
    engine = Engine(bundle, DecodingConfig(method="ar"), drafter_factory=lambda cfg, st: FixedTreeDrafter())
    assert engine.runner.kind == "static"  # the default runner: the chi-square is about the fast verify path
    if cpu_ops() is not None:
        assert engine.runner.matmul == "small_gemm"  # ... on our CPU kernels where they build
    n = 20_000
    counts = np.zeros((V, V, V))
    accepted = 0
    for seed in range(n):
        out = drive(engine._stream_ids(prompt, GenerationParams(seed=seed, **params_kw), state=None, should_cancel=None,
                                       keep_steps=False))
        a, b, c = out.token_ids
        counts[a, b, c] += 1
        accepted += out.stats.emitted_tokens - out.stats.steps
    assert accepted > n * 0.3  # the fixed tree is accepted often enough for the test to mean something
    exp = exact.ravel() / exact.sum() * n  # renormalise float rounding so the totals agree exactly
    obs = counts.ravel()
    big = exp >= 5  # pool rare cells so the chi-square approximation holds
    f_obs, f_exp = obs[big], exp[big]
    if (~big).any():
        f_obs, f_exp = np.append(f_obs, obs[~big].sum()), np.append(f_exp, exp[~big].sum())
    pval = chisquare(f_obs, f_exp).pvalue
    assert pval > 0.01, pval


def test_capacity_tuner_prefers_cheap_trees_when_acceptance_is_shallow():
    cost = {4: 10.0, 16: 20.0, 64: 40.0}
    tuner = CapacityTuner(cost, [4, 16, 64], warmup_steps=4, explore_every=0)
    for _ in range(20):
        assert tuner.capacity() in (4, 16, 64)
        tuner.observe(used_capacity=tuner.capacity(), accepted_creation_idx=[1, 2], overhead_ms=0.0)
    assert tuner.choose() == 4  # the accepted nodes are always among the first 4: paying for 64 is waste
    tuner2 = CapacityTuner({4: 10.0, 16: 12.0, 64: 14.0}, [4, 16, 64], warmup_steps=4, explore_every=0)
    for _ in range(20):
        tuner2.observe(used_capacity=64, accepted_creation_idx=[3, 10, 30, 50, 60, 63], overhead_ms=0.0)
    assert tuner2.choose() == 64  # deep acceptance from late nodes pays for the big tree


def test_capacity_tuner_explores_one_size_up_not_the_largest():
    tuner = CapacityTuner({4: 10.0, 16: 20.0, 64: 40.0}, [4, 16, 64], warmup_steps=4, explore_every=4)
    used = []
    for _ in range(24):
        cap = tuner.capacity()
        used.append(cap)
        tuner.observe(used_capacity=cap, accepted_creation_idx=[1, 2], overhead_ms=0.0)
    assert used[:4] == [16] * 4  # warm-up at the largest capacity costing <= 2x the cheapest, not at 64 (4x)
    assert tuner.current == 4 and set(used[4:]) == {4, 16}  # exploration costs t(16), never t(64)
    assert used[4:].count(16) == 5


def test_capacity_tuner_keeps_its_choice_between_near_equal_sizes_and_switches_on_a_clear_win():
    """Two sizes within switch_margin of each other: the choice stays put (it took turns every step before);
    once one is clearly better the tuner moves to it."""
    def run(margin: float) -> tuple[CapacityTuner, list[int]]:
        tuner = CapacityTuner({4: 10.0, 6: 12.4}, [4, 6], warmup_steps=0, explore_every=0, switch_margin=margin)
        chosen = []
        for step in range(40):  # MAT(4) = 4 always; MAT(6) alternates around 5: 400 vs ~403 tokens/s
            tuner.observe(used_capacity=6, accepted_creation_idx=[1, 2, 3] if step % 2 == 0 else [1, 2, 3, 4, 5],
                          overhead_ms=0.0)
            chosen.append(tuner.current)
        return tuner, chosen

    tuner, chosen = run(0.02)
    assert set(chosen[1:]) == {4}, chosen
    _, flapping = run(0.0)
    assert sum(a != b for a, b in zip(flapping, flapping[1:])) >= 10  # what the margin prevents
    for _ in range(20):  # size 6 now accepts deeper every step: clearly better
        tuner.observe(used_capacity=6, accepted_creation_idx=[1, 2, 3, 4, 5], overhead_ms=0.0)
    assert tuner.current == 6 and tuner.expected_rates()[6] > 1.02 * tuner.expected_rates()[4]


def test_capacity_tuner_compares_sizes_on_the_steps_that_saw_both():
    """A large size seen only early (the warm-up, on text that drafts well) is not credited with that text's
    acceptance against a small size seen on every step: its gain over the small size is taken from the steps
    that saw both. Unpaired means would give MAT(4) = 4 and choose 4 here."""
    tuner = CapacityTuner({2: 10.0, 4: 30.0}, [2, 4], warmup_steps=0, explore_every=0)
    for _ in range(16):  # early: every draft node accepted; both sizes seen
        tuner.observe(used_capacity=4, accepted_creation_idx=[1, 2, 3], overhead_ms=0.0)
    for _ in range(84):  # later: nothing accepted; only size 2 used
        tuner.observe(used_capacity=2, accepted_creation_idx=[], overhead_ms=0.0)
    rates = tuner.expected_rates()
    assert rates[2] == pytest.approx(1000 * 1.16 / 10) and rates[4] == pytest.approx(1000 * (1.16 + 2.0) / 30, abs=0.01)
    assert tuner.choose() == 2 and tuner.current == 2


def test_capacity_tuner_warmup_capacity_follows_the_cost_curve():
    flat = CapacityTuner({1: 10.0, 4: 10.5, 16: 11.0, 64: 13.0}, [4, 16, 64], warmup_steps=4)
    assert flat.warmup_cap == 64 and flat.capacity() == 64  # a GPU-like curve: warm up at the largest
    steep = CapacityTuner({1: 10.0, 4: 12.0, 16: 21.0, 64: 70.0}, [4, 16, 64], warmup_steps=4)
    assert steep.warmup_cap == 4  # t(16) = 2.1 x t(1): too dear for 16 warm-up steps


def test_capacity_tuner_climbs_above_the_warmup_capacity_when_everything_is_accepted():
    tuner = CapacityTuner({1: 10.0, 4: 10.0, 16: 15.0, 64: 40.0}, [4, 16, 64], warmup_steps=4, explore_every=2)
    assert tuner.warmup_cap == 16
    used = []
    for _ in range(40):
        cap = tuner.capacity()
        used.append(cap)
        tuner.observe(used_capacity=cap, accepted_creation_idx=list(range(1, cap)), overhead_ms=0.0)
    assert 64 in used and tuner.current == 64  # MAT c per step: 64/40 ms beats 16/15 ms, found by exploring


def test_auto_capacity_runs_and_stays_lossless(tiny):
    engine = Engine(tiny, DecodingConfig(method="racer", capacity="auto", auto_capacities=[4, 8, 16]))
    steps = set(engine.runner.step_sizes(16))  # where the runner's cost steps up: candidates too
    assert set(engine.cost_curve_ms) == {1, 4, 8, 16} | {s for s in steps if s >= 4}
    if cpu_ops() is not None:
        assert {6, 12} <= set(engine.cost_curve_ms)  # our kernels' 6-row register blocks
    out = engine.generate("abcabcabd", GenerationParams(max_new_tokens=60))
    assert out.token_ids == generate_reference(tiny, "abcabcabd", GenerationParams(max_new_tokens=60)).token_ids
    assert engine.tuner.steps > 0


def test_state_scopes(tiny):
    job = Engine(tiny, DecodingConfig(method="racer", scope="job"))
    s1, s2 = job.new_state(), job.new_state()
    assert s1 is not s2
    job.generate("abcabc", GenerationParams(max_new_tokens=10), state=s1)
    assert s1.automaton_nodes > 0 and s2.automaton_nodes == 0  # one job's text never reaches another
    job.free_state(s1)
    with pytest.raises(ValueError, match="freed"):
        job.generate("abcabc", GenerationParams(max_new_tokens=10), state=s1)
    glob = Engine(tiny, DecodingConfig(method="racer", scope="global"))
    assert glob.new_state() is glob.new_state()
    req = Engine(tiny, DecodingConfig(method="racer", scope="request"))
    s = req.new_state()
    req.generate("abcabc", GenerationParams(max_new_tokens=10), state=s)
    assert s.automaton_nodes == 0  # request scope used a fresh private state


@pytest.mark.parametrize("core", ["native", "python"])
def test_automaton_memory_bounded_across_rows(tiny, core, monkeypatch):
    if core == "python":
        monkeypatch.setenv("RACER_NATIVE_DRAFT", "off")
    engine = Engine(tiny, DecodingConfig(method="racer", max_nodes=200, ngram=6))
    state = engine.new_state()
    assert (state.native is not None) == (core == "native")
    for i in range(12):
        engine.generate(PROMPTS[i % len(PROMPTS)] + str(i), GenerationParams(max_new_tokens=40), state=state)
        assert 0 < state.automaton_nodes <= 200
    if core == "python":
        state.automaton.check_invariants()
    else:
        assert state.native.num_evicted > 0  # the pool was full: eviction kept it within max_nodes
    assert state.rows == 12
