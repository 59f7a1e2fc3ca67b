"""Token Recycling (TR): a ``[vocab, k]`` adjacency of top-k next tokens expanded through a static tree template.

The adjacency is the copy-logit store (copy_logits.py): row ``t`` holds the top-k next tokens the target
predicted the last time a verified node carried ``t``; every verified node refreshes its row, the prompt
fills it at prefill. What TR adds is the *shape*: instead of RACER's breadth rule, a fixed template of rank
paths says which adjacency entries to follow. The template is data (``TR_TEMPLATE``), not a rule, so it can
be swapped or tuned offline without touching the drafter.

Template encoding: each entry is a *rank path* from the draft root; ``(0, 2)`` is "the rank-2 adjacency entry
of the root's rank-0 entry". A node's token is ``adjacency[token of its parent][last rank]``. Entries are
ordered best first (an entry's parent always comes before it), so a capacity smaller than the template keeps
the best prefix and stays ancestor-closed.

Worked example: adjacency rows 5 -> [7, 8], 7 -> [9, 5], 8 -> [6, 1]; template ``((0,), (1,), (0, 0), (1, 0))``
with root 5 gives the draft 5 -> {7 -> {9}, 8 -> {6}}; with capacity 3 only 5 -> {7, 8}.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..values import SOURCE_TEMPLATE
from .base import Draft, TrieBuilder, Verified
from .copy_logits import CopyLogitStore
from .literature_state import LiteratureState
from .registry import DecodingMethod
from .state import DraftState

# 80 rank paths (81 nodes with the root), depth <= 6, layer widths 8, 20, 19, 15, 11, 7: wide near the root,
# a long rank-0 spine. Built once, offline, by taking the 80 rank paths of highest prior acceptance under a
# per-rank prior p(rank) = .55 .14 .07 .045 .03 .022 .016 .012 (a path scores the product over its ranks),
# then frozen here. Any ancestor-closed, best-first list of rank paths is a valid template.
TR_TEMPLATE: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (0, 0, 0), (1,), (0, 0, 0, 0), (0, 1), (1, 0), (2,), (0, 0, 0, 0, 0), (3,),
    (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 2), (2, 0), (4,), (0, 0, 0, 0, 0, 0), (0, 3), (3, 0), (0, 0, 0, 1),
    (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0), (5,), (0, 0, 2), (0, 2, 0), (2, 0, 0), (1, 1), (0, 4), (4, 0),
    (6,), (0, 0, 3), (0, 3, 0), (3, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 1, 0), (0, 0, 1, 0, 0), (0, 1, 0, 0, 0),
    (1, 0, 0, 0, 0), (0, 5), (5, 0), (7,), (0, 0, 0, 2), (0, 0, 2, 0), (0, 2, 0, 0), (2, 0, 0, 0), (0, 1, 1),
    (1, 0, 1), (1, 1, 0), (1, 2), (2, 1), (0, 0, 4), (0, 4, 0), (4, 0, 0), (0, 6), (6, 0), (0, 0, 0, 3),
    (0, 0, 3, 0), (0, 3, 0, 0), (3, 0, 0, 0), (0, 0, 0, 0, 0, 1), (0, 0, 0, 0, 1, 0), (0, 0, 0, 1, 0, 0),
    (0, 0, 1, 0, 0, 0), (0, 1, 0, 0, 0, 0), (1, 0, 0, 0, 0, 0), (0, 0, 5), (0, 5, 0), (5, 0, 0), (0, 7),
    (7, 0), (0, 0, 0, 0, 2), (0, 0, 0, 2, 0), (0, 0, 2, 0, 0), (0, 2, 0, 0, 0), (2, 0, 0, 0, 0), (1, 3),
    (3, 1), (0, 0, 1, 1), (0, 1, 0, 1),
)


def template_parents(template: Sequence[tuple[int, ...]]) -> list[int]:
    """Index (into ``template``) of each entry's parent, -1 for children of the root.

    Example: ``template_parents(((0,), (1,), (0, 0)))`` is ``[-1, -1, 0]``.

    Raises:
        ValueError: an empty or repeated rank path, or one whose parent does not come before it.
    """
    index: dict[tuple[int, ...], int] = {}
    parents: list[int] = []
    for i, path in enumerate(template):
        if not path or path in index or any(r < 0 for r in path):
            raise ValueError(f"template entry {i} {path!r} is empty, repeated or has a negative rank")
        if len(path) == 1:
            parents.append(-1)
        else:
            p = index.get(path[:-1])
            if p is None:
                raise ValueError(f"template entry {i} {path!r}: its parent {path[:-1]!r} must come before it")
            parents.append(p)
        index[path] = i
    return parents


def expand_template(
    table: np.ndarray,
    root: int,
    *,
    template: Sequence[tuple[int, ...]],
    parents: Sequence[int],
    capacity: int,
    max_depth: int,
    source: int = SOURCE_TEMPLATE,
) -> Draft:
    """The draft tree of ``template`` over the adjacency ``table`` ``[vocab, k]`` (-1: unknown entry).

    Entries whose rank is beyond the table's width, whose adjacency entry is unknown, whose parent was
    dropped, or deeper than ``max_depth`` are dropped with their subtrees. Duplicate (parent, token) pairs
    merge (capacity counts unique nodes, the root included).
    """
    builder = TrieBuilder(root=root, capacity=capacity)
    width = table.shape[1]
    node_of = [-1] * len(template)  # template entry -> builder node (-1: dropped)
    for i, path in enumerate(template):
        if builder.full:
            break
        if len(path) > max_depth:
            continue
        pnode = 0 if parents[i] < 0 else node_of[parents[i]]
        rank = path[-1]
        if pnode < 0 or rank >= width:
            continue
        tok = int(table[builder.tokens[pnode], rank])
        if tok < 0:
            continue
        node_of[i] = builder.add(pnode, tok, source)
    return builder.build()


class TokenRecyclingDrafter:
    """TR: the copy-logit store as the adjacency matrix, drafted through ``TR_TEMPLATE``."""

    name = "tr"
    needs_topk = True

    def __init__(self, state: DraftState, *, template: Sequence[tuple[int, ...]] = TR_TEMPLATE) -> None:
        state.check_alive()
        assert state.store is not None, "tr needs the copy-logit store in its draft state"
        self.state = state
        self.template = tuple(template)
        self.parents = template_parents(self.template)

    def start(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        self.state.start_row(prompt_ids, prompt_topk)

    def propose(self, root: int, *, capacity: int, max_depth: int) -> Draft:
        return expand_template(
            self.state.store.table, root, template=self.template, parents=self.parents, capacity=capacity,
            max_depth=max_depth,
        )

    def update(self, verified: Verified) -> None:
        if len(verified.node_tokens):
            self.state.store.update(verified.node_tokens, verified.node_topk)


def _tr_state(config: Any, *, scope: str, vocab_size: int, tokenizer: Any) -> LiteratureState:
    return LiteratureState(scope=scope, store=CopyLogitStore(vocab_size=vocab_size, k=config.max_breadth))


DECODING_METHODS = (
    DecodingMethod("tr", "Token Recycling: the copy-logit store drafted through a static tree template",
               make_state=_tr_state, make_drafter=lambda config, state: TokenRecyclingDrafter(state),
               settings=("max_breadth",)),
)
