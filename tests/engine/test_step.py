"""The batched decode step (engine/step.py): flat acceptance, flattening, telemetry and the tuner's batched
observation against their one-tree-at-a-time definitions."""

import sys

import numpy as np
import pytest

from racer_batch import DecodingConfig, Engine, GenerationParams
from racer_batch.drafters.base import Draft, TrieBuilder
from racer_batch.engine.batch import StreamBatch
from racer_batch.engine.capacity import CapacityTuner
from racer_batch.engine.step import HOST_PARTS, SCORES_PART, _accepted_by_source, flat_of_drafts, greedy_paths
from racer_batch.engine.tree import FlatTrees, accept_greedy, flatten_tree
from racer_batch.values import SOURCE_LOGITS, SOURCE_PLD, SOURCE_RETRIEVAL
from tests.helpers import tiny_bundle

PROMPTS = ["abcabcabd", "hello world, hello", "0123012301"]


def _random_trie(rng, vocab: int, size: int) -> Draft:
    b = TrieBuilder(root=int(rng.integers(vocab)), capacity=size)
    while not b.full:
        parent = int(rng.integers(len(b)))
        b.add(parent, int(rng.integers(vocab)), source=int(rng.integers(1, 4)))
    return b.build()


def _flat(drafts):
    trees = [flatten_tree(d, committed_len=0, device="cpu", dtype=None) for d in drafts]
    flat = FlatTrees.of([(t, None) for t in trees])
    return trees, flat


def test_greedy_paths_equal_accept_greedy_tree_by_tree():
    from racer_batch.drafters import native

    rng = np.random.default_rng(0)
    for _ in range(300):
        drafts = [_random_trie(rng, 4, int(rng.integers(1, 14))) for _ in range(int(rng.integers(1, 7)))]
        trees, flat = _flat(drafts)
        # choices biased toward the drafted tokens, so long paths are accepted often
        choices = np.where(rng.random(flat.rows) < 0.7, rng.integers(0, 4, flat.rows), 9)
        nodes, cu, bonus, rows = greedy_paths(flat, choices)
        assert (rows == nodes + np.repeat(flat.cu[:-1], np.diff(cu))).all()
        for b, tree in enumerate(trees):
            lo, hi = flat.cu[b], flat.cu[b + 1]
            path, bon = accept_greedy(tree, choices[lo:hi])
            assert nodes[cu[b]: cu[b + 1]].tolist() == path and bonus[b] == bon
        got = native.accept_greedy_batch(flat.cu, flat.parents, flat.tokens, choices.astype(np.int64))
        assert (got[0].tolist() == nodes.tolist() and got[1].tolist() == cu.tolist()
                and got[2].tolist() == bonus.tolist())


def test_flat_of_drafts_orders_each_tree_as_flatten_tree():
    rng = np.random.default_rng(1)
    drafts = [_random_trie(rng, 6, n) for n in (1, 5, 12, 3)]
    trees, want = _flat(drafts)
    flat, sources, order = flat_of_drafts(drafts, np.zeros(4, np.int64), [None] * 4)
    for name in ("tokens", "parents", "depths", "cu"):
        assert getattr(flat, name).tolist() == getattr(want, name).tolist(), name
    assert sources.tolist() == np.concatenate([t.sources for t in trees]).tolist()
    assert order.tolist() == np.concatenate([t.order for t in trees]).tolist()


def test_accepted_nodes_counted_by_source_within_the_emitted_tokens():
    # two chains: root + 3 nodes (retrieval, both, logits), root + 2 nodes (pld, retrieval|pld)
    tokens = np.array([1, 2, 3, 4, 5, 6, 7])
    flat = FlatTrees(tokens, np.array([-1, 0, 1, 2, -1, 0, 1]), np.array([0, 1, 2, 3, 0, 1, 2]),
                     np.array([0, 4, 7]), np.zeros(2, np.int64), [None, None])
    both = SOURCE_RETRIEVAL | SOURCE_LOGITS
    sources = np.array([0, SOURCE_RETRIEVAL, both, SOURCE_LOGITS, 0, SOURCE_PLD, SOURCE_RETRIEVAL | SOURCE_PLD])
    nodes = np.array([0, 1, 2, 3, 0, 1, 2])
    cu = np.array([0, 4, 7])
    plen = np.diff(cu)
    # row 0 emitted all (3 accepted), row 1 stopped after its first token (1 accepted)
    got = _accepted_by_source(flat, sources, nodes, cu, plen, np.array([3, 1]))
    assert got.tolist() == [[1, 1, 1, 0], [0, 0, 0, 1]]
    got = _accepted_by_source(flat, sources, nodes, cu, plen, np.array([1, 2]))
    assert got.tolist() == [[1, 0, 0, 0], [0, 0, 0, 1]]  # retrieval|pld is in no column, as before
    sources[5] = 1 << 12  # a registered method's own flag, above every built-in one: "other"
    got = _accepted_by_source(flat, sources, nodes, cu, plen, np.array([0, 1]))
    assert got.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]]


def test_observe_batch_equals_one_observe_per_tree():
    cost = {1: 10.0, 2: 10.5, 4: 11.0, 8: 13.0, 16: 20.0}
    one, many = CapacityTuner(cost, [2, 4, 8, 16]), CapacityTuner(cost, [2, 4, 8, 16])
    rng = np.random.default_rng(2)
    for _ in range(40):
        trees = [np.sort(rng.choice(16, size=int(rng.integers(0, 5)), replace=False)) for _ in range(6)]
        used = int(rng.choice([4, 8, 16]))
        for t in trees:
            one.observe(used_capacity=used, accepted_creation_idx=t.tolist(), overhead_ms=0.5)
        many.observe_batch(used_capacity=used, accepted_creation_idx=np.concatenate(trees), streams=6, overhead_ms=0.5)
    assert one.steps == many.steps
    assert np.allclose(one.sum_gain, many.sum_gain) and np.allclose(one.n_obs, many.n_obs)
    assert one.overhead_ms == pytest.approx(many.overhead_ms)
    assert one.current == many.current


