"""Service tests: the shared fixtures (Redis, private prefix, queue) come from tests/fixtures.py through
tests/conftest.py; here, one local Ray session per test module."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.fixtures import RaySession, local_ray


@pytest.fixture(scope="module")
def ray_session() -> Iterator[RaySession]:
    """One local Ray for the whole module (start-up takes ~10 s)."""
    yield from local_ray("rb-ray-")
