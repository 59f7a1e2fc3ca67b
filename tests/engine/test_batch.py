"""Several streams in one forward (engine/batch.py, StaticRunner.verify_batch; issue 14).

The oracle for a batch is the same stream decoded alone: a stream's logits, greedy tokens and seeded samples
must not depend on its batch-mates. ``generate_reference`` (the HF forward, one token at a time) checks that
the batched engine stays lossless.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_static_runner import bundle_of, make_model, prefilled_chain, rand_draft, rand_tokens

from racer_batch import DecodingConfig, Engine, GenerationParams, generate_reference
from racer_batch.engine.batch import Decode, Prefill, StreamBatch, drive, run_one
from racer_batch.engine.kernels import cpu_ops
from racer_batch.engine.static_runner import StaticRunner
from racer_batch.engine.tree import flatten_tree
from tests.helpers import tiny_bundle

needs_kernels = pytest.mark.skipif(cpu_ops() is None, reason="the batched forward runs on our CPU kernels")

PROMPTS = ["abcabcabd", "hello world, hello", "0123012301", "the cat sat on the mat. the cat",
           "xyz", "abababababababababababab abababab", "q", "mississippi mississippi miss",
           "a longer prompt that goes on and on: the quick brown fox jumps over the lazy dog, the quick brown"]


@needs_kernels
@pytest.mark.parametrize("family,over", [("llama", {}), ("qwen3", {}), ("qwen2", {}), ("llama_mqa", {}),
                                         ("llama", {"hidden_size": 96, "num_attention_heads": 4})])
def test_verify_batch_equals_each_stream_alone(family, over):
    """Every stream's logits from one batched forward equal (bit for bit) its own forward, over slots holding
    different committed lengths and trees of different sizes; the KV rows written are the same too."""
    model = make_model(family, seed=3, **over)
    gen = torch.Generator().manual_seed(7)
    lens, sizes = [5, 40, 1, 17], [3, 1, 9, 6]
    results = {}
    for mode in ("alone", "batched"):
        runner = StaticRunner(bundle_of(model))
        assert runner._ops is not None
        gen.manual_seed(7)
        caches, trees = [], []
        for n, t in zip(lens, sizes):
            cache = runner.new_cache(64)
            prompt = rand_tokens(gen, n)
            runner.prefill(prompt, cache=cache, topk=0)
            caches.append(cache)
            trees.append(flatten_tree(rand_draft(gen, t), committed_len=n, device="cpu", dtype=torch.float32))
        if mode == "alone":
            out = [runner.verify_tree(tr, cache=c).clone() for tr, c in zip(trees, caches)]
        else:
            out = runner.verify_batch(list(zip(trees, caches)))
        kv = [runner.kv[:, :, c.slot, :, : n + t].clone() for c, n, t in zip(caches, lens, sizes)]
        results[mode] = (out, kv)
    for a, b in zip(results["alone"][0], results["batched"][0]):
        assert a.shape == b.shape
        assert torch.equal(a, b)
    for a, b in zip(results["alone"][1], results["batched"][1]):
        assert torch.equal(a, b)


@needs_kernels
def test_verify_batch_rejects_a_shared_slot():
    runner, cache, tree = prefilled_chain()
    with pytest.raises(ValueError, match="share a KV-cache slot"):
        runner.verify_batch([(tree, cache), (tree, cache)])


def _run_batch(engine: Engine, prompts, params_of, *, width: int, state=None):
    """Decode ``prompts`` with at most ``width`` streams in flight, a finished stream's place taken by the next
    prompt (continuous batching). Returns {index: result or exception} and the batch stats."""
    batch = StreamBatch()
    todo = list(enumerate(prompts))
    out = {}
    while todo or len(batch):
        while todo and len(batch) < width:
            i, p = todo.pop(0)
            batch.add(i, engine.stream(p, params_of(i), state=state))
        for f in batch.step():
            out[f.key] = f.error if f.error is not None else f.result
    return out, batch.stats


@pytest.mark.parametrize("method,capacity", [("racer", 12), ("pld", 8), ("ar", 1), ("racer", "auto")])
def test_batched_greedy_equals_alone_and_reference(method, capacity):
    """B = 1, 2, 4, 8 streams of mixed lengths (continuous batching): every row's greedy tokens equal its
    batch-1 output and the HF greedy reference."""
    bundle = tiny_bundle(seed=1, head_scale=60.0)
    cfg = DecodingConfig(method=method, capacity=capacity)
    params = lambda i: GenerationParams(max_new_tokens=24 + 7 * (i % 3))  # noqa: E731
    alone = Engine(bundle, cfg)
    ref = {i: generate_reference(bundle, p, params(i)).token_ids for i, p in enumerate(PROMPTS)}
    for i, p in enumerate(PROMPTS):
        assert alone.generate(p, params(i)).token_ids == ref[i], (method, i)
    for width in (1, 2, 4, 8):
        engine = Engine(bundle, cfg, streams=width)
        out, stats = _run_batch(engine, PROMPTS, params, width=width, state=engine.new_state())
        for i in range(len(PROMPTS)):
            assert out[i].token_ids == ref[i], (method, width, i)
        if width > 1 and cpu_ops() is not None:
            assert max(stats.sizes) == width  # the streams did share forwards
        assert engine.runner.slots >= width


@pytest.mark.parametrize("methods", [("racer", "pld", "ar"), ("racer", "ar"), ("pld", "ar"), ("retrieval", "pld")])
def test_rows_of_several_methods_share_one_forward_and_stay_lossless(methods):
    """Method auto's candidates on one engine (``stream(method=...)``): rows of racer, pld and AR in one batched
    forward give every row its HF greedy tokens, the steps hold rows of different methods together, and each
    method's rows keep learning in their own draft state (a racer row still accepts drafted tokens)."""
    bundle = tiny_bundle(seed=1, head_scale=60.0)
    engine = Engine(bundle, DecodingConfig(method=methods[0], capacity=8), streams=4)
    params = lambda i: GenerationParams(max_new_tokens=24 + 7 * (i % 3))  # noqa: E731
    which = {i: methods[i % len(methods)] for i in range(len(PROMPTS))}
    states = {m: engine.new_state(m) for m in methods}
    batch, out, todo = StreamBatch(), {}, list(range(len(PROMPTS)))
    while todo or len(batch):
        while todo and len(batch) < 4:
            i = todo.pop(0)
            batch.add(i, engine.stream(PROMPTS[i], params(i), state=states[which[i]], method=which[i]))
        for f in batch.step():
            assert f.error is None, f.error
            out[f.key] = f.result
    for i, p in enumerate(PROMPTS):
        assert out[i].token_ids == generate_reference(bundle, p, params(i)).token_ids, (which[i], i)
    if cpu_ops() is not None:
        assert max(batch.stats.sizes) == 4
    st = [out[i].stats for i in out if which[i] == methods[0]]
    assert sum(x.accepted_retrieval + x.accepted_logits + x.accepted_both + x.accepted_other for x in st) > 0
    assert all(out[i].stats.tree_tokens == out[i].stats.steps for i in out if which[i] == "ar")


