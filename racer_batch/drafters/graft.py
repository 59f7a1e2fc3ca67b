"""Graft-style refill: prune low-confidence logits-tree branches, refill the freed budget from retrieval.

The copy-logit store keeps the target's probability beside every stored id (``CopyLogitStore(with_probs=
True)``; prompt rows have no probabilities, NaN). The logits tree is grown as in RACER (breadth rule) but
every child carries a *path confidence*: the product of the calibrated acceptance estimates of the edges from
the root. A child whose path confidence falls below ``graft_threshold`` is pruned with its subtree; the budget
it would have used goes to retrieval candidates from the Aho-Corasick automaton, best first.

Calibration (``ConfidenceCalibrator``): the stored probability of an edge is mapped to an estimate of "the
child is accepted given its parent was" from what was observed in this scope: edges fall in bins (12 bins of
log10 probability over [-3, 0], or, for rows without probabilities, a bin per rank 0..7), each bin keeps
(accepted, offered) counts, and its estimate is ``(accepted + w * prior) / (offered + w)`` with ``w = 4`` and
the prior the bin's probability (or ``0.5 / (rank + 1)``). A perfectly calibrated target leaves the stored
probabilities as they are; an over-confident one gets its branches pruned earlier.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..values import SOURCE_LOGITS, SOURCE_RETRIEVAL
from .automaton import Automaton, prefill_automaton
from .base import Draft, TrieBuilder, Verified
from .copy_logits import CopyLogitStore, child_breadth
from .literature_state import LiteratureState
from .registry import DecodingMethod

PROB_BINS = 12  # log10 probability bins over [-3, 0]
RANK_BINS = 8  # bins for edges without a stored probability, by rank
PRIOR_WEIGHT = 4.0


class ConfidenceCalibrator:
    """Maps a stored edge (probability or NaN, rank) to an estimated acceptance probability.

    Example::

        cal = ConfidenceCalibrator()
        cal.estimate(0.5, 0)                     # ~0.5 (prior only)
        for _ in range(100):
            cal.observe(cal.bin(0.5, 0), False)  # never accepted
        cal.estimate(0.5, 0) < 0.05              # True
    """

    def __init__(self) -> None:
        n = PROB_BINS + RANK_BINS
        self.accepted = np.zeros(n, dtype=np.float64)
        self.offered = np.zeros(n, dtype=np.float64)
        centers = 10.0 ** (-3.0 + 3.0 * (np.arange(PROB_BINS) + 0.5) / PROB_BINS)
        self.prior = np.concatenate([centers, 0.5 / (np.arange(RANK_BINS) + 1.0)])

    @staticmethod
    def bin(prob: float, rank: int) -> int:
        if math.isnan(prob):
            return PROB_BINS + min(rank, RANK_BINS - 1)
        x = (math.log10(max(prob, 1e-3)) + 3.0) / 3.0  # [0, 1]
        return min(PROB_BINS - 1, int(x * PROB_BINS))

    def estimate_bin(self, b: int) -> float:
        return float((self.accepted[b] + PRIOR_WEIGHT * self.prior[b]) / (self.offered[b] + PRIOR_WEIGHT))

    def estimate(self, prob: float, rank: int) -> float:
        return self.estimate_bin(self.bin(prob, rank))

    def observe(self, b: int, accepted: bool) -> None:
        self.offered[b] += 1.0
        self.accepted[b] += 1.0 if accepted else 0.0


@dataclass
class GraftAccounting:
    """Budget bookkeeping of one graft draft (nodes, the root not counted)."""

    logits_nodes: int  # logits-tree nodes kept
    pruned: int  # logits-tree children cut below the threshold (each would have cost one node)
    refilled: int  # retrieval nodes added after the logits tree
    capacity: int


def grow_pruned_logits_tree(
    builder: TrieBuilder,
    store: CopyLogitStore,
    *,
    calibrator: ConfidenceCalibrator,
    threshold: float,
    max_breadth: int,
    max_depth: int,
    edge_bins: dict[int, int] | None = None,
) -> int:
    """RACER's breadth-first logits tree, without children whose path confidence is below ``threshold``.

    Returns the number of pruned children. ``edge_bins`` (node -> calibration bin) is filled for every node
    added, so the caller can learn from the verification.

    Example: store rows 5 -> [7 (p .9), 8 (p .01)], 7 -> [9 (p .6)], threshold .05: the tree is 5 -> 7 -> 9;
    8 is pruned (path confidence about .01).
    """
    table = store.table
    probs = store.probs
    queue: deque[tuple[int, int, float]] = deque([(0, max_breadth, 1.0)])  # (node, breadth, path confidence)
    depths = builder.depths
    pruned = 0
    while queue:
        node, breadth, conf = queue.popleft()
        depth = depths[node]
        if depth >= max_depth:
            continue
        tok = builder.tokens[node]
        row = table[tok]
        for rank in range(min(breadth, table.shape[1])):
            child_tok = int(row[rank])
            if child_tok < 0:
                break
            p = float(probs[tok, rank]) if probs is not None else math.nan
            b = calibrator.bin(p, rank)
            c = conf * calibrator.estimate_bin(b)
            if c < threshold:
                pruned += 1
                continue
            child = builder.add(node, child_tok, SOURCE_LOGITS)
            if child < 0:
                return pruned
            if edge_bins is not None:
                edge_bins.setdefault(child, b)
            queue.append((child, child_breadth(breadth, child_rank=rank, parent_depth=depth), c))
    return pruned


def refill_from_retrieval(builder: TrieBuilder, cands: Any, *, max_depth: int) -> int:
    """Add retrieval candidates (``RetrievalCandidates``, best first) until the builder is full; returns the
    number of new nodes. A candidate equal to a kept logits node merges (costs nothing, both sources)."""
    before = len(builder)
    where = [-1] * len(cands.tokens)
    for i, (tok, par) in enumerate(zip(cands.tokens, cands.parents)):
        pnode = 0 if par < 0 else where[par]
        if pnode < 0 or builder.depths[pnode] >= max_depth:
            continue
        where[i] = builder.add(pnode, tok, SOURCE_RETRIEVAL)
    return len(builder) - before


class GraftDrafter:
    """Graft for one row: pruned copy-logit tree first, retrieval refill second; learns its calibration."""

    name = "graft"
    needs_topk = True
    needs_topk_probs = True

    def __init__(self, state: Any, *, max_breadth: int, threshold: float) -> None:
        state.check_alive()
        assert state.store is not None and state.store.probs is not None, "graft needs a store with probabilities"
        assert state.automaton is not None, "graft needs the automaton in its draft state"
        self.state = state
        self.max_breadth = max_breadth
        self.threshold = threshold
        if getattr(state, "calibrator", None) is None:
            state.calibrator = ConfidenceCalibrator()
        self.calibrator: ConfidenceCalibrator = state.calibrator
        self._last: tuple[Draft, dict[int, int]] | None = None
        self.last_accounting: GraftAccounting | None = None
        self.cursor = None  # this row's automaton cursor (its windows and matching state), opened at start

    def close(self) -> None:
        """The row ended: close its automaton cursor (the engine calls this once per row)."""
        if self.cursor is not None and self.state.automaton is not None:
            self.state.automaton.close_cursor(self.cursor)
        self.cursor = None

    def start(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        st = self.state
        st.start_row(prompt_ids, prompt_topk)  # the store learns the prompt's top-k, probabilities unknown
        self.cursor = st.automaton.new_cursor()
        prefill_automaton(st.automaton, list(prompt_ids), self.cursor)

    def propose(self, root: int, *, capacity: int, max_depth: int) -> Draft:
        st = self.state
        borders = st.automaton.advance(root, self.cursor)  # always advanced, to keep the matching state
        builder = TrieBuilder(root=root, capacity=capacity)
        edge_bins: dict[int, int] = {}
        pruned = 0
        if max_depth > 0:
            pruned = grow_pruned_logits_tree(
                builder, st.store, calibrator=self.calibrator, threshold=self.threshold,
                max_breadth=self.max_breadth, max_depth=max_depth, edge_bins=edge_bins,
            )
        logits_nodes = len(builder) - 1
        refilled = 0
        if borders and not builder.full and max_depth > 0:
            cands = st.automaton.candidates(borders, capacity - len(builder))
            refilled = refill_from_retrieval(builder, cands, max_depth=max_depth)
        draft = builder.build()
        self._last = (draft, edge_bins)
        self.last_accounting = GraftAccounting(logits_nodes, pruned, refilled, capacity)
        return draft

    def _learn(self, committed: Sequence[int]) -> None:
        """Each logits edge whose parent was accepted is one trial of its calibration bin."""
        if self._last is None:
            return
        draft, edge_bins = self._last
        self._last = None
        children: dict[tuple[int, int], int] = {}
        kids_of: dict[int, list[int]] = {}
        for i in range(1, len(draft)):
            children[(draft.parents[i], draft.token_ids[i])] = i
            kids_of.setdefault(draft.parents[i], []).append(i)
        node = 0
        accepted_path = [0]
        for tok in committed[:-1]:
            node = children.get((node, int(tok)), -1)
            if node < 0:
                break
            accepted_path.append(node)
        on_path = set(accepted_path)
        for parent in accepted_path:
            for child in kids_of.get(parent, []):
                b = edge_bins.get(child)
                if b is not None:
                    self.calibrator.observe(b, child in on_path)

    def update(self, verified: Verified) -> None:
        st = self.state
        self._learn(verified.committed)
        if len(verified.node_tokens):
            st.store.update(verified.node_tokens, verified.node_topk, verified.node_topk_probs)
        if verified.committed:
            st.automaton.extend(verified.committed, self.cursor)
            for tok in verified.committed[:-1]:
                st.automaton.advance(tok, self.cursor)


def _graft_state(config: Any, *, scope: str, vocab_size: int, tokenizer: Any) -> LiteratureState:
    """The copy-logit store with probabilities and the retrieval automaton (the calibrator comes with the first row)."""
    return LiteratureState(
        scope=scope, store=CopyLogitStore(vocab_size=vocab_size, k=config.max_breadth, with_probs=True),
        automaton=Automaton(max_nodes=config.max_nodes, ngram=config.ngram, min_border_depth=config.min_border_depth),
    )


DECODING_METHODS = (
    DecodingMethod(
        "graft", "Graft: copy-logit tree pruned by calibrated confidence, refilled from automaton retrieval",
        make_state=_graft_state,
        make_drafter=lambda config, state: GraftDrafter(state, max_breadth=config.max_breadth,
                                                        threshold=config.graft_threshold),
        settings=("max_breadth", "max_nodes", "ngram", "min_border_depth", "graft_threshold"),
    ),
)
