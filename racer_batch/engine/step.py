"""The batched decode step: one step of every stream of an engine, each part one call over all streams.

A stream (``Engine.stream``) keeps its per-row state in a ``DecodeRow`` and yields a ``Decode`` request per
step; ``StreamBatch`` hands every pending ``Decode`` of one engine to ``Stepper.step`` at once, and ``drive``
hands a lone stream's the same way (B = 1 is the same code). One step of B rows is:

1. **propose**: every row's draft tree, as one flat batch (``tree.FlatTrees``: each tree breadth-first, ``cu``
   row offsets). RACER and its ablations on the native draft core: one call for all rows
   (``drafters.native.propose_batch``'s contract, through the plan's step context); AR: the roots alone, no
   call; any other drafter: its own ``propose`` per row, flattened here.
2. **forward**: one ``runner.verify_flat`` over all trees (each over its own KV-cache slot).
3. **accept**: greedy rows together (``greedy_paths``: vectorised over the concatenated trees, each row's
   longest path whose every token is its parent's argmax); sampled rows each with its own seeded generator
   (one draw per emitted token, so a row's output does not depend on its batch-mates); relaxed acceptance
   per row as before.
4. **stops**: each row's block (accepted tokens + bonus) through its ``StopChecker``; text is decoded only
   for rows with stop strings.
5. **keep_rows**: one ``runner.keep_rows_batch`` call keeps every row's accepted KV rows.
6. **update**: the native draft core learns from every row in one call (``update_batch``); other drafters
   per row.
7. **telemetry**: per-row counters in one table (``Telemetry``: a row of numbers per stream, added to with
   one vectorised call per step), the capacity tuner observes the step once (``CapacityTuner.observe_batch``).

A step whose rows are all native and greedy (lossless) runs 3, 4, 6, the counts of 7 and, on the CPU's KV cache,
5 as one native call (``Stepper._commit_native``, through the plan's ``drafters.native.step_context``; its host
time is ``accept``, the checkers' bookkeeping ``stops``); ``Stepper.fused = False`` keeps the per-part path, its
oracle in tests. Native rows propose and commit through that context, which holds every argument that stays the
same while the same rows step (``StepPlan``).

The host time of each part is added to ``host_ms`` (part name -> ms; ``HOST_PARTS``), which a ``StreamBatch``
keeps in ``BatchStats.host_ms`` (benchmarks/host.py reports it per stream-step); the argmax / top-k pass over
the logits is timed there too, as ``SCORES_PART``, apart from the host parts (device work on a GPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from ..drafters import native as native_mod
from ..drafters.base import Verified
from ..values import SOURCE_LOGITS, SOURCE_RETRIEVAL
from .kernels import fused_argmax_topk
from .sampling import processed_probs
from .step_plan import FEW_ROWS, StepPlan
from .telemetry import TEL_FIELDS, Telemetry, keep_records
from .tree import FlatTrees, accept_relaxed, accept_sampling, breadth_first

HOST_PARTS = ("propose", "flatten", "accept", "stops", "keep_rows", "update", "telemetry")
# the argmax and top-k over the vocabulary of every row: timed beside the host parts (``host_ms[SCORES_PART]``)
# but not one of them: on a GPU it runs on the device over the logits the forward left there
SCORES_PART = "scores"


@dataclass(eq=False)
class DecodeRow:
    """One stream's decoding state between steps (the engine's ``_decode`` owns it).

    Attributes:
        drafter: the row's drafter (its ``native`` attribute, when set, is ``(NativeDraftState, row handle)``).
        cache: the row's KV-cache handle. committed_len: positions in it (prompt + kept tokens).
        root: the last emitted token, not yet in the KV cache (the next tree's root). While a fused plan steps the
            row, these two and the cache's length are the plan's (``StepPlan.roots`` / ``starts``), written back when
            the plan ends (``StepPlan.sync_rows``).
        stops: the row's ``StopChecker``; done/finish once it ended.
        gen: the row's seeded generator (sampling). k: top-k ids its drafter learns from (0: none).
        keep_steps: keep one StepRecord per step (``records``) besides the counters.
        native, root_only, greedy: the drafter's ``(NativeDraftState, row handle)`` or None, whether it drafts
            the root alone (AR) and whether the row is greedy; set by ``Stepper.open`` (none of them changes while
            the row decodes), so a step reads them without an attribute lookup through the drafter.
    """

    drafter: Any
    cache: Any
    stops: Any
    params: Any
    gen: Any
    committed_len: int
    root: int
    k: int = 0
    want_probs: bool = False
    keep_steps: bool = False
    done: bool = False
    finish: Optional[str] = None
    tid: int = -1
    records: list = field(default_factory=list)
    native: Any = None
    root_only: bool = False
    greedy: bool = True


def greedy_paths(flat: FlatTrees, choices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Greedy acceptance of every tree of a flat batch at once (docs/method.md 4: the longest path whose every
    drafted token equals the target's argmax at its parent).

    A trie node has at most one child per token, so the nodes whose whole ancestry matches form one chain per
    tree: the accepted path. Computed level by level (depth 1, 2, ...) over all trees together.

    Args:
        flat: the trees (``parents`` local, each tree breadth-first).
        choices: ``[R]`` argmax token of every row's logits.
    Returns:
        ``(nodes, cu_paths, bonus, rows)``: ``nodes`` the accepted paths' local node indices (root first) of
        all trees concatenated, ``cu_paths [B + 1]`` their offsets, ``bonus [B]`` each tree's bonus token (the
        argmax at its path's last node) and ``rows`` the global row of every entry of ``nodes``.
    """
    sizes = np.diff(flat.cu)
    base = np.repeat(flat.cu[:-1], sizes)
    parents = flat.parents
    ok = parents < 0  # roots
    maxd = int(flat.depths.max()) if flat.rows else 0
    if maxd:
        gpar = np.where(ok, 0, parents + base)
        match = flat.tokens == choices[gpar]
        for d in range(1, maxd + 1):
            idx = np.flatnonzero(flat.depths == d)
            ok[idx] = match[idx] & ok[gpar[idx]]
    rows = np.flatnonzero(ok)
    counts = np.add.reduceat(ok.astype(np.int64), flat.cu[:-1])
    cu_paths = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu_paths[1:])
    bonus = choices[rows[cu_paths[1:] - 1]]
    return rows - base[rows], cu_paths, bonus, rows


