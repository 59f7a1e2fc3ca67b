"""The step plan: what a decode step reads of its rows that stays the same while the same rows decode together
(engine/step.py's ``Stepper`` makes one per row set), and the per-row arrays the native step context reads and a
fused commit advances in place (docs/architecture.md, "One decoding step"). Rows are engine/step.py's ``DecodeRow``
(not imported here: step.py imports this module)."""

from __future__ import annotations

from itertools import chain
from typing import Any, Optional

import numpy as np

from ..drafters import native as native_mod
from .telemetry import Telemetry

FEW_ROWS = 4  # StepPlan.measure: up to this many rows, element by element


class StepPlan:
    """What a step reads of its rows that stays the same while the same rows decode together, made once for them
    (``Stepper._plan_of``), and the per-step arrays derived from the rows' emitted counts (:meth:`measure`).

    Attributes (B = len(rows)):
        rows: the rows, in step order. kind, native: ``drafting(rows)``. k, want_probs: the top-k ids the step's
            scores give (the widest any row's drafter learns from) and whether their probabilities too.
        handles: the native rows' (states, row handles ``[B]``) where kind is native, else None. caches: the
            rows' KV-cache handles. greedy: whether every row is greedy.
        checkers: the rows' ``StopChecker``. eos: ``[B, E]`` their EOS ids (``eos_table``). tids: ``[B]`` their
            telemetry rows, or None where a row keeps StepRecords (``_commit_native``). eos, tids, limits and depth
            are None in an AR plan (kind root), whose steps read none of them.
        limits: ``[B, 3]`` ``StopChecker.limits`` of every row (columns 0 and 1 refreshed by :meth:`measure`).
        depth: ``[B]`` the deepest draft node each row may take, ``StopChecker.remaining - 1`` (:meth:`measure`).
        times, timed: each row's draft, verify and update ms summed over the plan's fused steps, not yet added to
            the telemetry table, and whether there are any (``Stepper._flush_times``).
        roots, starts: ``[B]`` each row's root token and committed length (:meth:`measure` from the rows, or the
            last fused commit's in place).
        fused: the steps commit in one native call (``Stepper._fusable``, set by ``Stepper._plan_of``).
        quick: a fused plan whose step leaves nothing to Python between its two native calls (the KV rows kept
            and the telemetry counts added in the commit, no stop strings): ``Stepper._step_quick`` runs it. tuner,
            cap: the engine's capacity tuner (None: the commit is quiet, ``step_context``'s ``set_quiet``) and
            otherwise the fixed capacity, read when the plan is made (``Stepper._plan_of``). clock: a quick
            plan's float64 ``[5]`` step clock its commits add to (``step_context``'s ``set_clock``); host: the
            ``host_ms`` dict its steps were given (or None), which ``Stepper._flush_times`` adds the clock to.
        advanced: the last step's native commit wrote the next ``roots``, ``starts``, ``limits`` and ``depth`` in
            place, so the next step need not :meth:`measure`. stale: the rows' own ``root``, ``committed_len`` and
            KV-cache length are behind the plan's (written back by :meth:`sync_rows`).
        pool, slots: the runner's ``KVCache`` and the rows' slots ``[B]``, where the native commit keeps the KV rows
            (a native plan, every row a slot of that cache, the cache on the CPU: ``KVCache.host_view``); else
            None (``Stepper._keep``).
        ctx: a native plan's ``drafters.native.step_context`` over its handles, roots, starts, depth, limits, EOS
            ids, telemetry rows, slots and the checkers' token lists (parsed once; :meth:`bind` gives it the current
            telemetry table and KV buffer), else None; propose, commit: its two calls as plain CPython functions
            (``fast_propose`` / ``fast_commit``). strings: some row has stop strings (checked in Python).
    """

    __slots__ = ("rows", "kind", "native", "handles", "caches", "checkers", "eos", "tids", "limits", "depth",
                 "greedy", "times", "timed", "pool", "slots", "advanced", "stale", "fused", "roots", "starts", "ctx",
                 "strings", "k", "want_probs", "propose", "commit", "quick", "tuner", "cap", "clock", "host",
                 "_caps", "_left", "_deepest", "_cap", "_table", "_kv")

    def __init__(self, rows: list[Any], runner: Any = None, telemetry: Optional[Telemetry] = None) -> None:
        b = len(rows)
        self.rows = list(rows)
        self.kind, self.native = drafting(rows)
        self.handles = ([n[0] for n in self.native], np.fromiter((n[1] for n in self.native), np.int64, b)) \
            if self.kind == "native" else None
        self.caches = [r.cache for r in rows]
        self.greedy = all(r.greedy for r in rows)
        self.k = max(r.k for r in rows)  # rows of several methods (method auto): the widest; a row reads its own
        self.want_probs = any(r.want_probs for r in rows)
        self.checkers = checkers = [r.stops for r in rows]
        self.times = [0.0, 0.0, 0.0]  # draft, verify and update ms per row summed over the plan's steps
        self.timed = False  # times holds steps not yet in the telemetry table (Stepper._flush_times)
        self._cap: tuple[int, Optional[np.ndarray]] = (0, None)
        self.pool = self.slots = self.ctx = self._table = self._kv = self.propose = self.commit = None
        self.advanced = self.stale = self.fused = self.strings = self.quick = False
        self.tuner, self.cap, self.clock, self.host = None, 1, None, None
        if self.kind == "root":  # AR: no draft depth, no native commit
            self.eos = self.tids = self.limits = self.depth = self._caps = self._left = self._deepest = None
            self.roots = self.starts = None
            return
        self.roots = np.zeros(b, dtype=np.int64)
        self.starts = np.zeros(b, dtype=np.int64)
        pool = getattr(runner, "kv_cache", None)
        if (self.kind == "native" and pool is not None and pool.host_view() is not None
                and all(getattr(c, "pool", None) is pool for c in self.caches)):
            self.pool = pool
            self.slots = np.fromiter((c.slot for c in self.caches), np.int64, b)
        first = checkers[0]
        if all(c.eos == first.eos for c in checkers):  # one model's rows: one EOS row repeated
            self.eos = first.eos_row if b == 1 else np.repeat(first.eos_row, b, axis=0)
        else:
            self.eos = eos_table([c.eos_row for c in checkers])
        self.tids = None if any(r.keep_steps for r in rows) else np.fromiter((r.tid for r in rows), np.int64, b)
        self.limits = np.empty((b, 3), dtype=np.int64)  # columns 0 and 1: measure
        self.limits[:, 2] = [c.limits()[2] for c in checkers]
        self.strings = any(c.stop for c in checkers)  # rows whose stop strings the fused commit leaves to Python
        self._caps = np.fromiter(chain.from_iterable((c.max_new_tokens, c.room) for c in self.checkers), np.int64,
                                 2 * b).reshape(b, 2)
        self._left = self.limits[:, :2]  # a view: measure writes the two columns in place
        self._deepest = self._caps.min(axis=1) - 1
        self.depth = np.zeros(b, dtype=np.int64)
        if self.kind == "native":
            tel = None
            if self.tids is not None and telemetry is not None:
                tel, self._table = (telemetry.table, telemetry.hist, self.tids), telemetry.table
            self.ctx = native_mod.step_context(self.handles[0], self.handles[1], self.roots, self.starts, self.depth,
                                               self.limits, self.eos, tel, self.slots,
                                               [None if c.stop else c.tokens for c in checkers])
            self.propose, self.commit = self.ctx.fast_propose, self.ctx.fast_commit

    def bind(self, telemetry: Telemetry) -> None:
        """Give the context the telemetry table and the KV buffer as they are now, where either was replaced
        since (a table grown for a new row, a cache grown or made fresh)."""
        if self._table is not None and telemetry.table is not self._table:
            self.ctx.set_telemetry((telemetry.table, telemetry.hist, self.tids))
            self._table = telemetry.table
        pool = self.pool
        if pool is not None and pool.kv is not self._kv:
            self.ctx.set_kv(pool.host_view())
            self._kv = pool.kv

    def capacities(self, cap: int) -> np.ndarray:
        """``[B]`` int64 filled with ``cap`` (the native propose's capacities), made again only when it changes."""
        if self._cap[0] != cap or self._cap[1] is None:
            self._cap = (cap, np.full(len(self.rows), cap, dtype=np.int64))
        return self._cap[1]

    def measure(self) -> None:
        """Refresh ``limits`` (tokens left under max_new_tokens and under the context) and ``depth`` from how many
        tokens each row has emitted. A numpy call costs a few µs on the caches a forward left cold (measured ~11 µs
        for these three at B = 1), so a few rows are written element by element and more rows with three calls
        whatever B. A row that steps has not finished, so it has at least one token left and ``depth`` >= 0
        (``StopChecker.remaining`` >= 1). Where fused commits advanced the plan past its rows (``stale``; a quick
        step that raised before its commit leaves it so, not advanced), the rows are brought up to the plan first."""
        if self.stale:
            self.sync_rows()
        b = len(self.checkers)
        if b <= FEW_ROWS:
            lim, depth, roots, starts = self.limits, self.depth, self.roots, self.starts
            for i, c in enumerate(self.checkers):
                n = len(c.tokens)
                lim[i, 0] = c.max_new_tokens - n
                lim[i, 1] = c.room - n
                depth[i] = min(c.max_new_tokens, c.room) - 1 - n
                r = self.rows[i]
                roots[i], starts[i] = r.root, r.committed_len
            return
        n = np.fromiter((len(c.tokens) for c in self.checkers), np.int64, b)
        np.subtract(self._caps, n[:, None], out=self._left)
        np.subtract(self._deepest, n, out=self.depth)
        self.roots[:] = np.fromiter((r.root for r in self.rows), np.int64, b)
        self.starts[:] = np.fromiter((r.committed_len for r in self.rows), np.int64, b)

    def sync_rows(self) -> None:
        """Write the plan's ``roots`` and ``starts`` back into its rows (``root``, ``committed_len`` and the KV
        cache's ``length``) where fused commits advanced them in place (``stale``): before the plan is dropped, so
        the rows' own fields are right for the next plan and anything else that reads them."""
        if not self.stale:
            return
        self.stale = False
        roots, starts = self.roots.tolist(), self.starts.tolist()
        for i, r in enumerate(self.rows):
            r.root, r.committed_len = roots[i], starts[i]
            r.cache.length = starts[i]