def _telemetry_run(monkeypatch, core: str):
    monkeypatch.setenv("RACER_NATIVE_DRAFT", "off" if core == "python" else "on")
    engine = Engine(tiny_bundle(seed=1, head_scale=60.0), DecodingConfig(method="racer", capacity=8), streams=3)
    assert (engine.new_state().native is not None) == (core == "native")
    batch = StreamBatch()
    for i, p in enumerate(PROMPTS[:3]):
        batch.add(i, engine.stream(p * 3, GenerationParams(max_new_tokens=24), keep_steps=True))
    out = {}
    while len(batch):
        for f in batch.step():
            assert f.error is None
            out[f.key] = f.result
    return [out[i] for i in range(3)], batch.stats


def test_row_telemetry_adds_up_and_the_batch_times_its_parts(monkeypatch):
    """Counters from the per-row table equal the sums of the step records, on either draft core; the two
    cores draft the same trees, so they give the same tokens and counters; the batch keeps every part's host
    time."""
    runs = {core: _telemetry_run(monkeypatch, core) for core in ("native", "python")}
    for results, stats in runs.values():
        for r in results:
            st, recs = r.stats, r.stats.step_records
            assert st.steps == len(recs) and st.emitted_tokens == sum(x.emitted for x in recs) == r.output_tokens
            assert st.accepted_retrieval == sum(x.accepted_retrieval for x in recs)
            assert st.accepted_logits + st.accepted_both == sum(x.accepted_logits + x.accepted_both for x in recs)
            assert st.tree_tokens == sum(x.tree_size for x in recs)
            assert sum(st.accepted_hist.values()) == st.steps
            assert sum(k * v for k, v in st.accepted_hist.items()) == sum(x.accepted_length for x in recs)
        assert sum(r.stats.emitted_tokens - r.stats.steps for r in results) > 0  # drafts were accepted
        assert set(stats.host_ms) == {*HOST_PARTS, SCORES_PART} and all(v >= 0 for v in stats.host_ms.values())

    def key(results):
        return [(r.token_ids, r.stats.accepted_retrieval, r.stats.accepted_logits, r.stats.accepted_both,
                 r.stats.steps, r.stats.tree_tokens) for r in results]

    assert key(runs["native"][0]) == key(runs["python"][0])


def _fused_run(fused: bool, shared: bool, keep_steps: bool = True):
    """Six rows through a StreamBatch of three, with the fused native commit on or off: rows ending on
    length inside a block, on an extra EOS id, on a stop string (text checks stay in Python) and on a full
    context; with ``shared``, every row on one job draft state."""
    bundle = tiny_bundle(seed=1, head_scale=60.0, context_length=72)
    engine = Engine(bundle, DecodingConfig(method="racer", capacity=8), streams=3)
    engine.stepper.fused = fused
    state = engine.new_state() if shared else None
    params = [GenerationParams(max_new_tokens=n) for n in (7, 30, 13)]
    params += [GenerationParams(max_new_tokens=40, extra_eos_ids=[59]),
               GenerationParams(max_new_tokens=40, stop=["::"]), GenerationParams(max_new_tokens=60)]
    prompts = [PROMPTS[i % 3] * 3 for i in range(5)] + [PROMPTS[0] * 6]  # the last fills the context (72)
    batch = StreamBatch()
    for i, (p, gp) in enumerate(zip(prompts, params)):
        batch.add(i, engine.stream(p, gp, state=state, keep_steps=keep_steps))
    out = {}
    while len(batch):
        for f in batch.step():
            assert f.error is None
            out[f.key] = f.result
    table = None if state is None else state.native.store_table().tolist()
    nodes = None if state is None else state.native.num_nodes
    return [out[i] for i in range(6)], table, nodes


def _counts(rec):
    return (rec.tree_size, rec.accepted_length, rec.emitted, rec.accepted_retrieval, rec.accepted_logits,
            rec.accepted_both, rec.accepted_other)


@pytest.mark.parametrize("shared,keep_steps", [(False, True), (True, True), (True, False)])
def test_the_fused_native_commit_equals_the_per_part_step(shared, keep_steps):
    """``Stepper.fused`` (one ``commit_greedy_batch`` call: acceptance, stop checks by id, the drafters' update,
    the telemetry's counts, in the table itself without StepRecords) against the per-part step it replaces: the
    same tokens, finish reasons, counters, step records and learned draft state, with rows that end on each
    rule."""
    from racer_batch.drafters import native

    if not native.available():
        pytest.fail(f"the native draft core is needed here: {native.unavailable_reason()}")
    got, want = _fused_run(True, shared, keep_steps), _fused_run(False, shared, keep_steps)
    finishes = [r.finish_reason for r in want[0]]
    assert {"length", "eos", "stop", "context"} <= set(finishes), finishes
    assert sum(r.stats.emitted_tokens - r.stats.steps for r in want[0]) > 0  # drafts were accepted
    for g, w in zip(got[0], want[0]):
        assert (g.token_ids, g.finish_reason, g.text) == (w.token_ids, w.finish_reason, w.text)
        assert [_counts(a) for a in g.stats.step_records] == [_counts(a) for a in w.stats.step_records]
        assert len(g.stats.step_records) == (g.stats.steps if keep_steps else 0)  # the prefill is step 0
        assert _row_counters(g.stats) == _row_counters(w.stats)
        assert g.stats.draft_ms > 0 and g.stats.verify_ms > 0 and g.stats.update_ms > 0
    assert got[1:] == want[1:]


def _row_counters(st):
    return (st.steps, st.emitted_tokens, st.accepted_retrieval, st.accepted_logits, st.accepted_both,
            st.accepted_other, st.tree_tokens, dict(st.accepted_hist))


