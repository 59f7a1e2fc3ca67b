"""The native draft core (racer_batch/drafters/native) against its oracle, the Python ``TreeDrafter``.

Every step drafts a batch of streams with both, compares the flattened trees array for array with
``engine.tree.flatten_tree`` of the Python draft, checks ``accept_greedy_batch`` against ``accept_greedy`` and
``fill_tree_mask`` against ``TreeInputs.visible``, then feeds both the same update (the accepted path's tokens
plus the bonus, as the engine commits them) and compares the automaton's node and eviction counts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from racer_batch.drafters import native
from racer_batch.drafters.automaton import Automaton
from racer_batch.drafters.base import Verified
from racer_batch.drafters.copy_logits import CopyLogitStore
from racer_batch.drafters.methods import TreeDrafter, _tree_drafter, _tree_state
from racer_batch.drafters.native import (
    NativeDraftState,
    accept_greedy_batch,
    fill_tree_mask,
    propose_batch,
    update_batch,
)
from racer_batch.drafters.state import DraftState
from racer_batch.engine.tree import accept_greedy, flatten_tree
from racer_batch.values import SOURCE_LOGITS, SOURCE_RETRIEVAL, DecodingConfig

NEG = float(np.finfo(np.float32).min)
METHOD_PARTS = {"racer": (True, True), "retrieval": (True, False), "logits": (False, True)}


@pytest.fixture(scope="module", autouse=True)
def _built():
    native.native_core()  # a build failure fails every test here, loudly (RuntimeError with the compiler output)


# ---------------------------------------------------------------- the oracle harness


@contextmanager
def python_drafters():
    """``_tree_state`` makes Python states (its automaton and store) rather than native ones: the oracle."""
    old = os.environ.get("RACER_NATIVE_DRAFT")
    os.environ["RACER_NATIVE_DRAFT"] = "off"
    try:
        yield
    finally:
        if old is None:
            del os.environ["RACER_NATIVE_DRAFT"]
        else:
            os.environ["RACER_NATIVE_DRAFT"] = old


@dataclass(frozen=True)
class Scenario:
    method: str
    scope: str  # "job": one state shared by every row; "request": a state per row
    vocab: int
    max_nodes: int
    ngram: int
    min_border_depth: int = 2
    max_breadth: int = 4
    steps: int = 400
    max_rows: int = 4
    seed: int = 0
    via_config: bool = False  # build both sides from a DecodingConfig (_tree_state / from_config)
    front_stride: int = 0  # where > 0, the native automaton's order-label stride at the front (set_front_stride)
    retrieves: bool = True  # False where no border can have children (ngram 2): retrieval advances but never drafts


@dataclass
class Pair:
    """One state on both sides."""

    py: DraftState
    nat: NativeDraftState


@dataclass
class RowSim:
    """One row (stream) on both sides, and its text source."""

    pair: Pair
    drafter: TreeDrafter
    handle: int
    root: int
    text: list = field(default_factory=list)  # real-token test: the text the target "generates"
    pos: int = 0


@dataclass
class Tally:
    steps: int = 0
    streams: int = 0
    nodes: int = 0
    retrieval_nodes: int = 0
    logits_nodes: int = 0
    accepted: int = 0


class Sim:
    """Drives the Python drafters and the native core through the same random calls."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.rng = np.random.default_rng(sc.seed)
        self.retrieval, self.logits = METHOD_PARTS[sc.method]
        self.shared = self._new_pair() if sc.scope == "job" else None
        self.rows: list[RowSim] = []
        self.pairs: list[Pair] = [self.shared] if self.shared else []
        self.tally = Tally()
        self.true_topk = False  # put the target's choice first in every computed top-k row (real-token test)

    # -- states and rows

    def _new_pair(self) -> Pair:
        sc = self.sc
        if sc.via_config:
            cfg = DecodingConfig(max_nodes=sc.max_nodes, ngram=sc.ngram, min_border_depth=sc.min_border_depth,
                                 max_breadth=sc.max_breadth)
            with python_drafters():
                py = _tree_state(cfg, scope=sc.scope, vocab_size=sc.vocab, tokenizer=None, retrieval=self.retrieval,
                                 logits=self.logits)
            assert getattr(py, "native", None) is None, "the oracle must be the Python automaton and store"
            assert (py.automaton is not None, py.store is not None) == (self.retrieval, self.logits)
            nat = NativeDraftState.from_config(cfg, vocab_size=sc.vocab, scope=sc.scope, retrieval=self.retrieval,
                                               logits=self.logits)
            return Pair(py, nat)
        py = DraftState(scope=sc.scope)
        if self.logits:
            py.store = CopyLogitStore(vocab_size=sc.vocab, k=sc.max_breadth)
        if self.retrieval:
            py.automaton = Automaton(max_nodes=sc.max_nodes, ngram=sc.ngram, min_border_depth=sc.min_border_depth)
        nat = NativeDraftState(vocab_size=sc.vocab, k=sc.max_breadth, max_nodes=sc.max_nodes, ngram=sc.ngram,
                               min_border_depth=sc.min_border_depth, use_retrieval=self.retrieval,
                               use_logits=self.logits, max_breadth=sc.max_breadth, own_layers=sc.scope != "request")
        if sc.front_stride:
            nat._core.set_front_stride(sc.front_stride)
        return Pair(py, nat)

    def _drafter(self, pair: Pair) -> TreeDrafter:
        sc = self.sc
        if sc.via_config:
            cfg = DecodingConfig(max_breadth=sc.max_breadth)
            return _tree_drafter(cfg, pair.py, retrieval=self.retrieval, logits=self.logits)
        return TreeDrafter(pair.py, use_retrieval=self.retrieval, use_logits=self.logits, max_breadth=sc.max_breadth)

    def random_topk(self, n: int) -> np.ndarray:
        """``[n, k + extra]`` random top-k ids; some rows all -1 (not computed), some with a -1 tail."""
        k = self.sc.max_breadth + int(self.rng.integers(0, 3))
        topk = self.rng.integers(0, self.sc.vocab, size=(n, k), dtype=np.int64)
        for i in range(n):
            u = self.rng.random()
            if u < 0.15:
                topk[i] = -1
            elif u < 0.35:
                topk[i, int(self.rng.integers(1, k + 1)):] = -1
        return topk

    def open_row(self, prompt: list[int] | None = None, text: list[int] | None = None) -> RowSim:
        pair = self.shared if self.shared is not None else self._new_pair()
        if self.shared is None:
            self.pairs.append(pair)
        drafter = self._drafter(pair)
        handle = pair.nat.open_row()
        if prompt is None:
            prompt = [int(t) for t in self.rng.integers(0, self.sc.vocab, size=int(self.rng.integers(0, 40)))]
        topk = None if self.rng.random() < 0.2 else self.random_topk(len(prompt))
        drafter.start(prompt, topk)
        assert getattr(drafter, "native", None) is None, "the oracle drafter must run the Python code"
        pair.nat.start(handle, np.asarray(prompt, dtype=np.int64), topk)
        first = int(text[0]) if text else int(self.rng.integers(0, self.sc.vocab))
        # engine.py: the first token (chosen from the prompt's logits) is committed by an update with no nodes
        empty = np.zeros((0, self.sc.max_breadth), np.int64)
        drafter.update(Verified(np.zeros(0, np.int64), empty, [first]))
        update_batch([pair.nat], np.array([handle]), np.array([0, 0]), np.zeros(0, np.int64), empty,
                     np.array([first]), np.array([0, 1]))
        row = RowSim(pair, drafter, handle, first, list(text or []), 1)
        self.rows.append(row)
        return row

    def close_row(self, row: RowSim) -> None:
        row.drafter.close()
        row.pair.nat.close_row(row.handle)
        row.pair.nat.close_row(row.handle)  # idempotent
        self.rows.remove(row)
        if self.shared is None:
            row.pair.py.free()
            row.pair.nat.free()
            self.pairs.remove(row.pair)

    # -- one step

    def step(self, batch: list[RowSim], choose) -> None:
        """Propose, compare, accept (``choose(row, tree) -> choices``), update, compare counts."""
        b = len(batch)
        caps = self.rng.integers(1, 41, size=b)
        depths = self.rng.integers(0, 13, size=b)
        if self.rng.random() < 0.1:
            caps[:] = 1
        drafts = [r.drafter.propose(r.root, capacity=int(c), max_depth=int(d)) for r, c, d in zip(batch, caps, depths)]
        flat = propose_batch([r.pair.nat for r in batch], np.array([r.handle for r in batch]),
                             np.array([r.root for r in batch]), caps, depths)
        trees = [flatten_tree(d, committed_len=0, device="cpu", dtype=torch.float32) for d in drafts]
        self._compare_trees(flat, trees, caps, depths)
        choices = np.concatenate([choose(r, t) for r, t in zip(batch, trees)]).astype(np.int64)
        committed = self._accept(flat, trees, choices)
        if self.tally.steps % 4 == 0:
            self._check_mask(flat, trees)
        self._update(batch, flat, trees, committed, choices)
        self.tally.steps += 1

    def _compare_trees(self, flat, trees, caps, depths) -> None:
        assert flat.num_streams == len(trees)
        for i, t in enumerate(trees):
            lo, hi = int(flat.cu[i]), int(flat.cu[i + 1])
            where = f"step {self.tally.steps}, stream {i} (capacity {caps[i]}, max_depth {depths[i]})"
            assert hi - lo == t.size, f"{where}: {hi - lo} nodes, python {t.size}"
            assert np.array_equal(flat.tokens[lo:hi], t.tokens), f"{where}: tokens {flat.tokens[lo:hi]} != {t.tokens}"
            assert np.array_equal(flat.parents[lo:hi], t.parents), f"{where}: parents"
            assert np.array_equal(flat.depths[lo:hi], t.depths), f"{where}: depths"
            assert np.array_equal(flat.sources[lo:hi], t.sources), f"{where}: sources"
            assert np.array_equal(flat.order[lo:hi], t.order), f"{where}: order"
            assert t.size <= max(1, caps[i]) and int(t.depths.max()) <= depths[i]
            self.tally.streams += 1
            self.tally.nodes += t.size
            self.tally.retrieval_nodes += int(np.count_nonzero(t.sources & SOURCE_RETRIEVAL))
            self.tally.logits_nodes += int(np.count_nonzero(t.sources & SOURCE_LOGITS))

    def _accept(self, flat, trees, choices) -> list[list[int]]:
        path_nodes, cu_path, bonus = accept_greedy_batch(flat.cu, flat.parents, flat.tokens, choices)
        committed = []
        for i, t in enumerate(trees):
            lo, hi = int(flat.cu[i]), int(flat.cu[i + 1])
            want_path, want_bonus = accept_greedy(t, choices[lo:hi])
            got = path_nodes[cu_path[i]:cu_path[i + 1]].tolist()
            assert got == want_path and int(bonus[i]) == want_bonus, f"stream {i}: {got}, {bonus[i]} != {want_path}"
            committed.append([int(x) for x in t.tokens[got[1:]]] + [int(bonus[i])])
            self.tally.accepted += len(got) - 1
        return committed

    def _check_mask(self, flat, trees) -> None:
        b = len(trees)
        starts = self.rng.integers(0, 6, size=b)
        span = int((starts + flat.sizes()).max()) + int(self.rng.integers(0, 3))
        mask = torch.full((flat.rows, span), 7.0)
        assert fill_tree_mask(mask, flat.cu, flat.parents, starts, NEG) is mask
        for i, t in enumerate(trees):
            lo, hi, s = int(flat.cu[i]), int(flat.cu[i + 1]), int(starts[i])
            want = torch.full((hi - lo, span), NEG)
            want[:, :s] = 0.0
            want[:, s:s + t.size] = torch.where(torch.from_numpy(t.visible), 0.0, NEG)
            assert torch.equal(mask[lo:hi], want), f"mask of stream {i}"

    def _update(self, batch, flat, trees, committed, choices) -> None:
        topk = self.random_topk(flat.rows)
        if self.true_topk:
            topk[:, 0] = np.where(topk[:, 0] >= 0, choices, -1)
        order = list(range(len(batch)))
        if self.rng.random() < 0.3:  # the update order need not be the propose order
            self.rng.shuffle(order)
        for i in order:
            lo, hi = int(flat.cu[i]), int(flat.cu[i + 1])
            batch[i].drafter.update(Verified(trees[i].tokens, topk[lo:hi], committed[i]))
        sizes = flat.sizes()[order]
        cu = np.concatenate([[0], np.cumsum(sizes)])
        rows_of = np.concatenate([np.arange(flat.cu[i], flat.cu[i + 1]) for i in order])
        cu_c = np.concatenate([[0], np.cumsum([len(committed[i]) for i in order])])
        update_batch([batch[i].pair.nat for i in order], np.array([batch[i].handle for i in order]), cu,
                     flat.tokens[rows_of], topk[rows_of], np.array([t for i in order for t in committed[i]]), cu_c)
        for i in range(len(batch)):
            batch[i].root = committed[i][-1]
            batch[i].pos += len(committed[i])
        for pair in self.pairs:
            auto = pair.py.automaton
            if auto is not None:
                assert (pair.nat.num_nodes, pair.nat.num_evicted) == (auto.num_nodes, auto.num_evicted)
            else:
                assert pair.nat.num_nodes == 0


