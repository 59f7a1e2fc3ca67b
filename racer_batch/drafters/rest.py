"""REST-style corpus retrieval: a suffix-array datastore queried with the longest matching context suffix.

The datastore holds token documents concatenated with a separator (-1) after each one, and a suffix array
over them sorted by the first ``max_query`` tokens (a query is never longer, so a full sort is not needed).
A query is the context's suffix of length ``max_query`` down to ``min_query``: the longest one that occurs
gives the occurrences (at most ``max_occurrences``, the latest documents first); the ``depth`` tokens after
each occurrence (stopping at a document end) are counted in a trie, and the most frequent nodes form the
draft tree (a node's count never exceeds its parent's, so the kept set is ancestor-closed).

Two datastores can serve one drafter: a *static* one from the corpus the user names (``corpus_path``; built
once per process and shared read-only: it holds only the user's own corpus) and a *dynamic* one that learns
the rows of the draft state's scope (``rest_learn_outputs``: prompt and output of every finished row of the
job, for example earlier outputs of the same route). Their counts are pooled.

Memory: 8 bytes per datastore token (``int32`` text + ``int32`` suffix array) plus the documents of the
dynamic store; each store keeps at most ``corpus_max_tokens`` tokens (the dynamic one drops its oldest rows).

Build cost: prefix doubling with numpy, ``ceil(log2(max_query))`` stable sorts of ``n`` keys (about a second
for a million tokens). A compiled suffix-array package (pydivsufsort on PyPI) would sort the full suffixes
faster, but the bounded-depth numpy sort needs no new dependency and is fast enough for corpora of this size.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence, TextIO

import numpy as np

from ..values import SOURCE_CORPUS
from .base import Draft, TrieBuilder, Verified
from .literature_state import LiteratureState
from .registry import DecodingMethod

SEPARATOR = -1  # after every document; never part of a query


def build_suffix_array(text: np.ndarray, *, depth: int) -> np.ndarray:
    """Start positions of the suffixes of ``text`` ``[n]`` sorted by their first ``depth`` tokens.

    Suffixes equal on their first ``depth`` tokens keep no particular order. A suffix shorter than ``depth``
    sorts before its extensions (end of text is below every token, the separator -1 below every real token).

    Example: ``build_suffix_array(np.array([3, 1, 3, 2]), depth=2)`` is ``[1, 3, 0, 2]``
    ("1 3" < "2" < "3 1" < "3 2").
    """
    n = int(text.shape[0])
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    rank = text.astype(np.int64) + 2  # separator -1 -> 1; 0 is kept for "past the end"
    sa = np.argsort(rank, kind="stable")
    k = 1
    while k < depth:
        nxt = np.zeros(n, dtype=np.int64)
        if k < n:
            nxt[: n - k] = rank[k:]
        sa = np.lexsort((nxt, rank))  # by (rank of first k tokens, rank of the next k tokens)
        r1, r2 = rank[sa], nxt[sa]
        new_group = np.empty(n, dtype=bool)
        new_group[0] = True
        new_group[1:] = (r1[1:] != r1[:-1]) | (r2[1:] != r2[:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[sa] = np.cumsum(new_group)
        k *= 2
        if int(rank.max()) == n:  # all suffixes already distinct
            break
    return sa.astype(np.int32)


class SuffixIndex:
    """An immutable datastore: documents, their concatenation and its bounded-depth suffix array.

    Example::

        ix = SuffixIndex([[1, 2, 3], [1, 2, 4, 1, 2, 3]], max_query=4)
        ix.find([1, 2])                                   # -> 3 occurrences
        ix.continuations([1, 2], depth=2, max_occurrences=10)
        # -> [[3, -1], [4, 1], [3, -1]] in some order (-1: the document ended)
    """

    def __init__(self, docs: Sequence[Sequence[int]], *, max_query: int) -> None:
        parts = []
        for d in docs:
            if len(d):
                parts.append(np.asarray(d, dtype=np.int32))
                parts.append(np.array([SEPARATOR], dtype=np.int32))
        self.text = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)  # [n]
        if self.text.size and int(self.text.min()) < SEPARATOR:
            raise ValueError("datastore token ids must be >= 0")
        self.max_query = max_query
        self.sa = build_suffix_array(self.text, depth=max_query)  # [n]

    @property
    def num_tokens(self) -> int:
        return int(self.text.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.text.nbytes + self.sa.nbytes)

    def _bound(self, query: list[int], *, upper: bool) -> int:
        text, sa, m = self.text, self.sa, len(query)
        lo, hi = 0, len(sa)
        while lo < hi:
            mid = (lo + hi) // 2
            p = int(sa[mid])
            key = text[p : p + m].tolist()
            if key < query or (upper and key == query):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def range(self, query: Sequence[int]) -> tuple[int, int]:
        """Suffix-array range ``[lo, hi)`` of the suffixes that start with ``query`` (len <= max_query)."""
        q = [int(t) for t in query]
        assert 0 < len(q) <= self.max_query, f"query length {len(q)} not in 1..{self.max_query}"
        lo = self._bound(q, upper=False)
        return lo, self._bound(q, upper=True)

    def find(self, query: Sequence[int]) -> int:
        """Number of occurrences of ``query``."""
        lo, hi = self.range(query)
        return hi - lo

    def continuations(self, query: Sequence[int], *, depth: int, max_occurrences: int) -> np.ndarray:
        """``[m, depth]`` tokens after each of at most ``max_occurrences`` occurrences of ``query`` (the latest
        positions first; -1 from a document's end on)."""
        lo, hi = self.range(query)
        if hi <= lo:
            return np.zeros((0, depth), dtype=np.int32)
        pos = self.sa[lo:hi].astype(np.int64)
        if len(pos) > max_occurrences:
            pos = np.partition(pos, len(pos) - max_occurrences)[len(pos) - max_occurrences :]
        pos = np.sort(pos)[::-1] + len(query)  # first continuation position of each occurrence
        idx = pos[:, None] + np.arange(depth)[None, :]  # [m, depth]
        n = self.num_tokens
        out = np.where(idx < n, self.text[np.minimum(idx, n - 1)], SEPARATOR)
        ended = np.cumsum(out == SEPARATOR, axis=1) > 0
        return np.where(ended, SEPARATOR, out).astype(np.int32)


def count_trie_tree(
    conts: Sequence[np.ndarray], root: int, *, capacity: int, max_depth: int, source: int = SOURCE_CORPUS
) -> Draft:
    """Draft tree of the most frequent continuation prefixes, pooled over ``conts`` (each ``[m, depth]``).

    Every prefix of every row is a trie node counted once per row; nodes are kept by count (ties: shallower,
    then first seen) up to ``capacity`` nodes with the root.

    Example: rows ``[7, 8], [7, 9], [7, 8], [5, -1]`` give counts 7:3, 7-8:2, 5:1, 7-9:1; with capacity 3 the
    tree is root -> 7 -> 8.
    """
    count: dict[tuple[int, ...], int] = {}
    for mat in conts:
        depth = min(mat.shape[1], max_depth)
        for row in mat[:, :depth].tolist():
            for j in range(depth):
                if row[j] < 0:
                    break
                key = tuple(row[: j + 1])
                count[key] = count.get(key, 0) + 1
    builder = TrieBuilder(root=root, capacity=capacity)
    ranked = sorted(count.items(), key=lambda kv: (-kv[1], len(kv[0])))  # stable: first seen wins ties
    node_of: dict[tuple[int, ...], int] = {(): 0}
    for key, _ in ranked:
        if builder.full:
            break
        parent = node_of.get(key[:-1])
        if parent is None:  # cannot happen (counts are non-increasing downward); kept for safety
            continue
        node_of[key] = builder.add(parent, key[-1], source)
    return builder.build()


def _encode_text(text: str, tokenizer: Any, path: str | os.PathLike, where: str) -> list[int]:
    """Token ids of one corpus document's text.

    Raises:
        ValueError: no tokenizer (the corpus must give ``token_ids`` then).
    """
    if tokenizer is None:
        raise ValueError(f"corpus_path = {str(path)!r} {where}: text needs a tokenizer (give token_ids instead)")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _json_line_ids(line: str, where: str, tokenizer: Any, path: str | os.PathLike) -> list[int]:
    """Token ids of one ``.jsonl`` line: a JSON string, or an object with ``"token_ids"`` or ``"text"``.

    Raises:
        ValueError: not JSON, neither form, or text without a tokenizer (``where`` names the line).
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"corpus_path = {str(path)!r} {where}: not JSON ({exc})") from None
    if isinstance(obj, str):
        return _encode_text(obj, tokenizer, path, where)
    if isinstance(obj, dict) and isinstance(obj.get("token_ids"), list):
        return obj["token_ids"]
    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
        return _encode_text(obj["text"], tokenizer, path, where)
    raise ValueError(f"corpus_path = {str(path)!r} {where}: expected 'text' or 'token_ids', "
                     f"got {line[:80]!r}")


def _read_json_docs(f: TextIO, tokenizer: Any, path: str | os.PathLike, max_tokens: int) -> list[tuple[str, list]]:
    """``(where, token ids)`` of the non-blank lines of a ``.jsonl`` / ``.json`` corpus, up to the line that
    reaches ``max_tokens`` tokens in all."""
    items = ((i, line) for i, line in enumerate(f, 1) if line.strip())
    raw_docs = []
    total = 0
    for i, line in items:
        where = f"line {i}"
        ids = _json_line_ids(line, where, tokenizer, path)
        raw_docs.append((where, ids))
        total += len(ids)
        if total >= max_tokens:
            break
    return raw_docs


def _read_text_docs(f: TextIO, tokenizer: Any, path: str | os.PathLike, max_tokens: int) -> list[tuple[str, list]]:
    """``(where, token ids)`` of the blank-line separated documents of a plain text corpus, up to the one that
    reaches ``max_tokens`` tokens in all."""
    raw_docs = []
    total = 0
    for j, block in enumerate(f.read().split("\n\n")):
        if block.strip():
            ids = _encode_text(block.strip(), tokenizer, path, f"document {j + 1}")
            raw_docs.append((f"document {j + 1}", ids))
            total += len(ids)
            if total >= max_tokens:
                break
    return raw_docs


def _corpus_arrays(raw_docs: list[tuple[str, list]], path: str | os.PathLike, *, max_tokens: int,
                   vocab_size: int) -> list[np.ndarray]:
    """The documents as ``int32`` arrays, cut to ``max_tokens`` tokens in all.

    Raises:
        ValueError: token ids outside ``0 .. vocab_size - 1`` (``where`` names the document).
    """
    docs: list[np.ndarray] = []
    budget = max_tokens
    for where, ids in raw_docs:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
            raise ValueError(f"corpus_path = {str(path)!r} {where}: token ids must be in 0..{vocab_size - 1}")
        arr = arr[:budget]
        budget -= len(arr)
        docs.append(arr.astype(np.int32))
        if budget <= 0:
            break
    return docs


def load_corpus(path: str | os.PathLike, tokenizer: Any, *, max_tokens: int, vocab_size: int) -> list[np.ndarray]:
    """Token documents of a corpus file, at most ``max_tokens`` tokens in all (the rest is dropped).

    Formats: ``.jsonl`` / ``.json`` lines, each an object with ``"token_ids"`` (list of ints) or ``"text"``
    (string), or a JSON string; any other file is plain text with documents separated by blank lines.

    Raises:
        ValueError: missing or unreadable file, a bad line (named by number), token ids outside the
            vocabulary, or text without a tokenizer.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"corpus_path = {str(path)!r}: no such file")
    with p.open(encoding="utf-8") as f:
        if p.suffix.lower() in (".jsonl", ".json"):
            raw_docs = _read_json_docs(f, tokenizer, path, max_tokens)
        else:
            raw_docs = _read_text_docs(f, tokenizer, path, max_tokens)
    return _corpus_arrays(raw_docs, path, max_tokens=max_tokens, vocab_size=vocab_size)