def _started_state(rng, rows: int, vocab: int):
    from racer_batch.drafters.native import NativeDraftState

    st = NativeDraftState(vocab_size=vocab, max_nodes=64, ngram=4, min_border_depth=1, use_retrieval=True,
                          use_logits=True, max_breadth=3, own_layers=True)
    handles = []
    for _ in range(rows):
        h = st.open_row()
        prompt = rng.integers(0, 4, 12)
        st.start(h, prompt, rng.integers(0, vocab, (12, 3)))
        handles.append(h)
    return st, np.array(handles, dtype=np.int64)


def test_commit_greedy_batch_equals_its_parts_on_random_trees():
    """``drafters.native.commit_greedy_batch`` against the parts it fuses: ``greedy_paths``, ``StopChecker``
    by id (EOS, length, context), ``_accepted_by_source``, the tuner's created indices, the moved KV rows, and
    ``update_batch`` (applied only when every row is checked; a shared state learns in row order)."""
    from racer_batch.drafters.native import FINISH_OF_CODE, commit_greedy_batch, update_batch
    from racer_batch.engine.stops import StopChecker

    rng = np.random.default_rng(5)
    vocab, seen = 16, set()
    for _ in range(200):
        b = int(rng.integers(1, 6))
        drafts = [_random_trie(rng, 4, int(rng.integers(1, 10))) for _ in range(b)]
        trees, flat = _flat(drafts)
        sources = np.concatenate([t.sources for t in trees]).astype(np.int64)
        order = np.concatenate([t.order for t in trees]).astype(np.int64)
        choices = np.where(rng.random(flat.rows) < 0.8, rng.integers(0, 4, flat.rows), 9).astype(np.int64)
        topk = rng.integers(0, vocab, (flat.rows, 3))
        left_len, left_room = rng.integers(1, 7, b), rng.integers(1, 9, b)
        eos = np.where(rng.random((b, 2)) < 0.3, rng.integers(0, 4, (b, 2)), -1)
        checked = (rng.random(b) < 0.85).astype(np.int64)
        st, rows = _started_state(np.random.default_rng(len(seen)), b, vocab)
        ref, ref_rows = _started_state(np.random.default_rng(len(seen)), b, vocab)
        limits = np.stack([left_len, left_room, checked], 1)
        table, hist = rng.random((8, 11)), rng.integers(0, 3, (8, 65))
        table0, hist0, tids = table.copy(), hist.copy(), rng.permutation(8)[:b]
        # the KV cache the call keeps rows of: float32 half the time, else 2-byte elements seen as bytes
        kv = rng.random((2, 2, 6, 2, 16, 3)).astype(np.float32)
        if rng.random() < 0.5:
            kv = kv.view(np.uint8)
        kv0, slots = kv.copy(), rng.permutation(6)[:b]
        starts = np.array([int(rng.integers(0, 17 - (flat.cu[i + 1] - flat.cu[i]))) for i in range(b)])
        depths, roots, starts1 = rng.integers(0, 9, b), rng.integers(0, 4, b), starts.copy()
        limits0, depths0 = limits.copy(), depths.copy()
        c = commit_greedy_batch([st] * b, rows, flat.cu, flat.parents, flat.tokens, choices, sources, order, topk,
                                limits, eos, (table, hist, tids), (kv, slots, starts1), (roots, starts1, depths))
        assert np.array_equal(depths, depths0 - c.emitted)  # the emitted tokens off the depths and limits
        assert np.array_equal(limits[:, :2], limits0[:, :2] - c.emitted[:, None])
        assert np.array_equal(limits[:, 2], limits0[:, 2])
        assert np.array_equal(starts1, starts + np.diff(c.cu_paths))  # kv read the starts before they advanced
        assert roots.tolist() == [c.blocks[c.cu_paths[i + 1] - 1] for i in range(b)]
        nodes, cu, bonus, glob = greedy_paths(flat, choices)
        assert (c.nodes.tolist(), c.cu_paths.tolist(), c.bonus.tolist()) == (nodes.tolist(), cu.tolist(),
                                                                           bonus.tolist())
        emitted, committed = np.zeros(b, np.int64), []
        for i in range(b):
            block = flat.tokens[glob[cu[i] + 1: cu[i + 1]]].tolist() + [int(bonus[i])]
            assert c.blocks[cu[i]: cu[i + 1]].tolist() == block
            if checked[i]:
                chk = StopChecker(tokenizer=None, eos_ids=[e for e in eos[i] if e >= 0], stop=[],
                                  max_new_tokens=int(left_len[i]), prompt_tokens=0, context_length=int(left_room[i]))
                emitted[i] = chk.push_many(block)
                assert FINISH_OF_CODE[int(c.finish[i])] == chk.finish
                seen.add(chk.finish)
            else:
                emitted[i] = len(block)
                assert c.finish[i] == -1
            committed.append(block[: emitted[i]])
        assert c.emitted.tolist() == emitted.tolist()
        plen = np.diff(cu)
        want = _accepted_by_source(flat, sources, nodes, cu, plen, np.minimum(plen - 1, emitted))
        assert c.counts.tolist() == want.tolist()
        assert c.created.tolist() == order[glob[nodes > 0]].tolist()
        along = np.arange(len(nodes)) - np.repeat(cu[:-1], plen)
        stream = np.repeat(np.arange(b), plen)
        moved = np.stack([stream, nodes, along], 1)[nodes != along]
        assert c.moved.reshape(-1, 3).tolist() == moved.tolist()
        for q, src, dst in moved.tolist():  # ascending per stream, as KVCache.keep_rows_batch moves them
            kv0[:, :, slots[q], :, starts[q] + dst] = kv0[:, :, slots[q], :, starts[q] + src]
        assert np.array_equal(kv, kv0)
        assert c.updated == bool(checked.all())
        if c.updated:  # the step's counts added to the telemetry rows, the three times left alone
            acc = np.minimum(plen - 1, emitted)
            np.add.at(table0, (tids, slice(0, 8)), np.column_stack([np.ones(b), emitted, acc, want, plen * 0 + np.diff(
                flat.cu)]))
            np.add.at(hist0, (tids, np.minimum(acc, 64)), 1)
        assert np.array_equal(table, table0) and np.array_equal(hist, hist0)
        if c.updated:
            cu_c = np.zeros(b + 1, np.int64)
            np.cumsum([len(x) for x in committed], out=cu_c[1:])
            update_batch([ref] * b, ref_rows, flat.cu, flat.tokens, topk, np.array(sum(committed, []), np.int64),
                         cu_c)
        assert st.store_table().tolist() == ref.store_table().tolist()
        assert st.num_nodes == ref.num_nodes
        st.free()
        ref.free()
    assert {None, "eos", "length", "context"} <= seen