def random_choices(sim: Sim):
    """The target's argmax at each node: usually one of the node's children (long accepted paths), else random."""

    def choose(row: RowSim, tree) -> np.ndarray:
        out = sim.rng.integers(0, sim.sc.vocab, size=tree.size)
        for j, kids in enumerate(tree.children):
            if kids and sim.rng.random() < 0.75:
                out[j] = list(kids)[int(sim.rng.integers(0, len(kids)))]
        return out

    return choose


def run_random(sc: Scenario) -> Tally:
    sim = Sim(sc)
    choose = random_choices(sim)
    for _ in range(sc.steps):
        u = sim.rng.random()
        if not sim.rows or (u < 0.08 and len(sim.rows) < sc.max_rows):
            sim.open_row()
        elif u < 0.12 and len(sim.rows) > 1:
            sim.close_row(sim.rows[int(sim.rng.integers(0, len(sim.rows)))])
        batch = [sim.rows[i] for i in sim.rng.permutation(len(sim.rows))]
        if len(batch) > 1 and sim.rng.random() < 0.3:
            batch = batch[: int(sim.rng.integers(1, len(batch)))]
        sim.step(batch, choose)
    for row in list(sim.rows):
        sim.close_row(row)
    for pair in sim.pairs:
        if pair.py.automaton is not None:
            pair.py.automaton.check_invariants()
    return sim.tally