def test_a_mixed_step_is_charged_by_the_measured_cost_of_each_tree():
    """A step whose trees differ in size is split in proportion to ``t(B x size) / B`` (the engine's measured
    verify cost by tree rows); equal trees, or no measured cost, split it evenly."""
    from racer_batch.engine.batch import step_shares

    curve = {1: 10.0, 4: 12.0, 16: 20.0, 64: 60.0}
    shares = step_shares(np.array([4, 1, 1, 1]), curve)  # t(16) / 4 = 5.0 against t(4) / 4 = 3.0
    assert shares == pytest.approx([5.0 / 14.0, 3.0 / 14.0, 3.0 / 14.0, 3.0 / 14.0])
    assert step_shares(np.array([5, 5]), curve) is None
    assert step_shares(np.array([5, 1]), None) is None
    bundle = tiny_bundle(seed=1, head_scale=60.0)
    engine = Engine(bundle, DecodingConfig(method="racer", capacity=8), streams=2)
    cost = engine.measure_step_cost()
    assert {1, 2, 4, 8, 16, 32} <= set(cost) and all(ms > 0 for ms in cost.values())
    assert engine.measure_step_cost() is cost  # measured once
    assert engine.step_cost_long is None  # a 512-token model: no room for a long context past 2 x 256
    _run_mixed_and_check_charges(engine)


