"""The copy-logit store and the logits draft tree (docs/method.md sections 2.2 and 3.4).

The store is a fixed ``[vocab, k]`` table of token ids: row ``t`` holds the top-k next tokens the target
model predicted the most recent time a verified position's input token was ``t`` (-1 where nothing is
known yet). Sized by the model's full output vocabulary, special and added tokens included.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .base import TrieBuilder


class CopyLogitStore:
    """``[vocab, k]`` table of the target's last top-k predictions after each token.

    Raises:
        ValueError: vocab_size < 1 or k < 1.
    """

    def __init__(self, *, vocab_size: int, k: int, with_probs: bool = False) -> None:
        if vocab_size < 1 or k < 1:
            raise ValueError(f"copy-logit store needs vocab_size >= 1 and k >= 1, got {vocab_size}, {k}")
        self.k = k
        self.table = np.full((vocab_size, k), -1, dtype=np.int64)  # [vocab, k]
        # [vocab, k] target probability of each stored id (NaN: unknown, e.g. prompt rows); only with_probs
        self.probs: np.ndarray | None = np.full((vocab_size, k), np.nan, dtype=np.float32) if with_probs else None

    def update(self, tokens: np.ndarray, topk: np.ndarray, probs: np.ndarray | None = None) -> None:
        """Set ``row[tokens[i]] = topk[i]``; later positions win over earlier ones for repeated tokens.

        Args:
            tokens: ``[N]`` input token ids of verified positions.
            topk: ``[N, k']`` top-k' next-token ids at those positions (k' >= k; extra columns ignored); a row
                of -1 is a position whose prediction was not computed (a prefill computes only each token's
                last prompt position: ``engine.last_positions``) and changes nothing.
            probs: ``[N, k']`` their target probabilities, kept when the store was made ``with_probs``;
                None marks the rows' probabilities unknown (NaN).
        """
        if len(tokens) == 0:
            return
        known = topk[:, 0] >= 0
        if not known.all():
            tokens, topk = tokens[known], topk[known]
            probs = None if probs is None else probs[known]
        # numpy fancy assignment applies in order, so the last occurrence of a token wins.
        self.table[tokens] = topk[:, : self.k]
        if self.probs is not None:
            self.probs[tokens] = np.nan if probs is None else probs[:, : self.k]

    def row(self, token: int) -> np.ndarray:
        return self.table[token]

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes) + (int(self.probs.nbytes) if self.probs is not None else 0)


def child_breadth(parent_breadth: int, *, child_rank: int, parent_depth: int) -> int:
    """Breadth rule of the logits tree (docs/method.md 3.4; paper: b_child = max(1, floor(b_i / 2^(j + [i != root])))).

    Example: with max_breadth 8 the root's children get 8, 4, 2, 1, 1, ...; the first child of a
    depth-1 node of breadth 8 gets 4, the second 2, then 1.
    """
    shift = child_rank + (1 if parent_depth != 0 else 0)
    return max(1, parent_breadth >> shift)


def grow_logits_tree(
    builder: TrieBuilder,
    store: CopyLogitStore,
    *,
    max_breadth: int,
    max_depth: int,
    source: int,
    own: CopyLogitStore | None = None,
) -> None:
    """Fill ``builder`` breadth-first from its root with copy-logit children until it is full.

    A node of breadth b expands the first b entries of its token's store row; each new child costs one
    unit of the builder's capacity, a child the builder already holds (e.g. from retrieval) costs nothing
    but is still expanded. Nodes deeper than ``max_depth`` are not created. ``own``: the row's own layer
    over a shared ``store`` (``TreeDrafter``): a token's row comes from it where the row has one.
    """
    table = store.table
    own_table = None if own is None else own.table
    queue: deque[tuple[int, int]] = deque([(0, max_breadth)])  # (node, breadth)
    depths = builder.depths
    while queue:
        node, breadth = queue.popleft()
        depth = depths[node]
        if depth >= max_depth:
            continue
        tok = builder.tokens[node]
        row = table[tok] if own_table is None or own_table[tok, 0] < 0 else own_table[tok]
        for rank in range(min(breadth, table.shape[1])):
            tok = int(row[rank])
            if tok < 0:
                break
            child = builder.add(node, tok, source)
            if child < 0:
                return
            queue.append((child, child_breadth(breadth, child_rank=rank, parent_depth=depth)))
