"""Prometheus metrics of a worker: rows, tokens, accepted tokens, steps and errors by job and route.

The actors never need a metrics server: the runner tallies every row of a shard (``Tally``, per route) and
returns the tally's JSON as the shard's result, which travels through Ray as a dict. ``WorkerMetrics``
(prometheus-client) is the Prometheus sink of those tallies (``shard_done(job_id, tally, ...)``): the worker
process owns one registry and one HTTP endpoint (``racer-batch worker --metrics-port N``).
``MeteredExecutor`` wraps any executor and feeds the registry from each finished shard future, so the worker
loop itself is unchanged.

Counters move when a shard finishes (``output.shard_rows`` rows at a time); the in-flight progress of a
running shard is in Redis (``racer-batch status``). Series carry a ``job`` label; a long-lived worker keeps
the series of its last ``keep_jobs`` jobs and drops older ones, so the label set stays bounded.

Example::

    tally = Tally()
    tally.observe_row(RowRecord(id="a", row_idx=0, shard=0, route="chat", status="ok", job_id="j",
                                output_tokens=10, steps=4, accepted_hist=[1, 2, 1]))
    metrics.shard_done("j", tally, outcome="committed", elapsed_s=2.0)
    # racer_batch_accepted_tokens_total{job="j",route="chat"} += 2*1 + 1*2 = 4 accepted draft tokens
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import threading
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from racer_batch.service.job.task import ShardResult, ShardTask
from racer_batch.service.results.record import STATUSES
from racer_batch.service.results.tally import Tally

log = logging.getLogger(__name__)

ROW_STATUSES = STATUSES
_OUTCOMES = {"cancelled": "cancelled", "lease-lost": "lease_lost"}  # a shard result's ``stopped`` -> outcome


class WorkerMetrics:
    """The worker's Prometheus registry. Thread-safe (prometheus-client metrics are).

    Args:
        worker: the worker's name, exported as ``racer_batch_worker_info``.
        keep_jobs: finished jobs whose series are kept; older ones are removed from the registry.
        registry: a private registry by default (several workers in one process, tests).
    """

    def __init__(self, *, worker: str, keep_jobs: int = 20, registry: Optional[CollectorRegistry] = None) -> None:
        assert keep_jobs >= 1, f"keep_jobs must be at least 1, got {keep_jobs}"
        self.registry = registry or CollectorRegistry()
        self.keep_jobs = keep_jobs
        r = self.registry
        self.rows = Counter("racer_batch_rows", "Rows finished, by job, route and status (ok/error/cancelled).",
                            ["job", "route", "status"], registry=r)
        self.output_tokens = Counter("racer_batch_output_tokens", "Tokens generated (emitted), by job and route.",
                                     ["job", "route"], registry=r)
        self.accepted_tokens = Counter("racer_batch_accepted_tokens",
                                       "Draft tokens accepted by the target model (bonus tokens excluded).",
                                       ["job", "route"], registry=r)
        self.steps = Counter("racer_batch_steps", "Decoding steps (target forwards, prefill included).",
                             ["job", "route"], registry=r)
        self.generation_seconds = Counter("racer_batch_generation_seconds",
                                          "Time spent generating rows (prefill + decode), summed over actors.",
                                          ["job", "route"], registry=r)
        self.errors = Counter("racer_batch_errors",
                              "Errors: kind=row (a row ended with status=error), kind=shard (a shard attempt "
                              "raised or its actor died).", ["job", "route", "kind"], registry=r)
        self.shards = Counter("racer_batch_shards", "Shard attempts that returned, by outcome "
                              "(committed, cancelled, lease_lost, not_written).", ["job", "outcome"], registry=r)
        self.shard_retries = Counter("racer_batch_shard_retries", "Shard attempts that redo a shard (its earlier "
                                     "attempt's actor died, with its node or alone, or found no room).",
                                     ["job"], registry=r)
        self.nodes_lost = Counter("racer_batch_nodes_lost", "Ray nodes lost while they hosted the job's actors.",
                                  ["job"], registry=r)
        self.shard_seconds = Histogram("racer_batch_shard_seconds", "Wall time of a shard attempt on its actor.",
                                       buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 3600), registry=r)
        self.running_shards = Gauge("racer_batch_running_shards", "Shards dispatched and not yet returned.",
                                    registry=r)
        self.info = Gauge("racer_batch_worker_info", "Constant 1, labelled with the worker's name.", ["worker"],
                          registry=r)
        self.info.labels(worker=worker).set(1)
        self._lock = threading.Lock()
        self._labels: dict[str, set[tuple[Counter, tuple[str, ...]]]] = collections.defaultdict(set)
        self._finished: collections.deque[str] = collections.deque()
        self._server: Any = None

    # ---- feeding
    def _inc(self, metric: Counter, labels: tuple[str, ...], amount: float) -> None:
        metric.labels(*labels).inc(amount)
        with self._lock:
            self._labels[labels[0]].add((metric, labels))

    def observe_shard(self, job_id: str, result: ShardResult) -> None:
        """One shard attempt's result (``RowRunner.run_shard``), handed to ``shard_done``."""
        outcome = "committed" if result.committed else _OUTCOMES.get(result.stopped, "not_written")
        self.shard_done(job_id, Tally.from_dict(result.summary), outcome=outcome, elapsed_s=result.elapsed_s)

    def shard_done(self, job_id: str, tally: Tally, *, outcome: str, elapsed_s: Optional[float]) -> None:
        """The Prometheus sink of one shard attempt's tally (sinks.ShardDoneSink): rows by status, tokens,
        accepted tokens, steps and generation seconds per route; the attempt's outcome and wall time."""
        for route, t in tally.routes.items():
            for status in ROW_STATUSES:
                if getattr(t, status):
                    self._inc(self.rows, (job_id, route, status), getattr(t, status))
            if t.error:
                self._inc(self.errors, (job_id, route, "row"), t.error)
            self._inc(self.output_tokens, (job_id, route), t.output_tokens)
            self._inc(self.accepted_tokens, (job_id, route), t.accepted_tokens)
            self._inc(self.steps, (job_id, route), t.steps)
            self._inc(self.generation_seconds, (job_id, route), t.gen_ms / 1000.0)
        self._inc(self.shards, (job_id, outcome), 1)
        if elapsed_s is not None:
            self.shard_seconds.observe(float(elapsed_s))

    def observe_shard_error(self, job_id: str) -> None:
        """A shard attempt raised (actor crash, model load failure, I/O error)."""
        self._inc(self.errors, (job_id, "", "shard"), 1)

    def observe_retry(self, job_id: str) -> None:
        """A shard attempt that redoes the shard (attempt 2 or later) was dispatched."""
        self._inc(self.shard_retries, (job_id,), 1)

    def observe_nodes_lost(self, job_id: str, count: int) -> None:
        """``count`` Ray nodes that hosted the job's actors went down."""
        self._inc(self.nodes_lost, (job_id,), count)

    def job_ended(self, job_id: str) -> None:
        """Mark a job finished; the series of the oldest finished jobs beyond ``keep_jobs`` are removed."""
        with self._lock:
            if job_id in self._finished:
                return
            self._finished.append(job_id)
            old = []
            while len(self._finished) > self.keep_jobs:
                old.append(self._finished.popleft())
            series = [s for j in old for s in self._labels.pop(j, ())]
        for metric, labels in series:
            try:
                metric.remove(*labels)
            except KeyError:
                pass

    # ---- serving
    def serve(self, port: int, *, host: str = "0.0.0.0") -> int:
        """Start the ``/metrics`` HTTP endpoint on a daemon thread; returns the bound port (``port=0``: any)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class MeteredExecutor:
    """Wraps an executor (``Executor`` protocol in actors.py): every shard future feeds ``metrics``."""

    def __init__(self, inner: Any, metrics: WorkerMetrics) -> None:
        self.inner = inner
        self.metrics = metrics
        self._job = ""  # the job of the last shard submitted: the one whose nodes are lost

    def lost_nodes(self) -> list[str]:
        lost = self.inner.lost_nodes()
        if lost:
            self.metrics.observe_nodes_lost(self._job, len(lost))
        return lost

    @property
    def slots(self) -> int:
        return self.inner.slots

    def submit(self, slot: int, task: ShardTask) -> cf.Future:
        job_id = str(task.job_id)
        self._job = job_id
        fut = self.inner.submit(slot, task)
        if task.attempt > 1:
            self.metrics.observe_retry(job_id)
        self.metrics.running_shards.inc()
        fut.add_done_callback(lambda f: self._done(job_id, f))
        return fut

    def _done(self, job_id: str, fut: cf.Future) -> None:
        try:
            if fut.cancelled():
                return
            if fut.exception() is not None:
                self.metrics.observe_shard_error(job_id)
            else:
                self.metrics.observe_shard(job_id, fut.result())
        except Exception as exc:  # noqa: BLE001 - metrics must never break the worker
            log.warning("metrics for a shard of job %s not recorded: %s", job_id, exc)
        finally:
            self.metrics.running_shards.dec()  # last: 0 means every returned shard is counted

    def end_job(self, job_id: str) -> None:
        self.inner.end_job(job_id)
        self.metrics.job_ended(job_id)

    def __getattr__(self, name: str) -> Any:  # prepare, restart, regrow, is_crash, check_cluster, shutdown, ...
        return getattr(self.inner, name)
