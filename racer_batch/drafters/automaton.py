"""The retrieval half of RACER: an Aho-Corasick automaton over token n-grams of the text so far.

docs/method.md sections 2, 3 and 9. Pure Python (standard library only).

Terms
-----
* **text**: every token fed to :meth:`Automaton.extend`, in order (the prompt, then every committed token).
* **window**: the n-gram that starts at one text position. Each new token extends, by one token, every window
  that starts inside the last ``ngram`` tokens, so the trie holds every substring of length ``<= ngram`` of
  the text (as long as nothing was evicted) and a node's ``freq`` is the number of windows that passed
  through it, i.e. the number of occurrences of its string.
* **state**: the node of the longest suffix of the *advanced* tokens (see :meth:`Automaton.advance`) that
  the automaton matched; the trie root when nothing matches.
* **border**: a match of depth ``>= min_border_depth`` found on the failure chain of the state; the tokens
  below a border in the trie are continuations seen earlier in the text after the same context.

Use by the engine, one decoding step::

    borders = automaton.advance(root)                  # root: the token committed by the previous step
    cands = automaton.candidates(borders, capacity - 1)  # retrieval branches (the draft root not counted)
    ...  # verify the draft tree, commit accepted drafts + bonus
    automaton.extend(committed)                        # every newly committed token, in order
    for tok in committed[:-1]:                         # the last one is the next step's root and is
        automaton.advance(tok)                         # advanced at the start of the next step

At prefill: ``prefill_automaton(automaton, prompt_ids)``, then ``automaton.extend([first])`` for the token
chosen from the prompt logits (it is the first step's root; it is advanced by that step). Border ids are valid
until the next ``extend`` (which may evict nodes), so call ``candidates`` right after ``advance``.

Worked example (``ngram=4``)::

    a = Automaton(max_nodes=100, ngram=4)
    a.extend([1, 2, 3, 1, 2, 4, 1, 2])     # text; "1 2" occurs 3 times, then 3, then 4 once each
    a.advance(1)                            # -> []        state "1" (depth 1: not a border)
    b = a.advance(2)                        # -> [n12]     state "1 2"; border "1 2" (freq 3)
    c = a.candidates(b, 4)
    c.tokens  == [3, 4, 1, 1]               # "1 2" was followed by 3 and by 4, each then by 1
    c.parents == [-1, -1, 0, 1]             # -1: child of the draft root (the token 2)
    c.scores  == [1, 1, 1, 1]

Pooling: with text ``5 1 2 3 6 1 2 3 5 1 2`` and state "5 1 2" the borders are "5 1 2" (freq 2) and
"1 2" (freq 3). Token 3 follows "5 1 2" once and "1 2" twice, so the pooled candidate 3 scores 1 + 2 = 3:
the continuation seen after the longer context counts under both borders.

Node pool and eviction (LRU of leaves)
--------------------------------------
Nodes live in flat lists indexed by node id (id 0 is the trie root, never evicted and not counted); ids of
evicted nodes are reused at once, and the lists only grow up to ``max_nodes + 1`` entries. All live nodes sit
on one recency list (a circular doubly linked list through the root, front = most recent) that always keeps

    (a) every node behind its parent, and (b) every node behind its failure target.

A node is *touched* by moving it to just behind its parent (depth-1 nodes go to the front). Moving a node
forward never puts it behind anything it was ahead of, so (a) holds for its children; (b) needs its failure
target to be ahead of the parent's slot, which holds because touches always happen along a suffix chain in
order of increasing depth: in ``extend`` the new node ``S = A + t`` (``A`` the window's node before) goes
behind ``A`` just after ``S[1:]`` went behind ``A[1:]``, and ``A[1:]`` (the failure target of ``A``) is ahead of
``A`` by (b). ``advance`` touches its matches (depth 1 .. deepest, all on one suffix chain) the same way.
Consequences:

* The tail is always a leaf that no failure link points to, so eviction takes the tail: only leaves are ever
  evicted, never an internal node, and no subtree is orphaned (docs/method.md section 9, pitfall 4). Ancestors are
  at least as recent as their descendants, so touching a node also keeps its ancestors.
* A node takes its parent's place when touched, so recency is measured by the *start* of the most recent
  window through the node rather than its end: a node ranks at most ``ngram - 1`` tokens older than under a
  plain last-touch LRU, and a touch costs O(1) instead of moving every ancestor (O(depth)).
* docs/method.md asks to move borders and their ancestors to the front; here the matches are placed just behind
  their parents, which are already ahead of them, giving the same guarantee at O(1) per match.
* Nodes in use are never evicted: the nodes of the windows still growing (pinned between calls) and the
  current state. Eviction scans from the tail past them; when nothing can be evicted (a pool smaller than the
  windows need) the windows that would need a new node are dropped for good, longest first (the shorter
  windows keep growing).

Failure links
-------------
Because the victim is never a failure target, the trie stays closed under suffixes as well as prefixes:
every substring of a node's string is a node. The longest proper suffix present of a node ``S`` is therefore
always ``S[1:]``: it is set at creation (``S[1:]`` is the previous window's node created or visited in the same
``extend``) and never changes. The rule "when a node is evicted, re-point the nodes whose failure link
targets it to its own failure target" holds vacuously: the eviction scan skips nodes with a non-zero
failure reference count (by (b) the tail never has one), so no link ever targets a victim; and the mirror
case (re-creating a node that longer nodes should now point to) cannot arise either.
:meth:`Automaton.check_invariants` verifies all of this against a brute-force search.

Cost: ``extend`` does O(ngram) dictionary and list operations per token; ``advance`` O(ngram);
``candidates`` O(children visited * log) for a budget of a few dozen.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass
from typing import Sequence

from .._delegate import delegated

__all__ = ["Automaton", "Cursor", "NodeView", "RetrievalCandidates", "prefill_automaton"]

_ROOT = 0  # node id of the trie root; also the sentinel of the recency list


def _check(cond: bool, msg: str) -> None:
    """Raise AssertionError(msg) unless ``cond`` (the checks of :meth:`Automaton.check_invariants`)."""
    if not cond:
        raise AssertionError(msg)


def _check_borders(borders: Sequence[int], size: int) -> None:
    """Raise ValueError unless ``borders`` are distinct node ids in ``1 .. size - 1`` (the trie root excluded)."""
    seen: set[int] = set()
    for b in borders:
        if not isinstance(b, int) or not 0 < b < size or b in seen:
            raise ValueError(f"border {b!r} is not a live node id, or is repeated, in borders {list(borders)}")
        seen.add(b)


def _group_children(children: list[dict[int, int]], nodes: Sequence[int]) -> dict[int, list[int]]:
    """The children of ``nodes`` pooled by token: token -> child node ids, both in discovery order."""
    groups: dict[int, list[int]] = {}
    for m in nodes:
        for tok, c in children[m].items():
            g = groups.get(tok)
            if g is None:
                groups[tok] = [c]
            else:
                g.append(c)
    return groups


@dataclass(eq=False)
class Cursor:
    """One text's position in a shared automaton: the windows still growing and the matching state.

    Rows decoded together that share a job's automaton (engine/batch.py) each hold their own cursor, so one
    row's tokens never move another row's windows or matching state; the trie, counts and recency are shared.
    The automaton's own cursor serves callers that pass none.

    Attributes:
        active: ``active[j]`` the node of the text's last ``j`` tokens, for the windows still growing
            (``active[0]`` the trie root); these nodes are pinned (never evicted) while the cursor is open.
        state: node id of the matching state (0: the trie root); never evicted while the cursor is open.
    """

    active: list = None  # type: ignore[assignment]
    state: int = _ROOT
    closed: bool = False

    def __post_init__(self) -> None:
        if self.active is None:
            self.active = [_ROOT]


@dataclass(frozen=True)
class RetrievalCandidates:
    """Retrieval continuations below the borders, as a tree hanging under the draft root.

    Attributes:
        tokens: ``[N]`` token id of each candidate node (the draft root itself is not included), best first.
        parents: ``[N]`` index into ``tokens`` of each node's parent, ``-1`` when the parent is the draft root;
            ``parents[i] < i``.
        scores: ``[N]`` pooled frequency of each node: the sum, over the borders, of the frequency of the
            trie node reached by the same relative token path. Non-increasing along every path and over the
            list (ties: shallower first).
    """

    tokens: list[int]
    parents: list[int]
    scores: list[int]

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.parents) == len(self.scores):
            raise ValueError(
                f"ragged candidates: {len(self.tokens)} tokens, {len(self.parents)} parents, "
                f"{len(self.scores)} scores"
            )

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class NodeView:
    """One live trie node as seen by :meth:`Automaton.snapshot` (tests and debugging)."""

    node: int
    freq: int
    failure: tuple[int, ...]  # token path of the failure target; () for the trie root


class Automaton:
    """Aho-Corasick automaton over the token n-grams of a text, in a fixed pool of nodes with LRU eviction.

    See the module docstring for the engine's calling sequence, the eviction order and the failure links.

    Example::

        a = Automaton(max_nodes=100, ngram=3)
        a.extend([7, 8, 9, 7, 8])       # every substring of length <= 3; "7 8" has freq 2
        a.advance(7)                    # -> []             state "7"
        borders = a.advance(8)          # -> [node "7 8"]   state "7 8"
        a.candidates(borders, 2)        # -> tokens [9], parents [-1], scores [1] ("7 8 9" is a leaf)

    Args:
        max_nodes: node pool size (the trie root not counted); the trie never holds more.
        ngram: longest n-gram kept (trie depth).
        min_border_depth: shallowest match used as a border. Matches come from states below the trie root,
            so every match has depth >= 2 and the values 1 and 2 behave the same.
    """

    def __init__(self, *, max_nodes: int = 10_000, ngram: int = 10, min_border_depth: int = 2) -> None:
        for name, value in (("max_nodes", max_nodes), ("ngram", ngram), ("min_border_depth", min_border_depth)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        if ngram < 2:
            raise ValueError(f"ngram must be >= 2, got {ngram}")
        if not 1 <= min_border_depth <= ngram:
            raise ValueError(f"min_border_depth must be in [1, ngram={ngram}], got {min_border_depth}")
        self._max_nodes = max_nodes
        self._ngram = ngram
        self._min_border_depth = min_border_depth
        # Per-node lists indexed by node id; they grow with the high-water mark, up to max_nodes + 1.
        self._token: list[int] = [-1]  # token on the edge from the parent
        self._parent: list[int] = [-1]
        self._depth: list[int] = [0]
        self._fail: list[int] = [_ROOT]  # failure link: node of the longest proper suffix present
        self._nref: list[int] = [0]  # how many nodes have their failure link pointing here
        self._freq: list[int] = [0]  # windows that passed through the node
        self._children: list[dict[int, int]] = [{}]  # token -> child node
        self._prev: list[int] = [_ROOT]  # recency list, toward the front (more recent)
        self._next: list[int] = [_ROOT]  # recency list, toward the tail (less recent)
        self._pinned: list[int] = [0]  # per node: how many open cursors have it among their growing windows
        self._cursor = Cursor()  # the cursor of calls that pass none
        self._cursors: list[Cursor] = [self._cursor]  # open cursors (their windows are pinned, states kept)
        self._num_tokens = 0
        self._num_evicted = 0

    # ------------------------------------------------------------------ properties

    max_nodes = delegated("_max_nodes", "Node pool size (int), as given.")
    ngram = delegated("_ngram", "Longest n-gram kept (int), as given.")
    min_border_depth = delegated("_min_border_depth", "Shallowest match used as a border (int), as given.")

    @property
    def num_nodes(self) -> int:
        """Live nodes, the trie root not counted; never more than ``max_nodes``."""
        return len(self._token) - 1  # evicted ids are reused at once, so every id in use is live

    num_tokens = delegated("_num_tokens", "Tokens fed to :meth:`extend` so far.")
    num_evicted = delegated("_num_evicted", "Nodes evicted so far.")
    state = delegated("_cursor.state", "Node id of the default cursor's matching state (0: the trie root).")

    def new_cursor(self) -> Cursor:
        """A cursor for one more text read at the same time as the others (a new row): no window growing,
        the state at the trie root. Close it with :meth:`close_cursor` when the text ends."""
        c = Cursor()
        self._cursors.append(c)
        return c

    def close_cursor(self, cursor: Cursor) -> None:
        """End a cursor's text: its windows are unpinned and its state no longer kept (idempotent)."""
        if cursor.closed or cursor is self._cursor:
            return
        for x in cursor.active[1:]:
            self._pinned[x] -= 1
        cursor.active = [_ROOT]
        cursor.closed = True
        self._cursors.remove(cursor)

    def _cur(self, cursor: "Cursor | None") -> Cursor:
        if cursor is None:
            return self._cursor
        if cursor.closed:
            raise ValueError("automaton cursor was closed")
        return cursor

    # ------------------------------------------------------------------ text

    def extend(self, tokens: Sequence[int], cursor: "Cursor | None" = None) -> None:
        """Append committed tokens to the text, growing every window that starts in the last ``ngram`` tokens.

        For each token ``t`` the windows are the text's suffixes of length ``1 .. ngram`` ending at ``t``; the
        window of length ``k`` is the child on ``t`` of the node of the previous ``k - 1`` tokens, created if
        missing (its failure link is the window of length ``k - 1``, created or visited just before), its
        ``freq`` incremented and the node touched. Each start position is inserted once, incrementally. The
        matching state is not moved (see :meth:`advance`). ``cursor``: whose text grows (default: the
        automaton's own).

        Example (``ngram=3``): after ``extend([1, 2])`` the trie is {1, 2, 12}; ``extend([1])`` then adds
        {21, 121} and raises ``freq`` of "1" to 2.
        """
        ngram = self._ngram
        token_of = self._token
        parent_of = self._parent
        depth_of = self._depth
        fail_of = self._fail
        nref = self._nref
        freq = self._freq
        children = self._children
        prv = self._prev
        nxt = self._next
        pinned = self._pinned
        index = operator.index
        cur = self._cur(cursor)
        for raw in tokens:
            t = index(raw)
            if t < 0:
                raise ValueError(f"token ids must be >= 0, got {t} at text position {self._num_tokens}")
            old = cur.active
            new = [_ROOT]
            shorter = _ROOT  # node of the window one token shorter: the failure target of a new node
            for k in range(1, len(old) + 1):  # k: length of the window after adding t
                a = old[k - 1]
                ch = children[a]
                x = ch.get(t)
                if x is None:
                    if len(token_of) <= self._max_nodes:
                        x = self._grow()
                    else:
                        x = self._evict_lru_leaf()
                        if x < 0:  # every leaf is in use: drop this window and the longer ones
                            break
                    token_of[x] = t
                    parent_of[x] = a
                    depth_of[x] = k
                    fail_of[x] = shorter
                    nref[shorter] += 1
                    freq[x] = 1
                    ch[t] = x
                    n = nxt[a]  # link just behind the parent
                    prv[x] = a
                    nxt[x] = n
                    nxt[a] = x
                    prv[n] = x
                else:
                    freq[x] += 1
                    p = prv[x]
                    if p != a:  # move just behind the parent (always a move toward the front)
                        n = nxt[x]
                        nxt[p] = n
                        prv[n] = p
                        n = nxt[a]
                        prv[x] = a
                        nxt[x] = n
                        nxt[a] = x
                        prv[n] = x
                pinned[x] += 1
                new.append(x)
                shorter = x
            for j in range(1, len(old)):
                pinned[old[j]] -= 1
            if len(new) > ngram:  # the window of length ngram is complete
                pinned[new.pop()] -= 1
            cur.active = new
            self._num_tokens += 1

    def start_text(self, cursor: "Cursor | None" = None) -> None:
        """Start a new text (a new row) on ``cursor``: no window spans the boundary. Trie, counts and state
        are kept."""
        cur = self._cur(cursor)
        for x in cur.active[1:]:
            self._pinned[x] -= 1
        cur.active = [_ROOT]

    def _grow(self) -> int:
        """A fresh node id above the high-water mark (the caller fills it in)."""
        x = len(self._token)
        self._token.append(-1)
        self._parent.append(-1)
        self._depth.append(0)
        self._fail.append(_ROOT)
        self._nref.append(0)
        self._freq.append(0)
        self._children.append({})
        self._prev.append(_ROOT)
        self._next.append(_ROOT)
        self._pinned.append(0)
        return x

    def _evict_lru_leaf(self) -> int:
        """Unlink the least recent evictable node and return its id for reuse; -1 if none.

        The tail of the recency list is a leaf that no failure link targets (module docstring); the scan
        only steps past nodes in use (growing windows, the state) and whatever they keep alive.
        """
        prv = self._prev
        children = self._children
        nref = self._nref
        pinned = self._pinned
        states = {c.state for c in self._cursors}
        x = prv[_ROOT]
        while x != _ROOT:
            if not children[x] and not nref[x] and not pinned[x] and x not in states:
                break
            x = prv[x]
        else:
            return -1
        nxt = self._next
        p = prv[x]
        n = nxt[x]
        nxt[p] = n
        prv[n] = p
        del children[self._parent[x]][self._token[x]]
        nref[self._fail[x]] -= 1
        self._num_evicted += 1
        return x

    # ------------------------------------------------------------------ matching

    def reset_state(self, cursor: "Cursor | None" = None) -> None:
        """Move the matching state back to the trie root (the text and the trie are kept)."""
        self._cur(cursor).state = _ROOT

    def advance(self, token: int, cursor: "Cursor | None" = None) -> list[int]:
        """Move the matching state by one token and return the borders, deepest first.

        Walks the failure chain of the state (the trie root excluded); every state ``s`` with a child on
        ``token`` gives a match ``s.child[token]``, and every match of depth ``>= min_border_depth`` is a
        border. The deepest match (else the trie root's child on ``token``, else the trie root) becomes the
        state. Since the trie is suffix-closed, the matches are the deepest one and its failure chain. The
        matches are touched (just behind their parents, shallowest first), which keeps their ancestors too.

        Example: text ``1 2 3 1 2``, ``ngram=3``, state "1 2": ``advance(3)`` returns the nodes of
        "1 2 3" and "2 3" and the state becomes "1 2 3". ``cursor``: whose state moves (default: the
        automaton's own).
        """
        t = operator.index(token)
        if t < 0:
            raise ValueError(f"token ids must be >= 0, got {t}")
        children = self._children
        fail_of = self._fail
        cur = self._cur(cursor)
        s = cur.state
        v = _ROOT
        while s != _ROOT:
            c = children[s].get(t)
            if c is not None:
                v = c
                break
            s = fail_of[s]
        else:
            c = children[_ROOT].get(t)
            if c is not None:
                v = c
        chain = []  # the matches, deepest first: v, v[1:], ..., the depth-1 node of t
        x = v
        while x != _ROOT:
            chain.append(x)
            x = fail_of[x]
        parent_of = self._parent
        prv = self._prev
        nxt = self._next
        for x in reversed(chain):
            a = parent_of[x]
            p = prv[x]
            if p != a:
                n = nxt[x]
                nxt[p] = n
                prv[n] = p
                n = nxt[a]
                prv[x] = a
                nxt[x] = n
                nxt[a] = x
                prv[n] = x
        cur.state = v
        min_depth = max(2, self._min_border_depth)
        depth_of = self._depth
        return [x for x in chain if depth_of[x] >= min_depth]

    def candidates(self, borders: Sequence[int], budget: int) -> RetrievalCandidates:
        """Best-first continuations below all ``borders`` together, at most ``budget`` nodes.

        Continuations with the same relative token path under different borders are one candidate whose
        score is the sum of their ``freq`` (pooling). Candidates are kept in order of score (ties: shallower
        first, then discovery order); a candidate's children enter the queue when it is kept. Scores never
        increase going down, so the kept set is ancestor-closed and the order best-first.

        Example: text ``5 1 2 3 6 1 2 4 5 1 2`` and state "5 1 2": borders "5 1 2" (child 3, freq 1) and
        "1 2" (children 3 and 4, freq 1 each); ``candidates(borders, 2)`` gives tokens ``[3, 4]``, scores
        ``[2, 1]``, parents ``[-1, -1]``.

        Args:
            borders: border node ids from the last :meth:`advance` (valid until the next :meth:`extend`).
            budget: most candidate nodes to return (the draft root not counted); ``<= 0`` gives none.
        """
        if budget <= 0 or not borders:
            return RetrievalCandidates([], [], [])
        _check_borders(borders, len(self._token))
        children = self._children
        freq = self._freq
        heap: list[tuple[int, int, int, int, int, list[int]]] = []  # (-score, depth, seq, token, parent, nodes)
        groups = _group_children(children, borders)
        seq = 0
        for tok, nodes in groups.items():
            score = 0
            for c in nodes:
                score += freq[c]
            heap.append((-score, 1, seq, tok, -1, nodes))
            seq += 1
        heapq.heapify(heap)
        out_tokens: list[int] = []
        out_parents: list[int] = []
        out_scores: list[int] = []
        heappop = heapq.heappop
        heappush = heapq.heappush
        while heap:
            neg_score, depth, _, tok, parent, nodes = heappop(heap)
            idx = len(out_tokens)
            out_tokens.append(tok)
            out_parents.append(parent)
            out_scores.append(-neg_score)
            if idx + 1 >= budget:
                break
            if len(nodes) == 1:
                for tok2, c in children[nodes[0]].items():
                    heappush(heap, (-freq[c], depth + 1, seq, tok2, idx, [c]))
                    seq += 1
                continue
            groups = _group_children(children, nodes)
            for tok2, kids in groups.items():
                score = 0
                for c in kids:
                    score += freq[c]
                heappush(heap, (-score, depth + 1, seq, tok2, idx, kids))
                seq += 1
        return RetrievalCandidates(out_tokens, out_parents, out_scores)

    # ------------------------------------------------------------------ inspection

    def node_path(self, node: int) -> tuple[int, ...]:
        """The token string of a live node (``()`` for the trie root)."""
        if not isinstance(node, int) or not 0 <= node < len(self._token):
            raise ValueError(f"node {node!r} is not a live node id")
        path = []
        while node != _ROOT:
            path.append(self._token[node])
            node = self._parent[node]
        return tuple(reversed(path))

    def snapshot(self) -> dict[tuple[int, ...], NodeView]:
        """Every node reachable from the trie root through the children maps, keyed by its token string."""
        out: dict[tuple[int, ...], NodeView] = {}
        stack: list[tuple[int, tuple[int, ...]]] = [(_ROOT, ())]
        paths = {_ROOT: ()}
        while stack:
            node, path = stack.pop()
            for tok, c in self._children[node].items():
                if c in paths:
                    raise AssertionError(f"node {c} is reachable twice (second time as {path + (tok,)})")
                p = path + (tok,)
                paths[c] = p
                stack.append((c, p))
        for node, path in paths.items():
            if node != _ROOT:
                fail = self._fail[node]
                out[path] = NodeView(node, self._freq[node], paths.get(fail, ("<unreachable>", fail)))
        return out

    def check_invariants(self) -> None:
        """Check the whole structure (O(nodes * ngram**2)); raise AssertionError with context on a violation.

        Checks: parent/child consistency and no orphans; node count <= max_nodes; depth <= ngram; freq
        positive and non-increasing downward; every failure link targets the longest proper suffix present
        (found by brute force) and the trie is suffix-closed; failure reference counts; the recency list
        holds exactly the live nodes, each behind its parent and its failure target; the growing windows
        form a suffix chain of pinned nodes; the state is live.
        """
        size = len(self._token)
        live_nodes = self._check_pool(size)
        path_of = self._check_trie(size, live_nodes)
        self._check_nodes(size, live_nodes, path_of)
        self._check_recency(size, live_nodes, path_of)
        self._check_cursors(size)

    def _check_pool(self, size: int) -> list[int]:
        """Per-node list lengths and node counts; return the live node ids (the trie root not included)."""
        lists = (self._parent, self._depth, self._fail, self._nref, self._freq, self._children,
                 self._prev, self._next, self._pinned)
        _check(all(len(x) == size for x in lists), "per-node lists have different lengths")
        _check(size - 1 <= self._max_nodes, f"{size - 1} node ids for max_nodes={self._max_nodes}")
        live_nodes = list(range(1, size))
        _check(len(live_nodes) == self.num_nodes <= self._max_nodes,
               f"{len(live_nodes)} live nodes, num_nodes={self.num_nodes}, max_nodes={self._max_nodes}")
        return live_nodes

    def _check_trie(self, size: int, live_nodes: list[int]) -> dict[int, tuple[int, ...]]:
        """Parent/child consistency, reachability and no orphans; return the token path of every node."""
        path_of: dict[int, tuple[int, ...]] = {_ROOT: ()}
        stack = [_ROOT]
        while stack:
            node = stack.pop()
            for tok, c in self._children[node].items():
                _check(0 < c < size, f"node {node} has unknown child {c} on token {tok}")
                _check(self._parent[c] == node and self._token[c] == tok,
                       f"child {c} of node {node} on token {tok} has parent {self._parent[c]}, token {self._token[c]}")
                _check(c not in path_of, f"node {c} reached twice")
                path_of[c] = path_of[node] + (tok,)
                stack.append(c)
        orphans = [x for x in live_nodes if x not in path_of]
        _check(not orphans, f"orphaned nodes (live but unreachable from the root): {orphans[:10]}")
        return path_of

    def _check_nodes(self, size: int, live_nodes: list[int], path_of: dict[int, tuple[int, ...]]) -> None:
        """Depth, freq, failure links against a brute-force search, suffix closure, failure reference counts."""
        node_of = {p: x for x, p in path_of.items()}
        nref = [0] * size
        for x in live_nodes:
            path = path_of[x]
            p = self._parent[x]
            _check(self._depth[x] == len(path) <= self._ngram,
                   f"node {x} {path} has depth {self._depth[x]} (ngram={self._ngram})")
            _check(self._freq[x] >= 1, f"node {x} {path} has freq {self._freq[x]}")
            _check(p == _ROOT or self._freq[x] <= self._freq[p],
                   f"node {x} {path} has freq {self._freq[x]} above its parent's {self._freq[p]}")
            longest = next((node_of[path[i:]] for i in range(1, len(path)) if path[i:] in node_of), _ROOT)
            _check(self._fail[x] == longest,
                   f"node {x} {path}: failure link {self._fail[x]} {path_of.get(self._fail[x])}, "
                   f"longest proper suffix present is {longest} {path_of[longest]}")
            _check(path[1:] in node_of, f"node {x} {path}: suffix {path[1:]} missing (trie not suffix-closed)")
            nref[self._fail[x]] += 1
        _check(all(nref[x] == self._nref[x] for x in [_ROOT, *live_nodes]), "failure reference counts are off")

    def _check_recency(self, size: int, live_nodes: list[int], path_of: dict[int, tuple[int, ...]]) -> None:
        """The recency list: exactly the live nodes, consistent links, parent and failure target ahead."""
        pos = {_ROOT: -1}
        x = self._next[_ROOT]
        prev = _ROOT
        while x != _ROOT:
            _check(x not in pos and len(pos) <= size, f"recency list loops at node {x}")
            _check(self._prev[x] == prev, f"recency list: prev of {x} is {self._prev[x]}, expected {prev}")
            pos[x] = len(pos)
            prev, x = x, self._next[x]
        _check(self._prev[_ROOT] == prev, "recency list tail link broken")
        _check(set(pos) - {_ROOT} == set(live_nodes),
               f"recency list holds {len(pos) - 1} nodes, {len(live_nodes)} are live")
        for x in live_nodes:
            _check(pos[self._parent[x]] < pos[x], f"node {x} {path_of[x]} is ahead of its parent in the recency list")
            _check(pos[self._fail[x]] < pos[x],
                   f"node {x} {path_of[x]} is ahead of its failure target in the recency list")

    def _check_cursors(self, size: int) -> None:
        """The open cursors: growing windows form a suffix chain, pin counts match them, states are live."""
        pins = [0] * size
        for cur in self._cursors:
            act = cur.active
            _check(act[0] == _ROOT and len(act) <= self._ngram, f"active windows {act}")
            for j in range(1, len(act)):
                _check(0 < act[j] < size and self._depth[act[j]] == j and self._fail[act[j]] == act[j - 1],
                       f"active window {j} is node {act[j]}, not a suffix chain")
                pins[act[j]] += 1
            _check(0 <= cur.state < size, f"state {cur.state} is not live")
        _check(pins == list(self._pinned), "pin counts differ from the open cursors' active windows")


def prefill_automaton(automaton: Automaton, prompt_ids: Sequence[int], cursor: Cursor | None = None) -> list[int]:
    """Feed a prompt and set the matching state from its last ``ngram`` tokens; return the last borders.

    Starts a new text (no window spans from a previous row into the prompt), extends with the prompt, then
    resets the state and advances it over the prompt's last ``ngram`` tokens.

    Example: ``prefill_automaton(Automaton(ngram=3), [1, 2, 3, 1, 2])`` leaves the state at "3 1 2" and
    returns the nodes of "3 1 2" and "1 2".
    """
    automaton.start_text(cursor)
    automaton.extend(prompt_ids, cursor)
    automaton.reset_state(cursor)
    borders: list[int] = []
    for tok in list(prompt_ids)[-automaton.ngram :]:
        borders = automaton.advance(tok, cursor)
    return borders
