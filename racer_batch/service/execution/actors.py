"""Executors: where shards run. ``RayExecutor`` keeps a pool of Ray actors (thin shells around RowRunner);
``ThreadExecutor`` runs RowRunners on threads of this process (tests, ``worker --no-ray``).

Both hand back ``concurrent.futures.Future`` objects, so the worker's loop is the same for either.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from racer_batch.service.execution.queue import JobQueue, connect
from racer_batch.service.execution.runner import CANCELLED, KEEP_GOING, LEASE_LOST, RowRunner, ShardTask
from racer_batch.service.job.spec import Resources
from racer_batch.service.job.task import ShardResult
from racer_batch.service.results.record import RowRecord
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

    def evidence_share(self, job_id: str, spec_hash: str) -> "RedisEvidence":
        """Where this actor publishes and reads method auto's evidence for the job (``RedisEvidence``)."""
        return RedisEvidence(self.queue, job_id, spec_hash)


CLAIMS = "claims"  # RedisEvidence's field prefix of the first-row counters (never a chooser id: those are hex)


class RedisEvidence:
    """``auto.ClaimingShare`` over Redis: one hash per job and spec hash (``JobQueue.k_evidence``), a field per
    chooser, route and candidate (``<chooser id>\t<route>\t<method>``) holding that chooser's totals as JSON,
    and a counter per route and candidate of the first rows given (``claims\t<route>\t<method>``).
    The chooser id is new for every chooser, so a restarted actor never overwrites what its earlier self
    published; a changed spec (another model or config) reads another hash. Best effort: a Redis error is
    logged (once per chooser until it works again) and reads as no evidence from the others."""

    def __init__(self, queue: JobQueue, job_id: str, spec_hash: str) -> None:
        self.queue, self.key = queue, queue.k_evidence(job_id, spec_hash)
        self.me = uuid.uuid4().hex[:12]
        self._failing = False

    def publish(self, route: str, method: str, counters: Any) -> None:
        self._guard(lambda: self.queue.r.hset(self.key, f"{self.me}\t{route}\t{method}", json.dumps(dict(counters))))

    def others(self) -> dict[str, dict[str, dict[str, float]]]:
        got = self._guard(lambda: self.queue.r.hgetall(self.key)) or {}
        out: dict[str, dict[str, dict[str, float]]] = {}
        for field_, value in got.items():
            parts = field_.split("\t")
            if len(parts) != 3 or parts[0] in (self.me, CLAIMS):
                continue
            try:
                counters = json.loads(value)
            except ValueError:
                continue
            acc = out.setdefault(parts[1], {}).setdefault(parts[2], {})
            for name, v in counters.items():
                if isinstance(v, (int, float)):
                    acc[name] = acc.get(name, 0) + v
        return out

    def claim(self, route: str, method: str) -> Optional[int]:
        """``auto.ClaimingShare.claim``: HINCRBY of the field ``claims\t<route>\t<method>`` of the same hash (one
        atomic counter for every actor of the job, deleted with it); None when Redis fails."""
        got = self._guard(lambda: self.queue.r.hincrby(self.key, f"{CLAIMS}\t{route}\t{method}", 1))
        return None if got is None else int(got)

    def _guard(self, call: Any) -> Any:
        try:
            got = call()
        except Exception as exc:  # noqa: BLE001 - redis errors of any kind: the evidence is an optimisation
            if not self._failing:
                log.warning("method auto evidence of %s not shared: %s", self.key, exc)
            self._failing = True
            return None
        self._failing = False
        return got


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


class ClusterLost(RuntimeError):
    """The Ray cluster the worker joined is gone (its head does not answer): nothing can run or be asked of
    Ray any more. The worker hands its job back to the queue and stops; the message names the address."""


class ActorNotPlaced(RuntimeError):
    """An actor (re)started for a slot found no node with room within the start timeout (the cluster shrank);
    its shard is retried on the other slots and the slot is dropped."""