def test_a_mixed_step_charges_a_tree_for_its_attention_over_a_long_context(monkeypatch):
    """With a curve measured at a second, longer context, each stream's weight moves along the line between
    the two curves by its own committed length (``capacity.cost_at_context``)."""
    import racer_batch.engine.capacity as capacity
    import racer_batch.engine.engine as engine_mod
    from racer_batch.engine.batch import step_shares

    for mod in (capacity, engine_mod):
        monkeypatch.setattr(mod, "COST_CONTEXT", 64)
    monkeypatch.setattr(engine_mod, "LONG_COST_CONTEXT", 256)
    engine = Engine(tiny_bundle(seed=1, head_scale=60.0), DecodingConfig(method="racer", capacity=8), streams=2)
    cost = engine.measure_step_cost()
    long, curve = engine.step_cost_long
    assert long == 256 and set(curve) == set(cost) and all(ms > 0 for ms in curve.values())
    # a made-up pair of curves: the long context doubles a 16-row forward, so the longer stream weighs more
    fake = (256, {1: 1.0, 2: 1.0, 4: 1.0, 8: 2.0, 16: 4.0})
    short = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 2.0}
    near, far = (step_shares([8, 1], short, contexts=[c, c], long=fake)[0] for c in (64, 256))
    assert step_shares([8, 1], short)[0] == pytest.approx(near) and far > near
    _run_mixed_and_check_charges(engine)


def _run_mixed_and_check_charges(engine) -> None:
    """A racer row beside an AR row on ``engine``: every step where their trees differ splits as ``row_charges``
    over ``step_shares`` of the engine's measured cost (at each row's own context where a long curve exists)."""
    from racer_batch.engine.batch import row_charges, step_shares

    cost = engine.step_cost
    batch = StreamBatch()
    batch.add("racer", engine.stream("abcabd the cat and the hat abcabd the", GenerationParams(max_new_tokens=30),
                                     state=engine.new_state("racer"), method="racer"))
    batch.add("ar", engine.stream("abcabd the cat and the hat abcabd the", GenerationParams(max_new_tokens=30),
                                  state=engine.new_state("ar"), method="ar"))
    seen = 0
    while len(batch) == 2:
        before = {k: dict(v) for k, v in batch._share.items()}
        batch.step()
        sizes = None if engine.stepper.last_cu is None else np.diff(engine.stepper.last_cu)
        if len(batch) < 2 or sizes is None or len(sizes) < 2 or not before.get("racer") or sizes[0] == sizes[1]:
            continue
        got = {k: batch._share[k][id(engine.runner)] - before[k][id(engine.runner)] for k in ("racer", "ar")}
        # the racer row's own drafting host ms first (row_charges), the rest of the step by the measured cost
        want = row_charges(got["racer"] + got["ar"], engine.stepper.last_own_ms,
                           step_shares(sizes, cost, contexts=engine.stepper.last_starts, long=engine.step_cost_long))
        assert engine.stepper.last_own_ms[1] < engine.stepper.last_own_ms[0]  # AR's root-only draft costs less
        assert got["racer"] / got["ar"] == pytest.approx(want[0] / want[1], rel=1e-6)
        seen += 1
    assert seen > 0  # some step held a racer tree beside an AR root


def test_a_row_whose_drafter_is_slow_on_the_host_pays_for_it_alone(monkeypatch):
    """A mixed CPU step charges each row its own drafting host time before splitting the rest: a pld row whose
    propose takes 30 ms is charged those 30 ms, its AR batch-mate none of them."""
    import time as _time

    from racer_batch.drafters.methods import PldDrafter
    from racer_batch.engine.batch import row_charges

    assert row_charges(10.0, None, [0.6, 0.4]) == [0.6, 0.4]
    assert row_charges(10.0, [4.0, 0.0], None) == pytest.approx([0.7, 0.3])
    assert row_charges(10.0, [12.0, 0.0], None) == pytest.approx([1.0, 0.0])  # own above the wall: own alone
    slow = PldDrafter.propose

    def propose(self, *a, **kw):
        _time.sleep(0.03)
        return slow(self, *a, **kw)

    monkeypatch.setattr(PldDrafter, "propose", propose)
    engine = Engine(tiny_bundle(seed=1, head_scale=60.0), DecodingConfig(method="pld", capacity=4), streams=2)
    batch = StreamBatch()
    for m in ("pld", "ar"):
        batch.add(m, engine.stream("abcabd the cat and the hat", GenerationParams(max_new_tokens=6),
                                   state=engine.new_state(m), method=m))
    before = None
    while len(batch) == 2:
        before = {k: dict(v) for k, v in batch._share.items()}
        batch.step()
        if len(batch) == 2 and all(before.get(k) for k in ("pld", "ar")):
            got = {k: batch._share[k][id(engine.runner)] - before[k][id(engine.runner)] for k in ("pld", "ar")}
            assert engine.stepper.last_own_ms[0] >= 30.0 > 1.0 > engine.stepper.last_own_ms[1]
            assert got["pld"] - got["ar"] >= 29.0, got
            return
    pytest.fail("no step held both rows")


