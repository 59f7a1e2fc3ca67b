"""Executors: where shards run. ``RayExecutor`` keeps a pool of Ray actors (thin shells around RowRunner);
``ThreadExecutor`` runs RowRunners on threads of this process (tests, ``worker --no-ray``).

Both hand back ``concurrent.futures.Future`` objects, so the worker's loop is the same for either.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from racer_batch.service.execution.queue import JobQueue, connect
from racer_batch.service.results.record import RowRecord
from racer_batch.service.execution.runner import CANCELLED, KEEP_GOING, LEASE_LOST, RowRunner, ShardTask
from racer_batch.service.job.spec import Resources
from racer_batch.service.results.tally import Tally

log = logging.getLogger(__name__)


class RedisSink:
    """ShardSink over Redis: the telemetry sink of each row (row stream, error stream, the shard attempt's
    in-flight tally) and the stop verdict. Telemetry is best effort: a Redis outage never fails a row."""

    def __init__(self, queue: JobQueue) -> None:
        self.queue = queue

    def observe(self, record: RowRecord, *, progress: Tally) -> None:
        try:
            self.queue.record_row(record.job_id, record.telemetry(), shard=record.shard, progress=progress)
        except Exception as exc:  # noqa: BLE001 - redis errors of any kind: telemetry is optional
            log.warning("telemetry for job %s not recorded: %s", record.job_id, exc)

    def verdict(self, job_id: str, owner: str) -> str:
        try:
            cancel, cur = self.queue.r.hmget(self.queue.k_job(job_id), ["cancel", "owner"])
        except Exception as exc:  # noqa: BLE001 - keep generating while Redis is away
            log.warning("cannot check job %s in Redis: %s", job_id, exc)
            return KEEP_GOING
        if cancel == "1":
            return CANCELLED
        if cur is not None and cur != owner:
            return LEASE_LOST
        return KEEP_GOING


@dataclass(frozen=True)
class PoolShape:
    num_actors: int
    cpus_per_actor: float
    gpus_per_actor: float
    torch_threads: int = 0  # 0: auto (1)

    @property
    def threads(self) -> int:
        # Measured on 2 shared cores with the 135M model: 1 thread 13.5 tokens/s, 2 threads 1.6 (spinning
        # OpenMP threads collapse when another process holds a core). Scale out with actors instead.
        return self.torch_threads or 1


def resolve_shape(res: Resources, *, cluster_cpus: float, cluster_gpus: float) -> PoolShape:
    """``auto`` values: one actor per GPU when there are GPUs, else a single actor with every CPU reserved.

    Measured on the 2-core development machine, shared with other busy processes (demo job, 135M model):
    1 actor 13.8 tokens/s while generating, 2 single-threaded actors 5.1 each (10.2 together). Extra CPU
    actors are therefore opt-in (``num_actors``); measure on the target machine."""
    gpus = (1.0 if cluster_gpus >= 1 else 0.0) if res.gpus_per_actor == "auto" else float(res.gpus_per_actor)
    if res.num_actors == "auto":
        n = max(1, int(cluster_gpus // gpus)) if gpus > 0 else 1
    else:
        n = int(res.num_actors)
    cpus = res.cpus_per_actor or max(1.0, float(int(cluster_cpus // n)) if cluster_cpus else 1.0)
    threads = 0 if res.torch_threads == "auto" else int(res.torch_threads)
    return PoolShape(num_actors=n, cpus_per_actor=cpus, gpus_per_actor=gpus, torch_threads=threads)


class Executor(Protocol):
    slots: int

    def prepare(self, resources: Resources) -> None: ...

    def submit(self, slot: int, task: ShardTask) -> cf.Future: ...

    def end_job(self, job_id: str) -> None: ...

    def restart(self, slot: int) -> None: ...

    def is_crash(self, exc: BaseException) -> bool: ...

    def root_cause(self, exc: BaseException) -> BaseException: ...

    def shutdown(self) -> None: ...


class ThreadExecutor:
    """RowRunners on threads of this process: no isolation, same code path. Shape: ``num_actors`` threads."""

    def __init__(self, queue_url: str, *, prefix: str, allow_remote_code: bool = False,
                 device: Optional[str] = None, runner_options: Optional[dict] = None) -> None:
        self._url, self._prefix = queue_url, prefix
        self._allow, self._device = allow_remote_code, device
        self._runner_options = runner_options or {}  # extra RowRunner keywords (loader, engine_factory)
        self.runners: list[RowRunner] = []
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self.slots = 0

    def prepare(self, resources: Resources) -> None:
        n = 1 if resources.num_actors == "auto" else int(resources.num_actors)
        if n == self.slots:
            return
        self.shutdown()
        self.runners = [self._runner(i) for i in range(n)]
        self._pool = cf.ThreadPoolExecutor(max_workers=n, thread_name_prefix="racer-batch-runner")
        self.slots = n

    def _runner(self, slot: int) -> RowRunner:
        sink = RedisSink(JobQueue(connect(self._url), prefix=self._prefix))
        return RowRunner(worker_name=f"{socket.gethostname()}:{os.getpid()}:t{slot}", sink=sink,
                         allow_remote_code=self._allow, device=self._device, **self._runner_options)

    def submit(self, slot: int, task: ShardTask) -> cf.Future:
        """Run the task on a thread; the validated spec and plan are shared as they are."""
        assert self._pool is not None, "prepare() before submit()"
        return self._pool.submit(self.runners[slot].run_shard, task)

    def end_job(self, job_id: str) -> None:
        for r in self.runners:
            r.end_job(job_id)

    def restart(self, slot: int) -> None:
        if slot < len(self.runners):
            self.runners[slot] = self._runner(slot)

    def is_crash(self, exc: BaseException) -> bool:
        return False

    def root_cause(self, exc: BaseException) -> BaseException:
        return exc

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool = None
        self.runners = []
        self.slots = 0


class GenerationActor:
    """The Ray actor: a thin shell around RowRunner (tests use RowRunner directly)."""

    def __init__(self, *, worker_name: str, redis_url: str, prefix: str, torch_threads: int,
                 allow_remote_code: bool = False) -> None:
        self._threads = torch_threads
        os.environ["OMP_NUM_THREADS"] = str(torch_threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(torch_threads)
        sink = RedisSink(JobQueue(connect(redis_url), prefix=prefix))
        self.runner = RowRunner(worker_name=f"{worker_name}@{socket.gethostname()}:{os.getpid()}", sink=sink,
                                allow_remote_code=allow_remote_code)

    def run_shard(self, task: dict) -> dict:
        torch = sys.modules.get("torch")  # imported by the model loader; set its thread count once loaded
        if torch is not None and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        return self.runner.run_shard(task)

    def end_job(self, job_id: str) -> bool:
        return self.runner.end_job(job_id)

    def describe(self) -> dict:
        return self.runner.describe()


class RayExecutor:
    """A pool of GenerationActor; the pool is kept across jobs and rebuilt only when the shape changes."""

    def __init__(self, queue_url: str, *, prefix: str, name: str, allow_remote_code: bool = False) -> None:
        import ray

        self._ray = ray
        self._url, self._prefix, self._name, self._allow = queue_url, prefix, name, allow_remote_code
        self._remote = ray.remote(GenerationActor)
        self.actors: list[Any] = []
        self.shape: Optional[PoolShape] = None
        self.slots = 0

    def prepare(self, resources: Resources) -> None:
        cluster = self._ray.cluster_resources()
        shape = resolve_shape(resources, cluster_cpus=cluster.get("CPU", 1), cluster_gpus=cluster.get("GPU", 0))
        if shape == self.shape:
            return
        self.shutdown()
        self.shape = shape
        self.actors = [self._start(i) for i in range(shape.num_actors)]
        self.slots = shape.num_actors
        log.info("actor pool: %s", shape)

    def _start(self, slot: int) -> Any:
        assert self.shape is not None
        return self._remote.options(
            num_cpus=self.shape.cpus_per_actor, num_gpus=self.shape.gpus_per_actor, max_restarts=0,
        ).remote(worker_name=f"{self._name}/a{slot}", redis_url=self._url, prefix=self._prefix,
                 torch_threads=self.shape.threads, allow_remote_code=self._allow)

    def submit(self, slot: int, task: ShardTask) -> cf.Future:
        """Send the task as plain data; the actor validates its spec once per job and spec hash."""
        return self.actors[slot].run_shard.remote(task.to_dict()).future()

    def end_job(self, job_id: str) -> None:
        refs = [a.end_job.remote(job_id) for a in self.actors]
        try:
            self._ray.get(refs, timeout=60)
        except self._ray.exceptions.RayError as exc:
            log.warning("freeing state of job %s: %s", job_id, exc)

    def restart(self, slot: int) -> None:
        if slot >= len(self.actors):  # the pool was shut down meanwhile
            return
        try:
            self._ray.kill(self.actors[slot], no_restart=True)
        except self._ray.exceptions.RayError:
            pass
        self.actors[slot] = self._start(slot)

    def is_crash(self, exc: BaseException) -> bool:
        ex = self._ray.exceptions
        return isinstance(exc, (ex.RayActorError, ex.WorkerCrashedError, ex.ObjectLostError))

    def root_cause(self, exc: BaseException) -> BaseException:
        if isinstance(exc, self._ray.exceptions.RayTaskError):
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            return cause
        return exc

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                self._ray.kill(a, no_restart=True)
            except self._ray.exceptions.RayError:
                pass
        self.actors = []
        self.shape = None
        self.slots = 0
