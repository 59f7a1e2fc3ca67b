"""Local runs: a Redis to talk to (the one at the URL, else a private ``redis-server``), a local Ray,
and an embedded worker that runs until a given job ends (``submit --local --wait``)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from racer_batch.service.execution.actors import RayExecutor, ThreadExecutor, head_reachable
from racer_batch.service.execution.queue import TERMINAL, JobQueue, QueueUnavailable, connect, redact_url
from racer_batch.service.execution.worker import Worker

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[3]  # the folder holding the racer_batch package


@dataclass
class PrivateRedis:
    """A redis-server started for one run (no persistence); ``stop()`` ends it and removes its folder."""

    url: str
    proc: subprocess.Popen
    workdir: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_private_redis(*, port: Optional[int] = None, password: Optional[str] = None,
                        timeout_s: float = 10.0) -> PrivateRedis:
    exe = shutil.which("redis-server")
    if exe is None:
        raise QueueUnavailable("redis-server is not on the PATH; install Redis or set REDIS_URL to a running one")
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="rb-redis-")
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", workdir, "--daemonize", "no", "--loglevel", "warning"]
    if password:
        args += ["--requirepass", password]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    auth = f":{password}@" if password else ""
    url = f"redis://{auth}127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            shutil.rmtree(workdir, ignore_errors=True)
            raise QueueUnavailable(f"private redis-server exited at start: {err.strip()[:300]}")
        try:
            connect(url, timeout_s=0.5)
            return PrivateRedis(url=url, proc=proc, workdir=workdir)
        except QueueUnavailable:
            time.sleep(0.1)
    proc.kill()
    shutil.rmtree(workdir, ignore_errors=True)
    raise QueueUnavailable(f"private redis-server on port {port} did not answer within {timeout_s:.0f} s")


def ensure_redis(url: str, *, allow_private: bool = True) -> tuple[str, Optional[PrivateRedis]]:
    """The URL if Redis answers there; else a private redis-server (when allowed and on the PATH)."""
    try:
        connect(url, timeout_s=2.0)
        return url, None
    except QueueUnavailable as exc:
        if not allow_private or shutil.which("redis-server") is None:
            raise QueueUnavailable(
                f"{exc}\nStart Redis (redis-server) or set REDIS_URL; with redis-server on the PATH, "
                "`submit --local` starts a private one."
            ) from None
        log.warning("%s; starting a private redis-server for this run", exc)
    private = start_private_redis()
    return private.url, private


_OWNED_RAY_TMP: list[str] = []  # temp folders of the local Ray sessions this process started
_WATCHDOGS: list[subprocess.Popen] = []

# Run by a child of the process that starts a local Ray. Its stdin is a pipe whose only writer is that
# process, so the read returns when it ends, however it ends (kill -9 included). Ray ties the raylet and the
# GCS to their parent (parent-death signal) but not the agents the raylet starts (DashboardAgent,
# RuntimeEnvAgent), which linger for a minute; every process of the session is killed here, by pid: those
# whose command line names the session's private temp folder, and Ray processes ("ray::..." command lines: the
# agents rename theirs) holding a file open below it. Never the process that started Ray (after an orderly
# shutdown it is still alive, and may hold a log file of the folder open) and never this one.
_WATCHDOG = r"""
import os, shutil, signal, sys
starter = os.getppid()
sys.stdin.buffer.read()
tag, spared = sys.argv[1].encode(), {os.getpid(), starter}


def of_session(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read()
        if tag in cmd:
            return True
        if not cmd.startswith(b"ray::"):
            return False
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if os.readlink(f"/proc/{pid}/fd/{fd}").encode().startswith(tag):
                return True
    except OSError:
        pass
    return False


for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) not in spared and of_session(pid):
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
if sys.argv[2] == "1":
    shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


def start_ray_watchdog(temp_dir: str, *, remove_dir: bool) -> Optional[subprocess.Popen]:
    """A child process that kills the local Ray of ``temp_dir`` (every process whose command line names the
    folder) as soon as this process ends, even by SIGKILL; ``remove_dir`` also deletes the folder then.
    None where /proc is missing (not Linux)."""
    if not os.path.isdir("/proc/self"):
        return None
    proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, temp_dir, "1" if remove_dir else "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _WATCHDOGS.append(proc)
    return proc


