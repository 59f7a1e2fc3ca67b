"""SAM-Decoding: a suffix automaton over the request drafts a chain when the match is long enough.

A suffix automaton (SAM) of a text has one state per set of substrings that end at the same positions; it
is built online in amortised O(1) per token. The drafter keeps, for the row's text (prompt + committed
tokens), the longest suffix that also occurs *earlier* in the text: before a new token is added to the SAM,
the match is advanced on it (so the match is found among the text before the token), then the SAM is
extended. Every SAM state records the end of the first occurrence of its strings (``first_end``); the tokens
after it are the draft chain. A static corpus (``corpus_path``, optional) gets its own read-only SAM, matched
in parallel; the longer match wins. When the best match is shorter than ``sam_min_match`` the drafter falls
back to the copy-logit tree (RACER's logits tree).

Memory: about 2 states per token, each a small dict; the static corpus SAM is capped at
``SAM_CORPUS_MAX_TOKENS`` tokens (use ``rest`` for large corpora).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from ..values import SOURCE_LOGITS, SOURCE_SAM
from .base import Draft, TrieBuilder, Verified
from .copy_logits import CopyLogitStore, grow_logits_tree
from .literature_state import LiteratureState
from .registry import DecodingMethod

SAM_CORPUS_MAX_TOKENS = 200_000
_SEP = -1  # document separator in a corpus SAM: never matched, never drafted


class SuffixAutomaton:
    """Online suffix automaton of a token text, with first-occurrence end positions.

    Example::

        sam = SuffixAutomaton()
        sam.extend([1, 2, 3, 1, 2])
        sam.contains([2, 3, 1])      # True
        sam.contains([3, 2])         # False
        m = SamMatcher(sam)
        for t in [9, 1, 2]:
            m.advance(t)             # length 2 after "1 2": it occurs in the text
        sam.tokens[sam.first_end[m.state] + 1 :][:2]   # -> [3, 1], what followed "1 2" first
    """

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]  # transitions
        self.link: list[int] = [-1]  # suffix link
        self.length: list[int] = [0]  # longest string of the state
        self.first_end: list[int] = [-1]  # text position where the state's strings first end
        self.last = 0
        self.tokens: list[int] = []

    @property
    def num_states(self) -> int:
        return len(self.length)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self._extend_one(int(t))

    def _extend_one(self, t: int) -> None:
        nxt, link, length, first_end = self.next, self.link, self.length, self.first_end
        pos = len(self.tokens)
        self.tokens.append(t)
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        first_end.append(pos)
        p = self.last
        while p != -1 and t not in nxt[p]:
            nxt[p][t] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][t]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                first_end.append(first_end[q])
                while p != -1 and nxt[p].get(t) == q:
                    nxt[p][t] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self.last = cur

    def contains(self, query: Sequence[int]) -> bool:
        s = 0
        for t in query:
            s = self.next[s].get(int(t), -1)
            if s < 0:
                return False
        return True


class SamMatcher:
    """The longest suffix of the tokens advanced so far that occurs in ``sam``'s text: ``(state, length)``."""

    def __init__(self, sam: SuffixAutomaton) -> None:
        self.sam = sam
        self.state = 0
        self.length = 0

    def advance(self, t: int) -> None:
        nxt, link, length = self.sam.next, self.sam.link, self.sam.length
        s, n = self.state, self.length
        while s != 0 and t not in nxt[s]:
            s = link[s]
            n = length[s]
        if t in nxt[s]:
            s, n = nxt[s][t], n + 1
        else:
            s, n = 0, 0
        self.state, self.length = s, n

    def normalize(self) -> None:
        """Move to the state that owns the matched string after the SAM grew (a clone may have split it)."""
        link, length = self.sam.link, self.sam.length
        while self.state != 0 and length[link[self.state]] >= self.length:
            self.state = link[self.state]

    def continuation(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens after the first occurrence of the match (cut at a separator)."""
        if self.length == 0:
            return []
        start = self.sam.first_end[self.state] + 1
        out = []
        for t in self.sam.tokens[start : start + num_tokens]:
            if t == _SEP:
                break
            out.append(t)
        return out


def build_corpus_sam(docs: Sequence[Sequence[int]], *, max_tokens: int = SAM_CORPUS_MAX_TOKENS) -> SuffixAutomaton:
    """One SAM over corpus documents joined by a separator (matches never span two documents)."""
    sam = SuffixAutomaton()
    budget = max_tokens
    for d in docs:
        if budget <= 0:
            break
        d = list(d)[:budget]
        budget -= len(d)
        sam.extend(d)
        sam.extend([_SEP])
    return sam


_CORPUS_CACHE: "OrderedDict[tuple, SuffixAutomaton]" = OrderedDict()


def static_corpus_sam(path: str, tokenizer: Any, *, max_tokens: int, vocab_size: int) -> SuffixAutomaton:
    """The corpus SAM of a file, built once per process per (file version, settings)."""
    import os

    from .rest import load_corpus

    st = os.stat(path) if os.path.exists(path) else None
    cap = min(max_tokens, SAM_CORPUS_MAX_TOKENS)
    key = (os.path.abspath(path), st.st_mtime_ns if st else 0, st.st_size if st else 0, id(tokenizer), cap, vocab_size)
    sam = _CORPUS_CACHE.get(key)
    if sam is None:
        sam = build_corpus_sam(load_corpus(path, tokenizer, max_tokens=cap, vocab_size=vocab_size), max_tokens=cap)
        _CORPUS_CACHE[key] = sam
        while len(_CORPUS_CACHE) > 1:
            _CORPUS_CACHE.popitem(last=False)
    _CORPUS_CACHE.move_to_end(key)
    return sam


class SamDrafter:
    """SAM-Decoding for one row: request SAM (+ optional corpus SAM) chain, else the copy-logit tree."""

    name = "sam"
    needs_topk = True

    def __init__(self, state: Any, *, min_match: int, num_tokens: int, max_breadth: int) -> None:
        state.check_alive()
        assert state.store is not None, "sam needs the copy-logit store in its draft state for its fallback"
        self.state = state
        self.min_match = min_match
        self.num_tokens = num_tokens
        self.max_breadth = max_breadth
        self.sam = SuffixAutomaton()
        self.match = SamMatcher(self.sam)
        corpus = getattr(state, "sam_corpus", None)
        self.corpus_match = SamMatcher(corpus) if corpus is not None else None
        self.chain_steps = 0  # steps that drafted a SAM chain (telemetry and tests)

    def _push(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            t = int(t)
            self.match.advance(t)  # match among the text *before* t
            self.sam.extend([t])
            self.match.normalize()
            if self.corpus_match is not None:
                self.corpus_match.advance(t)

    def start(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        self.state.start_row(prompt_ids, prompt_topk)
        self._push(prompt_ids)

    def propose(self, root: int, *, capacity: int, max_depth: int) -> Draft:
        n = min(self.num_tokens, capacity - 1, max_depth)
        best = self.match
        if self.corpus_match is not None and self.corpus_match.length > best.length:
            best = self.corpus_match
        if n > 0 and best.length >= self.min_match:
            chain = best.continuation(n)
            if chain:
                self.chain_steps += 1
                return Draft([root, *chain], list(range(-1, len(chain))), [0] + [SOURCE_SAM] * len(chain))
        builder = TrieBuilder(root=root, capacity=capacity)
        grow_logits_tree(builder, self.state.store, max_breadth=self.max_breadth, max_depth=max_depth,
                         source=SOURCE_LOGITS)
        return builder.build()

    def update(self, verified: Verified) -> None:
        if len(verified.node_tokens):
            self.state.store.update(verified.node_tokens, verified.node_topk)
        self._push(verified.committed)


def _sam_state(config: Any, *, scope: str, vocab_size: int, tokenizer: Any) -> LiteratureState:
    """The copy-logit store of the fallback tree and, with ``corpus_path``, the shared corpus SAM.

    Raises:
        ValueError: a corpus file that cannot be read.
    """
    st = LiteratureState(scope=scope, store=CopyLogitStore(vocab_size=vocab_size, k=config.max_breadth))
    if config.corpus_path:
        st.sam_corpus = static_corpus_sam(config.corpus_path, tokenizer, max_tokens=config.corpus_max_tokens,
                                          vocab_size=vocab_size)
    return st


DECODING_METHODS = (
    DecodingMethod(
        "sam", "SAM-Decoding: suffix-automaton chain of the row (and a corpus), else the copy-logit tree",
        make_state=_sam_state, settings=("max_breadth", "corpus_path", "corpus_max_tokens", "sam_min_match",
                                         "sam_num_tokens"),
        make_drafter=lambda config, state: SamDrafter(state, min_match=config.sam_min_match,
                                                      num_tokens=config.sam_num_tokens, max_breadth=config.max_breadth),
    ),
)