def test_an_unknown_or_auto_row_method_is_refused():
    engine = Engine(tiny_bundle(seed=1), DecodingConfig(method="racer", capacity=4))
    for bad in ("auto", "no-such-method"):
        with pytest.raises(ValueError):
            engine.generate("abc", GenerationParams(max_new_tokens=4), method=bad)


def test_seeded_sample_is_independent_of_batch_mates():
    """A sampled row with a given seed gives the same tokens alone and among any batch-mates (vLLM #9441)."""
    bundle = tiny_bundle(seed=2, head_scale=30.0)
    cfg = DecodingConfig(method="racer", capacity=8)
    target = "the cat sat on the mat. the cat"
    params = lambda i: GenerationParams(max_new_tokens=30, temperature=0.9, top_p=0.95, seed=1234 if i == 0 else i)  # noqa: E731
    alone = Engine(bundle, cfg).generate(target, params(0)).token_ids
    for mates in (["xyz"], ["abcabcabd", "q", "hello world, hello"], PROMPTS[:7]):
        engine = Engine(bundle, cfg, streams=len(mates) + 1)
        out, _ = _run_batch(engine, [target, *mates], params, width=len(mates) + 1)
        assert out[0].token_ids == alone, mates


def test_a_failing_stream_ends_alone():
    """A prompt that fills the context (ValueError at its start) and a stream cancelled mid-way end alone; their
    batch-mates' outputs are those of a run without them."""
    bundle = tiny_bundle(seed=1, head_scale=60.0, context_length=128)
    good = ["abcabcabd", "hello world, hello", "0123012301"]
    engine = Engine(bundle, DecodingConfig(method="racer", capacity=8), streams=6)
    params = GenerationParams(max_new_tokens=20)
    expect = [engine.generate(p, params).token_ids for p in good]
    batch = StreamBatch()
    for i, p in enumerate(good):
        batch.add(i, engine.stream(p, params))
    batch.add("long", engine.stream("x" * 200, params))
    steps = {"n": 0}
    batch.add("cancel", engine.stream("abcabc", GenerationParams(max_new_tokens=50),
                                      should_cancel=lambda: steps["n"] >= 3))

    out = {}
    while len(batch):
        for f in batch.step():
            out[f.key] = f
        steps["n"] += 1
    assert isinstance(out["long"].error, ValueError) and "context" in str(out["long"].error)
    assert out["cancel"].result.finish_reason == "cancelled"
    assert [out[i].result.token_ids for i in range(3)] == expect
    assert not engine.runner._free_slots or len(engine.runner._free_slots) == engine.runner.slots  # all released


def test_rows_sharing_a_should_cancel_ask_it_once_per_step_and_keep_their_tokens():
    """A stream's ``Decode`` stands until its row is done: the batch asks ``should_cancel`` after each step (once
    per step for rows sharing one callable, as a shard's rows do) and resumes only the streams that ended. The
    cancelled rows keep what they had emitted: a prefix of their whole output."""
    bundle = tiny_bundle(seed=1)
    engine = Engine(bundle, DecodingConfig(method="racer", capacity=4), streams=3)
    params = GenerationParams(max_new_tokens=40)
    prompts = ["abcabcabd", "hello world, hello", "xyzxyz"]  # each runs its 40 tokens (13-25 steps) alone
    whole = [engine.generate(p, params).token_ids for p in prompts]
    assert all(len(w) == 40 for w in whole)
    calls, steps = {"n": 0}, {"n": 0}

    def cancel() -> bool:
        calls["n"] += 1
        return steps["n"] >= 4

    batch = StreamBatch()
    for i, p in enumerate(prompts):
        batch.add(i, engine.stream(p, params, should_cancel=cancel))
    out = {}
    while len(batch):
        for f in batch.step():
            out[f.key] = f.result
        steps["n"] += 1
    assert steps["n"] == 5
    assert calls["n"] == 3 + 5  # each row once before its first step, then once per step for all three
    for i in range(3):
        assert out[i].finish_reason == "cancelled"
        assert 5 <= len(out[i].token_ids) < len(whole[i])  # the first token and at least one per step
        assert out[i].token_ids == whole[i][: len(out[i].token_ids)]
    # drive (a lone row) settles the same way
    n = {"calls": 0}

    def after_three() -> bool:
        n["calls"] += 1
        return n["calls"] > 3

    alone = drive(engine.stream(prompts[0], params, should_cancel=after_three))
    assert alone.finish_reason == "cancelled" and alone.token_ids == whole[0][: len(alone.token_ids)]
    assert n["calls"] == 4 and len(alone.token_ids) < len(whole[0])


