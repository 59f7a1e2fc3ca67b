"""The one place where a draft tree becomes model inputs, and the acceptance rules (docs/method.md 3.6-3.8, 4).

Worked example. Draft (root 5) with nodes 0:5, 1:7 (parent 0), 2:8 (parent 0), 3:9 (parent 1), committed
length L = 10. Breadth-first order is 0, 1, 2, 3; position ids are [10, 11, 11, 12]; the tree attention
mask (1 = visible) over the tree part is::

    node 0: 1 0 0 0
    node 1: 1 1 0 0
    node 2: 1 0 1 0
    node 3: 1 1 0 1

and every node sees all L committed positions. Root-to-leaf paths: [[0, 1, 3], [0, 2, -1]] (padded with
-1, never with a token id). If the target's greedy choices are 7 at node 0, 9 at node 1 and 4 at node 3,
the accepted path is [0, 1, 3] (accepted length 2) and the bonus token is 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..drafters.base import Draft
from ..values import DecodingConfig, GenerationParams
from .sampling import draw, processed_probs


@dataclass
class TreeInputs:
    """A flattened draft tree (breadth-first order).

    Attributes:
        input_ids: ``[1, T]`` token ids.
        position_ids: ``[1, T]`` committed length + depth.
        attention_mask: ``[1, 1, T, L + T]`` additive float mask: 0 where visible, dtype-min elsewhere.
        parents: ``[T]`` parent index in flattened order, -1 for the root.
        depths: ``[T]`` depth of each node (root 0).
        paths: ``[n_leaves, max_depth + 1]`` node indices of each root-to-leaf path, padded with -1.
        order: ``[T]`` index of each flattened node in the original draft (creation order).
        tokens: ``[T]`` the token ids as a numpy array (same as input_ids).
        sources: ``[T]`` source flags per node.
        children: per node, dict token -> child node (flattened indices).
        visible: ``[T, T]`` bool, node i attends to node j (ancestors and itself); the tree block of the mask.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parents: np.ndarray
    depths: np.ndarray
    paths: np.ndarray
    order: np.ndarray
    tokens: np.ndarray
    sources: np.ndarray
    children: list[dict[int, int]]
    visible: np.ndarray
    committed_len: int = 0
    mask_dtype: torch.dtype = torch.float32
    _mask: Optional[torch.Tensor] = None

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def attention_mask(self) -> torch.Tensor:
        """``[1, 1, T, L + T]`` additive float mask over the committed prefix and the tree (0 visible,
        dtype-min hidden), built on first use: only the eager runner needs it; the static runner writes the
        ``visible`` block into its own preallocated mask."""
        if self._mask is None:
            n, lc = self.size, self.committed_len
            mask = torch.zeros((1, 1, n, lc + n), dtype=self.mask_dtype)
            mask[0, 0, :, lc:].masked_fill_(~torch.from_numpy(self.visible), torch.finfo(self.mask_dtype).min)
            self._mask = mask.to(self.input_ids.device)
        return self._mask