def flat_of_drafts(drafts: list, starts: np.ndarray, caches: list) -> tuple[FlatTrees, np.ndarray, np.ndarray]:
    """Draft trees (creation order) as one flat batch, each breadth-first as ``tree.flatten_tree`` orders it.

    Returns:
        ``(flat, sources [R], order [R])``: ``order`` the creation index of every row within its tree.
    """
    toks, pars, deps, srcs, ords, sizes = [], [], [], [], [], []
    for d in drafts:
        order, parents, depths = breadth_first(d.parents)
        pars.append(parents)
        deps.append(depths)
        toks.append(np.asarray(d.token_ids, dtype=np.int64)[order])
        srcs.append(np.asarray(d.sources, dtype=np.int64)[order])
        ords.append(order)
        sizes.append(len(d))
    cu = np.zeros(len(drafts) + 1, dtype=np.int64)
    np.cumsum(sizes, out=cu[1:])
    flat = FlatTrees(np.concatenate(toks), np.concatenate(pars), np.concatenate(deps), cu, starts, caches)
    return flat, np.concatenate(srcs), np.concatenate(ords)


class _Children:
    """``tree.children`` of one tree of a flat batch, for the per-row acceptance rules."""

    def __init__(self, tokens: np.ndarray, parents: np.ndarray) -> None:
        self.children: list[dict[int, int]] = [{} for _ in range(len(tokens))]
        for i in range(1, len(tokens)):
            self.children[int(parents[i])][int(tokens[i])] = i


