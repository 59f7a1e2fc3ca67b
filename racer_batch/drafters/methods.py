"""The drafters of ar, pld and RACER with its two ablations (logits, retrieval), and their DECODING_METHODS
(registry.py); the literature's tr, logitspec, rest, sam and graft live in their own modules."""

from __future__ import annotations

from functools import partial
from typing import Sequence

import numpy as np

from ..values import SOURCE_LOGITS, SOURCE_PLD, SOURCE_RETRIEVAL, DecodingConfig
from .automaton import Automaton, prefill_automaton
from .base import Draft, TrieBuilder, Verified
from .copy_logits import CopyLogitStore, grow_logits_tree
from .pld import PromptLookupIndex
from .registry import DecodingMethod
from .snapshot import TextHistory
from .state import DraftState


class ArDrafter:
    """No draft: every step verifies the root alone (autoregressive decoding through the same engine)."""

    name = "ar"
    needs_topk = False
    root_only = True  # every draft is the root alone and update learns nothing (the engine skips both calls)

    def start(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        pass

    def propose(self, root: int, *, capacity: int, max_depth: int) -> Draft:
        return Draft.root_only(root)

    def update(self, verified: Verified) -> None:
        pass


class PldDrafter:
    """Prompt lookup: a chain copied from the last match of the context's suffix n-gram."""

    name = "pld"
    needs_topk = False

    def __init__(self, *, max_ngram: int, num_tokens: int) -> None:
        self.max_ngram = max_ngram
        self.num_tokens = num_tokens
        self.index = PromptLookupIndex(max_ngram)  # the context and its n-grams (prompt_lookup without a scan)

    def start(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        self.index = PromptLookupIndex(self.max_ngram)
        self.index.extend(prompt_ids)

    def propose(self, root: int, *, capacity: int, max_depth: int) -> Draft:
        n = min(self.num_tokens, capacity - 1, max_depth)
        chain = self.index.lookup(num_tokens=n) if n > 0 else []
        tokens = [root, *chain]
        return Draft(tokens, list(range(-1, len(chain))), [0] + [SOURCE_PLD] * len(chain))

    def update(self, verified: Verified) -> None:
        self.index.extend(verified.committed)


class TreeDrafter:
    """RACER and its two ablations: retrieval (automaton) first, then the copy-logit tree fills the rest.

    ``use_retrieval`` / ``use_logits`` select racer (both), retrieval-only or logits-only. The automaton and
    store live in the DraftState; this object holds only one row's progress and, where the state is shared
    (scope ``job`` / ``global``), the row's own layer of the store: the predictions after this row's own
    tokens, read before the shared rows. Rows of a job decoded together (several streams per forward) would
    otherwise overwrite each other's entries for common tokens every step (measured on 24 Spec-Bench prompts
    at 4 streams, capacity 4: MAT 1.72 shared, 1.76 with private states, 1.80 one row at a time). One row at a
    time nothing changes: the shared row of a token this row has seen is then this row's own last write.
    """

    needs_topk = True

    def __init__(self, state: DraftState, *, use_retrieval: bool, use_logits: bool, max_breadth: int) -> None:
        state.check_alive()
        self.state = state
        self.use_retrieval = use_retrieval
        self.use_logits = use_logits
        self.max_breadth = max_breadth
        self.name = "racer" if use_retrieval and use_logits else ("retrieval" if use_retrieval else "logits")
        self.cursor = None  # this row's automaton cursor (its windows and matching state), opened at start
        self.own: CopyLogitStore | None = None  # this row's layer over a shared store, made at start
        # (NativeDraftState, row handle) where the state runs on the native draft core: the engine's batched
        # step proposes and updates every such row in one call each (engine/step.py)
        self.native: tuple | None = None

    def close(self) -> None:
        """The row ended: close its automaton cursor and drop its store layer (the engine calls this once per
        row)."""
        if self.native is not None:
            if not self.native[0].freed:
                self.native[0].close_row(self.native[1])
            self.native = None
        if self.cursor is not None and self.state.automaton is not None:
            self.state.automaton.close_cursor(self.cursor)
        self.cursor = None
        self.own = None

    def start(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        st = self.state
        st.check_alive()
        st.rows += 1
        if st.native is not None:
            row = st.native.open_row()
            self.native = (st.native, row)
            st.native.start(row, np.asarray(prompt_ids, dtype=np.int64), prompt_topk)
            return
        if st.store is not None and self.use_logits and st.scope != "request":
            self.own = CopyLogitStore(vocab_size=st.store.table.shape[0], k=st.store.k)
        if st.store is not None and prompt_topk is not None and len(prompt_ids):
            ids = np.asarray(prompt_ids, dtype=np.int64)
            st.store.update(ids, prompt_topk)
            if self.own is not None:
                self.own.update(ids, prompt_topk)
        if st.automaton is not None and self.use_retrieval:
            self.cursor = st.automaton.new_cursor()
            prefill_automaton(st.automaton, list(prompt_ids), self.cursor)

    def propose(self, root: int, *, capacity: int, max_depth: int) -> Draft:
        if self.native is not None:
            return _native_draft(self.native, root, capacity=capacity, max_depth=max_depth)
        st = self.state
        builder = TrieBuilder(root=root, capacity=capacity)
        if self.use_retrieval and st.automaton is not None:
            borders = st.automaton.advance(root, self.cursor)
            if borders and capacity > 1 and max_depth > 0:
                cands = st.automaton.candidates(borders, capacity - 1)
                where = [-1] * len(cands.tokens)  # candidate index -> builder node (-1: dropped)
                for i, (tok, par) in enumerate(zip(cands.tokens, cands.parents)):
                    pnode = 0 if par < 0 else where[par]
                    if pnode < 0 or builder.depths[pnode] >= max_depth:
                        continue
                    where[i] = builder.add(pnode, tok, SOURCE_RETRIEVAL)
        if self.use_logits and st.store is not None and not builder.full:
            grow_logits_tree(builder, st.store, max_breadth=self.max_breadth, max_depth=max_depth, source=SOURCE_LOGITS,
                             own=self.own)
        return builder.build()

    def update(self, verified: Verified) -> None:
        if self.native is not None:
            from .native import update_batch

            n, c = len(verified.node_tokens), len(verified.committed)
            update_batch([self.native[0]], np.array([self.native[1]]), np.array([0, n]),
                         np.asarray(verified.node_tokens, dtype=np.int64),
                         np.asarray(verified.node_topk, dtype=np.int64),
                         np.asarray(verified.committed, dtype=np.int64), np.array([0, c]))
            return
        st = self.state
        if st.store is not None and len(verified.node_tokens):
            st.store.update(verified.node_tokens, verified.node_topk)
            if self.own is not None:
                self.own.update(verified.node_tokens, verified.node_topk)
        if st.automaton is not None and self.use_retrieval and verified.committed:
            st.automaton.extend(verified.committed, self.cursor)
            for tok in verified.committed[:-1]:
                st.automaton.advance(tok, self.cursor)


def _native_draft(native: tuple, root: int, *, capacity: int, max_depth: int) -> Draft:
    """One row's tree from the native draft core, back in creation order (``Draft``)."""
    from .native import propose_batch

    one = np.ones(1, dtype=np.int64)
    return native_tree(propose_batch([native[0]], one * native[1], one * root, one * capacity, one * max_depth), 0)


def native_tree(flat, b: int) -> Draft:
    """Stream ``b`` of a native ``FlatDraft`` (breadth-first) back in creation order, as the drafter made it."""
    lo, hi = int(flat.cu[b]), int(flat.cu[b + 1])
    order = flat.order[lo:hi]
    tokens = np.empty(hi - lo, dtype=np.int64)
    parents = np.empty(hi - lo, dtype=np.int64)
    sources = np.empty(hi - lo, dtype=np.int64)
    tokens[order] = flat.tokens[lo:hi]
    sources[order] = flat.sources[lo:hi]
    par = flat.parents[lo:hi]
    parents[order] = np.where(par >= 0, order[np.maximum(par, 0)], -1)
    return Draft(tokens.tolist(), parents.tolist(), sources.tolist())


def native_enabled() -> bool:
    """Whether RACER's drafters run on the native draft core (``drafters.native``): wherever it builds, unless
    ``RACER_NATIVE_DRAFT=off``. A failed build is logged as an error there and the Python drafters (the same
    trees, node for node: tests/unit/test_native_draft.py) serve instead."""
    from . import native

    return native.available()


AUTOMATON_SETTINGS = ("max_nodes", "ngram", "min_border_depth")  # the automaton's DecodingConfig fields


def _tree_state(config: DecodingConfig, *, scope: str, vocab_size: int, tokenizer, retrieval: bool,
                logits: bool) -> DraftState:
    """The DraftState of racer (both parts), retrieval (the automaton) or logits (the copy-logit store)."""
    st = DraftState(scope=scope, history=TextHistory(config.max_nodes) if scope == "job" and retrieval else None)
    if native_enabled():
        from .native import NativeDraftState

        st.native = NativeDraftState.from_config(config, vocab_size=vocab_size, scope=scope, retrieval=retrieval,
                                                 logits=logits)
        return st
    if logits:
        st.store = CopyLogitStore(vocab_size=vocab_size, k=config.max_breadth)
    if retrieval:
        st.automaton = Automaton(
            max_nodes=config.max_nodes, ngram=config.ngram, min_border_depth=config.min_border_depth
        )
    return st


def _tree_drafter(config: DecodingConfig, state: DraftState, *, retrieval: bool, logits: bool) -> TreeDrafter:
    return TreeDrafter(state, use_retrieval=retrieval, use_logits=logits, max_breadth=config.max_breadth)


def _tree_method(name: str, summary: str, *, retrieval: bool, logits: bool) -> DecodingMethod:
    parts = dict(retrieval=retrieval, logits=logits)
    return DecodingMethod(
        name, summary, make_drafter=partial(_tree_drafter, **parts), make_state=partial(_tree_state, **parts),
        settings=(("max_breadth",) if logits else ()) + (AUTOMATON_SETTINGS if retrieval else ()),
    )


DECODING_METHODS = (
    DecodingMethod("ar", "no draft: autoregressive decoding through the engine",
                   make_drafter=lambda config, state: ArDrafter(), drafts=False),
    DecodingMethod(
        "pld", "prompt lookup", settings=("pld_max_ngram", "pld_num_tokens"),
        make_drafter=lambda config, state: PldDrafter(max_ngram=config.pld_max_ngram, num_tokens=config.pld_num_tokens),
    ),
    _tree_method("logits", "copy-logit tree only (RACER ablation)", retrieval=False, logits=True),
    _tree_method("retrieval", "automaton retrieval only (RACER ablation)", retrieval=True, logits=False),
    _tree_method("racer", "RACER: automaton retrieval, then the copy-logit tree", retrieval=True, logits=True),
)
