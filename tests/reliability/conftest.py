"""Fixtures for the reliability suite: the real Redis (private key prefix per test, cleaned up), private
redis-servers on free ports (for tests that restart or reconfigure Redis), and one local Ray for the whole
folder (this folder is a package so that ``scope="package"`` ends Ray when the folder's tests are done)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def redis_url() -> str:
    from racer_batch.service.queue import QueueUnavailable, connect

    try:
        connect(REDIS_URL, timeout_s=2.0)
    except QueueUnavailable as exc:
        pytest.skip(f"reliability tests need Redis: {exc}")
    return REDIS_URL


def _drop_prefix(url: str, prefix: str) -> None:
    from racer_batch.service.queue import connect

    r = connect(url)
    keys = list(r.scan_iter(f"{prefix}*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture()
def prefix(redis_url: str) -> Iterator[str]:
    """A private key prefix on the shared Redis; every key under it is deleted after the test."""
    p = f"rbrel-{uuid.uuid4().hex[:10]}:"
    yield p
    _drop_prefix(redis_url, p)


@pytest.fixture()
def queue(redis_url: str, prefix: str):
    from racer_batch.service.queue import JobQueue

    return JobQueue.from_url(redis_url, prefix=prefix)


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
        from racer_batch.service.queue import QueueUnavailable, connect

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
        pytest.skip("redis-server not on the PATH")
    from racer_batch.service.local import free_port

    servers: list[RedisServer] = []

    def make(password: Optional[str] = None, persist: bool = False) -> RedisServer:
        srv = RedisServer(port=free_port(), password=password, workdir=tempfile.mkdtemp(prefix="rbrel-redis-"),
                          persist=persist)
        srv.start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.stop()
        shutil.rmtree(srv.workdir, ignore_errors=True)


@dataclass
class RaySession:
    ray: object  # the ray module
    temp_dir: str  # Ray's session folder (logs included)


@pytest.fixture(scope="package")
def ray_session() -> Iterator[RaySession]:
    """One local Ray (2 CPUs, private temp folder) for every test of this folder."""
    import ray

    from racer_batch.service.local import init_local_ray

    tmp = tempfile.mkdtemp(prefix="rb-rel-", dir="/tmp")
    if ray.is_initialized():
        ray.shutdown()
    init_local_ray(num_cpus=2, temp_dir=tmp)
    yield RaySession(ray=ray, temp_dir=tmp)
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


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


ROOT = Path(__file__).resolve().parents[2]
