"""Fixtures and builders shared by the service, reliability, scale-out and report tests (one module).

tests/conftest.py imports the fixtures below, so every test folder sees them:

- ``redis_url``: the real Redis at ``$REDIS_URL`` (default 127.0.0.1:6379/0); the test fails without it.
- ``prefix``: a private key prefix ``rbtest-<folder>-<10 hex>:``; every key under it is deleted after the test.
- ``queue``: a JobQueue on ``redis_url`` under ``prefix``.
- ``redis_server_factory``: ``make(password=None, persist=False)`` starts a private redis-server on a free
  port (a ``RedisServer``: stop and start it again on the same port); all are killed after the test.
- ``cli``: the service commands in a click group, for click's CliRunner.

A folder that wants one local Ray for many tests defines its own ``ray_session`` fixture (its scope is the
folder's choice) around ``local_ray``; ``ray_cluster`` starts a Ray cluster of several nodes on this machine
(tests/scaleout). Process hygiene: tests/conftest.py marks this pytest run's environment
(``SESSION_ENV``), so every process a test starts carries the mark, and at the end of the run it fails the
run when any such process is still alive (``suite_processes``). The builders ``write_parquet``, ``base_overrides``,
``submit_standin_job`` and ``queue_url`` make small jobs on the stand-in engine (tests/standin.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]  # the repository root
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


# ---- Redis: the shared server under a private prefix
@pytest.fixture(scope="session")
def redis_url() -> str:
    """``REDIS_URL`` when Redis answers there; fails the test otherwise (a skipped service test would hide that
    nothing was checked; ``make test-fast`` leaves the Redis tiers out instead)."""
    from racer_batch.service.execution.queue import QueueUnavailable, connect

    try:
        connect(REDIS_URL, timeout_s=2.0)
    except QueueUnavailable as exc:
        pytest.fail(f"these tests need Redis at {REDIS_URL} (start redis-server, or run make test-fast): {exc}")
    return REDIS_URL


def drop_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix`` on the Redis at ``url``."""
    from racer_batch.service.execution.queue import connect

    r = connect(url)
    keys = list(r.scan_iter(f"{prefix}*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture()
def prefix(redis_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A private key prefix on the shared Redis, named after the test's folder; its keys are deleted after."""
    p = f"rbtest-{request.path.parent.name}-{uuid.uuid4().hex[:10]}:"
    yield p
    drop_prefix(redis_url, p)


@pytest.fixture()
def queue(redis_url: str, prefix: str):
    from racer_batch.service.execution.queue import JobQueue

    return JobQueue.from_url(redis_url, prefix=prefix)


def queue_url(queue: Any) -> str:
    """The Redis URL (no password) a JobQueue is connected to, e.g. ``redis://127.0.0.1:6379/0``."""
    kw = queue.r.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"


# ---- Redis: private servers that a test may stop, restart or protect with a password
@dataclass
class RedisServer:
    """A redis-server of our own on a fixed free port: it can be stopped and started again (same port)."""

    port: int
    password: Optional[str]
    workdir: str
    persist: bool = False  # append-only file with fsync at every write: a kill loses nothing
    proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def url_without_password(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it and wait until it answers; raises QueueUnavailable after ``timeout_s`` seconds."""
        from racer_batch.service.execution.queue import QueueUnavailable, connect

        assert self.proc is None or self.proc.poll() is not None, "already running"
        args = [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self.workdir, "--daemonize", "no",
                "--loglevel", "warning", "--logfile", os.path.join(self.workdir, "redis.log")]
        if self.persist:
            args[args.index("--appendonly") + 1] = "yes"
            args += ["--appendfsync", "always"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                connect(self.url, timeout_s=0.5)
                return
            except QueueUnavailable:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGKILL: without persistence its data is lost; with it, the append-only file keeps every write."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture()
def redis_server_factory() -> Iterator:
    """``make(password=None, persist=False)`` starts a private redis-server on a free port."""
    if shutil.which("redis-server") is None:
        pytest.fail("these tests start private redis-servers: install redis-server (it is not on the PATH)")
    from racer_batch.service.execution.local import free_port

    servers: list[RedisServer] = []

    def make(password: Optional[str] = None, persist: bool = False) -> RedisServer:
        srv = RedisServer(port=free_port(), password=password, workdir=tempfile.mkdtemp(prefix="rbtest-redis-"),
                          persist=persist)
        srv.start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.stop()
        shutil.rmtree(srv.workdir, ignore_errors=True)


# ---- Ray and the CLI
@dataclass
class RaySession:
    ray: Any  # the ray module
    temp_dir: str  # Ray's session folder (logs included)


def local_ray(tag: str) -> Iterator[RaySession]:
    """Body of a ``ray_session`` fixture: a local Ray with 2 CPUs and a private temp folder ``/tmp/<tag>*``,
    shut down when the fixture ends (its watchdog then kills, by pid, any process of the session that is
    left) and its folder removed."""
    import ray

    from racer_batch.service.execution.local import init_local_ray, shutdown_local_ray

    tmp = tempfile.mkdtemp(prefix=tag, dir="/tmp")
    if ray.is_initialized():
        ray.shutdown()
    init_local_ray(num_cpus=2, temp_dir=tmp)
    try:
        yield RaySession(ray=ray, temp_dir=tmp)
    finally:
        shutdown_local_ray()
        shutil.rmtree(tmp, ignore_errors=True)


# ---- a Ray cluster of several nodes on this machine
# Node deaths are noticed within about a second (Ray's defaults take 15 s: checks every 3 s, 5 misses).
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                   "health_check_failure_threshold": 2}


@dataclass
class RayCluster:
    """A running ``ray.cluster_utils.Cluster``: a head and more nodes (raylets) on this machine, each with its
    own resources, in the private temp folder ``temp_dir``. Workers join it by ``address``."""

    cluster: Any  # ray.cluster_utils.Cluster
    temp_dir: str

    @property
    def address(self) -> str:
        """The head's GCS address, ``host:port``: what ``racer-batch worker --ray-address`` takes."""
        return self.cluster.address

    @property
    def head(self) -> Any:
        return self.cluster.head_node

    def nodes(self) -> list:
        """The nodes still running (``ray._private.node.Node``; ``.node_id`` is the hex id), head first."""
        return self.cluster.list_all_nodes()

    def add_node(self, **node_args: Any) -> Any:
        """Start one more node (``num_cpus``, ``resources``, ...) and wait until it has joined."""
        return self.cluster.add_node(temp_dir=self.temp_dir, include_dashboard=False, **node_args)

    def remove_node(self, node: Any) -> None:
        """Kill a node's processes (SIGKILL, by pid), as a machine that dies; the head included."""
        self.cluster.remove_node(node, allow_graceful=False)

    def processes(self) -> dict[int, bytes]:
        """{pid: command line} of the live processes of this cluster (started while it was being set up or
        used: its nodes, their agents and workers, and any process a test started meanwhile)."""
        return marked_processes(CLUSTER_ENV, self.temp_dir)


@contextlib.contextmanager
def ray_cluster(tag: str, *, head_cpus: float = 1, nodes: Sequence[dict] = (),
                fast_node_death: bool = True) -> Iterator[RayCluster]:
    """A Ray cluster of several nodes on this machine, with Ray's own ``ray.cluster_utils.Cluster`` (what
    Ray's test suite uses to simulate nodes): a head with ``head_cpus`` CPUs, then one node per entry of
    ``nodes`` (``add_node`` arguments, e.g. ``{"num_cpus": 1}``), all in a private temp folder ``/tmp/<tag>*``
    (``RAY_TMPDIR`` points there meanwhile, so Ray's address file is not the shared /tmp/ray one).
    Node deaths are noticed fast (``FAST_NODE_DEATH``) unless ``fast_node_death`` is False (Ray's defaults:
    tens of seconds). When the block ends, however it ends, every node is
    removed and any process still naming the folder is killed by pid; then the folder is removed."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix=tag, dir="/tmp")  # short: Ray's socket paths are limited
    os.makedirs(os.path.join(tmp, "ray"))
    old_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    os.environ[CLUSTER_ENV] = tmp  # every process the cluster starts inherits it (agents rename themselves)
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=head_cpus, temp_dir=tmp, include_dashboard=False,
            _system_config=FAST_NODE_DEATH if fast_node_death else None))
        for args in nodes:
            cluster.add_node(temp_dir=tmp, include_dashboard=False, **args)
        yield RayCluster(cluster=cluster, temp_dir=tmp)
    finally:
        try:
            if cluster is not None:
                cluster.shutdown()
        finally:
            os.environ.pop(CLUSTER_ENV, None)
            kill_and_wait({**_processes_naming(tmp.encode()), **marked_processes(CLUSTER_ENV, tmp)}, timeout_s=30)
            if old_tmpdir is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = old_tmpdir
            shutil.rmtree(tmp, ignore_errors=True)


# ---- worker processes
@contextlib.contextmanager
def worker_process(log_path: Path, *args: str, redis_url: str, prefix: str, name: str, lease_s: float = 3.0
                   ) -> Iterator[subprocess.Popen]:
    """``racer-batch worker --lease-s LEASE_S --name NAME ARGS...`` as a subprocess on the Redis at
    ``redis_url`` under ``prefix``, its stderr (the worker's report lines) in ``log_path``. When the block ends,
    however it ends, a process still running is killed (SIGKILL, by pid) and reaped."""
    cmd = [sys.executable, "-m", "racer_batch", "worker", "--lease-s", f"{lease_s:g}", "--redis-url", redis_url,
           "--prefix", prefix, "--name", name, *args]
    with open(log_path, "wb") as log_fh:
        proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="400"),
                                stdout=subprocess.DEVNULL, stderr=log_fh)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def rescue_job(queue: Any, job_id: str, redis_url: str, *, shards_below: int) -> None:
    """After the worker ``doomed`` was SIGKILLed mid-job: the job is still running as its own, with fewer than
    ``shards_below`` shards done; a worker ``rescuer`` (Ray actors) then takes the expired lease and ends it."""
    from racer_batch.service.execution.local import make_executor
    from racer_batch.service.execution.worker import Worker

    st = queue.status(job_id)
    assert st.state == "running" and st.owner == "doomed" and st.shards_done < shards_below
    w = Worker(queue, make_executor("ray", url=redis_url, prefix=queue.prefix, name="rescuer"), name="rescuer",
               lease_s=3)
    try:
        assert w.run(max_jobs=1, idle_exit_s=20) == 1  # the rescuer took the expired lease and ended the job
    finally:
        w.executor.shutdown()

def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, seconds) a live process has used so far."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- process hygiene: what this pytest run started
SESSION_ENV = "RACER_TEST_SESSION"  # set by tests/conftest.py to a value of this run's own
CLUSTER_ENV = "RACER_TEST_RAY_CLUSTER"  # set by ray_cluster while its cluster lives: the cluster's temp folder


def _live_pids() -> Iterator[int]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def _state(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").strip()
    except OSError:
        return b""


def _processes_naming(tag: bytes) -> dict[int, bytes]:
    """{pid: command line} of live (not zombie) processes other than this one whose command line has ``tag``."""
    me = os.getpid()
    out = {}
    for pid in _live_pids():
        if pid != me and _state(pid) not in (None, "Z"):
            cmd = _cmdline(pid)
            if tag in cmd:
                out[pid] = cmd
    return out


def suite_processes(session: str) -> dict[int, bytes]:
    """{pid: command line} of live processes (zombies left out; this one too) whose environment holds
    ``SESSION_ENV=session``: the processes this pytest run started, directly or not, orphans included.
    Processes of other users and of other pytest runs do not carry this value."""
    return marked_processes(SESSION_ENV, session)


def marked_processes(name: str, value: str) -> dict[int, bytes]:
    """{pid: command line} of live processes (zombies and this one left out) whose environment has
    ``name=value``, which every process inherits from the one that started it."""
    mark = f"{name}={value}".encode()
    me = os.getpid()
    out = {}
    for pid in _live_pids():
        if pid == me or _state(pid) in (None, "Z"):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:  # another user's process, or it just ended
            continue
        if mark in env:
            out[pid] = _cmdline(pid)
    return out


def kill_and_wait(pids: Sequence[int] | dict, *, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL each pid (ours), then wait up to ``timeout_s`` seconds for them to end. Returns those still
    alive (not zombies)."""
    for pid in list(pids):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if _state(p) not in (None, "Z")]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _state(p) not in (None, "Z")]
    return alive


@pytest.fixture()
def cli():
    """The service commands in a click group, for click's CliRunner."""
    import click

    from racer_batch.cli.service import register

    @click.group()
    def main() -> None:
        """test harness"""

    register(main)
    return main


# ---- small jobs on the stand-in engine
def write_parquet(path: Path, rows: list[dict], schema: Optional[pa.Schema] = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def base_overrides(tmp_path: Path, **extra) -> dict:
    """Spec keys (dotted, as for load_spec) of a small stand-in job reading tmp_path/in.parquet."""
    d = {
        "input.path": str(tmp_path / "in.parquet"),
        "output.path": str(tmp_path / "out"),
        "model.name": "stand-in?mat=2",
        "generation.max_new_tokens": 8,
        "output.shard_rows": 4,
        "resources.num_actors": 1,
    }
    d.update(extra)
    return d


def submit_standin_job(queue: Any, tmp_path: Path, rows: list[dict], **over) -> tuple[Any, Any]:
    """Write ``rows`` to tmp_path/in.parquet and submit a stand-in job over them (``base_overrides`` updated
    with ``over``). Returns (JobSpec, the submit result)."""
    from racer_batch.service.job.spec import load_spec
    from racer_batch.service.submit import submit_job

    write_parquet(tmp_path / "in.parquet", rows)
    spec = load_spec(None, base_overrides(tmp_path, **over))
    return spec, submit_job(queue, spec)
