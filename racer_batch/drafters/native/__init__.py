"""The native (C++) draft core of RACER and its ablations: every stream of a decoding step drafted in one call.

``draft_core.cpp`` reproduces, node for node, what ``TreeDrafter`` (drafters/methods.py) proposes for the racer,
retrieval and logits methods: the retrieval automaton (drafters/automaton.py: its cursors, pins, recency list,
LRU leaf eviction, node id reuse and the tie order of ``candidates``), the copy-logit store with each row's own
layer and the logits tree (drafters/copy_logits.py), and the trie builder (drafters/base.py). One
:func:`propose_batch` call drafts every stream of a step, one :func:`update_batch` call teaches them all;
:func:`accept_greedy_batch` and :func:`fill_tree_mask` are engine/tree.py's greedy acceptance and
engine/decoder.py's flat-batch mask over the same flat arrays; :func:`commit_greedy_batch` is the whole greedy
commit of a step after its forward (acceptance, each block's stop checks by token id, the per-source counts
of the telemetry, the KV rows to move, and ``update_batch``) in one call.

Integer arguments: an int64 ndarray that is C-contiguous, aligned and in native byte order (what the engine
passes) is read in place through its own fields; anything else (lists, other integer dtypes, strided views) is
converted to one first, as before. Going through numpy's conversion for every argument cost ~1 µs each once a CPU
forward had evicted the caches (~11 µs for ten arguments in a micro-benchmark, more in the decode loop).

Build: compiled on first use with the machine's C++ compiler (pybind11 headers from torch; no libtorch link;
``-O3``, no ``-march``) into the kernels' cache (``racer_batch.native_build``: the file named by a hash of the
source, the flags and the Python and torch versions, replaced atomically); later processes load it in
milliseconds. A failed build or load is loud: :func:`native_core` raises RuntimeError with the compiler's output,
and :func:`available` logs it as an ERROR and returns False. ``RACER_NATIVE_DRAFT=off`` turns the core off
(:func:`available` False, :func:`unavailable_reason` says so); nothing here falls back silently.

Example (one job's two rows sharing a state, as scope ``job``)::

    st = NativeDraftState(vocab_size=V, max_nodes=10_000, ngram=10, min_border_depth=2, use_retrieval=True,
                          use_logits=True, max_breadth=8, own_layers=True)
    a, b = st.open_row(), st.open_row()
    st.start(a, prompt_a, topk_a); st.start(b, prompt_b, topk_b)
    flat = propose_batch([st, st], np.array([a, b]), roots, np.array([16, 16]), np.array([8, 8]))
    ...  # verify flat.tokens; accept; commit
    update_batch([st, st], np.array([a, b]), flat.cu, flat.tokens, topk, committed, cu_committed)
    st.close_row(a); st.close_row(b); st.free()
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from ..._delegate import delegated
from ...native_build import compile_library, library_path

__all__ = [
    "FlatDraft",
    "NativeDraftState",
    "accept_greedy_batch",
    "Commit",
    "available",
    "commit_greedy_batch",
    "fill_tree_mask",
    "native_core",
    "propose_batch",
    "step_context",
    "unavailable_reason",
    "update_batch",
]

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("draft_core.cpp")
_MODULE = "racer_draft_core"  # the name in PYBIND11_MODULE
_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-DNDEBUG"]
_ENV = "RACER_NATIVE_DRAFT"
_lock = threading.Lock()
_state: dict[str, object] = {}  # "module": the loaded module, or "error": why building or loading failed


# ---------------------------------------------------------------------------------------------- build and load


def _turned_off() -> bool:
    return os.environ.get(_ENV, "on").strip().lower() in ("0", "off", "false", "no")


def _library_path() -> Path:
    return library_path(_SRC, _FLAGS, "draft_core")


def _compile(out: Path) -> None:
    compile_library(_SRC, out, _FLAGS)


def _load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE, str(path), loader=loader)
    if spec is None:
        raise RuntimeError(f"cannot make an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def native_core() -> ModuleType:
    """The compiled module (``DraftCore`` and the batch functions), built on the first call and cached.

    Raises:
        RuntimeError: ``RACER_NATIVE_DRAFT=off``, or building or loading failed (the message carries the
            compiler's stderr tail; the failure is remembered, later calls raise the same without rebuilding).
    """
    if _turned_off():
        raise RuntimeError(f"the native draft core is turned off ({_ENV}=off)")
    mod = _state.get("module")
    if mod is not None:
        return mod  # type: ignore[return-value]
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        if "error" in _state:
            raise RuntimeError(_state["error"])
        try:
            path = _library_path()
            if not path.exists():
                log.warning("building racer's native draft core into %s (once per machine, ~30 s)", path)
                _compile(path)
            _state["module"] = _load(path)
        except Exception as exc:  # any build/load failure: remembered and re-raised as RuntimeError
            _state["error"] = f"racer's native draft core is unavailable: {type(exc).__name__}: {exc}"
            raise RuntimeError(_state["error"]) from exc
        return _state["module"]  # type: ignore[return-value]


def _core() -> ModuleType:
    """The module for the batch calls: once loaded, without reading the environment again (a step makes several
    calls; ``RACER_NATIVE_DRAFT=off`` decides whether states are made, :func:`available`, not whether the states
    that exist keep working); else :func:`native_core`."""
    mod = _state.get("module")
    return mod if mod is not None else native_core()  # type: ignore[return-value]


def available() -> bool:
    """Whether the native draft core can be used: builds it on the first call (see :func:`native_core`).

    False when ``RACER_NATIVE_DRAFT=off`` or when building or loading failed (then logged as an ERROR with the
    reason, once); the caller decides what to do instead.
    """
    if _turned_off():
        return False
    try:
        native_core()
    except RuntimeError as exc:
        if not _state.get("logged"):
            _state["logged"] = True
            log.error("%s", exc)
        return False
    return True


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True or the build was not tried yet)."""
    if _turned_off():
        return f"turned off ({_ENV}=off)"
    return _state.get("error")  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- the API


@dataclass(frozen=True)
class FlatDraft:
    """Every stream's draft tree, concatenated; each tree breadth-first exactly as ``engine.tree.flatten_tree``.

    Attributes (all int64 numpy arrays; stream ``b`` owns rows ``cu[b] : cu[b + 1]``, its root first):
        cu: ``[B + 1]`` row offsets.
        tokens: ``[R]`` token ids.
        parents: ``[R]`` parent as an index local to the stream's tree (flattened order), -1 at the root.
        depths: ``[R]`` depth (root 0).
        sources: ``[R]`` ``SOURCE_*`` bit flags (values.py) of the drafters that proposed each node; 0 at the root.
        order: ``[R]`` creation index of each node within its own tree (``TreeInputs.order``).
    """

    cu: np.ndarray
    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    sources: np.ndarray
    order: np.ndarray

    @property
    def num_streams(self) -> int:
        return int(self.cu.shape[0]) - 1

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    def sizes(self) -> np.ndarray:
        """``[B]`` nodes per stream."""
        return np.diff(self.cu)


class NativeDraftState:
    """One draft state (one job scope, or one request): the automaton and the ``[vocab, k]`` copy-logit store.

    Rows (streams) open on it with :meth:`open_row`; each has its own automaton cursor and, with ``own_layers``,
    its own store layer read before the shared table (``TreeDrafter.own``, used where scope != "request").

    Args:
        vocab_size: the model's full output vocabulary; every token id must be in ``[0, vocab_size)``.
        k: store columns (default ``max_breadth``, as ``_tree_state`` makes it).
        max_nodes, ngram, min_border_depth: the automaton's (``Automaton``), used when ``use_retrieval``.
        use_retrieval / use_logits: racer (both), retrieval or logits.
        max_breadth: breadth of the logits tree's root.
        own_layers: give each row its own store layer (only with ``use_logits``).

    Raises:
        ValueError: a setting out of range (as ``Automaton`` / ``CopyLogitStore``).
        RuntimeError: the native core is unavailable (:func:`native_core`).
    """

    __slots__ = ("_core", "k", "max_breadth", "own_layers", "use_logits", "use_retrieval", "vocab_size")

    def __init__(self, *, vocab_size: int, k: int | None = None, max_nodes: int = 10_000, ngram: int = 10,
                 min_border_depth: int = 2, use_retrieval: bool, use_logits: bool, max_breadth: int,
                 own_layers: bool) -> None:
        k = max_breadth if k is None else k
        self._core = native_core().DraftCore(
            vocab_size=int(vocab_size), k=int(k), max_nodes=int(max_nodes), ngram=int(ngram),
            min_border_depth=int(min_border_depth), use_retrieval=bool(use_retrieval), use_logits=bool(use_logits),
            max_breadth=int(max_breadth), own_layers=bool(own_layers),
        )
        self.vocab_size, self.k, self.max_breadth = int(vocab_size), int(k), int(max_breadth)
        self.use_retrieval, self.use_logits, self.own_layers = bool(use_retrieval), bool(use_logits), bool(own_layers)

    @classmethod
    def from_config(cls, config, *, vocab_size: int, scope: str, retrieval: bool, logits: bool) -> NativeDraftState:
        """The state ``methods._tree_state`` would make for a ``DecodingConfig`` (own layers unless scope request)."""
        return cls(vocab_size=vocab_size, k=config.max_breadth, max_nodes=config.max_nodes, ngram=config.ngram,
                   min_border_depth=config.min_border_depth, use_retrieval=retrieval, use_logits=logits,
                   max_breadth=config.max_breadth, own_layers=scope != "request")

    def open_row(self) -> int:
        """A new row (its automaton cursor; its own layer is made at :meth:`start`); returns its handle.

        Raises: ValueError: the state was freed."""
        return self._core.open_row()

    def close_row(self, row: int) -> None:
        """The row ended (``TreeDrafter.close``): its windows are unpinned, its state and own layer dropped.
        Idempotent; a no-op on a freed state or an unknown handle."""
        self._core.close_row(int(row))

    def start(self, row: int, prompt_ids, prompt_topk=None) -> None:
        """``TreeDrafter.start``: feed the prompt to the store (and the row's own layer) and the automaton.

        Args:
            prompt_ids: ``[P]`` token ids (converted to int64).
            prompt_topk: ``[P, k']`` top-k' ids per prompt position, k' >= k (extra columns ignored; rows whose
                first entry is -1 are skipped), or None.

        Raises:
            ValueError: freed state, unknown/closed/already started row, bad shapes, token ids outside the vocab.
        """
        self._core.start(int(row), prompt_ids, prompt_topk)

    def store_row(self, token: int) -> np.ndarray:
        """``[k]`` int64: the shared copy-logit store's row of ``token`` (-1 where nothing is known), as
        ``CopyLogitStore.row``.

        Raises: ValueError: no store (retrieval only), or ``token`` outside the vocabulary."""
        return self._core.store_row(int(token))

    def store_table(self) -> np.ndarray:
        """``[vocab, k]`` int32 copy of the shared copy-logit store (-1: nothing known).

        Raises: ValueError: no store (retrieval only)."""
        return self._core.store_table()

    def load_store(self, tokens: np.ndarray, rows: np.ndarray) -> None:
        """Write ``rows [n, k]`` as the shared store's rows of ``tokens [n]`` (a row whose first id is -1 changes
        nothing, as in an update).

        Raises: ValueError: no store, shapes other than ``[n]`` / ``[n, k]``, or a token outside the vocabulary."""
        self._core.load_store(np.asarray(tokens, dtype=np.int64), np.asarray(rows, dtype=np.int64))

    store_known = delegated("_core.store_known", "Tokens whose shared store row holds a prediction (0 without a "
                            "store).")

    def free(self) -> None:
        """Drop the automaton, the store and every row; later use raises ValueError (close_row is a no-op)."""
        self._core.free()

    freed = delegated("_core.freed", "Whether :meth:`free` was called (bool).")
    num_nodes = delegated("_core.num_nodes", "Live automaton nodes (the trie root not counted); 0 without retrieval.")
    num_evicted = delegated("_core.num_evicted", "Automaton nodes evicted so far.")
    num_scanned = delegated("_core.num_scanned", "Nodes the eviction scans have visited so far (the victims "
                            "included): how much the resume hint of draft_core.cpp's ``evict_lru_leaf`` saves, "
                            "against ``num_evicted``.")
    num_relabelled = delegated("_core.num_relabelled", "Order labels of the recency list rewritten so far (the "
                               "list's order-maintenance work behind the resume hint).")
    num_rows = delegated("_core.num_rows", "Open rows.")
    memory_bytes = delegated("_core.memory_bytes", "Bytes held: store table, own layers, automaton nodes and index "
                             "(capacity, not just use).")


def _cores(states: Sequence[NativeDraftState]) -> list:
    try:
        return [s._core for s in states]
    except AttributeError:
        raise ValueError("states must be NativeDraftState objects") from None


def propose_batch(states: Sequence[NativeDraftState], rows, roots, capacities, max_depths) -> FlatDraft:
    """``TreeDrafter.propose`` for every stream, in list order, in one native call; flattened breadth-first.

    Args (1-D, length B = len(states), converted to int64):
        states: each stream's state (a state may appear several times: its rows are drafted in list order).
        rows: each stream's row handle (open and started on its state).
        roots: the root tokens (the tokens committed last, not yet in the KV cache).
        capacities: most nodes per tree, the root included (>= 1).
        max_depths: deepest node depth (>= 0; 0 gives the root alone).

    Returns: a :class:`FlatDraft`. Side effects as the Python drafter's: the automaton advances over each root
    (also at capacity 1 or depth 0), touching its matches.

    Raises:
        ValueError: shapes, a closed/unknown/unstarted row, a freed state, a root outside the vocab, capacity < 1,
            max_depth < 0 (checked before any state changes).
    """
    out = _core().propose_batch(_cores(states), rows, roots, capacities, max_depths)
    return FlatDraft(*out)


def update_batch(states: Sequence[NativeDraftState], rows, cu, node_tokens, node_topk, committed, cu_committed) -> None:
    """``TreeDrafter.update`` for every stream, in list order, in one native call.

    Per stream ``b``: the store (shared table, then the row's own layer) learns ``node_topk`` at ``node_tokens``
    rows ``cu[b] : cu[b + 1]`` (rows whose first entry is -1 skipped), then the automaton extends the row's text by
    ``committed[cu_committed[b] : cu_committed[b + 1]]`` and advances over all of them but the last.

    Args (int64): rows ``[B]``; cu ``[B + 1]``; node_tokens ``[R]``; node_topk ``[R, k']`` (k' >= k);
        committed ``[M]``; cu_committed ``[B + 1]``.

    Raises:
        ValueError: shapes or offsets, token ids outside the vocab, too few top-k columns, a closed/unknown/
            unstarted row, a freed state (checked before any state changes).
    """
    _core().update_batch(_cores(states), rows, cu, node_tokens, node_topk, committed, cu_committed)


def accept_greedy_batch(cu, parents, tokens, choices) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``engine.tree.accept_greedy`` of every stream of a flat batch.

    Args (int64): cu ``[B + 1]`` (every stream non-empty); parents ``[R]`` local (-1 at each root, else a node
        before it); tokens ``[R]``; choices ``[R]`` the target's argmax at each node.

    Returns:
        ``(path_nodes [sum of path lengths], cu_path [B + 1], bonus [B])``: stream ``b``'s accepted path as local
        flattened node indices starting with 0 (``path_nodes[cu_path[b] : cu_path[b + 1]]``) and its bonus token
        (``choices`` at the path's last node).

    Raises:
        ValueError: shapes, offsets or parents not a forest of the streams' trees.
    """
    return _core().accept_greedy_batch(cu, parents, tokens, choices)


# commit_greedy_batch's finish codes -> engine/stops.py's finish reasons (-1: not checked, the row has stop strings)
FINISH_OF_CODE = {0: None, 1: "eos", 2: "length", 3: "context"}


class Commit(NamedTuple):
    """What :func:`commit_greedy_batch` decided for every stream of a step (int64 numpy arrays; a named tuple,
    built without per-field work on the hot path).

    Attributes:
        nodes: accepted paths' local node indices, root first, all streams concatenated; ``cu_paths [B + 1]``
            their offsets (as :func:`accept_greedy_batch`).
        bonus: ``[B]`` each stream's bonus token.
        blocks: ``[sum of path lengths]`` each stream's block (the accepted draft tokens, then the bonus),
            over the same ``cu_paths`` (a block is as long as its path).
        emitted: ``[B]`` tokens of the block taken before a stop rule ended the stream (the block's length for a
            stream that goes on or was not checked).
        finish: ``[B]`` 0 goes on, 1 eos, 2 length, 3 context (``FINISH_OF_CODE``), -1 not checked.
        counts: ``[B, 4]`` accepted draft nodes within the emitted tokens by source: retrieval alone, logits
            alone, both, neither (engine/step.py ``_accepted_by_source``).
        created: creation indices (``order``) of every accepted non-root node, streams concatenated.
        moved: ``[M, 3]`` KV rows to move, (stream, source node, destination index along the path) for every
            path entry whose node is not its own index.
        updated: whether the drafters learned here (every stream checked).
        ended: how many checked streams a stop rule ended (``finish > 0``): none, and the caller has nothing to
            finish.
    """

    nodes: np.ndarray
    cu_paths: np.ndarray
    bonus: np.ndarray
    blocks: np.ndarray
    emitted: np.ndarray
    finish: np.ndarray
    counts: np.ndarray
    created: np.ndarray
    moved: np.ndarray
    updated: bool
    ended: int


def commit_greedy_batch(states: Sequence[NativeDraftState], rows, cu, parents, tokens, choices, sources, order, topk,
                        limits, eos, telemetry=None, kv=None, advance=None) -> Commit:
    """The greedy commit of one step of every stream, in one native call (docs/method.md 4 and 9.11).

    Per stream ``b`` (rows ``cu[b] : cu[b + 1]`` of the flat trees): the greedy longest path and its bonus
    (:func:`accept_greedy_batch`); its block; where ``limits[b, 2]`` (checked), ``StopChecker.push`` over the
    block by token id (an EOS id -> eos, else ``limits[b, 0]`` tokens taken -> length, else ``limits[b, 1]`` ->
    context; a row with stop strings is the caller's, checked 0); the source counts and created indices of the telemetry
    and the KV rows to move. Then, only where every stream was checked, :func:`update_batch` with each
    stream's emitted tokens (else the caller updates after its own checks, so a shared state learns in stream
    order either way).

    Args (int64, converted): states / rows as :func:`update_batch` (``[B]``); cu ``[B + 1]``, parents, tokens,
        choices (the target's argmax at each node), sources, order ``[R]`` as a :class:`FlatDraft`; topk
        ``[R, k']`` (k' >= the store's k); limits ``[B, 3]``: per row the tokens it may still emit under
        ``max_new_tokens`` and under the context (each >= 1) and whether its stops are checked here (1) or by the
        caller (0, stop strings: ``StopChecker.limits``); eos ``[B, E]`` each row's EOS ids, padded with -1.
        telemetry: None, or ``(table, hist, tids)``: engine/telemetry.py's ``Telemetry`` arrays (``table [N, C >= 8]``
        float64, ``hist [N, H]`` int64, both writeable and C-contiguous) and each stream's row ``tids [B]``;
        where the drafters learned here (``updated``), every stream's step is added to them in place (columns
        steps, emitted, accepted, the four source counts, tree_tokens; one histogram count of its accepted
        length, clipped to the last bin).
        kv: None, or ``(kv, slots, starts)``: the KV cache as a writeable C-contiguous numpy array
            ``[L, 2, S, H, P, D]`` of any element type (engine/kv_cache.py's layout; ``KVCache.host_view``), each
            stream's slot ``[B]`` and committed length ``[B]`` (its tree's rows at ``starts[b] ..``); every
            stream's accepted rows are then moved down in place in the same call (``Commit.moved``, as
            ``KVCache.keep_rows_batch`` would; a stream that ended is moved too, harmlessly).
        advance: None, or ``(roots, starts, depths)``, each ``[B]``: every stream's root token, committed length
            and draft depth limit (``propose_batch``'s ``max_depths``), rewritten in place with the next step's
            for a stream that goes on: the root becomes the block's last token, the committed length grows by the
            path's length, and the emitted tokens come off the depth and off columns 0 and 1 of ``limits`` (all
            four must be writeable C-contiguous int64 arrays, read in place).

    Returns: a :class:`Commit`.

    Raises:
        ValueError: shapes, offsets, parents not a forest, a closed/unknown/unstarted row, a freed state, a token
            outside the vocabulary, too few top-k columns, a KV slot or tree outside ``kv``, or ``advance`` /
            ``limits`` not writeable in place (checked before any state changes).
    """
    return Commit._make(_core().commit_greedy_batch(_cores(states), rows, cu, parents, tokens, choices, sources,
                                                          order, topk, limits, eos, telemetry, kv, advance))


def step_context(states: Sequence[NativeDraftState], rows, roots, starts, depths, limits, eos, telemetry=None,
                 slots=None, tokens=None):
    """The arguments every step of a run over the same streams gives :func:`propose_batch` and
    :func:`commit_greedy_batch`, parsed and checked once (engine/step_plan.py's ``StepPlan``; after a forward the
    per-call parsing of ~15 arguments cost ~25 µs, measured on an AMD EPYC at B = 1 on SmolLM2-135M).

    Args (int64 numpy arrays, ``B = len(states)``; those written in place must be writeable, C-contiguous and
        read in place, and are held by the context): states / rows as :func:`propose_batch`; roots, starts,
        depths ``[B]`` and limits ``[B, 3]``: each stream's root token, committed length, draft depth limit and
        ``StopChecker.limits``, read by every propose and commit and advanced in place by every commit (as
        ``commit_greedy_batch``'s ``advance``); eos ``[B, E]``; telemetry as there, or None; slots ``[B]`` each
        stream's KV-cache slot, or None (no KV rows kept); tokens: None, or per stream its ``StopChecker.tokens``
        list, None for a stream with stop strings (``limits[b, 2] == 0``): every commit then appends each checked
        stream's emitted tokens to its list (the caller only sets the finish reason of the streams that ended).

    Returns the native ``StepContext``: ``propose(capacities [B])`` -> the tuple :func:`propose_batch` wraps in a
    :class:`FlatDraft` (``cu, tokens, parents, depths, sources, order``), from the context's roots and depths;
    ``commit(choices [R], topk [R, k'])`` -> a :class:`Commit` as :func:`commit_greedy_batch`'s (made in C++), over
    the trees the last ``propose`` made (kept in the context: committed once, ValueError without a propose before),
    with the context's limits, EOS ids, telemetry, KV cache (where set) and advance;
    ``set_telemetry((table, hist, tids) or None)`` and ``set_kv(kv array or None)`` again after either buffer
    was replaced (``set_kv`` needs ``slots``); ``set_quiet(True)``: a commit after which the caller has nothing
    to read (every stream checked by id and updated, none ended, the KV rows kept) returns None instead of a
    :class:`Commit` (no arrays built: the caller keeps no capacity tuner, and the telemetry counts are the
    context's), and a propose gives None for ``sources`` and ``order`` (the commit reads its own copy);
    ``set_clock(float64 [5] array or None)``: ``fast_commit(choices, topk, t0, t1, t2, t3)`` (``perf_counter``
    stamps: before the propose, after it, after the forward, after the scores) adds each step's propose, scores
    and commit ms, 1 step and the forward's ms to it. ``fast_propose`` / ``fast_commit``: the two calls as plain
    CPython functions bound to the context (no pybind11 dispatch; ~5-8 µs each after a forward), the same
    arguments.

    Raises:
        ValueError: as the two calls (shapes, an array not writeable in place, a freed state), when made or when
            called.
    """
    return _core().StepContext(_cores(states), rows, roots, starts, depths, limits, eos, telemetry, slots, tokens,
                               Commit)


def _mask_bits(mask, neg: float) -> tuple[np.ndarray, int]:
    """``(numpy view of mask's memory, bit pattern of neg in mask's dtype)``; raises ValueError."""
    if isinstance(mask, torch.Tensor):
        if mask.device.type != "cpu" or not mask.is_contiguous():
            raise ValueError(f"mask must be a contiguous CPU tensor, got {mask.device} "
                             f"(contiguous: {mask.is_contiguous()})")
        if mask.dtype == torch.float32:
            return mask.detach().numpy(), int(np.float32(neg).view(np.uint32))
        if mask.dtype in (torch.float16, torch.bfloat16):
            bits = int(torch.tensor(neg, dtype=mask.dtype).view(torch.int16).item()) & 0xFFFF
            return mask.detach().view(torch.int16).numpy(), bits
        raise ValueError(f"mask dtype must be float32, float16 or bfloat16, got {mask.dtype}")
    if isinstance(mask, np.ndarray) and mask.dtype == np.float32:
        return mask, int(np.float32(neg).view(np.uint32))
    if isinstance(mask, np.ndarray) and mask.dtype == np.float16:
        return mask, int(np.float16(neg).view(np.uint16))
    raise ValueError(f"mask must be a torch tensor or a float32/float16 numpy array, got {type(mask).__name__}")


def fill_tree_mask(mask, cu, parents, starts, neg: float):
    """Write a flat batch's additive tree-attention mask into ``mask [R, S]`` (every element) and return it.

    Row ``r`` of stream ``b`` (rows ``cu[b] : cu[b + 1]``, local index ``i``): columns ``[0, starts[b])`` (the
    committed prefix) get 0, column ``starts[b] + j`` gets 0 where node ``j`` is an ancestor-or-self of ``i`` and
    ``neg`` elsewhere, columns from ``starts[b] + T_b`` on get ``neg``. Same contract as
    ``engine.decoder.fill_tree_mask``.

    Args:
        mask: ``[R, S]`` C-contiguous CPU torch tensor (float32, float16 or bfloat16) or numpy array (float32 or
            float16), written in place.
        cu: ``[B + 1]`` int64 row offsets (every stream non-empty); parents: ``[R]`` local parents;
        starts: ``[B]`` committed length of each stream; neg: the hidden value (e.g. the dtype's min).

    Raises:
        ValueError: mask type/layout/shape, offsets, parents not a forest, or a stream not fitting in S columns.
    """
    view, neg_bits = _mask_bits(mask, neg)
    _core().fill_tree_mask(view, cu, parents, starts, 0, neg_bits)
    return mask