def test_commit_greedy_batch_refuses_a_kv_cache_it_cannot_keep_rows_in():
    """A KV array of the wrong rank or layout, read-only, a slot outside it or a tree past its positions raises
    ValueError before the draft state or the cache changes."""
    from racer_batch.drafters.native import commit_greedy_batch

    rng = np.random.default_rng(4)
    st, rows = _started_state(rng, 1, 16)
    args = (np.array([0, 3]), np.array([-1, 0, 1]), np.array([1, 2, 3]), np.array([2, 3, 4]), np.array([0, 1, 1]),
            np.array([0, 1, 2]), rng.integers(0, 16, (3, 3)), np.array([[9, 9, 1]]), np.array([[15]]))
    before = (st.num_nodes, st.store_table().tolist())
    kv = rng.random((2, 2, 3, 2, 8, 4)).astype(np.float32)
    frozen = kv.copy()
    frozen.flags.writeable = False
    for bad, match in [((kv[0], [0], [0]), "kv must"), ((kv.transpose(0, 1, 2, 3, 5, 4), [0], [0]), "kv must"),
                       ((frozen, [0], [0]), "kv must"), ((kv, [3], [0]), "not a slot"),
                       ((kv, [0], [6]), "does not fit"), ((kv, [0], [-1]), "does not fit"), ((kv, [0]), "kv must")]:
        snapshot = kv.copy()
        with pytest.raises(ValueError, match=match):
            commit_greedy_batch([st], rows, *args, None, bad)
        assert (st.num_nodes, st.store_table().tolist()) == before
        assert np.array_equal(kv, snapshot)
    frozen_depths = np.zeros(1, np.int64)
    frozen_depths.flags.writeable = False
    ok = np.zeros(1, np.int64)
    for depths in [np.zeros(1, np.int32), np.zeros(2, np.int64), frozen_depths]:
        with pytest.raises(ValueError, match="advance"):
            commit_greedy_batch([st], rows, *args, None, None, (ok.copy(), ok.copy(), depths))
        with pytest.raises(ValueError, match="advance"):
            commit_greedy_batch([st], rows, *args, None, None, (depths, ok.copy(), ok.copy()))
    with pytest.raises(ValueError, match="advance"):
        commit_greedy_batch([st], rows, *args, None, None, (ok.copy(), ok.copy()))
    frozen_limits = args[7].copy()
    frozen_limits.flags.writeable = False
    with pytest.raises(ValueError, match="limits"):
        commit_greedy_batch([st], rows, *args[:7], frozen_limits, args[8], None, None, (ok, ok.copy(), ok.copy()))
    assert (st.num_nodes, st.store_table().tolist()) == before
    c = commit_greedy_batch([st], rows, *args, None, (kv, np.array([2]), np.array([5])))
    assert c.nodes.tolist() == [0, 1, 2] and not len(c.moved)  # a chain accepted in place: nothing moved


def test_commit_greedy_batch_refuses_a_telemetry_table_it_cannot_write():
    """A table the call would have to copy (another dtype, not contiguous) or a row outside it raises
    ValueError before the draft state changes, instead of counting into a copy."""
    from racer_batch.drafters.native import commit_greedy_batch

    rng = np.random.default_rng(3)
    st, rows = _started_state(rng, 1, 16)
    args = (np.array([0, 2]), np.array([-1, 0]), np.array([1, 2]), np.array([2, 3]), np.array([0, 1]),
            np.array([0, 1]), rng.integers(0, 16, (2, 3)), np.array([[9, 9, 1]]), np.array([[15]]))
    before = (st.num_nodes, st.store_table().tolist())
    hist = np.zeros((4, 65), np.int64)
    for table, tids in [(np.zeros((4, 11), np.float32), [0]), (np.zeros((11, 4)).T, [0]),
                        (np.zeros((4, 11)), [4]), (np.zeros((4, 11)), [-1])]:
        with pytest.raises(ValueError, match="telemetry"):
            commit_greedy_batch([st], rows, *args, (table, hist, np.array(tids)))
        assert (st.num_nodes, st.store_table().tolist()) == before
    table = np.zeros((4, 11))
    c = commit_greedy_batch([st], rows, *args, (table, hist, np.array([2])))
    assert c.updated and c.emitted.tolist() == [2] and table[2, :3].tolist() == [1.0, 2.0, 1.0]
    assert hist[2, 1] == 1 and hist.sum() == 1 and st.num_nodes != before[0]
    st.free()


