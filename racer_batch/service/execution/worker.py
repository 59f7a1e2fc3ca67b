"""The worker: take a job under a lease, plan its shards, run them on the executor, keep the lease alive,
record progress in Redis and the manifest, and finish (or hand back) the job.

Plain class: ``Worker(queue, executor).run()``; the CLI and ``submit --local`` wrap it.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import pyarrow as pa
import redis

from racer_batch.service.execution.actors import ClusterLost, Executor
from racer_batch.service.execution.queue import DEFAULT_PREFIX, JobQueue, Lease, plural
from racer_batch.service.execution.runner import CANCELLED, LEASE_LOST, ShardTask, ShardWriter
from racer_batch.service.job.inputs import InputError, InputPlan, answer_columns, iter_shards, plan_input
from racer_batch.service.job.spec import JobSpec
from racer_batch.service.job.task import ShardResult
from racer_batch.service.results.manifest import job_manifest
from racer_batch.service.results.output import write_manifest
from racer_batch.service.results.record import RowOrigin, RowRecord, now_utc
from racer_batch.service.results.resume import ResumePlan, clear_stale, plan_resume
from racer_batch.service.results.tally import Tally

log = logging.getLogger(__name__)


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(self, queue: JobQueue, executor: Executor, *, name: Optional[str] = None, lease_s: float = 30.0,
                 max_shard_attempts: int = 3, max_node_faults: int = 20, max_job_attempts: int = 10,
                 poll_s: float = 0.5,
                 only_job: Optional[str] = None, report: Optional[Callable[[str], None]] = None) -> None:
        """``only_job``: run that job alone (the embedded worker of ``submit --local``); other jobs met in
        the queue are held while looking for it and then handed back, so they keep their place for real
        workers and are never run here. ``report``: where one line per event goes (job taken, shard
        committed, job ended, shards redone); default the log at INFO. ``racer-batch worker`` prints them."""
        assert lease_s > 1, f"lease_s must exceed one second, got {lease_s}"
        self.only_job = only_job
        self.queue = queue
        self.executor = executor
        self.name = name or worker_id()
        self.lease_s = lease_s
        self.max_shard_attempts = max_shard_attempts
        self.max_node_faults = max_node_faults
        self.max_job_attempts = max_job_attempts
        self.poll_s = poll_s
        self.jobs_run = 0
        self._report = report or log.info

    # ---- main loop
    def run(self, *, max_jobs: Optional[int] = None, stop: Callable[[], bool] = lambda: False,
            idle_exit_s: Optional[float] = None) -> int:
        """Take and run jobs until ``stop()``, ``max_jobs`` jobs, or ``idle_exit_s`` with nothing queued."""
        idle_since = time.monotonic()
        held: list[Lease] = []  # other jobs' leases taken while looking for only_job
        try:
            while not stop() and (max_jobs is None or self.jobs_run < max_jobs):
                before = self.jobs_run
                if not self._run_one(held, stop=stop, idle_since=idle_since, idle_exit_s=idle_exit_s):
                    break
                if self.jobs_run != before:
                    idle_since = time.monotonic()
        finally:
            self._hand_back(held)
        return self.jobs_run

    def _hand_back(self, held: list[Lease]) -> None:
        for other in held:
            try:
                self.queue.release(other, message=f"passed over by embedded worker {self.name}")
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("job %s: could not hand back (%s); its lease will expire", other.job_id, exc)
        held.clear()

    def _run_one(self, held: list[Lease], *, stop: Callable[[], bool], idle_since: float,
                 idle_exit_s: Optional[float]) -> bool:
        """Claim and run at most one job; False when the worker should stop (idle for too long). Raises
        ClusterLost, before taking a job, when the executor's cluster is gone."""
        self.executor.check_cluster()
        try:
            lease = self.queue.claim(consumer=self.name, lease_ms=int(self.lease_s * 1000),
                                     block_ms=int(self.poll_s * 1000))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("queue unavailable, retrying: %s", exc)
            time.sleep(min(5.0, self.poll_s * 4))
            return True
        if lease is None:
            return not (idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s)
        if self.only_job is not None and lease.job_id != self.only_job:
            held.append(lease)  # pending under this consumer, so the next claim moves past it
            return True
        self._hand_back(held)
        try:
            self.run_job(lease, stop=stop)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # Redis went away at a point where the job's state could not be written (say, marking it
            # done). Keep the worker: the lease expires and the job is taken again, or, when Redis lost
            # its data, re-submitting resumes it from the output folder.
            log.warning("job %s: Redis unavailable (%s); the job is left to its lease", lease.job_id, exc)
            time.sleep(min(5.0, self.poll_s * 4))
        self.jobs_run += 1
        return True

    # ---- one job
    def run_job(self, lease: Lease, *, stop: Callable[[], bool] = lambda: False) -> str:
        """Run one leased job to its end. Returns the final state (done/cancelled/failed/lost/released).
        On an unexpected error (or Ctrl-C) the job goes back to the queue before the error propagates.

        Raises:
            ClusterLost: the Ray cluster went away (its head does not answer); the job is back on the queue
                and the message says so."""
        try:
            return self._run_job(lease, stop=stop)
        except BaseException as exc:
            why = f"{exc}" if isinstance(exc, ClusterLost) else type(exc).__name__
            try:
                self.queue.release(lease, message=f"worker {self.name} stopped: {why}")
                handed = True
            except redis.RedisError as rexc:
                log.warning("could not hand job %s back (its lease will expire): %s", lease.job_id, rexc)
                handed = False
            if isinstance(exc, ClusterLost):
                back = "handed back to the queue" if handed else f"left to its lease ({self.lease_s:g} s)"
                raise ClusterLost(f"{exc}; job {lease.job_id} {back}") from exc
            raise

    def _run_job(self, lease: Lease, *, stop: Callable[[], bool]) -> str:
        job = self._open_job(lease)
        if isinstance(job, str):
            return job
        if len(job.done) < job.num_shards:
            self.executor.prepare(job.spec.resources)
            job.free_slots = self.executor.usable_slots()
            self._room_message(job)
        while job.pending or job.running:
            self._keep_lease(job)
            if stop() and not job.released:
                job.released = True
                job.pending.clear()
                self._release_now(job)  # queued at once; the shards in flight see their lease gone and stop
            self._dispatch(job)
            if not job.running:
                if not job.free_slots and not job.stopping and self._more_to_run(job):
                    self._wait_for_room(job)  # every slot dropped: wait (one poll), never spin
                    continue
                break
            finished, _ = cf.wait(list(job.running), timeout=min(1.0, self.lease_s / 3),
                                  return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                self._collect(job, fut)
        self.executor.end_job(job.job_id)
        return self._close_job(job)

    def _open_job(self, lease: Lease) -> "JobRun | str":
        """Check the leased job, plan it and resume it from the output folder. Returns the run, or the final
        state when the job ends here (failed)."""
        job_id = lease.job_id
        fields = self.queue.job_fields(job_id)
        failure = None
        if int(fields.get("attempts", 1)) > self.max_job_attempts:
            failure = f"taken {self.max_job_attempts} times without finishing; giving up"
        else:
            spec = JobSpec.model_validate(json.loads(fields["spec"]))  # once per job in this process
            plan = InputPlan.from_dict(json.loads(fields["plan"]))
            failure = _input_changed(spec, plan)
        if failure:
            self.queue.finish(lease, state="failed", message=failure)
            return "failed"
        num_shards = plan.num_shards(spec.output.shard_rows)
        self._report(f"job {job_id}: taken by {self.name}{' (reclaimed)' if lease.reclaimed else ''}: "
                     f"{plan.num_rows} rows in {plural(num_shards, 'shard')}")
        done, problem = self._resume(job_id, spec, plan)
        if done:
            self._report(f"job {job_id}: {len(done)}/{num_shards} shards kept from the output folder")
        job = JobRun(lease=lease, spec=spec, plan=plan, done=done, pending=ShardFeed(
            plan, columns=list(spec.input.columns.model_dump().values()), shard_rows=spec.output.shard_rows,
            skip=frozenset(done)))
        unwritable = problem or self._manifest(job, state="running")
        if unwritable:
            self.queue.finish(lease, state="failed", message=unwritable)
            return "failed"
        return job

    def _keep_lease(self, job: "JobRun") -> None:
        """Every third of the lease: check the cluster (ClusterLost propagates), note lost nodes, start
        dropped slots again where there is room, renew the lease (a lost lease stops the job) and look for a
        cancel request."""
        now = time.monotonic()
        if now < job.next_renew:
            return
        self.executor.check_cluster()
        self._note_lost_nodes(job)
        back = self.executor.regrow()
        if back:
            job.free_slots += back
            self._room_message(job)
        if self._renew(job.lease) is False:
            job.lost = True
            job.pending.clear()
        job.next_renew = now + self.lease_s / 3
        if not job.cancelled and self._cancel_requested(job.job_id):
            job.cancelled = True
            job.pending.clear()
            self._report(f"job {job.job_id}: cancel requested, stopping at the next step boundary")

    def _dispatch(self, job: "JobRun") -> None:
        """Hand the next shards to the free slots (none once the job is stopping)."""
        while job.free_slots and not job.stopping:
            try:
                shard = job.pending.next()
            except (OSError, ValueError, AssertionError, pa.ArrowException) as exc:
                job.failure = f"input no longer readable: {type(exc).__name__}: {exc}"
                job.pending.clear()
                return
            if shard is None:
                return
            slot = job.free_slots.pop()
            job.attempts[shard] += 1
            lo, hi = job.plan.shard_range(shard, job.spec.output.shard_rows)
            task = ShardTask(job_id=job.job_id, shard=shard, row_start=lo, row_stop=hi, spec=job.spec,
                             plan=job.plan, spec_hash=job.spec_hash, owner=self.name,
                             attempt=job.attempts[shard], rows=job.pending.rows[shard])
            job.running[self.executor.submit(slot, task)] = (slot, shard)

    def _more_to_run(self, job: "JobRun") -> bool:
        """Whether a shard is left to dispatch (reads ahead one shard); an unreadable input fails the job."""
        try:
            return job.pending.has_more()
        except (OSError, ValueError, AssertionError, pa.ArrowException) as exc:
            job.failure = f"input no longer readable: {type(exc).__name__}: {exc}"
            job.pending.clear()
            return False

    def _wait_for_room(self, job: "JobRun") -> None:
        """No slot has an actor (the cluster has no room for any): the status line says so; wait one poll.
        ``_keep_lease`` renews the lease meanwhile and brings slots back once nodes have room."""
        if not job.waiting:
            self._room_message(job)
        time.sleep(self.poll_s)

    def _room_message(self, job: "JobRun") -> None:
        """The job's status line while the pool is short of its slots (``waiting for Ray resources: ...`` or
        ``running on 3 of 4 actors: ...``), cleared once every slot is back; one report line per change."""
        note = self.executor.room_note()
        if note is None:
            message = ""
        elif not self.executor.usable_slots():
            message = f"waiting for Ray resources: {note}"
        else:
            message = f"running on what is left: {note}"
        job.waiting = message.startswith("waiting")
        if message == job.room_message:
            return
        job.room_message = message
        self._report(f"job {job.job_id}: " + (message or f"all {self.executor.slots} actors running again"))
        self._redis_best_effort(self.queue.set_message, job.job_id, message)

    def _note_lost_nodes(self, job: "JobRun") -> None:
        """Record Ray nodes that went down under this pool's actors (status ``nodes_lost``, the manifest)."""
        for node in self.executor.lost_nodes():
            if node in job.nodes_lost:
                continue
            job.nodes_lost.append(node)
            self._report(f"job {job.job_id}: Ray node {node} lost; the shards its actors held are retried "
                         "on the nodes left")
            self._redis_best_effort(self.queue.note_node_lost, job.job_id, node)

    def _collect(self, job: "JobRun", fut: cf.Future) -> None:
        """One returned shard attempt: commit it, note a stop, or decide what its failure means."""
        slot, shard = job.running.pop(fut)
        job.free_slots.append(slot)
        try:
            res: ShardResult = fut.result()
        except Exception as exc:  # noqa: BLE001 - actor crash or setup error, decided below
            if not job.released:  # shutting down: the shard is redone by whoever takes the job next
                job.failure = self._shard_failed(job, shard=shard, slot=slot, exc=exc) or job.failure
            return
        if res.committed:
            self._committed(job, shard, res.summary)
            width = res.streams
            self._report(f"job {job.job_id}: shard {shard} committed ({len(job.done)}/{job.num_shards} shards; "
                         f"rows ok {res.summary['ok']}, error {res.summary['error']}"
                         + (f"; {width} rows in flight at once" if width > 1 else "") + ")")
            if time.monotonic() >= job.next_manifest:  # throttled: the part files are the truth
                self._manifest(job, state="running")
                job.next_manifest = time.monotonic() + 5.0
        elif res.stopped == CANCELLED:
            job.cancelled = True
        elif res.stopped == LEASE_LOST:
            job.lost = True
            job.pending.clear()

    def _committed(self, job: "JobRun", shard: int, summary: dict) -> None:
        job.done[shard] = summary
        job.pending.committed(shard)
        self._redis_best_effort(self.queue.commit_shard, job.job_id, shard, summary)

    def _release_now(self, job: "JobRun") -> None:
        """Hand the job back to the queue once (state queued, no owner): a stop (Ctrl-C, SIGTERM) does it as soon
        as it is seen, not after the shards in flight return, so ``status`` says queued at once and a second
        interrupt cannot leave a lease nobody renews. Those shards then read LEASE_LOST and write nothing."""
        if job.handed_back:
            return
        try:
            self.queue.release(job.lease, message=f"released by {self.name} (stopped)")
            job.handed_back = True
        except redis.RedisError as exc:
            log.warning("could not hand job %s back (its lease will expire): %s", job.job_id, exc)

    def _close_job(self, job: "JobRun") -> str:
        """End the run: the final state in the manifest and Redis (or the job handed back / left)."""
        if job.released:  # before ``lost``: after our own release the shards in flight read their lease as lost
            self._release_now(job)
            return "released"
        if job.lost:
            self._report(f"job {job.job_id}: lease lost to another worker; stopped here, shards in flight not "
                         "written")
            return "lost"
        failure = job.failure
        if not failure and not job.cancelled:
            failure = _all_rows_failed(job.job_id, job.done, prefix=self.queue.prefix)
        state = "failed" if failure else "cancelled" if job.cancelled else "done"
        self._manifest(job, state=state)
        self._finish(job.lease, state=state, message=failure or "")
        self._report(f"job {job.job_id}: {state} ({len(job.done)}/{job.num_shards} shards)"
                     + (f": {failure}" if failure else ""))
        return state

    def _resume(self, job_id: str, spec: JobSpec, plan: InputPlan) -> tuple[dict[int, dict], Optional[str]]:
        """Shards kept from the output folder (service/results/resume.py), after deleting the stale part files and
        making Redis agree with the folder (the folder is the truth). Returns ({shard: summary}, None), or
        ({}, a job failure message) when the folder or the input cannot be read or cleaned."""
        try:
            resume: ResumePlan = plan_resume(spec, plan)
            clear_stale(spec, resume)
        except (OSError, ValueError, AssertionError, pa.ArrowException) as exc:
            return {}, f"cannot compare the output folder with the input: {type(exc).__name__}: {exc}"
        for line in resume.describe():
            self._report(f"job {job_id}: {line}")
        done = resume.done
        self.queue.sync_committed(job_id, done)  # recovery: the output folder is the truth
        self._redis_best_effort(self.queue.mark_run_base, job_id)
        return done, None

    def _finish(self, lease: Lease, *, state: str, message: str) -> None:
        """Mark the job ended, waiting out a short Redis outage (at most a third of the lease, backing off);
        a longer one raises, and the job is left to its lease (see run)."""
        deadline = time.monotonic() + self.lease_s / 3
        pause_s = 0.1
        while True:
            try:
                self.queue.finish(lease, state=state, message=message)
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if time.monotonic() + pause_s > deadline:
                    raise
                log.warning("job %s: cannot mark it %s yet (%s); retrying in %.1f s", lease.job_id, state, exc,
                            pause_s)
                time.sleep(pause_s)
                pause_s = min(2.0, pause_s * 2)

    @staticmethod
    def _redis_best_effort(fn: Callable, *args: object) -> None:
        """Redis writes that the output folder can rebuild (shard summaries): an outage only logs."""
        try:
            fn(*args)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("Redis unavailable, %s skipped (rebuilt from the output folder on resume): %s",
                        getattr(fn, "__name__", "write"), exc)

    def _renew(self, lease: Lease) -> Optional[bool]:
        """True: renewed; False: the job belongs to someone else; None: Redis unreachable (keep going)."""
        try:
            return self.queue.renew(lease)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("cannot renew lease of job %s: %s", lease.job_id, exc)
            return None

    def _cancel_requested(self, job_id: str) -> bool:
        try:
            return self.queue.is_cancelled(job_id)
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    def _shard_failed(self, job: "JobRun", *, shard: int, slot: int, exc: BaseException) -> Optional[str]:
        """Decide what a failed shard means. Returns a job failure message, or None to carry on.

        * The actor died (a row may crash the process, e.g. out of memory): restart it and retry; after
          ``max_shard_attempts`` the shard's rows are written with status=error, so the job still ends.
        * The actor's node died or stopped answering, or the actor found no room in time (``node_fault``):
          the shard is retried without using up its attempts (the rows are not at fault); only after
          ``max_node_faults`` such faults of one shard does the job fail, its rows never marked errors.
        * ValueError / AssertionError raised outside any row (the model cannot load, the input changed):
          retrying cannot help, the job fails with the message.
        * Any other exception (an I/O error writing the part file, a bug): retried, then the job fails;
          rows are never marked as errors for a fault that is not theirs.
        """
        crash = self.executor.is_crash(exc)
        cause = self.executor.root_cause(exc)
        node_fault = crash and bool(self.executor.node_fault(slot, exc))  # before restart: it needs the slot
        if node_fault:
            job.node_faults[shard] += 1
        tries = job.attempts[shard] - job.node_faults[shard]  # the attempts the shard itself may be blamed for
        if crash:
            log.warning("job %s shard %d: actor %s (%s); restarting it", job.job_id, shard,
                        "lost with its node" if node_fault else "crashed", type(exc).__name__)
            if not self.executor.restart(slot):  # no room left for it in the cluster: run on what is left
                job.free_slots.remove(slot)
            self._note_lost_nodes(job)
            self._room_message(job)
        elif isinstance(cause, (ValueError, AssertionError)):
            return f"shard {shard}: {cause}"
        else:
            log.warning("job %s shard %d attempt %d failed: %s: %s", job.job_id, shard, tries,
                        type(cause).__name__, cause)
        if node_fault and job.node_faults[shard] > self.max_node_faults:
            return (f"shard {shard}: lost to node faults {job.node_faults[shard]} times (the cluster keeps "
                    f"failing under it); last: {type(cause).__name__}: {cause}")
        if node_fault or tries < self.max_shard_attempts:
            job.pending.retry(shard)
            job.retried.add(shard)
            job.retries += 1
            self._report(f"job {job.job_id}: shard {shard} retried after attempt {job.attempts[shard]} "
                         f"({type(cause).__name__}{', a node fault' if node_fault else ''})")
            self._redis_best_effort(self.queue.note_shard_retried, job.job_id, shard)
            return None
        message = f"shard failed {tries} times; last error: {type(cause).__name__}: {cause}"
        log.error("job %s shard %d: %s", job.job_id, shard, message)
        if not crash:
            return f"shard {shard}: {message}"
        self._committed(job, shard, self._write_failed_shard(job, shard=shard, message=message))
        return None

    def _write_failed_shard(self, job: "JobRun", *, shard: int, message: str) -> dict:
        """Every row of a shard that kept crashing gets status=error, so the job still completes. Returns
        the shard summary written into the part file."""
        spec = job.spec
        id_col, route_col = spec.input.columns.id, spec.input.columns.route
        writer = ShardWriter(out_dir=spec.output.path, job_id=job.job_id, shard=shard,
                             row_range=job.plan.shard_range(shard, spec.output.shard_rows),
                             spec_hash=job.spec_hash, fp_columns=answer_columns(spec.input))
        tally = Tally()
        for row_idx, raw in job.pending.rows[shard]:
            writer.add_input(row_idx, str(raw.get(id_col)), raw)
            rec = RowRecord.without_answer(status="error", error=message, finished_at=now_utc(), origin=RowOrigin(
                id=str(raw.get(id_col)), row_idx=row_idx, shard=shard, route=str(raw.get(route_col) or spec.route),
                job_id=job.job_id, worker=self.name, model=spec.model.name, method=spec.decoding.method,
                config_hash=spec.decoding.config_hash(), seed=(spec.seed + row_idx) % (2**63)))
            writer.observe(rec)
            tally.observe_row(rec)
        meta = writer.summary(tally, worker=self.name, attempt=0, elapsed_s=0.0)
        writer.commit(meta, stopped=None)
        return meta

    def _manifest(self, job: "JobRun", *, state: str) -> Optional[str]:
        """Rewrite the manifest. Returns None, or a message naming the folder when it cannot be written
        (the part files stay the truth, so only the first write of a run fails the job)."""
        try:
            write_manifest(job.spec.output.path, job_manifest(
                job.job_id, job.spec, job.plan, state=state, done=job.done, worker=self.name,
                faults={"nodes_lost": list(job.nodes_lost), "shards_retried": len(job.retried),
                        "retries": job.retries}))
        except OSError as exc:
            message = f"output.path = {job.spec.output.path!r}: cannot write the manifest: {exc.strerror or exc}"
            log.warning("job %s: %s", job.job_id, message)
            return message
        return None


@dataclass
class JobRun:
    """The state of one job while this worker runs it: its lease, validated spec and plan, the committed
    shards ({shard: summary}), the shards still to run and those in flight, and why it is stopping."""

    lease: Lease
    spec: JobSpec
    plan: InputPlan
    done: dict[int, dict]
    pending: "ShardFeed"
    attempts: collections.Counter = field(default_factory=collections.Counter)
    running: dict[cf.Future, tuple[int, int]] = field(default_factory=dict)  # future -> (slot, shard)
    free_slots: list[int] = field(default_factory=list)
    cancelled: bool = False
    lost: bool = False
    released: bool = False
    handed_back: bool = False  # released in Redis (``Worker._release_now``)
    failure: Optional[str] = None
    next_renew: float = 0.0
    next_manifest: float = 0.0
    nodes_lost: list[str] = field(default_factory=list)  # Ray nodes lost under this run's actors
    retried: set[int] = field(default_factory=set)  # shards redone at least once in this run
    retries: int = 0  # shard attempts redone in this run (a shard retried twice counts 2)
    node_faults: collections.Counter = field(default_factory=collections.Counter)  # shard -> node faults
    waiting: bool = False  # no slot had room: waiting for the cluster
    room_message: str = ""  # the status line set while the pool is short of slots

    def __post_init__(self) -> None:
        self.spec_hash = self.spec.spec_hash()
        self.num_shards = self.plan.num_shards(self.spec.output.shard_rows)

    @property
    def job_id(self) -> str:
        return self.lease.job_id

    @property
    def stopping(self) -> bool:
        return bool(self.cancelled or self.lost or self.released or self.failure)


class ShardFeed:
    """Shards still to run, read lazily in one pass over the input. A shard's rows stay cached from dispatch
    until it is committed (a retry reuses them), so memory holds only the shards in flight."""

    def __init__(self, plan: InputPlan, *, columns: list[str], shard_rows: int, skip: frozenset[int]) -> None:
        self._it = iter_shards(plan, columns=columns, shard_rows=shard_rows, skip=skip)
        self._retry: collections.deque[int] = collections.deque()
        self._exhausted = False
        self.rows: dict[int, list] = {}

    def __bool__(self) -> bool:
        return bool(self._retry) or not self._exhausted

    def next(self) -> Optional[int]:
        if self._retry:
            return self._retry.popleft()
        if self._exhausted:
            return None
        try:
            shard, rows = next(self._it)
        except StopIteration:
            self._exhausted = True
            return None
        self.rows[shard] = rows
        return shard

    def retry(self, shard: int) -> None:
        self._retry.appendleft(shard)

    def has_more(self) -> bool:
        """Whether a shard is left to hand out; reads the next shard ahead when needed (it is handed out
        first). Raises what reading the input raises."""
        if self._retry:
            return True
        shard = self.next()
        if shard is None:
            return False
        self._retry.appendleft(shard)
        return True

    def committed(self, shard: int) -> None:
        self.rows.pop(shard, None)

    def clear(self) -> None:
        self._retry.clear()
        self._exhausted = True


def _input_changed(spec: JobSpec, plan: InputPlan) -> Optional[str]:
    """Why the job's input cannot be used any more (unreadable, or other files than at submit), or None."""
    try:
        now_plan = plan_input(spec.input)
    except InputError as exc:
        return f"input no longer readable: {exc}"
    if now_plan.fingerprint != plan.fingerprint:
        return "input files changed since submit; submit again"
    return None


def errors_command(job_id: str, prefix: str) -> str:
    """The command that lists a job's failed rows, with ``--prefix`` where the queue's is not the default."""
    return f"racer-batch errors {job_id}" + ("" if prefix == DEFAULT_PREFIX else f" --prefix {prefix}")


def _all_rows_failed(job_id: str, done: dict[int, dict], *, prefix: str) -> Optional[str]:
    """The failure message of a job in which rows ran and none came back ok, else None (a job of zero rows
    is done)."""
    totals = Tally.of(done.values())
    if totals.rows == 0 or totals.ok > 0:
        return None
    return f"every row failed ({totals.error} errors); {errors_command(job_id, prefix)} lists them"