@needs_kernels
def test_batched_forward_failure_falls_back_stream_by_stream(monkeypatch):
    """If the batched step's forward raises, each stream steps alone: outputs unchanged, the fallback counted."""
    bundle = tiny_bundle(seed=1, head_scale=60.0)
    engine = Engine(bundle, DecodingConfig(method="racer", capacity=8), streams=3)
    params = GenerationParams(max_new_tokens=16)
    expect = [engine.generate(p, params).token_ids for p in PROMPTS[:3]]

    real = engine.runner.verify_flat

    def broken(flat):
        if flat.num_streams > 1:
            raise RuntimeError("injected batched-forward failure")
        return real(flat)

    monkeypatch.setattr(engine.runner, "verify_flat", broken)
    out, stats = _run_batch(engine, PROMPTS[:3], lambda i: params, width=3)
    assert [out[i].token_ids for i in range(3)] == expect
    assert stats.fallbacks > 0


def test_drive_matches_generate_and_stream_yields_requests():
    bundle = tiny_bundle(seed=1)
    engine = Engine(bundle, DecodingConfig(method="racer", capacity=4))
    s = engine.stream("abcabc", GenerationParams(max_new_tokens=5))
    first = next(s)
    assert isinstance(first, Prefill) and first.prompt_ids == engine.encode("abcabc")
    s.close()  # an abandoned stream releases its slot
    assert engine.runner.slots == len(engine.runner._free_slots)
    assert drive(engine.stream("abcabc", GenerationParams(max_new_tokens=9))).token_ids == \
        engine.generate("abcabc", GenerationParams(max_new_tokens=9)).token_ids
    assert isinstance(s2 := engine.stream("abcabc", GenerationParams(max_new_tokens=5)), object)
    req = next(s2)
    req = s2.send(run_one(req))
    assert isinstance(req, Decode) and req.row.committed_len == len(engine.encode("abcabc"))  # after the prefill
    s2.close()


@pytest.mark.parametrize("family", ["llama", "qwen3", "llama_mqa"])
def test_padded_batched_step_matches_each_stream_alone(family):
    """The static-shape ``[B_pad, N_pad]`` step (the CUDA-graph path, run eagerly here on plain matmuls): each
    stream's logits match its own forward, a slot in the range that is not in the batch keeps its KV rows."""
    model = make_model(family, seed=5)
    runner = StaticRunner(bundle_of(model), matmul="torch")
    assert runner._ops is None
    gen = torch.Generator().manual_seed(11)
    caches = []
    for n in (6, 30, 2):
        c = runner.new_cache(64)
        runner.prefill(rand_tokens(gen, n), cache=c, topk=0)
        caches.append(c)
    idle = caches[1]  # slot 1 holds a row but sits this step out
    before = runner.kv[:, :, idle.slot, :, : idle.length].clone()
    items = [(flatten_tree(rand_draft(gen, t), committed_len=c.length, device="cpu", dtype=torch.float32), c)
             for t, c in ((5, caches[0]), (3, caches[2]))]
    alone = [runner.verify_tree(tree, cache=c).clone() for tree, c in items]
    batched = runner.verify_batch(items)
    assert runner.last_batch_path == "padded"
    for a, b in zip(alone, batched):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert torch.equal(runner.kv[:, :, idle.slot, :, : idle.length], before)


def test_padded_path_streams_stay_lossless(monkeypatch):
    """Whole streams on the padded path (no CPU kernels): greedy output equals the HF reference at B = 4."""
    monkeypatch.setenv("RACER_MATMUL", "torch")
    bundle = tiny_bundle(seed=1, head_scale=60.0)
    engine = Engine(bundle, DecodingConfig(method="racer", capacity=8), streams=4)
    assert engine.runner._ops is None
    params = lambda i: GenerationParams(max_new_tokens=20 + 5 * (i % 3))  # noqa: E731
    out, stats = _run_batch(engine, PROMPTS, params, width=4, state=engine.new_state())
    for i, p in enumerate(PROMPTS):
        assert out[i].token_ids == generate_reference(bundle, p, params(i)).token_ids, i
    assert max(stats.sizes) == 4 and engine.runner.last_batch_path == "padded"