_STATIC_CACHE: "OrderedDict[tuple, SuffixIndex]" = OrderedDict()
_STATIC_CACHE_SIZE = 2


def static_index(path: str, tokenizer: Any, *, max_tokens: int, max_query: int, vocab_size: int) -> SuffixIndex:
    """The static datastore of a corpus file, built once per process per (file version, settings)."""
    st = os.stat(path) if os.path.exists(path) else None
    key = (os.path.abspath(path), st.st_mtime_ns if st else 0, st.st_size if st else 0, id(tokenizer),
           max_tokens, max_query, vocab_size)
    ix = _STATIC_CACHE.get(key)
    if ix is None:
        ix = SuffixIndex(load_corpus(path, tokenizer, max_tokens=max_tokens, vocab_size=vocab_size),
                         max_query=max_query)
        _STATIC_CACHE[key] = ix
        while len(_STATIC_CACHE) > _STATIC_CACHE_SIZE:
            _STATIC_CACHE.popitem(last=False)
    _STATIC_CACHE.move_to_end(key)
    return ix


class RestDatastore:
    """The datastores of one draft-state scope: the static corpus and the learned rows of the scope.

    Rows are registered as live lists (the drafter keeps appending to its row) and indexed when the next row
    starts (:meth:`refresh`), when they are complete.
    """

    def __init__(self, *, static: SuffixIndex | None, learn: bool, max_tokens: int, max_query: int) -> None:
        self.static = static
        self.learn = learn
        self.max_tokens = max_tokens
        self.max_query = max_query
        self.rows: list[list[int]] = []
        self.dynamic: SuffixIndex | None = None
        self._indexed_rows = 0

    def refresh(self) -> None:
        """Index the rows registered so far (oldest dropped beyond ``max_tokens``)."""
        if not self.learn or len(self.rows) == self._indexed_rows:
            return
        total = 0
        keep = 0
        for row in reversed(self.rows):
            if total + len(row) > self.max_tokens and keep:
                break
            total += len(row)
            keep += 1
        self.rows = self.rows[len(self.rows) - keep :]
        self.dynamic = SuffixIndex(self.rows, max_query=self.max_query)
        self._indexed_rows = len(self.rows)

    def add_row(self, row: list[int]) -> None:
        if self.learn:
            self.rows.append(row)

    def indices(self) -> list[SuffixIndex]:
        return [ix for ix in (self.static, self.dynamic) if ix is not None and ix.num_tokens]

    @property
    def nbytes(self) -> int:
        n = self.dynamic.nbytes if self.dynamic is not None else 0
        return n + 8 * sum(len(r) for r in self.rows)  # the static store is shared, not counted per state


