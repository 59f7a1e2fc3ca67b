"""LogitSpec: guess the token after the root from the last logits, then extend each guess by n-gram lookup.

The last verified node's logits chose the root (the bonus token); their other top-k entries are good guesses
for the *next-next* token, i.e. the root's children. Each guess ``c`` becomes a query: the context, then
``c``; the longest suffix n-gram of that query found earlier in the context gives the tokens that followed
it, which extend the branch. Branches are cut by rank (rank ``r`` keeps ``ceil(L / (r + 1))`` extension
tokens, ``L = logitspec_branch_tokens``). A plain prompt-lookup chain from the root (the context's own suffix
n-gram) goes in first, because a long context match beats any single-token guess; capacity default 64.

The context is the row's prompt plus every committed token; the root is its last token when ``propose`` runs.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..values import SOURCE_LASTLOGIT, SOURCE_NGRAM
from .base import Draft, TrieBuilder, Verified
from .literature_state import LiteratureState
from .registry import DecodingMethod
from .state import DraftState


class NgramIndex:
    """Most recent continuation of every n-gram (n = 1 .. max_ngram) of a growing token list.

    Only n-grams that are followed by at least one token are indexed, so a query always returns a non-empty
    continuation or nothing, and the context's own suffix never matches itself.

    Example::

        ix = NgramIndex(max_ngram=2)
        ix.extend([1, 2, 3, 1, 2, 4, 1])
        ix.lookup([4, 1, 2], num_tokens=3)   # -> ([4, 1], 2): "1 2" last continued at position 5
        ix.lookup([9], num_tokens=3)         # -> ([], 0)
    """

    def __init__(self, *, max_ngram: int) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]  # [n][gram] -> pos

    def extend(self, tokens: Sequence[int]) -> None:
        ctx = self.tokens
        for t in tokens:
            i = len(ctx)  # position of the new token: it continues the n-grams ending at i - 1
            for n in range(1, min(self.max_ngram, i) + 1):
                self._next[n][tuple(ctx[i - n : i])] = i
            ctx.append(int(t))

    def lookup(self, query: Sequence[int], *, num_tokens: int) -> tuple[list[int], int]:
        """(up to ``num_tokens`` tokens that last followed the longest indexed suffix n-gram of ``query``, n)."""
        if num_tokens <= 0:
            return [], 0
        for n in range(min(self.max_ngram, len(query)), 0, -1):
            pos = self._next[n].get(tuple(query[len(query) - n :]))
            if pos is not None:
                return self.tokens[pos : pos + num_tokens], n
        return [], 0


def rank_cut(branch_tokens: int, rank: int) -> int:
    """Extension tokens kept after a first-layer guess of ``rank``: ``ceil(branch_tokens / (rank + 1))``.

    Example: with 12, ranks 0..4 keep 12, 6, 4, 3, 3 tokens.
    """
    return -(-branch_tokens // (rank + 1))


def logitspec_tree(
    index: NgramIndex,
    root: int,
    last_topk: Sequence[int],
    *,
    capacity: int,
    max_depth: int,
    branch_tokens: int,
) -> Draft:
    """LogitSpec draft rooted at ``root`` (the last token of ``index.tokens``).

    Order of insertion (the builder stops adding new nodes when full; duplicates merge): (1) the root's own
    prompt-lookup chain, at most half the budget; (2) the first layer: ``last_topk`` (ids, best first, -1 =
    unknown); (3) each guess's n-gram extension in rank order, cut by :func:`rank_cut`.

    Example: context ``[5, 6, 7, 8, 9, 7]`` (root 7), last_topk ``[7, 9]``: the chain "8 9 7 ..." from the
    earlier "7"; guess 9 with query "... 7 9" matches nothing longer than "9", which was followed by "7".
    """
    builder = TrieBuilder(root=root, capacity=capacity)
    if max_depth <= 0 or capacity <= 1:
        return builder.build()
    ctx = index.tokens
    chain_cap = min(branch_tokens, max_depth, max(1, (capacity - 1) // 2))
    chain, _ = index.lookup(ctx, num_tokens=chain_cap)
    node = 0
    for tok in chain:
        node = builder.add(node, tok, SOURCE_NGRAM)
        if node < 0:
            break
    guesses: list[tuple[int, int]] = []  # (rank, node)
    for rank, tok in enumerate(last_topk):
        tok = int(tok)
        if tok < 0:
            break
        child = builder.add(0, tok, SOURCE_LASTLOGIT)
        if child >= 0:
            guesses.append((rank, child))
    if max_depth >= 2:
        tail = list(ctx[-(index.max_ngram - 1) :]) if index.max_ngram > 1 else []
        for rank, child in guesses:
            ext, _ = index.lookup(tail + [builder.tokens[child]],
                                  num_tokens=min(rank_cut(branch_tokens, rank), max_depth - 1))
            node = child
            for tok in ext:
                node = builder.add(node, tok, SOURCE_NGRAM)
                if node < 0:
                    break
            if builder.full:
                break
    return builder.build()


class LogitSpecDrafter:
    """LogitSpec for one row: the context's n-gram index plus the last verified node's top-k."""

    name = "logitspec"
    needs_topk = True

    def __init__(self, state: DraftState, *, max_ngram: int, branch_tokens: int) -> None:
        state.check_alive()
        self.state = state
        self.index = NgramIndex(max_ngram=max_ngram)
        self.branch_tokens = branch_tokens
        self.last_topk = np.zeros(0, dtype=np.int64)  # [k] top-k of the logits that chose the current root

    def start(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        self.state.check_alive()
        self.state.rows += 1
        self.index.extend(prompt_ids)
        if prompt_topk is not None and len(prompt_topk):
            self.last_topk = np.asarray(prompt_topk[-1])  # the last prompt position chose the first token

    def propose(self, root: int, *, capacity: int, max_depth: int) -> Draft:
        assert self.index.tokens and self.index.tokens[-1] == root, "the root must be the last committed token"
        return logitspec_tree(
            self.index, root, self.last_topk, capacity=capacity, max_depth=max_depth,
            branch_tokens=self.branch_tokens,
        )

    def update(self, verified: Verified) -> None:
        if verified.last_node >= 0 and len(verified.node_topk):
            self.last_topk = np.asarray(verified.node_topk[verified.last_node])
        self.index.extend(verified.committed)


DECODING_METHODS = (
    DecodingMethod(
        "logitspec", "LogitSpec: last-logit guesses for the root's children, extended by context n-gram lookup",
        make_state=lambda config, *, scope, vocab_size, tokenizer: LiteratureState(scope=scope),
        make_drafter=lambda config, state: LogitSpecDrafter(
            state, max_ngram=config.logitspec_ngram, branch_tokens=config.logitspec_branch_tokens),
        settings=("max_breadth", "logitspec_ngram", "logitspec_branch_tokens"),
    ),
)