# ---------------------------------------------------------------- random token streams

SCENARIOS = [
    # tiny pools: eviction on most steps, windows dropped when every leaf is pinned
    Scenario("racer", "job", vocab=4, max_nodes=3, ngram=3, steps=350, seed=1),
    Scenario("racer", "job", vocab=5, max_nodes=12, ngram=4, steps=500, seed=2),
    Scenario("retrieval", "job", vocab=3, max_nodes=8, ngram=5, steps=450, seed=3),
    Scenario("retrieval", "job", vocab=6, max_nodes=40, ngram=5, min_border_depth=3, steps=500, seed=4),
    Scenario("racer", "job", vocab=8, max_nodes=60, ngram=6, max_breadth=8, steps=500, seed=5, max_rows=6),
    Scenario("logits", "job", vocab=6, max_nodes=16, ngram=4, max_breadth=8, steps=450, seed=6),
    Scenario("logits", "job", vocab=50, max_nodes=16, ngram=4, max_breadth=3, steps=400, seed=7),
    Scenario("racer", "request", vocab=5, max_nodes=20, ngram=4, steps=500, seed=8),
    Scenario("retrieval", "request", vocab=4, max_nodes=6, ngram=3, steps=450, seed=9),
    Scenario("logits", "request", vocab=7, max_nodes=16, ngram=2, max_breadth=5, steps=450, seed=10),
    # larger pools and n-grams, wider vocabularies
    Scenario("racer", "job", vocab=12, max_nodes=5000, ngram=10, max_breadth=8, steps=500, seed=11),
    Scenario("racer", "job", vocab=30, max_nodes=300, ngram=8, max_breadth=6, steps=450, seed=12),
    Scenario("retrieval", "job", vocab=10, max_nodes=100_000, ngram=12, min_border_depth=4, steps=450, seed=13),
    Scenario("racer", "request", vocab=9, max_nodes=2000, ngram=2, steps=300, seed=14, retrieves=False),
    Scenario("racer", "request", vocab=9, max_nodes=2000, ngram=3, steps=300, seed=23),
    Scenario("racer", "job", vocab=6, max_nodes=200, ngram=5, max_breadth=2, steps=500, seed=15, via_config=False),
    Scenario("racer", "job", vocab=7, max_nodes=16, ngram=4, max_breadth=8, steps=450, seed=16, via_config=True),
    Scenario("retrieval", "request", vocab=5, max_nodes=64, ngram=6, steps=450, seed=17, via_config=True),
    Scenario("logits", "job", vocab=40, max_nodes=16, ngram=10, max_breadth=8, steps=400, seed=18, via_config=True),
    Scenario("racer", "job", vocab=3, max_nodes=25, ngram=7, min_border_depth=5, steps=500, seed=19, max_rows=5),
    Scenario("racer", "job", vocab=200, max_nodes=150, ngram=4, max_breadth=4, steps=450, seed=20),
    Scenario("retrieval", "job", vocab=3, max_nodes=4, ngram=3, steps=400, seed=21),
    Scenario("racer", "request", vocab=6, max_nodes=9, ngram=3, max_breadth=1, steps=450, seed=22),
    # many rows on one state: the eviction scan's resume hint kept across rows and calls (draft_core.cpp's
    # evict_lru_leaf); a pool larger than the hint's walk bound (kHintWalk, 512) in the second
    Scenario("racer", "job", vocab=4, max_nodes=40, ngram=5, steps=300, seed=24, max_rows=12),
    Scenario("retrieval", "job", vocab=6, max_nodes=1500, ngram=10, steps=300, seed=25, max_rows=16),
]
TOTAL_STEPS = sum(s.steps for s in SCENARIOS)


