"""Fixtures for scale-out tests: the real Redis under a private key prefix (deleted after the test)."""

from __future__ import annotations

import os
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
        pytest.skip(f"these tests need Redis: {exc}")
    return REDIS_URL


@pytest.fixture()
def prefix(redis_url: str):
    from racer_batch.service.queue import connect

    p = f"rbscale-{uuid.uuid4().hex[:10]}:"
    yield p
    r = connect(redis_url)
    keys = list(r.scan_iter(f"{p}*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture()
def queue(redis_url: str, prefix: str):
    from racer_batch.service.queue import JobQueue

    return JobQueue.from_url(redis_url, prefix=prefix)