@pytest.mark.parametrize("b", [3, 9])  # plain indexing (<= 4 rows) and the array path
def test_telemetry_add_roots_equals_add_with_a_values_block(b):
    """``Telemetry.add_roots`` (a step where no row took a draft node: AR) adds what ``add`` adds for the values
    block of those columns: steps, emitted, tree tokens, the three times, histogram bin 0."""
    from racer_batch.engine.telemetry import TEL_FIELDS, Telemetry

    rng = np.random.default_rng(b)
    fast, ref = Telemetry(), Telemetry()
    for t in (fast, ref):
        [t.open() for _ in range(b + 2)]
    tids = rng.permutation(b + 2)[:b].tolist()  # rows of the table in no particular order
    for _ in range(6):
        emitted, tree = rng.integers(1, 4, b).tolist(), rng.integers(1, 7, b).tolist()
        ms = tuple(float(x) for x in rng.random(3))
        fast.add_roots(tids, emitted, tree, ms)
        vals = np.zeros((b, len(TEL_FIELDS)))
        vals[:, 0], vals[:, 1], vals[:, 7], vals[:, 8:11] = 1.0, emitted, tree, ms
        ref.add(np.asarray(tids), vals, np.zeros(b, dtype=np.int64))
    assert np.allclose(fast.table, ref.table) and np.array_equal(fast.hist, ref.hist)
    assert fast.table[tids[0], 0] == 6 and fast.hist[tids[0], 0] == 6


def test_ar_rows_count_the_same_with_and_without_step_records():
    """AR rows through a StreamBatch: the counters kept by ``add_roots`` (no StepRecords) equal those of the
    values-block path (rows keeping StepRecords)."""
    bundle = tiny_bundle(seed=1)

    def run(keep_steps: bool):
        engine = Engine(bundle, DecodingConfig(method="ar"), streams=3)
        batch = StreamBatch()
        for i, p in enumerate(PROMPTS):
            batch.add(i, engine.stream(p, GenerationParams(max_new_tokens=9 + 4 * i), keep_steps=keep_steps))
        out = {}
        while len(batch):
            for f in batch.step():
                out[f.key] = f.result
        return [(r.token_ids, r.stats.steps, r.stats.emitted_tokens, r.stats.tree_tokens, r.stats.accepted_hist)
                for r in (out[i] for i in range(len(PROMPTS)))]

    plain, kept = run(False), run(True)
    assert plain == kept
    assert all(steps == len(ids) and hist == {0: steps} for ids, steps, _, _, hist in plain)


@pytest.mark.parametrize("b", [1, 3, 4, 5, 9])
def test_step_plan_limits_and_depths_follow_the_rows_emitted_tokens(b):
    """``StepPlan`` is made once for a run of steps over the same rows; its ``limits`` and ``depth`` must still be
    each row's ``StopChecker.limits()`` and ``remaining - 1`` after every step's tokens (element by element up to
    ``FEW_ROWS`` rows, numpy above), and a different row list must get a new plan."""
    from racer_batch.engine.step import DecodeRow, Stepper
    from racer_batch.engine.step_plan import FEW_ROWS, StepPlan
    from racer_batch.engine.stops import StopChecker

    rng = np.random.default_rng(b)
    rows = []
    for i in range(b):
        stops = StopChecker(tokenizer=None, eos_ids=[0, 2 + i % 2], stop=[], max_new_tokens=int(rng.integers(20, 40)),
                            prompt_tokens=int(rng.integers(1, 30)), context_length=50)
        row = DecodeRow(drafter=None, cache=object(), stops=stops, params=None, gen=None, committed_len=5, root=1)
        row.tid = i
        rows.append(row)
    stepper = Stepper.__new__(Stepper)
    stepper._plan, stepper.runner, stepper.telemetry = None, None, None
    plan = stepper._plan_of(rows)
    assert plan.kind == "python" and FEW_ROWS == 4  # b = 5 and 9 take the numpy path
    assert plan.eos.shape == (b, 2) and plan.tids.tolist() == list(range(b))
    for _ in range(6):
        for r in rows:
            if r.stops.remaining > 3:
                r.stops.commit_checked([7] * int(rng.integers(0, 4)), None)
        again = stepper._plan_of(rows)
        assert again is plan
        assert plan.limits.tolist() == [list(r.stops.limits()) for r in rows]
        assert plan.depth.tolist() == [r.stops.remaining - 1 for r in rows]
        assert plan.capacities(3).tolist() == [3] * b and plan.capacities(5).tolist() == [5] * b
    fewer = rows[1:] if b > 1 else [rows[0], rows[0]]
    assert stepper._plan_of(fewer) is not plan and isinstance(stepper._plan, StepPlan)
    rev = list(reversed(rows))
    assert b == 1 or stepper._plan_of(rev).rows == rev


@pytest.mark.parametrize("fused", [True, False])
def test_each_rows_step_times_add_up_to_the_batch_forward_time(fused):
    """Each step gives every row its share of the forward (and of the drafting and the rest); the fused path sums
    them per step plan and adds them to the table only when the plan changes or a row closes
    (``Stepper._flush_times``). Summed over the rows they must still equal the batch's forward time: a plan
    replaced or a row closed without the flush would lose steps."""
    bundle = tiny_bundle(seed=1, head_scale=60.0, context_length=96)
    engine = Engine(bundle, DecodingConfig(method="racer", capacity=4), streams=3)
    engine.stepper.fused = fused
    state = engine.new_state()
    batch = StreamBatch()
    for i, n in enumerate((5, 21, 9, 30, 14, 3, 17)):
        batch.add(i, engine.stream(PROMPTS[i % 3] * 2, GenerationParams(max_new_tokens=n), state=state))
    results = []
    while len(batch):
        for f in batch.step():
            assert f.error is None
            results.append(f.result)
    assert len(results) == 7 and all(r.stats.verify_ms > 0 and r.stats.draft_ms > 0 for r in results)
    total = sum(r.stats.verify_ms for r in results)
    assert total == pytest.approx(batch.stats.verify_ms, rel=1e-9)


def _long_run(fused: bool):
    """Four rows of 60 new tokens at capacity 2 through a StreamBatch (many steps over the same rows), one with
    a stop string; tokens and finish reasons."""
    engine = Engine(tiny_bundle(seed=1, head_scale=60.0), DecodingConfig(method="racer", capacity=2), streams=4)
    engine.stepper.fused = fused
    batch = StreamBatch()
    for i, p in enumerate(PROMPTS[:3] + PROMPTS[:1]):
        gp = GenerationParams(max_new_tokens=60 - 7 * i, stop=["::"] if i == 3 else [])
        batch.add(i, engine.stream(p * 2, gp))
    out = {}
    while len(batch):
        for f in batch.step():
            assert f.error is None
            out[f.key] = f.result
    return [(out[i].token_ids, out[i].finish_reason) for i in range(4)]