def test_the_random_scenarios_cover_ten_thousand_steps():
    assert TOTAL_STEPS >= 10_000


@pytest.mark.parametrize("sc", SCENARIOS,
                         ids=lambda s: f"{s.method}-{s.scope}-v{s.vocab}-n{s.max_nodes}-g{s.ngram}-s{s.seed}")
def test_native_core_matches_python_tree_drafter(sc: Scenario):
    tally = run_random(sc)
    assert tally.steps == sc.steps and tally.streams >= sc.steps
    assert tally.accepted > 0 or not (sc.retrieves or METHOD_PARTS[sc.method][1])
    if METHOD_PARTS[sc.method][0]:
        assert (tally.retrieval_nodes > 0) == sc.retrieves, "retrieval never drafted: the comparison would be vacuous"
    if METHOD_PARTS[sc.method][1]:
        assert tally.logits_nodes > 0, "the logits tree never grew: the comparison would be vacuous"


def _run_rows(sc: Scenario, rows: int, steps: int) -> Sim:
    """``rows`` rows of one job state stepping together ``steps`` times on both sides."""
    sim = Sim(sc)
    choose = random_choices(sim)
    for _ in range(rows):
        sim.open_row()
    for _ in range(steps):
        sim.step(list(sim.rows), choose)
    return sim