def check_head_address(address: str, *, timeout_s: float = 3.0) -> None:
    """Raises ConnectionError when ``address`` is an explicit ``host:port`` whose GCS does not accept a TCP
    connection within ``timeout_s`` seconds: ``ray.init`` would retry such an address for ever. ``auto``,
    ``ray://`` addresses and a host without a port are left to Ray (they fail cleanly or mean something
    else)."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    why = head_reachable(f"{host.strip('[]')}:{port}", timeout_s=timeout_s)
    if why is not None:
        raise ConnectionError(f"the Ray head at {address} does not answer ({why})")


ACTOR_ENV_PREFIXES = ("RACER_", "HF_")  # the worker's variables that travel to its actors, on every node


def actor_env_vars(environ: Optional[dict] = None) -> dict[str, str]:
    """The environment the actors get (Ray's runtime_env ``env_vars``), on the worker's node and on every
    other node of a joined cluster alike: each of the worker's variables whose name starts with ``RACER_``
    or ``HF_`` (engine hook, kernels, caches, Hugging Face offline mode...), and PYTHONPATH with the
    project first. HF_HUB_DISABLE_PROGRESS_BARS defaults to 1."""
    environ = os.environ if environ is None else environ
    env_vars = {k: v for k, v in environ.items() if k.startswith(ACTOR_ENV_PREFIXES)}
    env_vars["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), environ.get("PYTHONPATH")]))
    env_vars.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return env_vars


def init_local_ray(*, address: Optional[str] = None, num_cpus: Optional[int] = None,
                   temp_dir: Optional[str] = None) -> None:
    """Start (or join, with ``address``) Ray. Local runs use a short private temp folder, no dashboard;
    ``shutdown_local_ray`` stops it and removes the folder."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray renices its workers to 15 by default; on a shared machine that starves the generation actors.
    os.environ.setdefault("RAY_worker_niceness", "0")
    if address:
        check_head_address(address)  # before Ray: it would retry an unreachable head for ever
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": actor_env_vars()}
    if address:
        ray.init(address=address, runtime_env=env, logging_level=logging.WARNING, log_to_driver=True)
        return
    tmp = temp_dir or tempfile.mkdtemp(prefix="rb-ray-", dir="/tmp")  # short: Ray's socket paths are limited
    if temp_dir is None:
        _OWNED_RAY_TMP.append(tmp)
    start_ray_watchdog(tmp, remove_dir=temp_dir is None)  # before Ray: no window where it could outlive us
    ray.init(num_cpus=num_cpus or os.cpu_count(), _temp_dir=tmp, include_dashboard=False, runtime_env=env,
             logging_level=logging.WARNING, log_to_driver=True, configure_logging=True)


def shutdown_local_ray() -> None:
    """Stop the Ray this process started (no-op when joined or not started) and remove its temp folder."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    while _WATCHDOGS:  # closing its pipe lets it sweep whatever Ray left behind
        dog = _WATCHDOGS.pop()
        if dog.stdin is not None:
            dog.stdin.close()
        try:
            dog.wait(timeout=10)
        except subprocess.TimeoutExpired:
            dog.kill()
    while _OWNED_RAY_TMP:
        shutil.rmtree(_OWNED_RAY_TMP.pop(), ignore_errors=True)


def make_executor(kind: str, *, url: str, prefix: str, name: str, allow_remote_code: bool = False,
                  actor_start_timeout_s: float = 120.0):
    """``ray``: a RayExecutor (``actor_start_timeout_s``: how long a started actor may wait for a node with
    room before its shard is retried elsewhere); ``thread``: a ThreadExecutor. ``name`` starts each row's
    ``worker`` column."""
    if kind == "ray":
        return RayExecutor(url, prefix=prefix, name=name, allow_remote_code=allow_remote_code,
                           start_timeout_s=actor_start_timeout_s)
    assert kind == "thread", f"unknown executor kind {kind!r}"
    return ThreadExecutor(url, prefix=prefix, allow_remote_code=allow_remote_code, name=name)


@dataclass
class EmbeddedRun:
    state: str
    elapsed_s: float
    extra: dict = field(default_factory=dict)


def run_until_done(queue: JobQueue, job_id: str, *, url: str, prefix: str, executor_kind: str = "ray",
                   lease_s: float = 30.0, on_tick: Optional[Callable[[], None]] = None,
                   tick_s: float = 1.0) -> EmbeddedRun:
    """Run an in-process worker until ``job_id`` reaches a terminal state. ``on_tick`` runs on the calling
    thread every ``tick_s`` (progress display) while the worker runs on a background thread."""
    t0 = time.monotonic()
    executor = make_executor(executor_kind, url=url, prefix=prefix, name="local")
    worker = Worker(queue, executor, name=f"local-{os.getpid()}", lease_s=lease_s, only_job=job_id)
    stop_flag = threading.Event()

    def _done() -> bool:
        try:
            return queue.job_fields(job_id).get("state") in TERMINAL
        except KeyError:
            return True

    # The main thread waits on an Event of its own, not Thread.join: a join interrupted by Ctrl-C can leave
    # is_alive() False while the thread still runs (CPython 3.11), and the process would then exit before the
    # worker handed the job back.
    finished = threading.Event()

    def _loop() -> None:
        try:
            worker.run(stop=lambda: stop_flag.is_set() or _done())
        finally:
            finished.set()

    th = threading.Thread(target=_loop, name="racer-batch-worker", daemon=True)
    th.start()
    try:
        while not finished.wait(timeout=tick_s):
            if on_tick is not None:
                on_tick()
    except KeyboardInterrupt:
        stop_flag.set()  # the worker hands the job back at its next check (within a second)
        try:
            finished.wait()
        except KeyboardInterrupt:  # a second Ctrl-C: leave without waiting for the shards in flight
            pass
        raise
    finally:
        executor.shutdown()
    state = queue.job_fields(job_id).get("state", "?")
    return EmbeddedRun(state=state, elapsed_s=time.monotonic() - t0)


__all__ = ["ACTOR_ENV_PREFIXES", "PrivateRedis", "actor_env_vars", "check_head_address", "ensure_redis",
           "init_local_ray", "make_executor", "redact_url", "run_until_done", "shutdown_local_ray",
           "start_private_redis"]