def test_the_quick_steps_times_reach_the_batch_and_the_rows_when_their_plan_ends(monkeypatch):
    """A quick plan's commits add each step's times to the plan's clock (``step_context``'s ``set_clock``):
    once the plan ends they are in ``BatchStats.host_ms`` (propose, scores, accept) and in each row's draft and
    verify ms, each row's share at least its steps' forward time (the clock is the one ``time.perf_counter``
    reads); ``set_clock`` refuses an array it cannot add to."""
    from racer_batch.drafters.native import step_context
    from racer_batch.engine import step as step_mod

    flushed, orig = [], step_mod.Stepper._flush_times

    def flush(self):
        plan = self._plan
        if plan is not None and plan.clock is not None and plan.clock[3]:
            flushed.append((plan.clock.copy(), len(plan.rows)))
        return orig(self)

    monkeypatch.setattr(step_mod.Stepper, "_flush_times", flush)
    engine = Engine(tiny_bundle(seed=1, head_scale=60.0), DecodingConfig(method="racer", capacity=2), streams=2)
    batch = StreamBatch()
    for i, p in enumerate(PROMPTS[:2]):
        batch.add(i, engine.stream(p * 2, GenerationParams(max_new_tokens=30 + 10 * i)))
    results = []
    while len(batch):
        for f in batch.step():
            assert f.error is None
            results.append(f.result)
    steps = sum(c[3] for c, _ in flushed)
    assert flushed and steps >= 10
    host = batch.stats.host_ms
    for part, i in (("propose", 0), ("scores", 1), ("accept", 2)):
        assert host[part] >= sum(c[i] for c, _ in flushed) > 0
    assert all(c[4] >= c[1] > 0 and c[2] > 0 for c, _ in flushed)  # forward and scores, then the commit
    verify = sum(c[4] / b for c, b in flushed)
    assert sum(r.stats.verify_ms for r in results) >= verify * 0.999 and all(r.stats.draft_ms > 0 for r in results)
    st, rows = _started_state(np.random.default_rng(2), 1, 16)
    ctx = step_context([st], rows, np.zeros(1, np.int64), np.full(1, 5, np.int64), np.full(1, 40, np.int64),
                       np.array([[41, 50, 1]], np.int64), np.full((1, 1), 15, np.int64))
    frozen = np.zeros(5)
    frozen.flags.writeable = False
    for bad in (np.zeros(4), np.zeros(5, np.float32), frozen, np.zeros((5, 2))[:, 0]):
        with pytest.raises(ValueError, match="clock"):
            ctx.set_clock(bad)
    ctx.set_clock(None)
    st.free()


def test_the_quick_step_with_a_capacity_tuner_tells_it_every_step(monkeypatch):
    """With ``capacity: auto`` the quick step (``Stepper._step_quick``) reads the full ``Commit`` (its context is
    not quiet) and the tuner observes every step; the tokens equal the per-part path's (lossless, whatever the
    capacities the tuner picks)."""
    from racer_batch.engine import step as step_mod

    def run(fused: bool):
        engine = Engine(tiny_bundle(seed=1, head_scale=60.0), DecodingConfig(method="racer", capacity="auto"),
                        streams=3)
        engine.stepper.fused = fused
        batch = StreamBatch()
        for i, p in enumerate(PROMPTS[:3]):
            batch.add(i, engine.stream(p * 2, GenerationParams(max_new_tokens=40 - 5 * i)))
        out = {}
        while len(batch):
            for f in batch.step():
                assert f.error is None
                out[f.key] = f.result.token_ids
        return [out[i] for i in range(3)], engine.tuner.steps

    want, _ = run(False)
    quick, orig = [0], step_mod.Stepper._step_quick

    def counted(self, plan, t0):
        assert plan.tuner is self.engine.tuner is not None
        quick[0] += 1
        return orig(self, plan, t0)

    monkeypatch.setattr(step_mod.Stepper, "_step_quick", counted)
    got, observed = run(True)
    assert got == want and quick[0] >= 5 and observed >= quick[0]


def test_the_native_commit_advances_the_plan_and_keeps_the_kv_rows_itself(monkeypatch):
    """A fused step on the CPU's KV cache keeps the accepted KV rows inside the native commit (no
    ``Stepper._keep`` / ``keep_rows_batch``) and takes each row's emitted tokens off the plan's ``limits`` and
    ``depth`` in place: before every step that skips ``StepPlan.measure``, those arrays equal what ``measure``
    computes from the rows' checkers; the tokens equal the per-part step's (which keeps rows with
    ``keep_rows_batch``)."""
    from racer_batch.engine import step as step_mod

    want = _long_run(False)
    checked, pools = [0], []
    orig, orig_step = step_mod.Stepper._plan_of, step_mod.Stepper.step

    def step(self, rows, host_ms=None):  # before the step reads its plan (the quick path skips _plan_of)
        plan = self._plan
        if plan is not None and plan.rows == rows and plan.advanced:
            assert plan.stale
            roots, starts = plan.roots.copy(), plan.starts.copy()
            # the root is the last emitted token; the KV cache holds the prompt and every other emitted token
            assert roots.tolist() == [r.stops.tokens[-1] for r in rows]
            lengths = [r.committed_len - len(r.stops.tokens) for r in rows]  # the rows' own fields lag behind
            plan.sync_rows()
            assert plan.starts.tolist() == [r.committed_len for r in rows] == [r.cache.length for r in rows]
            assert [r.committed_len - len(r.stops.tokens) for r in rows] != lengths or checked[0] == 0
            got = (plan.limits.copy(), plan.depth.copy())
            plan.measure()
            assert np.array_equal(got[0], plan.limits) and np.array_equal(got[1], plan.depth)
            assert np.array_equal(roots, plan.roots) and np.array_equal(starts, plan.starts)
            checked[0] += 1
        return orig_step(self, rows, host_ms)

    def plan_of(self, rows):
        out = orig(self, rows)
        pools.append(out.pool is not None)
        return out

    def refuse(*args, **kwargs):
        raise AssertionError("Stepper._keep called on a fused CPU step")

    monkeypatch.setattr(step_mod.Stepper, "step", step)
    monkeypatch.setattr(step_mod.Stepper, "_plan_of", plan_of)
    monkeypatch.setattr(step_mod.Stepper, "_keep", refuse)
    got = _long_run(True)
    assert checked[0] > 20 and pools and all(pools)
    assert got == want
    assert sum(len(t) for t, _ in got) > 150