class Executor(Protocol):
    """Where shards run. ``slots`` numbers the pool's places (0..slots-1); some may be dropped when the
    cluster has no room for them (``usable_slots``), and come back with ``regrow``."""

    slots: int

    def prepare(self, resources: Resources) -> None: ...

    def usable_slots(self) -> list[int]: ...

    def submit(self, slot: int, task: ShardTask) -> cf.Future: ...

    def end_job(self, job_id: str) -> None: ...

    def restart(self, slot: int) -> bool: ...

    def regrow(self) -> list[int]: ...

    def room_note(self) -> Optional[str]: ...

    def check_cluster(self) -> None: ...

    def lost_nodes(self) -> list[str]: ...

    def is_crash(self, exc: BaseException) -> bool: ...

    def node_fault(self, slot: int, exc: BaseException) -> bool: ...

    def root_cause(self, exc: BaseException) -> BaseException: ...

    def shutdown(self) -> None: ...


class ThreadExecutor:
    """RowRunners on threads of this process: no isolation, same code path. Shape: ``num_actors`` threads."""

    def __init__(self, queue_url: str, *, prefix: str, allow_remote_code: bool = False,
                 device: Optional[str] = None, runner_options: Optional[dict] = None,
                 name: Optional[str] = None) -> None:
        """``name``: the worker's name, the start of each row's ``worker`` column (``NAME/tN@host:pid``);
        None: ``host:pid:tN``."""
        self._url, self._prefix, self._name = queue_url, prefix, name
        self._allow, self._device = allow_remote_code, device
        self._runner_options = runner_options or {}  # extra RowRunner keywords (loader, engine_factory)
        self.runners: list[RowRunner] = []
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self.slots = 0
        self._threads_before: Optional[int] = None  # torch's thread count before prepare (restored at shutdown)

    def prepare(self, resources: Resources) -> None:
        """``num_actors`` runner threads. torch's intra-op threads are set as a Ray actor sets its own
        (``resources.torch_threads``, auto: 1; the process's own count comes back at ``shutdown``), and
        transformers' "Loading weights" bar is off, as on the actors (HF_HUB_DISABLE_PROGRESS_BARS)."""
        self._as_on_actors(resolve_shape(resources, cluster_cpus=0, cluster_gpus=0).threads)
        n = 1 if resources.num_actors == "auto" else int(resources.num_actors)
        if n == self.slots:
            return
        self._shutdown_pool()
        self.runners = [self._runner(i) for i in range(n)]
        self._pool = cf.ThreadPoolExecutor(max_workers=n, thread_name_prefix="racer-batch-runner")
        self.slots = n

    def _runner(self, slot: int) -> RowRunner:
        sink = RedisSink(JobQueue(connect(self._url), prefix=self._prefix))
        where = f"{socket.gethostname()}:{os.getpid()}"
        name = f"{self._name}/t{slot}@{where}" if self._name else f"{where}:t{slot}"
        return RowRunner(worker_name=name, sink=sink, allow_remote_code=self._allow, device=self._device,
                         **self._runner_options)

    def submit(self, slot: int, task: ShardTask) -> cf.Future:
        """Run the task on a thread; the validated spec and plan are shared as they are."""
        assert self._pool is not None, "prepare() before submit()"
        return self._pool.submit(self.runners[slot].run_shard, task)

    def end_job(self, job_id: str) -> None:
        for r in self.runners:
            r.end_job(job_id)

    def usable_slots(self) -> list[int]:
        return list(range(self.slots))

    def restart(self, slot: int) -> bool:
        """A fresh runner for the slot; threads always have room (True)."""
        if slot < len(self.runners):
            self.runners[slot] = self._runner(slot)
        return True

    def regrow(self) -> list[int]:
        return []

    def room_note(self) -> Optional[str]:
        return None

    def check_cluster(self) -> None:
        return None

    def lost_nodes(self) -> list[str]:
        return []

    def is_crash(self, exc: BaseException) -> bool:
        return False

    def node_fault(self, slot: int, exc: BaseException) -> bool:
        return False  # threads of this process: no node to lose

    def root_cause(self, exc: BaseException) -> BaseException:
        return exc

    def _as_on_actors(self, threads: int) -> None:
        """torch's intra-op threads and the HF progress bar as a Ray actor has them."""
        try:
            import torch
            from transformers.utils import logging as hf_logging
        except ImportError:  # the stand-in model needs neither
            return
        hf_logging.disable_progress_bar()
        if self._threads_before is None:
            self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)

    def _shutdown_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool = None
        self.runners = []
        self.slots = 0

    def shutdown(self) -> None:
        self._shutdown_pool()
        if self._threads_before is not None:
            import torch

            torch.set_num_threads(self._threads_before)
            self._threads_before = None