def argmax_and_topk(logits: torch.Tensor, k: int, ops: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """``kernels.fused_argmax_topk`` as numpy ``(argmax [R], top-k ids [R, k])``, or None where it does not
    apply (a runner without our kernels: the caller then uses torch's two ops)."""
    fused = fused_argmax_topk(logits, k, ops)
    return None if fused is None else (fused[0].numpy(), fused[1].numpy())


class Stepper:
    """Runs the batched decode step for one engine (module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.runner = engine.runner
        self.config = engine.config
        self.telemetry = Telemetry()
        self._ops = getattr(self.runner, "_ops", None)
        self.committing = False  # the running step has begun committing tokens (no retry past this point)
        self.last_flat: Optional[FlatTrees] = None  # the last step's trees (last_cu, last_starts)
        self.last_rows = 0  # tree rows of the last step's forward
        self.last_ended = False  # some row of the last step ended (a stop rule, or the step failed)
        self._native_accept: Any = None  # drafters.native.accept_greedy_batch, False where unavailable
        # greedy steps of native rows commit in one native call (_commit_native); False: the per-part path
        # (acceptance, stops, update apart), kept as its oracle in tests
        self.fused = True
        # host ms of the last step that belong to one row alone ([B]: its drafter's own propose and update; a
        # native call over several rows split evenly among them), where some row drafts in Python (kinds mixed
        # and python); None after a step of native or root-only rows (every row's host work alike). StreamBatch
        # charges each row its own part before splitting the rest of the step (batch.row_charges)
        self.last_own_ms: Optional[list[float]] = None
        self._plan: Optional[StepPlan] = None  # what the last step read of its rows that stays while they decode

    # ---- row lifecycle
    def open(self, row: DecodeRow) -> None:
        """A row starts decoding (after its prefill and ``drafter.start``): its telemetry row, and what the steps
        read of its drafter and params (``DecodeRow.native``, ``root_only``, ``greedy``)."""
        row.tid = self.telemetry.open()
        row.native = getattr(row.drafter, "native", None)
        row.root_only = bool(getattr(row.drafter, "root_only", False))
        row.greedy = bool(row.params.greedy)

    def close(self, row: DecodeRow, stats: Any) -> None:
        """Move the row's counters into ``stats`` (a ``RowStats``; StepRecords too when kept). The step plan goes
        too (its times added first): the next step's rows differ, and it holds the rows' drafters and caches."""
        self._flush_times()
        if self._plan is not None:
            self._plan.sync_rows()
        self._plan = None
        if row.tid >= 0:
            self.telemetry.close(row.tid, stats)
            row.tid = -1
        stats.step_records.extend(row.records)

    # ---- the step
    def step(self, rows: list[DecodeRow], host_ms: Optional[dict] = None) -> float:
        """One decode step of every row in ``rows`` (rows of this engine, none done). Returns the forward's
        milliseconds. ``host_ms``: part name -> ms, added to (a quick plan's steps when the plan ends or a row
        closes: ``_flush_times``)."""
        t0 = time.perf_counter()
        plan = self._plan
        if plan is not None and plan.quick and plan.advanced and plan.host is host_ms and plan.rows == rows:
            plan.advanced = False  # _plan_of's common case: the last step's commit advanced the plan
            return self._step_quick(plan, t0)
        host = host_ms if host_ms is not None else {}
        if len(host) <= len(HOST_PARTS):  # every part named from the first step on (a fused step skips some)
            for part in (*HOST_PARTS, SCORES_PART):
                host.setdefault(part, 0.0)
        plan = self._plan_of(rows)
        if plan.quick:
            if plan.host is not host_ms:  # its times so far go where they were asked for
                self._flush_times()
                plan.host = host_ms
            return self._step_quick(plan, t0)
        clock = _Clock(host, t0)
        self.committing = False
        self.last_ended = True  # until the step says otherwise (a step that raises: its rows are settled)
        cap = self.engine._capacity(self.engine._in_flight)
        kind, native, handles = plan.kind, plan.native, plan.handles
        own = [0.0] * len(rows) if kind in ("mixed", "python") else None
        self.last_own_ms = own
        flat, sources, order = self._propose(rows, cap, clock, plan, own)
        clock.lap("flatten")
        self.last_flat = flat
        self.last_rows = flat.rows
        t0 = time.perf_counter()
        logits = self.runner.verify_flat(flat)  # [R, V]
        t1 = time.perf_counter()
        # the argmax / top-k over the vocabulary reads the logits where they are: device work on a GPU (counted
        # with the forward in the rows' verify time), kept apart from the host parts as SCORES_PART
        choices, topk, probs = self._scores(plan, logits)
        t2 = time.perf_counter()
        forward_ms = (t2 - t0) * 1000.0
        host[SCORES_PART] = host.get(SCORES_PART, 0.0) + (t2 - t1) * 1000.0
        clock.skip()
        commit = counted = None
        if plan.fused:
            nodes, cu_paths, emitted, commit, counted = self._commit_native(
                rows, flat, sources, order, choices, topk, clock, plan)
        else:
            nodes, cu_paths, bonus = self._accept(rows, flat, logits, choices)
            clock.lap("accept")
            self.committing = True
            blocks, emitted = self._stops(rows, flat, nodes, cu_paths, bonus)
            clock.lap("stops")
        # a fused step knows whether a row ended (stop strings aside): else the batch asks every row (Decode.settle)
        self.last_ended = commit is None or bool(commit.ended) or plan.strings
        if commit is None or plan.pool is None:  # else the native commit kept the rows (and advanced the plan)
            self._keep(rows, flat, nodes, cu_paths, None if commit is None else commit.moved)
        clock.lap("keep_rows")
        if commit is None:
            self._update(rows, flat, topk, probs, nodes, cu_paths, blocks, emitted, kind, native, own, handles)
            clock.lap("update")
        self._observe(rows, flat, sources, order, cap, nodes, cu_paths, emitted, forward_ms, clock, commit, counted)
        clock.lap("telemetry")
        return forward_ms

    @property
    def last_cu(self) -> Optional[np.ndarray]:
        """``[B + 1]`` the last step's tree row offsets (its trees' sizes)."""
        return None if self.last_flat is None else self.last_flat.cu

    @property
    def last_starts(self) -> Optional[np.ndarray]:
        """``[B]`` the last step's committed lengths (its trees' contexts)."""
        return None if self.last_flat is None else self.last_flat.starts

    def _step_quick(self, plan: "StepPlan", t0: float) -> float:
        """``step`` of a quick plan (``StepPlan.quick``: native, greedy, the KV rows and telemetry counts kept in
        the commit, no stop strings): the plan's propose, the forward, the scores and the plan's commit, which
        also adds the step's times to the plan's clock (``StepPlan.clock``: host parts ``propose`` from ``t0``,
        ``scores`` and ``accept``, the commit itself; added to ``host_ms`` and the rows' telemetry by
        ``_flush_times``), and only what the batch needs around them. After a forward each Python attribute or
        call touched costs a cache miss: the general path's glue around the same calls cost ~60 µs per step at
        B = 1 on SmolLM2-135M. Returns the forward's ms, as ``step``."""
        self.committing = False
        self.last_ended = True
        self.last_own_ms = None
        tuner = plan.tuner
        engine = self.engine
        cap = plan.cap if tuner is None else engine._capacity(engine._in_flight)
        starts = plan.starts
        if engine.step_cost:  # read after the commit advanced them (batch._shares): this step's own copy
            starts = starts.copy()
        cu, tokens, parents, depths, _, _ = plan.propose(plan.capacities(cap))  # a quiet context: no sources, order
        flat = self.last_flat = FlatTrees(tokens, parents, depths, cu, starts, plan.caches)
        self.last_rows = len(tokens)
        t1 = time.perf_counter()
        logits = self.runner.verify_flat(flat)  # [R, V]
        t2 = time.perf_counter()
        choices, topk, _ = self._scores(plan, logits)
        t3 = time.perf_counter()
        plan.bind(self.telemetry)
        self.committing = True  # the call below updates the drafters: no retry past it
        c = plan.commit(choices, topk, t0, t1, t2, t3)  # None: every row goes on (a quiet context: no tuner)
        plan.advanced = plan.stale = True
        self.last_ended = False
        if c is not None:
            if c.ended:
                self.last_ended = True
                self._end_rows(plan.rows, c.finish)
            if tuner is not None:
                b = len(plan.rows)
                tuner.observe_batch(used_capacity=cap, accepted_creation_idx=c.created, streams=b,
                                    overhead_ms=(t1 - t0 + time.perf_counter() - t3) * 1000.0 / b)
        return (t3 - t1) * 1000.0

    @staticmethod
    def _end_rows(rows: list[DecodeRow], finish: np.ndarray) -> None:
        """Rows a fused commit ended by id (``finish [B]`` > 0, ``Commit.finish``): their checkers' finish reason
        and the rows done (their tokens are already on the checkers' lists)."""
        for i, f in enumerate(finish.tolist()):
            if f > 0:
                r = rows[i]
                r.stops.end_checked(native_mod.FINISH_OF_CODE[f])
                r.done, r.finish = True, r.stops.finish

    def _plan_of(self, rows: list[DecodeRow]) -> "StepPlan":
        """The step's ``StepPlan``: the last step's where ``rows`` are the same rows in the same order (the common case
        between two joins or finishes of continuous batching), else a new one."""
        plan = self._plan
        if plan is None or plan.rows != rows:  # DecodeRow compares by identity (eq=False)
            self._flush_times()
            if plan is not None:
                plan.sync_rows()
            plan = self._plan = StepPlan(rows, self.runner, self.telemetry)
            plan.fused = self._fusable(plan)
            plan.quick = (plan.fused and plan.pool is not None and not plan.strings and plan.tids is not None
                          and plan.k > 0)
            if plan.quick:
                plan.tuner = self.engine.tuner
                plan.cap = self.engine._capacity(1)
                plan.ctx.set_quiet(plan.tuner is None)
                plan.clock = np.zeros(5)
                plan.ctx.set_clock(plan.clock)
        if plan.kind != "root":  # AR's steps read none of roots, starts, limits and depths from the plan
            if plan.advanced:  # the last step's native commit left them as they are now
                plan.advanced = False
            else:
                plan.measure()
        return plan

    def _flush_times(self) -> None:
        """Add the current plan's summed step times to its rows' telemetry (``StepPlan.times``): before the plan is
        replaced and before any row closes, so a row's table entry is whole when it is read and no freed row is
        written."""
        plan = self._plan
        if plan is None:
            return
        acc = plan.clock
        if acc is not None and acc[3]:  # a quick plan's steps, summed in its commits
            b = len(plan.rows)
            t = plan.times
            t[0] += float(acc[0]) / b
            t[1] += float(acc[4]) / b
            t[2] += float(acc[2]) / b
            plan.timed = True
            if plan.host is not None:
                for part, i in (("propose", 0), (SCORES_PART, 1), ("accept", 2)):
                    plan.host[part] = plan.host.get(part, 0.0) + float(acc[i])
            acc[:] = 0.0
        if plan.timed:
            self.telemetry.add_times(plan.tids, (plan.times[0], plan.times[1], plan.times[2]))
            plan.times, plan.timed = [0.0, 0.0, 0.0], False

    def _fusable(self, plan: "StepPlan") -> bool:
        """Whether the steps of a plan commit in one native call (``_commit_native``): every row on the native draft
        core, greedy and lossless (sampled and relaxed rows draw per row), and the fused commit not turned off;
        decided once per plan (``StepPlan.fused``)."""
        if plan.kind != "native" or not plan.greedy or not self.fused or self.config.acceptance != "lossless":
            return False
        return bool(self._native_accept_fn())

    def _native_accept_fn(self) -> Any:
        """``drafters.native.accept_greedy_batch`` where the native core built, else False (decided once)."""
        if self._native_accept is None:
            self._native_accept = native_mod.accept_greedy_batch if native_mod.available() else False
        return self._native_accept

    def _commit_native(self, rows, flat, sources, order, choices, topk, clock, plan):
        """Acceptance, stop checks by token id, the telemetry's source counts, the drafters' update and, on the
        CPU's KV cache (``StepPlan.pool``), keeping the accepted KV rows of every row in one call of the plan's
        step context (``drafters.native.commit_greedy_batch``'s contract; host parts: that call is ``accept``; the
        checkers' bookkeeping ``stops``; rows with stop strings go through their ``StopChecker.push_many``, and
        then every row's update is one ``update_batch``, ``update``). Returns ``(nodes, cu_paths,
        emitted, commit, counted)``; ``commit.counts`` is None where a stop string cut a block (``_observe`` counts
        those); ``counted``: the rows' telemetry ids where the call added the step's counts to the table (every
        row checked by id and none keeping StepRecords), else None."""
        b = len(rows)
        if topk is None:
            topk = np.zeros((flat.rows, 1), dtype=np.int64)
        # the telemetry table's counts are added in the call (where it updates), unless a row keeps StepRecords;
        # on the CPU the call keeps every row's accepted KV rows too. The call also writes each row's next root,
        # committed length, depth and limits into the plan (the rows' own fields are written back when the plan
        # ends, StepPlan.sync_rows), unless a stop string cuts a block below: that row is then done, and the next
        # step's rows make a new plan
        plan.bind(self.telemetry)
        self.committing = True  # the call below updates the drafters: no retry past it
        # it appends each checked row's emitted tokens to its checker's list (StepPlan.ctx)
        c = plan.commit(choices, topk)  # a Commit, over the trees its propose made
        plan.advanced = plan.stale = True
        clock.lap("accept")
        if not c.ended and not plan.strings:  # every row goes on, its tokens already on its checker's list
            clock.lap("stops")
            return c.nodes, c.cu_paths, c.emitted, c, (plan.tids if c.updated else None)
        flat_blocks, cu, emitted_l, fin = c.blocks.tolist(), c.cu_paths.tolist(), c.emitted.tolist(), c.finish.tolist()
        blocks: list[list[int]] = []
        cut = False
        for i, r in enumerate(rows):
            block = flat_blocks[cu[i]: cu[i + 1]]
            if fin[i] < 0:  # stop strings: the row's own checker decodes text
                n = r.stops.push_many(block)
                cut = cut or n != len(block)
                emitted_l[i] = n
                if r.stops.finish is not None:
                    r.done, r.finish = True, r.stops.finish
            blocks.append(block)
        self._end_rows(rows, c.finish)  # those checked by id that ended (their tokens are on their checkers' lists)
        emitted = np.asarray(emitted_l, dtype=np.int64) if plan.strings else c.emitted  # a stop string may cut
        clock.lap("stops")
        if not c.updated:
            _update_native(plan.native, flat, topk, [blocks[i][: emitted_l[i]] for i in range(b)], plan.handles)
        clock.lap("update")  # ~0 where the call above updated every row (that time is in ``accept``)
        if cut:
            c = c._replace(counts=None)
        return c.nodes, c.cu_paths, emitted, c, (plan.tids if c.updated else None)

    def _propose(self, rows: list[DecodeRow], cap: int, clock: "_Clock", plan: "StepPlan",
                 own: Optional[list[float]] = None) -> tuple[FlatTrees, np.ndarray, np.ndarray]:
        """Every row's draft tree as one flat batch (host time: ``propose``, then ``flatten`` where a drafter's
        own trees are flattened here), with each row's ``sources`` and creation ``order``; ``plan`` is the step's
        ``StepPlan`` (how the rows draft, their handles and draft depths)."""
        b = len(rows)
        kind = plan.kind
        caches = plan.caches
        if kind == "root":  # AR: the rows' own fields (an AR plan keeps no arrays)
            if b <= FEW_ROWS:  # a list and one array: cheaper than fromiter over a generator for a few rows
                starts = np.array([r.committed_len for r in rows], dtype=np.int64)
                roots = np.array([r.root for r in rows], dtype=np.int64)
            else:
                starts = np.fromiter((r.committed_len for r in rows), np.int64, b)
                roots = np.fromiter((r.root for r in rows), np.int64, b)
            zeros = np.zeros(b, dtype=np.int64)
            flat = FlatTrees(roots, zeros - 1, zeros, np.arange(b + 1, dtype=np.int64), starts, caches)
            clock.lap("propose")
            return flat, zeros, zeros
        depth, roots, starts = plan.depth, plan.roots, plan.starts
        # a fused plan's starts advance in place in the commit: where this step's are read after it (the KV keep
        # off the CPU, Stepper._keep; method auto's step_shares contexts, last_starts) the trees get a copy
        if plan.fused and (plan.pool is None or self.engine.step_cost):
            starts = starts.copy()
        if kind == "native":  # the plan's context reads its roots and depths (propose_batch's tuple)
            cu, tokens, parents, depths, sources, order = plan.propose(plan.capacities(cap))
            flat = FlatTrees(tokens, parents, depths, cu, starts, caches)
            clock.lap("propose")
            return flat, sources, order
        if kind == "mixed":  # rows of several methods in one forward: the native rows in one call, the rest each
            drafts = _mixed_drafts(rows, plan.native, roots, cap, depth, own)
        else:
            drafts = []
            for i, r in enumerate(rows):
                t0 = time.perf_counter()
                drafts.append(r.drafter.propose(int(roots[i]), capacity=cap, max_depth=int(depth[i])))
                _split_own(own, [i], t0)
        clock.lap("propose")
        return flat_of_drafts(drafts, starts, caches)

    def _scores(self, plan: "StepPlan", logits: torch.Tensor) -> tuple[np.ndarray, Optional[np.ndarray], Any]:
        """``(argmax [R], top-k ids [R, k] or None, top-k probabilities [R, k] or None)`` of every row of the
        plan (``StepPlan.k``, ``want_probs``)."""
        k, want_probs = plan.k, plan.want_probs
        if not want_probs:
            fused = argmax_and_topk(logits, max(k, 1), self._ops)
            if fused is not None:
                return fused[0], (fused[1] if k else None), None
        choices = logits.argmax(dim=-1).cpu().numpy()
        if not k:
            return choices, None, None
        top = torch.topk(logits, k, dim=-1)
        probs = None
        if want_probs:  # only drafters that keep probabilities beside the ids (graft) pay for the softmax
            logz = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
            probs = torch.exp(top.values.float() - logz).cpu().numpy()
        return choices, top.indices.cpu().numpy(), probs

    def _accept(self, rows: list[DecodeRow], flat: FlatTrees, logits: torch.Tensor, choices: np.ndarray):
        """Every row's accepted path (local nodes, concatenated, ``cu_paths``) and bonus token."""
        nodes, cu_paths, bonus = self._greedy(flat, choices)
        lossless = self.config.acceptance == "lossless"
        if lossless and all(r.greedy for r in rows):
            return nodes, cu_paths, bonus
        paths = [nodes[cu_paths[i]: cu_paths[i + 1]] for i in range(len(rows))]
        bonus = bonus.copy()
        for i, r in enumerate(rows):
            if lossless and r.greedy:
                continue
            lo, hi = int(flat.cu[i]), int(flat.cu[i + 1])
            tree = _Children(flat.tokens[lo:hi], flat.parents[lo:hi])
            row_logits = logits[lo:hi]
            if not lossless:
                path, bonus[i] = accept_relaxed(tree, row_logits, config=self.config, params=r.params, generator=r.gen)
            else:
                path, bonus[i] = accept_sampling(
                    tree, lambda n, lg=row_logits, p=r.params: processed_probs(lg[n], p), r.gen)
            paths[i] = np.asarray(path, dtype=np.int64)
        cu_paths = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in paths], out=cu_paths[1:])
        return np.concatenate(paths), cu_paths, bonus

    def _greedy(self, flat: FlatTrees, choices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Greedy paths of every tree: AR's roots at once; trees on the native core's ``accept_greedy_batch``
        where it built (one call), else ``greedy_paths``."""
        b = flat.num_streams
        if flat.rows == b:  # every tree is its root alone
            return np.zeros(b, dtype=np.int64), np.arange(b + 1, dtype=np.int64), choices.astype(np.int64, copy=False)
        accept = self._native_accept_fn()
        if accept:
            return accept(flat.cu, flat.parents, flat.tokens, np.asarray(choices, dtype=np.int64))
        return greedy_paths(flat, choices)[:3]

    @staticmethod
    def _stops(rows, flat, nodes, cu_paths, bonus) -> tuple[list[list[int]], np.ndarray]:
        """Each row's block (accepted draft tokens, then the bonus) through its stop rules; returns the blocks
        and how many of each were emitted."""
        bonus_l = bonus.tolist()
        roots_only = len(nodes) == len(rows)  # no draft node accepted anywhere: each block is the bonus alone
        if not roots_only:
            drafted = flat.tokens[nodes + np.repeat(flat.cu[:-1], np.diff(cu_paths))].tolist()
            cu = cu_paths.tolist()
        blocks: list[list[int]] = []
        emitted = np.zeros(len(rows), dtype=np.int64)
        for i, r in enumerate(rows):
            block = [] if roots_only else drafted[cu[i] + 1: cu[i + 1]]
            block.append(bonus_l[i])
            n = r.stops.push_many(block)
            if r.stops.finish is not None:
                r.done, r.finish = True, r.stops.finish
            emitted[i] = n
            blocks.append(block)
        return blocks, emitted

    def _keep(self, rows, flat, nodes, cu_paths, moved: Optional[np.ndarray] = None) -> None:
        """Keep the accepted path's KV rows of every row that goes on; advance its committed length.
        ``moved``: a native commit's ``[M, 3]`` rows to move (``Commit.moved``), used where every row goes on."""
        cu = cu_paths.tolist()  # one numpy call (slicing and subtracting cost three, each µs on cold caches)
        lengths = [cu[i + 1] - cu[i] for i in range(len(rows))]
        if not any(r.done for r in rows):
            self.runner.keep_rows_batch(flat.caches, flat.starts, nodes, cu_paths, moved=moved)
            for r, n in zip(rows, lengths):
                r.committed_len += n
            return
        live = [i for i, r in enumerate(rows) if not r.done]
        if not live:
            return
        keep_nodes = np.concatenate([nodes[cu_paths[i]: cu_paths[i + 1]] for i in live])
        keep_cu = np.zeros(len(live) + 1, dtype=np.int64)
        np.cumsum([lengths[i] for i in live], out=keep_cu[1:])
        self.runner.keep_rows_batch([rows[i].cache for i in live], flat.starts[live], keep_nodes, keep_cu)
        for i in live:
            rows[i].committed_len += lengths[i]

    @staticmethod
    def _update(rows, flat, topk, probs, nodes, cu_paths, blocks, emitted, kind: str, native: list,
                own: Optional[list[float]] = None, handles: Optional[tuple] = None) -> None:
        """The drafters learn from the step: every verified node's top-k and the committed tokens."""
        for i, r in enumerate(rows):
            r.root = blocks[i][-1]
        if kind == "root":
            return
        if topk is None:
            topk = np.zeros((flat.rows, 1), dtype=np.int64)
        committed = [blocks[i][: int(emitted[i])] for i in range(len(rows))]
        if kind == "native":
            _update_native(native, flat, topk, committed, handles)
            return
        if kind == "mixed":
            nat = [i for i, n in enumerate(native) if n is not None]
            t0 = time.perf_counter()
            _update_native([native[i] for i in nat], flat.subset(nat), topk[flat.rows_of(nat)],
                           [committed[i] for i in nat])
            _split_own(own, nat, t0)
        for i, r in enumerate(rows):
            if kind == "mixed" and (native[i] is not None or r.root_only):
                continue
            t0 = time.perf_counter()
            lo, hi = int(flat.cu[i]), int(flat.cu[i + 1])
            r.drafter.update(Verified(
                flat.tokens[lo:hi], topk[lo:hi], committed[i],
                node_topk_probs=None if probs is None else probs[lo:hi],
                last_node=int(nodes[cu_paths[i + 1] - 1]),
            ))
            _split_own(own, [i], t0)

    def _observe(self, rows, flat, sources, order, cap, nodes, cu_paths, emitted, forward_ms, clock,
                 commit=None, counted: Optional[np.ndarray] = None) -> None:
        """Telemetry of the step for every row (one table update) and one capacity-tuner observation
        (``commit``: a native commit's source counts and created indices, where it made them; ``counted``: the
        rows' telemetry ids where that call already added the step's counts, leaving the three times here)."""
        b = len(rows)
        host = clock.since_start_ms()
        propose = clock.propose_ms
        if counted is not None:  # the plan's tids: the same three times go to every row of the plan, summed
            # here and added to the table once per plan (_flush_times; a table update per step cost ~10 µs at
            # B = 1 after a cold forward)
            plan = self._plan
            t = plan.times
            t[0] += propose / b
            t[1] += forward_ms / b
            t[2] += (host - propose) / b
            plan.timed = True
        else:
            self._count(rows, flat, sources, nodes, cu_paths, emitted, commit, (propose, forward_ms, host))
        tuner = self.engine.tuner
        if tuner is not None:
            if commit is not None:
                created, drafting = commit.created, b
            else:
                created = order[(nodes + np.repeat(flat.cu[:-1], cu_paths[1:] - cu_paths[:-1]))[nodes > 0]]
                # rows that draft (a mixed step's AR rows would count as trees that accepted nothing)
                drafting = b - sum(1 for r in rows if r.root_only)
            if drafting:
                tuner.observe_batch(used_capacity=cap, accepted_creation_idx=created, streams=drafting,
                                    overhead_ms=host / b)

    def _count(self, rows, flat, sources, nodes, cu_paths, emitted, commit, times) -> None:
        """The step's counters of every row as one ``[B, len(TEL_FIELDS)]`` block added to the table (and each
        keeping row's StepRecord); ``times``: (propose, forward, host) ms of the step."""
        b = len(rows)
        propose, forward_ms, host = times
        if len(nodes) == b and not any(r.keep_steps for r in rows):  # no draft node taken anywhere (AR's steps)
            self.telemetry.add_roots([r.tid for r in rows], emitted.tolist(), (flat.cu[1:] - flat.cu[:-1]).tolist(),
                                     (propose / b, forward_ms / b, (host - propose) / b))
            return
        plen = cu_paths[1:] - cu_paths[:-1]
        accepted = np.minimum(plen - 1, emitted)  # accepted draft nodes (a stop inside the block cuts them too)
        vals = np.zeros((b, len(TEL_FIELDS)))
        vals[:, 0] = 1.0
        vals[:, 1] = emitted
        vals[:, 2] = accepted
        if len(nodes) > b:  # some tree had an accepted draft node: count them by source
            counts = None if commit is None else commit.counts
            if counts is None:
                counts = _accepted_by_source(flat, sources, nodes, cu_paths, plen, accepted)
            vals[:, 3:7] = counts
        vals[:, 7] = flat.cu[1:] - flat.cu[:-1]
        vals[:, 8] = propose / b
        vals[:, 9] = forward_ms / b
        vals[:, 10] = (host - propose) / b
        self.telemetry.add(np.fromiter((r.tid for r in rows), np.int64, b), vals, accepted)
        if any(r.keep_steps for r in rows):
            keep_records(rows, vals)


def _accepted_by_source(flat, sources, nodes, cu_paths, plen, accepted) -> np.ndarray:
    """``[B, 4]`` accepted draft nodes per row by source (retrieval, logits, both, other), counting only the
    nodes within each row's emitted tokens."""
    b = len(plen)
    owner = np.repeat(np.arange(b), plen)
    place = np.arange(len(nodes)) - np.repeat(cu_paths[:-1], plen)  # 0 at each root
    counted = (place > 0) & (place <= accepted[owner])
    src = sources[(nodes + flat.cu[:-1][owner])[counted]]
    # source flags -> column: retrieval alone 0, logits alone 1, both 2, neither (other drafters' nodes) 3; a
    # retrieval or logits flag together with another drafter's flag 4 (counted in none, as before)
    rl = src & (SOURCE_RETRIEVAL | SOURCE_LOGITS)
    col = np.where(rl == 0, 3, np.where(src == rl, rl - 1, 4))
    return np.bincount(owner[counted] * 5 + col, minlength=5 * b).reshape(b, 5)[:, :4]


def _split_own(own: Optional[list[float]], rows: list[int], t0: float) -> None:
    """Add the ms since ``t0`` to ``own`` (a mixed step's per-row host ms), split evenly among ``rows``."""
    if own is not None and rows:
        ms = (time.perf_counter() - t0) * 1000.0 / len(rows)
        for i in rows:
            own[i] += ms


def _mixed_drafts(rows: list[DecodeRow], native: list, roots: np.ndarray, cap: int, depth: np.ndarray,
                  own: Optional[list[float]] = None) -> list:
    """Every row's Draft (creation order) where only some rows are native: those from one ``propose_batch``
    call, the others from their drafters' ``propose`` (each call's ms added to ``own``, where given)."""
    from ..drafters.methods import native_tree

    nat = [i for i, n in enumerate(native) if n is not None]
    t0 = time.perf_counter()
    got = native_mod.propose_batch([native[i][0] for i in nat],
                                   np.fromiter((native[i][1] for i in nat), np.int64, len(nat)), roots[nat],
                                   np.full(len(nat), cap, dtype=np.int64), depth[nat])
    drafts: list = [None] * len(rows)
    for j, i in enumerate(nat):
        drafts[i] = native_tree(got, j)
    _split_own(own, nat, t0)
    for i, r in enumerate(rows):
        if drafts[i] is None:
            t0 = time.perf_counter()
            drafts[i] = r.drafter.propose(int(roots[i]), capacity=cap, max_depth=int(depth[i]))
            _split_own(own, [i], t0)
    return drafts


def _update_native(native: list, flat: FlatTrees, topk: np.ndarray, committed: list[list[int]],
                   handles: Optional[tuple] = None) -> None:
    """One ``update_batch`` call of the native draft core for every row (``native``: (state, row handle);
    ``handles``: the same as (states, handles [B]) where the step made them)."""
    b = len(native)
    cu_c = np.zeros(b + 1, dtype=np.int64)
    np.cumsum([len(c) for c in committed], out=cu_c[1:])
    flat_c = np.fromiter((t for c in committed for t in c), np.int64, int(cu_c[-1]))
    if handles is None:
        handles = ([n[0] for n in native], np.fromiter((n[1] for n in native), np.int64, b))
    native_mod.update_batch(handles[0], handles[1], flat.cu, flat.tokens, topk, flat_c, cu_c)


class _Clock:
    """Per-part host time of one step, added to a shared ``host_ms`` dict as it goes (the ``propose`` part also
    kept apart: the step's telemetry splits the host time into propose and the rest)."""

    __slots__ = ("host", "t0", "t", "propose_ms")

    def __init__(self, host: dict, t0: Optional[float] = None) -> None:
        self.host = host
        self.t0 = self.t = time.perf_counter() if t0 is None else t0
        self.propose_ms = 0.0

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        ms = (now - self.t) * 1000.0
        self.host[part] = self.host.get(part, 0.0) + ms
        if part == "propose":
            self.propose_ms += ms
        self.t = now

    def skip(self) -> None:
        """Not host time (the forward): restart the lap."""
        now = time.perf_counter()
        self.t0 += now - self.t
        self.t = now

    def since_start_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000.0