def test_a_plan_measured_while_ahead_of_its_rows_keeps_its_place():
    """``StepPlan.measure`` on a plan whose fused commits advanced it past its rows (as after a quick step that
    raised before its commit) first writes the plan back into the rows, so the arrays stay where the commits
    left them instead of going back to the rows' old fields."""
    engine = Engine(tiny_bundle(seed=1, head_scale=60.0), DecodingConfig(method="racer", capacity=2), streams=2)
    batch = StreamBatch()
    for i, p in enumerate(PROMPTS[:2]):
        batch.add(i, engine.stream(p * 2, GenerationParams(max_new_tokens=40)))
    for _ in range(6):
        assert not batch.step()
    plan = engine.stepper._plan
    assert plan.quick and plan.stale and plan.advanced
    want = [a.copy() for a in (plan.roots, plan.starts, plan.limits, plan.depth)]
    assert [r.committed_len for r in plan.rows] != want[1].tolist()  # the rows' own fields lag behind
    plan.advanced = False
    plan.measure()
    assert all(np.array_equal(a, w) for a, w in zip((plan.roots, plan.starts, plan.limits, plan.depth), want))
    assert [r.committed_len for r in plan.rows] == want[1].tolist() and not plan.stale
    batch.close()


def test_a_quiet_step_context_returns_none_until_a_stream_ends():
    """``set_quiet(True)``: a commit after which the caller has nothing to read (every stream checked, none ended,
    the KV rows kept) returns None, and each propose gives None for sources and order; otherwise the same trees,
    commits, advanced arrays, telemetry, KV rows and learned state as a context that is not quiet. A commit where
    a stream ends (here by length) is a whole ``Commit`` again; without KV rows to keep it is never quiet."""
    from racer_batch.drafters.native import Commit, FlatDraft, step_context

    rng = np.random.default_rng(3)
    b, vocab = 3, 16
    made = []
    for _ in range(2):
        st, rows = _started_state(np.random.default_rng(2), b, vocab)
        arrays = [rng.integers(0, 4, b) if not made else made[0][2][0].copy(), np.full(b, 5, np.int64),
                  np.full(b, 40, np.int64), np.array([[41, 50, 1], [9, 50, 1], [41, 50, 1]], np.int64)]
        tel = (np.zeros((4, 11)), np.zeros((4, 65), np.int64), np.array([2, 0, 3]))
        kv = np.random.default_rng(4).random((2, 2, 4, 2, 64, 3)).astype(np.float32)
        ctx = step_context([st] * b, rows, *arrays, np.full((b, 1), 15, np.int64), tel, np.array([3, 1, 0]),
                           [[], [], []])
        ctx.set_kv(kv)
        made.append((st, ctx, arrays, tel, kv))
    (q_st, quiet, q_arr, q_tel, q_kv), (r_st, ref, r_arr, r_tel, r_kv) = made
    quiet.set_quiet(True)
    nones = whole = 0
    for _step in range(12):
        caps = np.full(b, 4, np.int64)
        got, want = quiet.fast_propose(caps), FlatDraft(*ref.fast_propose(caps))
        assert got[4] is None and got[5] is None
        assert all(np.array_equal(x, getattr(want, f)) for x, f in zip(got, ("cu", "tokens", "parents", "depths")))
        choices = np.where(rng.random(len(want.tokens)) < 0.8, rng.integers(0, 4, len(want.tokens)), 9)
        topk = rng.integers(0, vocab, (len(want.tokens), 3))
        c, w = quiet.fast_commit(choices, topk), ref.fast_commit(choices, topk)
        if w.ended:
            assert type(c) is Commit and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(c, w))
            whole += 1
        else:
            assert c is None
            nones += 1
        for x, y in [*zip(q_arr, r_arr), *zip(q_tel, r_tel), (q_kv, r_kv)]:
            assert np.array_equal(x, y)
        if w.ended:
            break
    assert nones >= 2 and whole == 1  # the second stream's length limit (9 tokens) ends it within 12 steps
    assert q_st.store_table().tolist() == r_st.store_table().tolist() and q_st.num_nodes == r_st.num_nodes
    lone, rows = _started_state(np.random.default_rng(2), 1, vocab)
    bare = step_context([lone], rows, np.zeros(1, np.int64), np.full(1, 5, np.int64), np.full(1, 40, np.int64),
                        np.array([[41, 50, 1]], np.int64), np.full((1, 1), 15, np.int64), None, None, [[]])
    bare.set_quiet(True)  # no KV cache to keep rows in: the caller keeps them, so it reads the Commit
    flat = FlatDraft(*bare.fast_propose(np.full(1, 4, np.int64)))
    assert type(bare.fast_commit(np.zeros(len(flat.tokens), np.int64), np.zeros((len(flat.tokens), 3), np.int64))) \
        is Commit
    for s in (q_st, r_st, lone):
        s.free()


