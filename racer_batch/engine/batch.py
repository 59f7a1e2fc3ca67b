"""Several streams decoded together: each stream is a generator that yields the work it needs next, and a
``StreamBatch`` runs one step of every stream in flight, each part of the step once for all of them.

A stream (``Engine.stream``) keeps batch-1 RACER semantics: its own draft tree, committed length, stop rules,
seeded generator and KV-cache slot. It yields a ``Prefill`` (the prompt, once, at its first step), then one
standing ``Decode`` (its ``step.DecodeRow``: stepped until the row is done or cancelled, ``Decode.settle``, and
only then the stream is resumed), and returns its ``GenerationResult``. ``drive`` runs one stream
alone (``Engine.generate``); a ``StreamBatch`` runs many: every pending ``Decode`` of one engine goes into one
``step.Stepper.step`` call (one batched propose, one ``runner.verify_flat`` forward over all trees, batched
acceptance, stops, ``keep_rows_batch``, drafter update and telemetry: engine/step.py), while a joining stream's
``Prefill`` runs on its own just before (a separate prefill: it stalls the others for one prompt forward,
measured in benchmarks/throughput-*.md). Streams join and leave between steps (continuous batching): the
caller adds a new stream whenever one finishes. A ``Verify`` (one tree, the runner's logits sent back) serves
streams that are not an Engine's (the service tests' stand-in engine).

Isolation: a stream that raises (a bad row) ends alone with its exception; if a batched step raises before
any row committed a token, each of its streams steps again alone, so only the one that fails again ends with
the error. The arithmetic of one stream's rows does not depend on its batch-mates on our CPU kernels and on
the padded CUDA path (each row's GEMM reduction order is fixed), so greedy and seeded sampled outputs are those
of the stream decoded alone (tests/engine/test_batch.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Hashable, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class Prefill:
    """A stream's prompt forward: ``runner.prefill(prompt_ids, cache=cache, topk=topk, rows=rows)``
    (``rows`` None: the top-k at every position, and the call leaves the keyword out)."""

    runner: Any
    prompt_ids: list[int]
    cache: Any
    topk: int
    rows: Any = None  # np.ndarray [R] of sorted prompt positions, or None


@dataclass
class Verify:
    """One draft tree (``tree.TreeInputs``) verified over the stream's KV-cache slot ``cache``."""

    runner: Any
    tree: Any
    cache: Any


@dataclass
class Decode:
    """Decode steps of a stream (``step.DecodeRow``), each run by its engine's ``step.Stepper`` together with
    every other pending ``Decode`` of that engine in one batched step. The request stands until the row is done:
    after each step the runner (``StreamBatch``, ``drive``) calls :meth:`settle` and sends the stream None only
    where it returns True (a stream resumed while its row goes on yields the same request again)."""

    stepper: Any
    row: Any
    should_cancel: Optional[Callable[[], bool]] = None

    def settle(self, asked: Optional[dict] = None) -> bool:
        """After a step: whether the stream is to be resumed, i.e. its row is done, or ``should_cancel()`` is
        True now (then the row ends as ``cancelled``). ``asked``: ``id(should_cancel) -> answer`` for this step,
        so rows sharing one callable (a shard's rows) ask it once per step."""
        row = self.row
        if row.done:
            return True
        fn = self.should_cancel
        if fn is None:
            return False
        if asked is None:
            cancel = bool(fn())
        else:
            cancel = asked.get(id(fn))
            if cancel is None:
                cancel = asked[id(fn)] = bool(fn())
        if cancel:
            row.finish, row.done = "cancelled", True
        return cancel


Request = Any  # Prefill | Verify | Decode
Stream = Generator[Request, Any, Any]


def run_one(req: Request) -> Any:
    """What the runner returns for one request, on its own (batch size 1)."""
    if isinstance(req, Decode):
        req.stepper.step([req.row])
        return None
    if isinstance(req, Prefill):
        if req.rows is None:
            return req.runner.prefill(req.prompt_ids, cache=req.cache, topk=req.topk)
        return req.runner.prefill(req.prompt_ids, cache=req.cache, topk=req.topk, rows=req.rows)
    return req.runner.verify_tree(req.tree, cache=req.cache)