@dataclass
class FlatTrees:
    """Several streams' draft trees concatenated into one flat batch: the one input shape of a verify forward.

    Each stream's tree is in breadth-first order (as ``flatten_tree`` orders it, root first); stream ``b`` owns
    rows ``cu[b] : cu[b + 1]``. Row ``r`` of stream ``b`` sits at position ``starts[b] + depths[r]`` and attends
    to the ``starts[b]`` committed positions of its KV-cache slot plus its tree ancestors and itself.

    Attributes:
        tokens: ``[R]`` int64 token ids.
        parents: ``[R]`` int64 parent of each row, as an index local to its own tree (-1 for a root).
        depths: ``[R]`` int64 depth of each row (roots 0).
        cu: ``[B + 1]`` int64 cumulative rows per stream (``cu[0] == 0``, ``cu[-1] == R``).
        starts: ``[B]`` int64 committed length of each stream's KV-cache slot (the first tree row's position).
        caches: ``B`` cache handles (the runner's ``new_cache`` objects), one per stream, distinct slots.
    """

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    cu: np.ndarray
    starts: np.ndarray
    caches: list

    @property
    def num_streams(self) -> int:
        return len(self.caches)

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    def sizes(self) -> np.ndarray:
        """``[B]`` rows per stream."""
        return self.cu[1:] - self.cu[:-1]

    def rows_of(self, streams: Sequence[int]) -> np.ndarray:
        """``[R']`` the global rows of the trees of ``streams``, in that order."""
        if not len(streams):
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(self.cu[i], self.cu[i + 1]) for i in streams])

    def subset(self, streams: Sequence[int]) -> "FlatTrees":
        """The trees of ``streams`` (indices into this batch, in that order) as a flat batch of their own."""
        idx = [int(i) for i in streams]
        cu = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(self.sizes()[idx], out=cu[1:])
        rows = self.rows_of(idx)
        return FlatTrees(self.tokens[rows], self.parents[rows], self.depths[rows], cu, self.starts[idx],
                         [self.caches[i] for i in idx])

    def positions(self) -> np.ndarray:
        """``[R]`` int64 position of every row: its stream's committed length + its depth."""
        return np.repeat(self.starts, self.sizes()) + self.depths

    def visible(self, b: int) -> np.ndarray:
        """``[T_b, T_b]`` bool tree block of stream ``b``'s mask (ancestors and self)."""
        lo, hi = int(self.cu[b]), int(self.cu[b + 1])
        par = self.parents[lo:hi]
        n = hi - lo
        vis = np.eye(n, dtype=bool)
        for i in range(1, n):
            vis[i] |= vis[par[i]]
        return vis

    @staticmethod
    def of(items: list, starts: list | None = None) -> "FlatTrees":
        """From ``[(TreeInputs, cache), ...]`` (``starts`` default: each tree's ``committed_len``)."""
        trees = [t for t, _ in items]
        cu = np.zeros(len(trees) + 1, dtype=np.int64)
        cu[1:] = np.cumsum([t.size for t in trees])
        return FlatTrees(
            tokens=np.concatenate([t.tokens for t in trees]).astype(np.int64),
            parents=np.concatenate([t.parents for t in trees]).astype(np.int64),
            depths=np.concatenate([t.depths for t in trees]).astype(np.int64),
            cu=cu,
            starts=np.asarray(starts if starts is not None else [t.committed_len for t in trees], dtype=np.int64),
            caches=[c for _, c in items],
        )


