"""The drafters behind the engine's one interface: ar, pld, logits, retrieval and racer, and the literature's
tr, logitspec, rest, sam and graft (their own modules)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..types import SOURCE_LOGITS, SOURCE_PLD, SOURCE_RETRIEVAL, DecodingConfig
from .automaton import prefill_automaton
from .base import Draft, TrieBuilder, Verified
from .copy_logits import grow_logits_tree
from .pld import prompt_lookup
from .state import DraftState


class ArDrafter:
    """No draft: every step verifies the root alone (autoregressive decoding through the same engine)."""

    name = "ar"
    needs_topk = False

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
        self.context: list[int] = []

    def start(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        self.context = list(prompt_ids)

    def propose(self, root: int, *, capacity: int, max_depth: int) -> Draft:
        n = min(self.num_tokens, capacity - 1, max_depth)
        chain = prompt_lookup(self.context, max_ngram=self.max_ngram, num_tokens=n) if n > 0 else []
        tokens = [root, *chain]
        return Draft(tokens, list(range(-1, len(chain))), [0] + [SOURCE_PLD] * len(chain))

    def update(self, verified: Verified) -> None:
        self.context.extend(verified.committed)


class TreeDrafter:
    """RACER and its two ablations: retrieval (automaton) first, then the copy-logit tree fills the rest.

    ``use_retrieval`` / ``use_logits`` select racer (both), retrieval-only or logits-only. The automaton and
    store live in the DraftState; this object holds only one row's progress.
    """

    needs_topk = True

    def __init__(self, state: DraftState, *, use_retrieval: bool, use_logits: bool, max_breadth: int) -> None:
        state.check_alive()
        self.state = state
        self.use_retrieval = use_retrieval
        self.use_logits = use_logits
        self.max_breadth = max_breadth
        self.name = "racer" if use_retrieval and use_logits else ("retrieval" if use_retrieval else "logits")

    def start(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        st = self.state
        st.check_alive()
        st.rows += 1
        if st.store is not None and prompt_topk is not None and len(prompt_ids):
            st.store.update(np.asarray(prompt_ids, dtype=np.int64), prompt_topk)
        if st.automaton is not None and self.use_retrieval:
            prefill_automaton(st.automaton, list(prompt_ids))

    def propose(self, root: int, *, capacity: int, max_depth: int) -> Draft:
        st = self.state
        builder = TrieBuilder(root=root, capacity=capacity)
        if self.use_retrieval and st.automaton is not None:
            borders = st.automaton.advance(root)
            if borders and capacity > 1 and max_depth > 0:
                cands = st.automaton.candidates(borders, capacity - 1)
                where = [-1] * len(cands.tokens)  # candidate index -> builder node (-1: dropped)
                for i, (tok, par) in enumerate(zip(cands.tokens, cands.parents)):
                    pnode = 0 if par < 0 else where[par]
                    if pnode < 0 or builder.depths[pnode] >= max_depth:
                        continue
                    where[i] = builder.add(pnode, tok, SOURCE_RETRIEVAL)
        if self.use_logits and st.store is not None and not builder.full:
            grow_logits_tree(builder, st.store, max_breadth=self.max_breadth, max_depth=max_depth, source=SOURCE_LOGITS)
        return builder.build()

    def update(self, verified: Verified) -> None:
        st = self.state
        if st.store is not None and len(verified.node_tokens):
            st.store.update(verified.node_tokens, verified.node_topk)
        if st.automaton is not None and self.use_retrieval and verified.committed:
            st.automaton.extend(verified.committed)
            for tok in verified.committed[:-1]:
                st.automaton.advance(tok)


LITERATURE_METHODS = ("tr", "logitspec", "rest", "sam", "graft")


def make_state(config: DecodingConfig, *, vocab_size: int, scope: str | None = None, tokenizer=None) -> DraftState:
    """A fresh DraftState holding what ``config.method`` needs.

    ``tokenizer`` is needed only to read a text corpus (``corpus_path``) for rest and sam.

    Raises:
        ValueError: a corpus that cannot be read (rest, sam).
    """
    from .automaton import Automaton
    from .copy_logits import CopyLogitStore

    m = config.method
    if m in LITERATURE_METHODS:
        return _make_literature_state(config, vocab_size=vocab_size, scope=scope, tokenizer=tokenizer)
    st = DraftState(scope=scope or config.scope)
    if config.method in ("logits", "racer"):
        st.store = CopyLogitStore(vocab_size=vocab_size, k=config.max_breadth)
    if config.method in ("retrieval", "racer"):
        st.automaton = Automaton(
            max_nodes=config.max_nodes, ngram=config.ngram, min_border_depth=config.min_border_depth
        )
    return st


def _make_literature_state(config: DecodingConfig, *, vocab_size: int, scope: str | None, tokenizer) -> DraftState:
    from .automaton import Automaton
    from .copy_logits import CopyLogitStore
    from .literature_state import LiteratureState
    from .rest import RestDatastore, static_index
    from .sam import static_corpus_sam

    m = config.method
    st = LiteratureState(scope=scope or config.scope)
    if m in ("tr", "sam", "graft"):
        st.store = CopyLogitStore(vocab_size=vocab_size, k=config.max_breadth, with_probs=m == "graft")
    if m == "graft":
        st.automaton = Automaton(max_nodes=config.max_nodes, ngram=config.ngram, min_border_depth=config.min_border_depth)
    if m == "rest":
        static = None
        if config.corpus_path:
            static = static_index(config.corpus_path, tokenizer, max_tokens=config.corpus_max_tokens,
                                  max_query=config.rest_max_query, vocab_size=vocab_size)
        st.rest = RestDatastore(static=static, learn=config.rest_learn_outputs, max_tokens=config.corpus_max_tokens,
                                max_query=config.rest_max_query)
    if m == "sam" and config.corpus_path:
        st.sam_corpus = static_corpus_sam(config.corpus_path, tokenizer, max_tokens=config.corpus_max_tokens,
                                          vocab_size=vocab_size)
    return st


def make_drafter(config: DecodingConfig, state: DraftState):
    """The drafter for one row under ``config.method``, bound to ``state``."""
    m = config.method
    if m == "ar":
        return ArDrafter()
    if m == "pld":
        return PldDrafter(max_ngram=config.pld_max_ngram, num_tokens=config.pld_num_tokens)
    if m in ("racer", "logits", "retrieval"):
        return TreeDrafter(
            state, use_retrieval=m in ("racer", "retrieval"), use_logits=m in ("racer", "logits"),
            max_breadth=config.max_breadth,
        )
    if m == "tr":
        from .token_recycling import TokenRecyclingDrafter

        return TokenRecyclingDrafter(state)
    if m == "logitspec":
        from .logitspec import LogitSpecDrafter

        return LogitSpecDrafter(state, max_ngram=config.logitspec_ngram, branch_tokens=config.logitspec_branch_tokens)
    if m == "rest":
        from .rest import RestDrafter

        return RestDrafter(state, max_query=config.rest_max_query, min_query=config.rest_min_query,
                           max_occurrences=config.rest_max_occurrences, depth=config.rest_depth)
    if m == "sam":
        from .sam import SamDrafter

        return SamDrafter(state, min_match=config.sam_min_match, num_tokens=config.sam_num_tokens,
                          max_breadth=config.max_breadth)
    if m == "graft":
        from .graft import GraftDrafter

        return GraftDrafter(state, max_breadth=config.max_breadth, threshold=config.graft_threshold)
    raise ValueError(f"unknown decoding method {m!r}")