def drive(stream: Stream) -> Any:
    """Run one stream to its end alone; returns its result (exceptions propagate)."""
    try:
        req = next(stream)
        while True:
            out = run_one(req)
            if isinstance(req, Decode):
                while not req.settle():  # the row goes on: the standing request again, without a resume
                    run_one(req)
            req = stream.send(out)
    except StopIteration as stop:
        return stop.value


@dataclass
class Finished:
    """A stream that ended during a step: its key, its result or the exception it raised, and its share of
    the actor's time per runner (``device_ms``: {id(runner): ms}; a batched step shared by n streams counts
    1/n of its forward time for each, on a CPU runner 1/n of the whole step's wall time, or where its trees
    differ in size and the engine measured its verify cost, each stream's ``step_shares``; a prefill all of its
    wall time for its stream); ``prefill_ms``: the part of ``device_ms`` that was its prompt forward(s), per
    runner, so that a row's decode time alone is ``device_ms - prefill_ms``."""

    key: Hashable
    result: Any = None
    error: Optional[BaseException] = None
    device_ms: dict = field(default_factory=dict)
    prefill_ms: dict = field(default_factory=dict)


@dataclass
class _Live:
    stream: Stream
    request: Request


@dataclass(eq=False)
class _Group:
    """The pending ``Decode`` requests of one engine (one ``Stepper``) in one step: their keys, requests and rows
    in step order; whether its runner computes on the CPU (``_on_cpu``) and its engine measured a step cost
    (``_shares``); and, while the group is kept for the next steps (``StreamBatch._steady``), the ms of its steps
    to split equally among its streams, not yet charged (``pending``: added to every stream's share at once when
    the group is dropped, before any of its streams can end)."""

    keys: list
    reqs: list
    rows: list
    stepper: Any
    cpu: bool = True
    costed: bool = False
    defer: bool = False
    pending: float = 0.0
    cancellable: bool = False  # some request has a should_cancel to ask after every step


@dataclass
class BatchStats:
    """Counters of a StreamBatch (for benchmarks and logs)."""

    steps: int = 0  # batched verify forwards
    rows: int = 0  # tree rows verified in them
    streams: int = 0  # stream-steps (sum of the batch sizes)
    prefills: int = 0
    prefill_ms: float = 0.0  # time the batch stood still for joining streams' prefills
    verify_ms: float = 0.0
    fallbacks: int = 0  # batched forwards that raised and were retried stream by stream
    sizes: dict = field(default_factory=dict)  # batch size -> steps
    host_ms: dict = field(default_factory=dict)  # host time of the batched decode steps per part (step.HOST_PARTS)