def test_a_step_context_proposes_and_commits_as_the_two_calls_it_parses_once():
    """``drafters.native.step_context`` over several steps against ``propose_batch`` + ``commit_greedy_batch``
    given the same arguments every step: the same trees, commits, advanced arrays, telemetry counts, KV rows and
    learned state; the telemetry table and KV buffer swapped mid-run (``set_telemetry`` / ``set_kv``) are the
    ones written after; bad arguments raise ValueError."""
    from racer_batch.drafters.native import Commit, FlatDraft, commit_greedy_batch, propose_batch, step_context

    rng = np.random.default_rng(11)
    b, vocab = 3, 16
    st, rows = _started_state(np.random.default_rng(1), b, vocab)
    ref, ref_rows = _started_state(np.random.default_rng(1), b, vocab)
    mk = lambda: (rng.integers(0, 4, b), np.full(b, 5, np.int64), np.full(b, 40, np.int64),  # noqa: E731
                  np.array([[41, 50, 1]] * b, np.int64))
    roots, starts, depths, limits = mk()
    r_roots, r_starts, r_depths, r_limits = roots.copy(), starts.copy(), depths.copy(), limits.copy()
    eos = np.full((b, 1), 15, np.int64)
    table, hist, tids = np.zeros((4, 11)), np.zeros((4, 65), np.int64), np.array([2, 0, 3])
    r_table, r_hist = table.copy(), hist.copy()
    kv = rng.random((2, 2, 4, 2, 64, 3)).astype(np.float32)
    r_kv, slots = kv.copy(), np.array([3, 1, 0])
    lists = [[], [7], []]  # each stream's StopChecker.tokens: the context appends its emitted tokens
    ctx = step_context([st] * b, rows, roots, starts, depths, limits, eos, (table, hist, tids), slots, lists)
    ctx.set_kv(kv)
    emitted = [[], [7], []]
    for step in range(8):
        if step == 4:  # both buffers replaced: the context writes the new ones from now on
            old_table, old_kv = table, kv
            table, r_table = table.copy(), r_table.copy()
            kv, r_kv = kv.copy(), r_kv.copy()
            before = (old_table.copy(), old_kv.copy())
            ctx.set_telemetry((table, hist, tids))
            ctx.set_kv(kv)
        caps = np.full(b, 4, np.int64)
        propose = ctx.propose if step % 2 else ctx.fast_propose
        got, want = FlatDraft(*propose(caps)), propose_batch([ref] * b, ref_rows, r_roots, caps, r_depths)
        assert all(np.array_equal(getattr(got, f), getattr(want, f)) for f in ("cu", "tokens", "parents", "sources"))
        choices = np.where(rng.random(len(got.tokens)) < 0.7, rng.integers(0, 4, len(got.tokens)), 9)
        topk = rng.integers(0, vocab, (len(got.tokens), 3))
        args = (got.cu, got.parents, got.tokens, choices, got.sources, got.order, topk)
        c = (ctx.commit if step % 2 else ctx.fast_commit)(choices, topk)  # the pybind method or the plain one
        assert type(c) is Commit
        w = commit_greedy_batch([ref] * b, ref_rows, *args, r_limits, eos, (r_table, r_hist, tids),
                                (r_kv, slots, r_starts), (r_roots, r_starts, r_depths))
        assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(c, w))
        for i in range(b):
            emitted[i] += c.blocks[c.cu_paths[i]: c.cu_paths[i] + c.emitted[i]].tolist()
        assert lists == emitted and c.ended == int((c.finish > 0).sum())
        for x, y in [(roots, r_roots), (starts, r_starts), (depths, r_depths), (limits, r_limits), (table, r_table),
                     (hist, r_hist), (kv, r_kv)]:
            assert np.array_equal(x, y)
    assert st.store_table().tolist() == ref.store_table().tolist() and st.num_nodes == ref.num_nodes
    assert starts.min() > 5 and table[tids, 0].tolist() == [8, 8, 8]
    assert np.array_equal(old_table, before[0]) and np.array_equal(old_kv, before[1])  # untouched once replaced
    assert not np.array_equal(kv, before[1])  # rows were moved in the new buffer
    with pytest.raises(ValueError, match="without kv slots"):
        step_context([st] * b, rows, roots, starts, depths, limits, eos, None, None).set_kv(kv)
    frozen = roots.copy()
    frozen.flags.writeable = False
    for bad in [(frozen, starts, depths, limits), (roots, starts.astype(np.int32), depths, limits),
                (roots, starts, depths[:2], limits), (roots, starts, depths, limits[:, :2])]:
        with pytest.raises(ValueError):
            step_context([st] * b, rows, *bad, eos, None, slots)
    with pytest.raises(ValueError, match="propose first"):  # the last trees were committed already
        ctx.commit(choices, topk)
    with pytest.raises(ValueError, match="propose first"):
        ctx.fast_commit(choices, topk)
    with pytest.raises(ValueError, match="takes"):
        ctx.fast_commit(choices)
    with pytest.raises(TypeError):
        ctx.fast_commit(choices, topk, x=1)
    # a bound function keeps its context alive on its own
    lone = step_context([st] * b, rows, roots.copy(), starts.copy(), depths.copy(), limits.copy(), eos)
    fast, refs = lone.fast_propose, sys.getrefcount(lone)
    assert refs >= 3  # the capsule inside the bound function holds one more reference
    del lone
    assert len(FlatDraft(*fast(np.full(b, 2, np.int64))).cu) == b + 1
    ctx.propose(np.full(b, 4, np.int64))
    with pytest.raises(ValueError, match="choices"):
        ctx.commit(choices[:-1], topk)
    with pytest.raises(ValueError, match="kv must"):
        ctx.set_kv(kv[0])
    for bad, match in [([[], []], "one list"), ([[], (), []], "a list or None"), ([[], None, []], "needs its list")]:
        with pytest.raises(ValueError, match=match):
            step_context([st] * b, rows, roots, starts, depths, limits, eos, None, None, bad)
    st.free()
    with pytest.raises(ValueError, match="freed"):
        ctx.propose(np.full(b, 4, np.int64))
    ref.free()
