"""Fixtures for service tests: the real Redis (private key prefix per test, cleaned up), one local Ray
session per test module, and helpers that write small input files."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def redis_url() -> str:
    from racer_batch.service.queue import QueueUnavailable, connect

    try:
        connect(REDIS_URL, timeout_s=2.0)
    except QueueUnavailable as exc:
        pytest.skip(f"service tests need Redis: {exc}")
    return REDIS_URL


@pytest.fixture()
def prefix(redis_url: str):
    """A private key prefix; every key under it is deleted after the test."""
    from racer_batch.service.queue import connect

    p = f"rbtest-{uuid.uuid4().hex[:10]}:"
    yield p
    r = connect(redis_url)
    keys = list(r.scan_iter(f"{p}*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture()
def queue(redis_url: str, prefix: str):
    from racer_batch.service.queue import JobQueue

    return JobQueue.from_url(redis_url, prefix=prefix)


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the whole module (start-up takes ~10 s)."""
    import ray

    from racer_batch.service.local import init_local_ray

    tmp = tempfile.mkdtemp(prefix="rb-ray-", dir="/tmp")
    if ray.is_initialized():
        ray.shutdown()
    init_local_ray(num_cpus=2, temp_dir=tmp)
    yield ray
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)