def rest_query(
    indices: Sequence[SuffixIndex], context: Sequence[int], *, max_query: int, min_query: int
) -> list[int]:
    """The longest suffix of ``context`` (``max_query`` .. ``min_query`` tokens) found in any index; [] if none.

    Example: indices over ``[[4, 1, 2, 3]]``, context ``[9, 1, 2]``: "9 1 2" is absent, "1 2" occurs.
    """
    def found(m: int) -> bool:
        q = list(context[len(context) - m :])
        return any(ix.find(q) for ix in indices)

    # A suffix that occurs has all its own suffixes occurring too, so binary search the longest length.
    lo, hi = min_query, min(max_query, len(context))
    if hi < lo or not found(lo):
        return []
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if found(mid):
            lo = mid
        else:
            hi = mid - 1
    return list(context[len(context) - lo :])


class RestDrafter:
    """REST for one row: query the scope's datastores with the context suffix, draft the frequent continuations."""

    name = "rest"
    needs_topk = False

    def __init__(self, state: Any, *, max_query: int, min_query: int, max_occurrences: int, depth: int) -> None:
        state.check_alive()
        assert getattr(state, "rest", None) is not None, "rest needs a RestDatastore in its draft state"
        self.state = state
        self.store: RestDatastore = state.rest
        self.max_query = max_query
        self.min_query = min(min_query, max_query)
        self.max_occurrences = max_occurrences
        self.depth = depth
        self.context: list[int] = []

    def start(self, prompt_ids: Sequence[int], prompt_topk: np.ndarray | None) -> None:
        self.state.check_alive()
        self.state.rows += 1
        self.store.refresh()  # the rows before this one are complete now
        self.context = [int(t) for t in prompt_ids]
        self.store.add_row(self.context)  # a live list: it keeps growing with this row's output

    def propose(self, root: int, *, capacity: int, max_depth: int) -> Draft:
        indices = self.store.indices()
        if not indices or capacity <= 1 or max_depth <= 0:
            return Draft.root_only(root)
        q = rest_query(indices, self.context, max_query=self.max_query, min_query=self.min_query)
        if not q:
            return Draft.root_only(root)
        conts = [ix.continuations(q, depth=self.depth, max_occurrences=self.max_occurrences) for ix in indices]
        return count_trie_tree(conts, root, capacity=capacity, max_depth=max_depth)

    def update(self, verified: Verified) -> None:
        self.context.extend(int(t) for t in verified.committed)