def test_small_pools_evict_and_match():
    sim = _run_rows(Scenario("racer", "job", vocab=5, max_nodes=10, ngram=4, steps=0, seed=30), 3, 150)
    nat = sim.shared.nat
    assert nat.num_evicted > 50 and nat.num_nodes <= 10
    assert nat.num_evicted == sim.shared.py.automaton.num_evicted
    assert nat.memory_bytes > 0


def test_the_eviction_scan_resumes_across_rows_with_many_rows_open():
    """With 64 rows open on a full trie their windows and states sit unevictable at the recency list's tail;
    a scan from the tail for every eviction would walk past them each time (~2 us per eviction measured, 4.6
    ms per 300-token prompt start). The resume hint, kept across tokens and rows, visits few nodes per victim;
    with the hint dropped at every release (kHintWalk 0) this scan visits ~214 nodes per victim, with it ~9."""
    rng = np.random.default_rng(7)
    st = NativeDraftState(vocab_size=500, max_nodes=3000, ngram=10, use_retrieval=True, use_logits=False,
                          max_breadth=4, own_layers=False)
    rows = []
    for _ in range(96):
        r = st.open_row()
        st.start(r, rng.integers(0, 500, size=200), None)
        rows.append(r)
        if len(rows) > 64:
            st.close_row(rows.pop(0))
    assert st.num_nodes == 3000 and st.num_evicted > 10_000
    assert st.num_scanned / st.num_evicted < 30.0