def breadth_first(parents: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A draft's nodes in breadth-first order: ``(order, parents, depths)``, each ``[T]`` int64 — ``order`` the
    creation index of each flattened node (a stable sort by depth, so parents still precede children),
    ``parents`` the flattened parent of each (-1 for the root), ``depths`` its depth."""
    n = len(parents)
    par0 = np.asarray(parents, dtype=np.int64)
    depth0 = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        depth0[i] = depth0[par0[i]] + 1
    order = np.argsort(depth0, kind="stable")
    new_of_old = np.empty(n, dtype=np.int64)
    new_of_old[order] = np.arange(n)
    return order, np.where(par0[order] >= 0, new_of_old[np.maximum(par0[order], 0)], -1), depth0[order]


def flatten_tree(draft: Draft, *, committed_len: int, device: torch.device | str, dtype: torch.dtype) -> TreeInputs:
    """Flatten ``draft`` for one verification forward pass over a KV cache of ``committed_len`` positions."""
    n = len(draft)
    order, parents, depths = breadth_first(draft.parents)
    tokens = np.asarray(draft.token_ids, dtype=np.int64)[order]
    sources = np.asarray(draft.sources, dtype=np.int64)[order]

    visible = np.zeros((n, n), dtype=bool)  # visible[i, j]: node i attends to node j
    children: list[dict[int, int]] = [{} for _ in range(n)]
    for i in range(n):
        p = parents[i]
        if p >= 0:
            visible[i] = visible[p]
            children[p][int(tokens[i])] = i
        visible[i, i] = True

    is_leaf = np.ones(n, dtype=bool)
    is_leaf[parents[parents >= 0]] = False
    leaves = np.nonzero(is_leaf)[0]
    max_depth = int(depths.max()) if n else 0
    paths = np.full((len(leaves), max_depth + 1), -1, dtype=np.int64)
    for r, leaf in enumerate(leaves):
        node = int(leaf)
        while node >= 0:
            paths[r, depths[node]] = node
            node = int(parents[node])

    return TreeInputs(
        input_ids=torch.from_numpy(tokens).view(1, n).to(device),
        position_ids=(torch.from_numpy(depths) + committed_len).view(1, n).to(device),
        parents=parents,
        depths=depths,
        paths=paths,
        order=order,
        tokens=tokens,
        sources=sources,
        children=children,
        visible=visible,
        committed_len=committed_len,
        mask_dtype=dtype,
    )


def accept_greedy(tree: TreeInputs, choices: np.ndarray) -> tuple[list[int], int]:
    """Greedy acceptance (docs/method.md 4): the longest path whose every drafted token equals the target's
    argmax at its parent.

    Args:
        choices: ``[T]`` argmax token of each node's logits.
    Returns:
        (accepted path as flattened node indices starting with the root, bonus token).
    """
    paths = tree.paths  # [P, D+1]
    if paths.shape[1] == 1:
        return [0], int(choices[0])
    child = paths[:, 1:]
    parent = paths[:, :-1]
    ok = (child >= 0) & (tree.tokens[np.maximum(child, 0)] == choices[np.maximum(parent, 0)])
    run = np.cumprod(ok, axis=1).sum(axis=1)  # accepted length per path
    best = int(np.argmax(run))
    length = int(run[best])
    path = [int(x) for x in paths[best, : length + 1]]
    return path, int(choices[path[-1]])


def accept_sampling(tree: TreeInputs, probs_of, generator: torch.Generator) -> tuple[list[int], int]:
    """Lossless sampling acceptance for deterministic drafts (docs/method.md 4).

    At each node draw one token from the processed target distribution p of that node; if a child
    carries it, descend and repeat, else stop and emit the draw as the bonus token.

    Args:
        probs_of: callable node -> ``[V]`` processed probabilities of that node.
    """
    node = 0
    path = [0]
    while True:
        tok = draw(probs_of(node), generator)
        nxt = tree.children[node].get(tok)
        if nxt is None:
            return path, tok
        node = nxt
        path.append(node)


def accept_relaxed(
    tree: TreeInputs, logits: torch.Tensor, *, config: DecodingConfig, params: GenerationParams,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """Relaxed (lossy, opt-in) acceptance: also descend into a draft child the target merely finds plausible.

    At each node the target's own choice comes first: the argmax (greedy) or one draw from the processed
    distribution p (sampling), exactly as in lossless acceptance; if a child carries it, descend. Otherwise
    descend into the most probable child whose token is within the target's top-``relaxed_topk``
    (``acceptance="topk"``) or has p >= ``relaxed_threshold`` (``"threshold"``); with none, stop and emit the
    target's choice as the bonus token. Outputs differ from the target model's: job specs refuse it
    without a lossless shadow comparison (``racer_batch.service.job.spec.check_relaxed_allowed``).

    Args:
        logits: ``[T, V]`` target logits of the flattened tree.
    Returns:
        (accepted path as flattened node indices starting with the root, bonus token).
    """
    node, path = 0, [0]
    while True:
        row = logits[node]  # [V]
        if params.greedy:
            probs = torch.softmax(row.float(), dim=-1)
            choice = int(torch.argmax(row))
        else:
            probs = processed_probs(row, params)
            choice = draw(probs, generator)
        kids = tree.children[node]
        nxt = kids.get(choice)
        if nxt is None and kids:
            cand = torch.tensor(list(kids), dtype=torch.long)
            p = probs[cand]  # [children]
            if config.acceptance == "topk":
                kth = torch.topk(probs, min(config.relaxed_topk, probs.shape[-1])).values[-1]
                ok = p >= kth
            else:
                ok = p >= config.relaxed_threshold
            ok &= p > 0  # never accept a token the processed distribution rules out
            if bool(ok.any()):
                best = int(torch.argmax(torch.where(ok, p, torch.full_like(p, -1.0))))
                nxt = kids[int(cand[best])]
        if nxt is None:
            return path, choice
        node = nxt
        path.append(node)