def test_tuner_picks_a_smaller_tree_for_more_streams():
    """Same acceptance, the CPU-kernel cost shape (flat to 6 rows, then steps): one stream affords a 4+ node
    tree, four streams in one forward do best with 3 nodes each, and best_streams prefers more streams."""
    from racer_batch.engine.capacity import CapacityTuner

    cost = {1: 26.0, 2: 26.0, 3: 26.0, 4: 27.0, 6: 30.0, 8: 37.0, 12: 42.0, 16: 63.0, 24: 68.0, 32: 100.0,
            48: 150.0, 64: 196.0}
    cands = [1, 2, 3, 4, 6, 8, 12]
    tuner = CapacityTuner(cost, cands, warmup_steps=0, explore_every=0)
    rng = np.random.default_rng(0)
    for _ in range(400):  # each next draft node accepted with probability 0.6, creation order = depth
        n = 0
        while n < 11 and rng.random() < 0.6:
            n += 1
        tuner.observe(used_capacity=12, accepted_creation_idx=list(range(1, n + 1)), overhead_ms=0.5)
    assert tuner.capacity(streams=1) >= 4
    assert tuner.capacity(streams=4) in (2, 3)
    assert tuner.cost(96) > tuner.cost(64)  # extrapolated past the last measured size
    b, c, rate = tuner.best_streams((1, 2, 4))
    assert b == 4 and rate > tuner.expected_rates(1)[tuner.capacity(streams=1)]


def test_slots_grow_on_demand_up_to_max_slots():
    """A row beyond the reserved slots gets a new one (its batch-mates' KV rows are kept); past ``max_slots``
    new_cache refuses."""
    runner = StaticRunner(bundle_of(make_model("llama", seed=2)), slots=1, max_slots=3)
    a = runner.new_cache(16)
    runner.prefill([5, 6, 7, 8], cache=a, topk=0)
    before = runner.kv[:, :, a.slot, :, :4].clone()
    b, c = runner.new_cache(16), runner.new_cache(16)
    assert runner.slots == 3 and {a.slot, b.slot, c.slot} == {0, 1, 2}
    assert torch.equal(runner.kv[:, :, a.slot, :, :4], before)
    with pytest.raises(RuntimeError, match="slots are in use"):
        runner.new_cache(16)
    b.release()
    assert runner.new_cache(16).slot == b.slot  # the lowest free slot


def _charges(deferred: bool, monkeypatch) -> tuple[dict, int]:
    """Each stream's charged ms (device_ms) of three streams through a StreamBatch, on a clock that reads
    whole ms; with ``deferred`` False every step charges at once (kept groups' ``defer`` forced off)."""
    import itertools

    from racer_batch.engine import batch as batch_mod

    engine = Engine(tiny_bundle(seed=1), DecodingConfig(method="racer", capacity=4), streams=3)
    with monkeypatch.context() as m:
        if not deferred:
            m.setattr(batch_mod._Group, "defer", property(lambda self: False, lambda self, v: None))
        ticks = itertools.count()
        m.setattr(batch_mod.time, "perf_counter", lambda: next(ticks) * 1e-3)
        batch = StreamBatch()
        for i, n in enumerate([12, 30, 20]):
            batch.add(i, engine.stream(PROMPTS[i], GenerationParams(max_new_tokens=n)))
        done, kept = [], 0
        while len(batch):
            kept += batch._steady is not None
            done += batch.step()
    assert all(f.error is None for f in done)
    return {f.key: f.device_ms[id(engine.runner)] for f in done}, kept


def test_kept_decode_groups_charge_each_stream_its_equal_share_when_dropped(monkeypatch):
    """Steps of the same streams reuse their decode group (``StreamBatch._steady``) and add its wall time up,
    charged when a stream joins, leaves or ends: every stream's ``device_ms`` equals what charging each step
    at once gives (the same clock readings), and most steps did reuse the groups."""
    deferred, kept = _charges(True, monkeypatch)
    at_once, _ = _charges(False, monkeypatch)
    assert kept >= 5 and set(deferred) == {0, 1, 2}
    assert deferred == pytest.approx(at_once, rel=1e-9) and min(deferred.values()) > 0