def test_the_eviction_scan_stays_short_while_64_rows_decode_together():
    """Decoding 64 rows at once on a full trie (update_batch, one committed token per row and step, as at B = 64):
    each row's released windows sit thousands of nodes from the front, so a bounded walk could not place them
    against the resume node and dropped the hint; every later eviction then scanned from the tail (351 nodes per
    victim here before the order labels, 24 us per row-step on an Intel Xeon). With the labels the hint holds
    (31.5 nodes per victim), and the labels' upkeep stays a few nodes per insertion."""
    rng = np.random.default_rng(11)
    st = NativeDraftState(vocab_size=2000, max_nodes=10_000, ngram=10, use_retrieval=True, use_logits=False,
                          max_breadth=4, own_layers=False)
    rows = np.array([st.open_row() for _ in range(64)], dtype=np.int64)
    for r in rows:
        st.start(int(r), rng.integers(0, 2000, size=300), None)
    ev0, sc0, rl0 = st.num_evicted, st.num_scanned, st.num_relabelled
    cu = np.arange(65, dtype=np.int64)
    topk = np.full((64, 1), -1, dtype=np.int64)
    for _ in range(60):
        drafted, committed = rng.integers(0, 2000, size=64), rng.integers(0, 2000, size=64)
        native.update_batch([st] * 64, rows, cu, drafted, topk, committed, cu)
    evicted = st.num_evicted - ev0
    assert evicted > 20_000
    assert (st.num_scanned - sc0) / evicted < 100.0  # 31.5 with the labels, 351 before
    # 2.2 labels rewritten per victim before the front stride (draft_core.cpp Automaton::label), 0 with it
    assert (st.num_relabelled - rl0) / evicted < 0.5


def test_order_labels_relabel_and_the_victims_still_match_python():
    """A long run on a mid-sized pool with many rows, the front's label stride cut to 1: the front of the recency
    list takes most insertions, so its labels run out and are rewritten many times; the drafts (and so every
    eviction) still equal the Python automaton's, which scans from the tail."""
    sim = _run_rows(Scenario("racer", "job", vocab=300, max_nodes=500, ngram=10, max_breadth=4, steps=0, seed=31,
                             max_rows=12, front_stride=1), 12, 250)
    nat = sim.shared.nat
    assert nat.num_relabelled > 1000 and nat.num_evicted > 1000
    assert nat.num_evicted == sim.shared.py.automaton.num_evicted
    sim.shared.py.automaton.check_invariants()


# ---------------------------------------------------------------- a real token stream