def _rest_state(config: Any, *, scope: str, vocab_size: int, tokenizer: Any) -> LiteratureState:
    """The scope's datastores: the static corpus index (shared, built once per process) and a learning one.

    Raises:
        ValueError: a corpus file that cannot be read.
    """
    static = None
    if config.corpus_path:
        static = static_index(config.corpus_path, tokenizer, max_tokens=config.corpus_max_tokens,
                              max_query=config.rest_max_query, vocab_size=vocab_size)
    rest = RestDatastore(static=static, learn=config.rest_learn_outputs, max_tokens=config.corpus_max_tokens,
                         max_query=config.rest_max_query)
    return LiteratureState(scope=scope, rest=rest)


def _rest_drafter(config: Any, state: Any) -> RestDrafter:
    return RestDrafter(state, max_query=config.rest_max_query, min_query=config.rest_min_query,
                       max_occurrences=config.rest_max_occurrences, depth=config.rest_depth)


def _rest_has_a_source(config: Any) -> None:
    if config.corpus_path is None and not config.rest_learn_outputs:
        raise ValueError("method 'rest' with no corpus_path and rest_learn_outputs false has nothing to "
                         "retrieve from (every step would draft nothing); set corpus_path or rest_learn_outputs")


DECODING_METHODS = (
    DecodingMethod(
        "rest", "REST: frequent continuations of the context suffix in a corpus and the scope's earlier rows",
        make_state=_rest_state, make_drafter=_rest_drafter, check_config=_rest_has_a_source,
        settings=("corpus_path", "corpus_max_tokens", "rest_learn_outputs", "rest_max_query", "rest_min_query",
                  "rest_max_occurrences", "rest_depth"),
    ),
)