def _ignore_sigint() -> None:
    """A Ctrl-C at the terminal reaches every process of its group, the actors of a ``submit --local`` too: the
    worker stops them itself (hands the job back, ends its Ray), so an actor ignores SIGINT instead of dying
    mid-shard with a traceback."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the process's main thread (a threaded actor): Ray's own handling stays
        pass


def _actors_that_fit(resources: dict, placed: int, shape: "PoolShape") -> int:
    """How many more actors of ``shape`` a node with ``resources`` ({"CPU": n, "GPU": n}) holds beside the
    ``placed`` ones there (1 for a shape that asks for no CPU and no GPU)."""
    cpus, gpus = shape.cpus_per_actor, shape.gpus_per_actor
    fit = [int((resources.get("CPU", 0.0) - placed * cpus) / cpus + 1e-9)] if cpus > 0 else []
    fit += [int((resources.get("GPU", 0.0) - placed * gpus) / gpus + 1e-9)] if gpus > 0 else []
    return max(0, min(fit)) if fit else 1


class GenerationActor:
    """The Ray actor: a thin shell around RowRunner (tests use RowRunner directly)."""

    def __init__(self, *, worker_name: str, redis_url: str, prefix: str, torch_threads: int,
                 allow_remote_code: bool = False) -> None:
        _ignore_sigint()
        self._threads = torch_threads
        os.environ["OMP_NUM_THREADS"] = str(torch_threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(torch_threads)
        sink = RedisSink(JobQueue(connect(redis_url), prefix=prefix))
        self.runner = RowRunner(worker_name=f"{worker_name}@{socket.gethostname()}:{os.getpid()}", sink=sink,
                                node=_ray_node_id(), allow_remote_code=allow_remote_code)

    def run_shard(self, task: dict) -> ShardResult:
        torch = sys.modules.get("torch")  # imported by the model loader; set its thread count once loaded
        if torch is not None and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        return self.runner.run_shard(task)

    def end_job(self, job_id: str) -> bool:
        return self.runner.end_job(job_id)

    def node(self) -> Optional[str]:
        """The Ray node id (hex) this actor runs on; its answer is also the sign that the actor was placed."""
        return self.runner.node

    def describe(self) -> dict:
        return self.runner.describe()


def _ray_node_id() -> Optional[str]:
    """The Ray node id of this process (hex), or None outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - no Ray, or no runtime context: the column stays null
        return None


def head_reachable(gcs_address: str, *, timeout_s: float = 2.0) -> Optional[str]:
    """None when a TCP connection to the Ray head's GCS (``host:port``) opens within ``timeout_s`` seconds,
    else the reason (``Connection refused``, ``timed out``)."""
    host, _, port = gcs_address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return None


SUSPECT_S = 60.0  # a node whose raylet stopped answering takes no new actor for at least this long


def _raylet_answers(node: dict, *, timeout_s: float = 1.0) -> bool:
    """Whether the node's raylet (``ray.nodes()`` entry) accepts a TCP connection on its node-manager port."""
    host, port = node.get("NodeManagerAddress"), node.get("NodeManagerPort")
    if not host or not port:
        return True  # nothing to check: trust Ray's listing
    return head_reachable(f"{host}:{port}", timeout_s=timeout_s) is None