class StreamBatch:
    """Streams in flight together, stepped in lockstep.

    ``add(key, stream)`` starts a stream (its first request is taken at once; a stream that fails before its
    first forward ends in the next ``step``); ``step()`` runs one forward for every stream in flight (prefills
    first, each alone, then one ``verify_batch`` per runner) and returns the streams that ended.
    """

    def __init__(self) -> None:
        self._live: dict[Hashable, _Live] = {}
        self._done: list[Finished] = []
        self._share: dict[Hashable, dict[int, float]] = {}  # key -> {id(runner): ms of forwards it had}
        self._prefill: dict[Hashable, dict[int, float]] = {}  # key -> {id(runner): ms of its prefills} (in _share)
        # the last step's decode groups while no stream joined, left or changed its request since (a standing
        # Decode is not resumed while its row goes on): the next step steps them without looking at every stream
        self._steady: Optional[list[_Group]] = None
        self.stats = BatchStats()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    @property
    def keys(self) -> list[Hashable]:
        return list(self._live)

    def add(self, key: Hashable, stream: Stream) -> None:
        """Start ``stream`` under ``key`` (unique among the streams in flight).

        Raises:
            KeyError: ``key`` is already in flight.
        """
        if key in self._live:
            raise KeyError(f"stream {key!r} is already in flight")
        self._unsteady()
        try:
            self._live[key] = _Live(stream, next(stream))
        except StopIteration as stop:
            self._done.append(Finished(key, result=stop.value))
        except Exception as exc:  # noqa: BLE001 - a bad row ends alone
            self._done.append(Finished(key, error=exc))
        else:
            self._share[key] = {}

    def cancel(self, key: Hashable) -> None:
        """Drop a stream now (closing its generator releases its slot); nothing is reported for it."""
        self._unsteady()
        live = self._live.pop(key, None)
        self._share.pop(key, None)
        self._prefill.pop(key, None)
        if live is not None:
            live.stream.close()

    def close(self) -> None:
        """Drop every stream in flight (their slots are released)."""
        for key in list(self._live):
            self.cancel(key)

    def _send(self, key: Hashable, value: Any = None, error: Optional[BaseException] = None) -> None:
        live = self._live[key]
        self._unsteady()  # the stream's request changes, or it ends
        try:
            live.request = live.stream.throw(error) if error is not None else live.stream.send(value)
        except StopIteration as stop:
            del self._live[key]
            self._done.append(Finished(key, result=stop.value, device_ms=self._share.pop(key, {}),
                                       prefill_ms=self._prefill.pop(key, {})))
        except Exception as exc:  # noqa: BLE001 - the stream's own failure ends that stream only
            del self._live[key]
            self._done.append(Finished(key, error=exc, device_ms=self._share.pop(key, {}),
                                       prefill_ms=self._prefill.pop(key, {})))

    def _unsteady(self) -> None:
        """Drop the kept decode groups (a stream joins, leaves or changes its request), charging each its pending
        ms first."""
        steady, self._steady = self._steady, None
        for group in steady or ():
            self._charge_pending(group)
            group.defer = False  # a step of it still under way charges at once

    def _charge_pending(self, group: _Group) -> None:
        if group.pending:
            each, rid = group.pending / len(group.keys), id(group.stepper.runner)
            for key in group.keys:
                share = self._share.get(key)
                if share is not None:
                    share[rid] = share.get(rid, 0.0) + each
            group.pending = 0.0

    def _charge(self, key: Hashable, runner: Any, ms: float) -> None:
        share = self._share.setdefault(key, {})
        share[id(runner)] = share.get(id(runner), 0.0) + ms

    def step(self) -> list[Finished]:
        """One step of every stream in flight; returns the streams that ended (in the order they ended)."""
        steady = self._steady
        if steady is not None:  # the same standing Decode requests as the last step: only those to step
            for group in steady:
                self._decode_group(group)
        else:
            self._step_all()
        done, self._done = self._done, []
        return done

    def _step_all(self) -> None:
        """One step of every stream, each request looked at: prefills first (each alone), then a batched decode
        step per engine and a batched verify per runner. Where every stream decodes, the groups are kept for
        the next step (``_steady``)."""
        st = self.stats
        for key in [k for k, v in self._live.items() if isinstance(v.request, Prefill)]:
            req = self._live[key].request
            t0 = time.perf_counter()
            try:
                out = run_one(req)
            except Exception as exc:  # noqa: BLE001
                out, err = None, exc
            else:
                err = None
            ms = (time.perf_counter() - t0) * 1000.0
            self._charge(key, req.runner, ms)
            pre = self._prefill.setdefault(key, {})
            pre[id(req.runner)] = pre.get(id(req.runner), 0.0) + ms
            self._send(key, out, error=err)
            st.prefills += 1
            st.prefill_ms += ms
        groups: dict[int, list[Hashable]] = {}
        decodes: dict[int, _Group] = {}
        for key, live in self._live.items():
            req = live.request
            if isinstance(req, Decode):
                g = decodes.get(id(req.stepper))
                if g is None:
                    stepper = req.stepper
                    g = decodes[id(stepper)] = _Group([], [], [], stepper, cpu=_on_cpu(stepper.runner),
                                                      costed=bool(getattr(stepper.engine, "step_cost", None)))
                g.keys.append(key)
                g.reqs.append(req)
                g.rows.append(req.row)
                g.cancellable = g.cancellable or req.should_cancel is not None
            elif isinstance(req, Verify):
                groups.setdefault(id(req.runner), []).append(key)
        steady = list(decodes.values())
        self._steady = steady if steady and not groups else None
        for group in self._steady or ():
            group.defer = True
        for group in steady:
            self._decode_group(group)
        for keys in groups.values():
            self._verify_group(keys)

    def _count(self, keys: list[Hashable], runner: Any, ms: float, rows: int, charge: Optional[float] = None,
               shares: Optional[list[float]] = None) -> None:
        """Count one batched step of ``ms`` forward time over ``keys``; each stream is charged its share of
        ``charge`` (default ``ms``; a CPU step: its whole wall time, host work included): ``shares`` (summing to
        1), else an equal share."""
        total = ms if charge is None else charge
        rid, share_of = id(runner), self._share
        if shares is None:
            each = total / len(keys)
            for key in keys:  # _charge, inlined (once per stream and step)
                share = share_of[key]
                share[rid] = share.get(rid, 0.0) + each
        else:
            for key, s in zip(keys, shares):
                share = share_of[key]
                share[rid] = share.get(rid, 0.0) + total * s
        self._tally(len(keys), ms, rows)

    def _tally(self, b: int, ms: float, rows: int) -> None:
        """The batch's counters of one step of ``b`` streams, ``rows`` tree rows and ``ms`` forward time."""
        st = self.stats
        st.verify_ms += ms
        st.steps += 1
        st.streams += b
        st.rows += rows
        st.sizes[b] = st.sizes.get(b, 0) + 1

    def _decode_group(self, group: _Group) -> None:
        """One batched decode step of these streams (one engine's); where it fails before any row committed
        a token, each row is retried alone so that only a row that fails by itself ends with the error. A stream
        is resumed only where ``Decode.settle`` says so (its row ended, or its ``should_cancel`` is True)."""
        keys, reqs, rows, stepper = group.keys, group.reqs, group.rows, group.stepper
        t0 = time.perf_counter()
        asked: dict = {}  # should_cancel answers of this step (Decode.settle)
        try:
            ms = stepper.step(rows, self.stats.host_ms)
        except Exception as exc:  # noqa: BLE001 - find the stream that fails by itself
            if len(keys) == 1 or stepper.committing:
                for key in keys:
                    self._send(key, error=exc)
                return
            log.warning("batched decode step of %d streams failed (%r); stepping them one by one", len(keys), exc)
            self.stats.fallbacks += 1
            for key, req in zip(keys, reqs):
                try:
                    stepper.step([req.row], self.stats.host_ms)
                except Exception as exc1:  # noqa: BLE001
                    self._send(key, error=exc1)
                else:
                    if req.settle(asked):
                        self._send(key, None)
            return
        wall = (time.perf_counter() - t0) * 1000.0
        cpu, own = group.cpu, stepper.last_own_ms
        shares = _shares(stepper) if group.costed else None
        if cpu and own:  # the host work is charged too: each row's own part (a mixed step's drafting) first
            shares = row_charges(wall, own, shares)
        if shares is None and group.defer:  # equal shares: added up, charged when the group is dropped
            group.pending += wall if cpu else ms
            self._tally(len(keys), ms, stepper.last_rows)
        else:
            self._count(keys, stepper.runner, ms, stepper.last_rows, charge=wall if cpu else ms, shares=shares)
        if not (stepper.last_ended or group.cancellable):  # every row goes on and none is asked to stop
            return
        for key, req in zip(keys, reqs):
            if req.settle(asked):
                self._send(key, None)

    def _verify_group(self, keys: list[Hashable]) -> None:
        reqs = [self._live[k].request for k in keys]
        t0 = time.perf_counter()
        outs = self._verify(reqs)
        ms = (time.perf_counter() - t0) * 1000.0
        self._count(keys, reqs[0].runner, ms, sum(r.tree.size for r in reqs))
        for key, out in zip(keys, outs):
            if isinstance(out, BaseException):
                self._send(key, error=out)
            else:
                self._send(key, out)

    def _verify(self, reqs: list[Verify]) -> list[Any]:
        """Logits per request from one batched forward; if it raises, each request alone (its own outcome)."""
        runner = reqs[0].runner
        if len(reqs) > 1 and hasattr(runner, "verify_batch"):
            try:
                return list(runner.verify_batch([(r.tree, r.cache) for r in reqs]))
            except Exception as exc:  # noqa: BLE001 - find the stream that fails by itself
                log.warning("batched verify of %d streams failed (%r); verifying them one by one", len(reqs), exc)
                self.stats.fallbacks += 1
        outs: list[Any] = []
        for r in reqs:
            try:
                outs.append(_own_copy(run_one(r)) if len(reqs) > 1 else run_one(r))
            except Exception as exc:  # noqa: BLE001
                outs.append(exc)
        return outs