def _token_texts(source: str) -> tuple[list[list[int]], int]:
    """SmolLM2 token ids of 16 Spec-Bench prompts spread over the set, or of the 24 smoke prompts."""
    from racer_batch import benchdata
    from racer_batch.models import load_model

    if source == "smoke":
        picked = benchdata.smoke_prompts()
        assert len(picked) == 24
    else:
        prompts = benchdata.load_set("spec_bench")
        picked = prompts[:: max(1, len(prompts) // 16)][:16]
    tok = load_model("tiny-random", device="cpu").tokenizer
    return [tok(" ".join(p.turns))["input_ids"] for p in picked], len(tok)


@pytest.mark.parametrize("source,max_nodes", [("spec_bench", 400), ("spec_bench", 20_000), ("smoke", 400),
                                              ("smoke", 20_000)])
def test_native_core_matches_python_on_real_tokens(source, max_nodes):
    texts, vocab = _token_texts(source)
    sim = Sim(Scenario("racer", "job", vocab=vocab, max_nodes=max_nodes, ngram=10, max_breadth=8, steps=0,
                       seed=40 + max_nodes))
    sim.true_topk = True

    def choose(row: RowSim, tree) -> np.ndarray:  # a target that always says the true text: accept along it
        padded = np.asarray(row.text + [0] * 16, dtype=np.int64)
        return padded[np.minimum(row.pos + tree.depths, len(padded) - 1)]

    pending = list(texts)
    while pending or sim.rows:
        while pending and len(sim.rows) < 4:
            text = pending.pop()
            half = len(text) // 2
            sim.open_row(prompt=text[:half], text=text)  # the answer starts by repeating the prompt
        sim.step(list(sim.rows), choose)
        for row in [r for r in sim.rows if r.pos >= len(r.text)]:
            sim.close_row(row)
    assert sim.tally.steps > 100 and sim.tally.retrieval_nodes > 100 and sim.tally.accepted > 100
    if max_nodes == 400:
        assert sim.shared.nat.num_evicted > 0


# ---------------------------------------------------------------- focused cases


def _state(**kw) -> NativeDraftState:
    args = {"vocab_size": 10, "k": 4, "max_nodes": 100, "ngram": 4, "min_border_depth": 2, "use_retrieval": True,
            "use_logits": True, "max_breadth": 4, "own_layers": True}
    args.update(kw)
    return NativeDraftState(**args)


def test_capacity_one_or_depth_zero_gives_the_root_and_still_advances():
    st = _state()
    r = st.open_row()
    st.start(r, np.array([1, 2, 3, 1, 2, 3, 1, 2]), np.tile(np.arange(4), (8, 1)))
    for cap, depth in ((1, 5), (8, 0)):
        flat = propose_batch([st], np.array([r]), np.array([3]), np.array([cap]), np.array([depth]))
        assert flat.cu.tolist() == [0, 1] and flat.tokens.tolist() == [3] and flat.parents.tolist() == [-1]
    flat = propose_batch([st], np.array([r]), np.array([1]), np.array([4]), np.array([3]))
    assert flat.tokens[1] == 2 and flat.sources[1] & SOURCE_RETRIEVAL  # "1 2 3 1" then 2: text retrieval


def test_accept_greedy_batch_on_a_hand_made_batch():
    cu = np.array([0, 4, 5])
    parents = np.array([-1, 0, 0, 1, -1])
    tokens = np.array([5, 7, 8, 9, 3])
    choices = np.array([7, 9, 0, 4, 6])
    path, cu_path, bonus = accept_greedy_batch(cu, parents, tokens, choices)
    assert path.tolist() == [0, 1, 3, 0] and cu_path.tolist() == [0, 3, 4] and bonus.tolist() == [4, 6]


def test_int64_arguments_are_read_in_place_or_converted_alike():
    """The native calls read a C-contiguous, aligned, native-order int64 array in place and convert anything else
    (lists, int32, strided views, big-endian, read-only): every form gives the same answer; what cannot be an
    int64 array is refused by the binding."""
    cu, parents, tokens, choices = [0, 4, 5], [-1, 0, 0, 1, -1], [5, 7, 8, 9, 3], [7, 9, 0, 4, 6]
    want = ([0, 1, 3, 0], [0, 3, 4], [4, 6])

    def forms(values):
        a = np.array(values, dtype=np.int64)
        wide = np.zeros(2 * len(values), dtype=np.int64)
        wide[::2] = values
        frozen = a.copy()
        frozen.flags.writeable = False
        return {"int64": a, "list": list(values), "int32": a.astype(np.int32), "strided": wide[::2],
                "big-endian": a.astype(">i8"), "read-only": frozen}

    args = [forms(v) for v in (cu, parents, tokens, choices)]
    for name in args[0]:
        got = accept_greedy_batch(*(f[name] for f in args))
        assert tuple(x.tolist() for x in got) == want, name
    with pytest.raises(TypeError):
        accept_greedy_batch("0 4 5", parents, tokens, choices)
    # only the int64 form (what the engine passes) is read in place; a read-only one too (nothing writes to it)
    reads = native.native_core().reads_in_place
    assert {name: reads(f) for name, f in args[0].items()} == {
        "int64": True, "list": False, "int32": False, "strided": False, "big-endian": False, "read-only": True}


def test_fill_tree_mask_other_dtypes_and_numpy():
    cu, parents, starts = np.array([0, 3]), np.array([-1, 0, 1]), np.array([2])
    want = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=bool)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        neg = float(torch.finfo(dtype).min)
        m = fill_tree_mask(torch.full((3, 6), 3.0, dtype=dtype), cu, parents, starts, neg)
        assert torch.equal(m, torch.where(torch.from_numpy(want), torch.tensor(neg, dtype=dtype),
                                          torch.tensor(0.0, dtype=dtype)))
    a = np.full((3, 6), 3.0, dtype=np.float32)
    fill_tree_mask(a, cu, parents, starts, -1.0)
    assert np.array_equal(a, np.where(want, -1.0, 0.0).astype(np.float32))


def test_rows_of_one_state_keep_their_own_layers():
    st = _state(use_retrieval=False)
    a, b = st.open_row(), st.open_row()
    st.start(a, np.array([1]), np.array([[2, 3, -1, -1]]))
    st.start(b, np.array([1]), np.array([[4, -1, -1, -1]]))  # the shared row of token 1 is now b's
    flat = propose_batch([st, st], np.array([a, b]), np.array([1, 1]), np.array([3, 3]), np.array([1, 1]))
    assert flat.tokens.tolist() == [1, 2, 3, 1, 4]


def test_bad_inputs_raise_value_error():
    st = _state()
    r = st.open_row()
    one = np.array([1])
    with pytest.raises(ValueError, match="was not started"):
        propose_batch([st], np.array([r]), one, one, one)
    with pytest.raises(ValueError, match="token id"):
        st.start(r, np.array([1, 10]))
    with pytest.raises(ValueError, match="columns"):
        st.start(r, np.array([1, 2]), np.zeros((2, 2), np.int64))
    st.start(r, np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="already started"):
        st.start(r, np.array([1]))
    with pytest.raises(ValueError, match="root"):
        propose_batch([st], np.array([r]), np.array([10]), one, one)
    with pytest.raises(ValueError, match="capacity"):
        propose_batch([st], np.array([r]), one, np.array([0]), one)
    with pytest.raises(ValueError, match="max_depth"):
        propose_batch([st], np.array([r]), one, one, np.array([-1]))
    with pytest.raises(ValueError, match="length 1"):
        propose_batch([st], np.array([r, r]), one, one, one)
    with pytest.raises(ValueError, match="never opened"):
        propose_batch([st], np.array([r + 7]), one, one, one)
    with pytest.raises(ValueError, match="NativeDraftState"):
        propose_batch([object()], np.array([r]), one, one, one)
    topk = np.zeros((1, 4), np.int64)
    with pytest.raises(ValueError, match="committed"):
        update_batch([st], np.array([r]), np.array([0, 1]), one, topk, np.array([-3]), np.array([0, 1]))
    with pytest.raises(ValueError, match="node_topk"):
        update_batch([st], np.array([r]), np.array([0, 1]), one, topk + 99, one, np.array([0, 1]))
    with pytest.raises(ValueError, match="cu"):
        update_batch([st], np.array([r]), np.array([0, 2]), one, topk, one, np.array([0, 1]))
    with pytest.raises(ValueError, match="parents"):
        accept_greedy_batch(np.array([0, 2]), np.array([-1, 1]), np.array([1, 2]), np.array([1, 2]))
    with pytest.raises(ValueError, match="fit"):
        fill_tree_mask(np.zeros((2, 3), np.float32), np.array([0, 2]), np.array([-1, 0]), np.array([2]), NEG)
    with pytest.raises(ValueError, match="mask"):
        fill_tree_mask(np.zeros((2, 3), np.float64), np.array([0, 2]), np.array([-1, 0]), np.array([0]), NEG)
    with pytest.raises(ValueError, match="ngram"):
        _state(ngram=1)
    st.close_row(r)
    with pytest.raises(ValueError, match="was closed"):
        update_batch([st], np.array([r]), np.array([0, 0]), np.zeros(0, np.int64), topk[:0], one, np.array([0, 1]))
    st.free()
    with pytest.raises(ValueError, match="freed"):
        st.open_row()
    st.close_row(r)  # a no-op on a freed state


def test_a_failed_batch_changes_nothing():
    st = _state(use_logits=False)
    r = st.open_row()
    st.start(r, np.array([1, 2, 3, 1, 2, 3]))
    before = st.num_nodes
    with pytest.raises(ValueError):  # the second stream's committed token is bad: the first must not be applied
        update_batch([st, st], np.array([r, r]), np.array([0, 0, 0]), np.zeros(0, np.int64), np.zeros((0, 4), np.int64),
                     np.array([4, 5, 6, 99]), np.array([0, 3, 4]))
    assert st.num_nodes == before


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("RACER_NATIVE_DRAFT", "off")
    assert not native.available()
    assert "RACER_NATIVE_DRAFT=off" in native.unavailable_reason()
    with pytest.raises(RuntimeError, match="turned off"):
        native.native_core()
    monkeypatch.delenv("RACER_NATIVE_DRAFT")
    assert native.available() and native.unavailable_reason() is None


def test_a_failed_build_is_loud(tmp_path):
    bad = tmp_path / "draft_core.cpp"
    bad.write_text("#include <pybind11/pybind11.h>\nthis is not C++;\n")
    code = (
        "import logging, pathlib\n"
        "logging.basicConfig(level=logging.ERROR)\n"
        "from racer_batch.drafters import native\n"
        f"native._SRC = pathlib.Path({str(bad)!r})\n"
        "assert not native.available()\n"
        "assert 'failed' in native.unavailable_reason()\n"
        "try:\n"
        "    native.native_core()\n"
        "except RuntimeError as exc:\n"
        "    assert 'this is not' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('no RuntimeError')\n"
    )
    env = {"RACER_KERNEL_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ERROR" in proc.stderr and "draft_core.cpp" in proc.stderr