def drafting(rows: list[Any]) -> tuple[str, list]:
    """How a step's rows draft, decided once per step: ``root`` (AR: the root alone, nothing to learn),
    ``native`` (one call of the native draft core for all rows; with each row's (state, row handle)),
    ``mixed`` (some rows native, the others AR or another drafter: method auto's candidates in one forward; the
    native rows in one call, with each row's (state, row handle) or None) or ``python`` (each drafter's own
    ``propose`` / ``update``)."""
    if all(r.root_only for r in rows):
        return "root", []
    native = [r.native for r in rows]
    n = sum(1 for x in native if x is not None)
    if n == len(rows):
        return "native", native
    return ("mixed", native) if n else ("python", [])


def eos_table(rows: list[np.ndarray]) -> np.ndarray:
    """Each row's EOS ids (``StopChecker.eos_row``, ``[1, E_i]``) as one ``[B, E]`` int64 table, padded with -1
    (``commit_greedy_batch``'s ``eos``)."""
    if len(rows) == 1:
        return rows[0]
    width = max(x.shape[1] for x in rows)
    if all(x.shape[1] == width for x in rows):
        return np.concatenate(rows)
    table = np.full((len(rows), width), -1, dtype=np.int64)
    for i, x in enumerate(rows):
        table[i, : x.shape[1]] = x[0]
    return table