def _shares(stepper: Any) -> Optional[list[float]]:
    """``step_shares`` of the stepper's last step, its tree sizes computed only where a step cost was measured
    (method auto's engine): nothing is added to any other engine's step."""
    cost = getattr(stepper.engine, "step_cost", None)
    cu = getattr(stepper, "last_cu", None)
    if not cost or cu is None:
        return None
    return step_shares(np.diff(cu), cost, contexts=getattr(stepper, "last_starts", None),
                       long=getattr(stepper.engine, "step_cost_long", None))


def step_shares(sizes: Any, step_cost: Optional[dict], *, contexts: Any = None,
                long: Optional[tuple[int, dict]] = None) -> Optional[list[float]]:
    """Each stream's share of a batched step whose trees differ in size (method auto's candidates in one
    forward): stream ``i`` weighs ``t(B x sizes[i], contexts[i]) / B``, what a stream costs per step where all B
    streams of the step have trees of its size after as many cached tokens as it has, ``t`` the engine's measured
    verify cost by tree rows (``step_cost``, ``Engine.measure_step_cost``; ``capacity.cost_at`` between and past
    the measured sizes), moved toward its curve at a long context (``long``: ``(tokens, {rows: ms})``,
    ``capacity.cost_at_context``) by each stream's committed length ``contexts [B]``; and the step is split in
    proportion. So a stream's tokens per charged second compare methods as whole batches of each would run at
    the same B. None (an equal share) where every tree has the same size or no cost was measured. (Without the
    context, a tree row's attention over a long prompt was charged at a 256-token price: on RAG rows method
    auto measured its AR rows at 0.74x of fixed AR and its tree rows above their fixed figures,
    benchmarks/warm-auto-20261206-040531.md.)

    >>> [round(x, 3) for x in step_shares([4, 1], {1: 10.0, 2: 11.0, 8: 16.0})]  # t(8) / 2 : t(2) / 2
    [0.593, 0.407]
    >>> [round(x, 3) for x in step_shares([4, 1], {1: 10.0, 2: 11.0, 8: 16.0}, contexts=[1024, 1024],
    ...                                   long=(1024, {1: 10.5, 2: 11.5, 8: 24.0}))]  # t(8, 1024) / 2 : ...
    [0.676, 0.324]
    """
    if sizes is None or not step_cost or len(sizes) < 2:
        return None
    sz = [int(x) for x in sizes]
    if min(sz) == max(sz):
        return None
    from racer_batch.engine.capacity import cost_at_context

    b = len(sz)
    ctx = [0.0] * b if contexts is None else [float(c) for c in contexts]
    use = long if contexts is not None else None
    w = [cost_at_context(step_cost, b * x, c, use) / b for x, c in zip(sz, ctx)]
    total = sum(w)
    return [x / total for x in w] if total > 0 else None