class RayExecutor:
    """A pool of GenerationActor spread over the cluster's nodes; kept across jobs, rebuilt only when the
    shape changes.

    Placement: every actor is created with Ray's ``SPREAD`` scheduling strategy, so the pool lands on as many
    nodes as have room (one node's loss then costs the fewest actors) instead of filling the node the worker
    joined first, as Ray's default policy does.

    Cluster faults (docs/scaleout.md, "Cluster mode"): an actor that dies, with its process or its node, is
    restarted while the cluster has room for it; otherwise its slot is dropped and the job runs on the slots
    left (``usable_slots``). ``regrow`` starts dropped slots again once there is room (a node joined). An
    actor that is still not placed ``start_timeout_s`` seconds after it was started fails its shard with
    ActorNotPlaced. ``check_cluster`` raises ClusterLost when the head stops answering: Ray's own calls would
    then block for a minute and end the process, so the worker checks first and hands its job back."""

    def __init__(self, queue_url: str, *, prefix: str, name: str, allow_remote_code: bool = False,
                 start_timeout_s: float = 120.0) -> None:
        import ray

        assert start_timeout_s > 0, f"start_timeout_s must be positive, got {start_timeout_s}"
        self._ray = ray
        self._url, self._prefix, self._name, self._allow = queue_url, prefix, name, allow_remote_code
        self._remote = ray.remote(GenerationActor)
        self.start_timeout_s = start_timeout_s
        self.actors: list[Any] = []  # per slot; None: the slot is dropped (no room in the cluster)
        self._placed: dict[int, cf.Future] = {}  # slot -> the actor's node id, done once it is placed
        self._hosts: set[str] = set()  # nodes that hosted this pool's actors, not yet reported lost
        self._timers: list[threading.Timer] = []
        # nodes (ids, hex) whose raylet stopped answering under an actor of this pool, with when: Ray may list
        # such a node alive for a while yet (its health checks have not failed enough), so no actor is
        # started there until it answers again after SUSPECT_S seconds, or Ray lists it dead
        self._suspects: dict[str, float] = {}
        self.shape: Optional[PoolShape] = None
        self.slots = 0

    # ---- the pool
    def prepare(self, resources: Resources) -> None:
        """Size the pool for a job (``resolve_shape`` over the cluster's resources); start as many actors as
        the nodes have room for, the rest of the slots dropped until there is room. Raises ClusterLost."""
        self.check_cluster()
        cluster = self._ray.cluster_resources()
        shape = resolve_shape(resources, cluster_cpus=cluster.get("CPU", 1), cluster_gpus=cluster.get("GPU", 0))
        if shape == self.shape:
            return
        self.shutdown()
        self.shape = shape
        self.slots = shape.num_actors
        self.actors = [None] * shape.num_actors
        for slot in range(min(shape.num_actors, self._free_places())):
            self.actors[slot] = self._start(slot)
        log.info("actor pool: %s, scheduling strategy SPREAD", shape)
        note = self.room_note()
        if note:
            log.warning("actor pool: %s", note)

    def usable_slots(self) -> list[int]:
        return [slot for slot, actor in enumerate(self.actors) if actor is not None]

    def _start(self, slot: int, *, node: Optional[str] = None) -> Any:
        """Start the slot's actor: SPREAD over the cluster, or on ``node`` (hard node affinity) when a node is
        suspect, so that Ray cannot place it on the suspect one."""
        assert self.shape is not None
        strategy: Any = "SPREAD"
        if node is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        actor = self._remote.options(
            num_cpus=self.shape.cpus_per_actor, num_gpus=self.shape.gpus_per_actor, max_restarts=0,
            scheduling_strategy=strategy,
        ).remote(worker_name=f"{self._name}/a{slot}", redis_url=self._url, prefix=self._prefix,
                 torch_threads=self.shape.threads, allow_remote_code=self._allow)
        placed = actor.node.remote().future()
        placed.add_done_callback(self._note_host)
        self._placed[slot] = placed
        return actor

    def _note_host(self, placed: cf.Future) -> None:
        if not placed.cancelled() and placed.exception() is None and placed.result():
            self._hosts.add(placed.result())

    def _free_places(self) -> int:
        """How many more actors of the pool's shape the live nodes hold beside this pool's live actors (an
        actor not placed yet counts against the total). Other drivers' use of the nodes is not seen; an
        actor that finds no room after all ends with ActorNotPlaced. Suspect nodes have no room."""
        rooms, unplaced = self._rooms()
        return max(0, sum(rooms.values()) - unplaced)

    def _suspect_nodes(self, nodes: list[dict]) -> set[str]:
        """The suspect nodes still suspect: listed alive and either suspected less than SUSPECT_S seconds ago
        or still not answering. A node Ray lists dead leaves the list (it has no room anyway)."""
        alive = {n.get("NodeID"): n for n in nodes if n.get("Alive")}
        now = time.monotonic()
        for node_id, since in list(self._suspects.items()):
            if node_id not in alive or (now - since >= SUSPECT_S and _raylet_answers(alive[node_id])):
                del self._suspects[node_id]
        return set(self._suspects)

    def _start_where_room(self, slot: int) -> Any:
        """``_start``; while a node is suspect, on the live node with the most room other than it."""
        node = None
        if self._suspects:
            rooms, _ = self._rooms()
            if rooms:
                node = max(rooms, key=lambda n: rooms[n])
        return self._start(slot, node=node)

    def _rooms(self) -> tuple[dict[str, int], int]:
        """({node id: how many more actors of the pool's shape it holds} over the live, not suspect nodes with
        room, the number of this pool's actors not placed yet)."""
        assert self.shape is not None
        used: collections.Counter[str] = collections.Counter()
        unplaced = 0
        for slot, actor in enumerate(self.actors):
            if actor is None:
                continue
            placed = self._placed.get(slot)
            if placed is not None and placed.done() and placed.exception() is None and placed.result():
                used[placed.result()] += 1
            else:
                unplaced += 1
        nodes = self._ray.nodes()
        suspect = self._suspect_nodes(nodes) if self._suspects else set()
        rooms: dict[str, int] = {}
        for node in nodes:
            if not node.get("Alive") or node.get("NodeID") in suspect:
                continue
            room = _actors_that_fit(node.get("Resources", {}), used[node.get("NodeID")], self.shape)
            if room:
                rooms[node.get("NodeID")] = room
        return rooms, unplaced

    def room_note(self) -> Optional[str]:
        """Why some slots are dropped (``3 of 4 actors: no room for more actors of 1 CPU on the 3 live nodes
        (3 CPU)``), or None when every slot has an actor."""
        if self.shape is None or all(a is not None for a in self.actors):
            return None
        live = [n for n in self._ray.nodes() if n.get("Alive")]
        cpu = sum(n.get("Resources", {}).get("CPU", 0.0) for n in live)
        gpu = sum(n.get("Resources", {}).get("GPU", 0.0) for n in live)
        want = f"{self.shape.cpus_per_actor:g} CPU" + (f", {self.shape.gpus_per_actor:g} GPU"
                                                      if self.shape.gpus_per_actor else "")
        has = f"{cpu:g} CPU" + (f", {gpu:g} GPU" if gpu else "")
        return (f"{len(self.usable_slots())} of {self.slots} actors: no room for more actors of {want} on the "
                f"{len(live)} live node(s) ({has})")

    # ---- shards
    def submit(self, slot: int, task: ShardTask) -> cf.Future:
        """Send the task as plain data; the actor validates its spec once per job and spec hash. On an actor
        not placed yet, the future fails with ActorNotPlaced after ``start_timeout_s`` seconds."""
        actor = self.actors[slot]
        assert actor is not None, f"slot {slot} was dropped (no room in the cluster); it takes no shards"
        fut = actor.run_shard.remote(task.to_dict()).future()
        placed = self._placed.get(slot)
        if placed is None or placed.done():
            return fut
        return self._placed_in_time(slot, actor, placed, fut)

    def _placed_in_time(self, slot: int, actor: Any, placed: cf.Future, fut: cf.Future) -> cf.Future:
        """``fut``, or ActorNotPlaced when the actor is not placed within ``start_timeout_s`` seconds."""
        out: cf.Future = cf.Future()

        def settle(setter: Any, value: Any) -> None:
            try:
                setter(value)
            except cf.InvalidStateError:  # the other side settled it first
                pass

        def copy(done: cf.Future) -> None:
            exc = done.exception()
            settle(out.set_exception, exc) if exc is not None else settle(out.set_result, done.result())

        def expire() -> None:
            if placed.done() or out.done():
                return
            settle(out.set_exception, ActorNotPlaced(
                f"actor of slot {slot} not placed within {self.start_timeout_s:g} s: "
                f"{self.room_note() or 'the cluster has no node with room for it now'}"))
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - killing a pending actor is best effort
                pass

        fut.add_done_callback(copy)
        timer = threading.Timer(self.start_timeout_s, expire)
        timer.daemon = True
        timer.start()
        self._timers = [t for t in self._timers if t.is_alive()] + [timer]
        return out

    def end_job(self, job_id: str) -> None:
        """Free the job's state on every actor (waits up to 60 s). Raises ClusterLost."""
        self.check_cluster()
        refs = [a.end_job.remote(job_id) for a in self.actors if a is not None]
        try:
            self._ray.get(refs, timeout=60)
        except self._ray.exceptions.RayError as exc:
            log.warning("freeing state of job %s: %s", job_id, exc)

    # ---- faults
    def restart(self, slot: int) -> bool:
        """Replace the slot's actor after it died. Returns False when the slot is dropped instead: the live
        nodes have no room for another actor (a node was lost), or the pool was shut down. Raises ClusterLost."""
        if slot >= len(self.actors):  # the pool was shut down meanwhile
            return False
        self.check_cluster()
        old, self.actors[slot] = self.actors[slot], None
        self._placed.pop(slot, None)
        if old is not None:
            try:
                self._ray.kill(old, no_restart=True)
            except self._ray.exceptions.RayError:
                pass
        if self._free_places() < 1:
            log.warning("slot %d dropped: %s", slot, self.room_note())
            return False
        self.actors[slot] = self._start_where_room(slot)
        return True

    def regrow(self) -> list[int]:
        """Start actors for dropped slots while the live nodes have room; returns the slots started."""
        dropped = [slot for slot, actor in enumerate(self.actors) if actor is None]
        if not dropped:
            return []
        self.check_cluster()
        back = dropped[:self._free_places()]
        for slot in back:
            self.actors[slot] = self._start_where_room(slot)
        return back

    def check_cluster(self) -> None:
        """Raises ClusterLost when the head of the Ray cluster this process joined does not answer (see
        ``head_reachable``). Cheap: one TCP connection."""
        if not self._ray.is_initialized():
            return
        address = self._ray.get_runtime_context().gcs_address
        why = head_reachable(address)
        if why is not None:
            raise ClusterLost(f"the Ray head at {address} does not answer ({why})")

    def lost_nodes(self) -> list[str]:
        """Nodes (ids, hex) that hosted this pool's actors and are now dead, each reported once."""
        if not self._hosts:
            return []
        self.check_cluster()
        nodes = self._ray.nodes()
        alive = {n.get("NodeID") for n in nodes if n.get("Alive")}
        gone = sorted((self._hosts - alive) | (self._hosts & self._suspect_nodes(nodes)))
        self._hosts.difference_update(gone)
        return gone

    def is_crash(self, exc: BaseException) -> bool:
        ex = self._ray.exceptions
        return isinstance(exc, (ex.RayActorError, ex.WorkerCrashedError, ex.ObjectLostError, ex.NodeDiedError,
                                ActorNotPlaced))

    def node_fault(self, slot: int, exc: BaseException) -> bool:
        """Whether the slot's failure (an ``is_crash`` one) came from its node, not from its shard: the actor
        was never placed in time, or its node is dead, or its node's raylet does not answer (Ray may list
        such a node alive for half a minute yet). Such a node becomes suspect: no actor is started on it
        (``restart``, ``regrow``) until it answers again. Call before ``restart``. A plain actor crash on a
        live node (a row that runs it out of memory) is not a node fault."""
        ex = self._ray.exceptions
        if isinstance(exc, ActorNotPlaced):
            return True
        placed = self._placed.get(slot)
        node_id = (placed.result() if placed is not None and placed.done() and not placed.cancelled()
                   and placed.exception() is None else None)
        if node_id is None:
            return isinstance(exc, (ex.ActorUnavailableError, ex.NodeDiedError))
        try:
            info = next((n for n in self._ray.nodes() if n.get("NodeID") == node_id), None)
        except Exception:  # noqa: BLE001 - the GCS did not answer: the cluster check decides later
            info = None
        if info is None or not info.get("Alive") or not _raylet_answers(info):
            self._suspects.setdefault(node_id, time.monotonic())
            return True
        return isinstance(exc, ex.NodeDiedError)

    def root_cause(self, exc: BaseException) -> BaseException:
        if isinstance(exc, self._ray.exceptions.RayTaskError):
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            return cause
        return exc

    def shutdown(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers = []
        for a in self.actors:
            if a is None:
                continue
            try:
                self._ray.kill(a, no_restart=True)
            except self._ray.exceptions.RayError:
                pass
        self.actors = []
        self._placed.clear()
        self.shape = None
        self.slots = 0
