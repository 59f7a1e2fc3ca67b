"""The draft tree type, the trie builder that merges candidates, and the drafter lifecycle.

A draft tree is a list of nodes in creation order (parents before children). Node 0 is the *root*: the
token committed by the previous step and not yet in the KV cache. ``parents[0] == -1``. Capacity counts
the root, so a draft of capacity C has at most C nodes (docs/method.md section 3, step 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np


@dataclass(frozen=True)
class Draft:
    """A draft tree.

    Attributes:
        token_ids: ``[T]`` token id of every node; ``token_ids[0]`` is the root token.
        parents: ``[T]`` index of each node's parent, ``-1`` for the root; ``parents[i] < i``.
        sources: ``[T]`` bit flags of the drafters that proposed each node (``SOURCE_*`` in values.py);
            0 for the root.
    """

    token_ids: list[int]
    parents: list[int]
    sources: list[int]

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert n >= 1 and len(self.parents) == n and len(self.sources) == n, "ragged draft"
        assert self.parents[0] == -1, "node 0 must be the root"
        for i in range(1, n):
            assert 0 <= self.parents[i] < i, f"node {i} has parent {self.parents[i]}: parents must come first"

    @staticmethod
    def root_only(root: int) -> "Draft":
        """The empty draft: just the root (one-token step, as in autoregressive decoding)."""
        return Draft([root], [-1], [0])

    @staticmethod
    def chain(token_ids: Sequence[int]) -> "Draft":
        """A chain: each token the child of the one before (cost curves, warm-up of fixed tree sizes)."""
        n = len(token_ids)
        return Draft([int(t) for t in token_ids], list(range(-1, n - 1)), [0] * n)

    def __len__(self) -> int:
        return len(self.token_ids)


class TrieBuilder:
    """Builds one draft tree, merging duplicate (parent, token) children so capacity counts unique nodes.

    Example::

        b = TrieBuilder(root=5, capacity=4)
        a = b.add(0, 7, source=1)      # node 1
        b.add(0, 7, source=2)          # same node 1, now sourced by both (1|2), costs nothing
        b.add(a, 9, source=2)          # node 2
        b.add(0, 8, source=2)          # node 3; the builder is now full
        b.add(0, 6, source=2)          # -> -1 (no room)
    """

    __slots__ = ("tokens", "parents", "sources", "depths", "children", "capacity")

    def __init__(self, *, root: int, capacity: int) -> None:
        self.tokens = [int(root)]
        self.parents = [-1]
        self.sources = [0]
        self.depths = [0]
        self.children: list[dict[int, int]] = [{}]
        self.capacity = max(1, int(capacity))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.capacity

    def add(self, parent: int, token: int, source: int) -> int:
        """Child of ``parent`` carrying ``token``; returns its node index, or -1 when the tree is full."""
        kids = self.children[parent]
        node = kids.get(token)
        if node is not None:
            self.sources[node] |= source
            return node
        if len(self.tokens) >= self.capacity:
            return -1
        node = len(self.tokens)
        kids[token] = node
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.sources.append(source)
        self.depths.append(self.depths[parent] + 1)
        self.children.append({})
        return node

    def build(self) -> Draft:
        return Draft(list(self.tokens), list(self.parents), list(self.sources))


@dataclass
class Verified:
    """What a drafter learns from one verification step.

    Attributes:
        node_tokens: ``[T]`` token ids of the verified tree nodes (root first).
        node_topk: ``[T, k]`` top-k next-token ids of each node's target logits (descending probability).
        committed: tokens appended to the output this step (accepted drafts then the bonus), in order.
        node_topk_probs: ``[T, k]`` target probabilities of ``node_topk`` (float32), given only to drafters
            whose ``needs_topk_probs`` is true; else None.
        last_node: index into ``node_tokens`` of the deepest accepted node, whose logits chose the bonus
            token; -1 for the prefill update (no tree was verified).
    """

    node_tokens: np.ndarray
    node_topk: np.ndarray
    committed: list[int]
    node_topk_probs: np.ndarray | None = None
    last_node: int = -1


class Drafter(Protocol):
    """Lifecycle of one row's drafter (docs/method.md 10.2); its long-lived state lives in a DraftState."""

    name: str

    def start(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        """Feed the prompt (``prompt_topk``: ``[P, k]`` top-k ids per prompt position, or None; computed only
        at each token's last position, the rows before are -1: ``engine.last_positions``)."""

    def propose(self, root: int, *, capacity: int, max_depth: int) -> Draft:
        """Draft tree rooted at ``root`` with at most ``capacity`` nodes and depth at most ``max_depth``."""

    def update(self, verified: Verified) -> None:
        """Learn from a verification step."""

    # optional: ``close()`` -- the row ended (the engine calls it once, also on errors and cancels); drafters
    # that hold a cursor in shared state (the automaton's) release it here