def row_charges(wall_ms: float, own_ms: Optional[Sequence[float]], shares: Optional[list[float]]
                ) -> Optional[list[float]]:
    """Each row's share of a CPU step's wall time where some of it belongs to one row alone (``own_ms [B]``: a
    mixed step's per-row drafting, ``Stepper.last_own_ms``): row ``i`` is charged ``own_ms[i]`` plus its
    ``shares[i]`` (equal where None) of the rest, so a drafter that is slow on the host is not paid for by its
    batch-mates. ``shares`` unchanged where there is no ``own_ms``.

    >>> [round(x, 3) for x in row_charges(10.0, [4.0, 0.0], [0.5, 0.5])]  # 4 + 3 : 0 + 3
    [0.7, 0.3]
    """
    if not own_ms or wall_ms <= 0:
        return shares
    n = len(own_ms)
    base = shares if shares is not None else [1.0 / n] * n
    rest = max(wall_ms - sum(own_ms), 0.0)
    w = [o + rest * s for o, s in zip(own_ms, base)]
    total = sum(w)
    return [x / total for x in w] if total > 0 else shares


def _on_cpu(runner: Any) -> bool:
    """Whether ``runner`` computes on the CPU (its forward and host work then share the same cores)."""
    return getattr(getattr(runner, "device", None), "type", "cpu") == "cpu"


def _own_copy(logits: Any) -> Any:
    """Runners reuse one logits buffer per call: a stream's logits from a one-by-one pass are copied."""
    return logits.clone() if hasattr(logits, "clone") else logits
