"""Reliability suite: the shared fixtures (Redis, private prefix, queue, private redis-servers, the CLI group)
come from tests/fixtures.py through tests/conftest.py; here, one local Ray for the whole folder (this folder
is a package so that ``scope="package"`` ends Ray when the folder's tests are done)."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.fixtures import RaySession, local_ray


@pytest.fixture(scope="package")
def ray_session() -> Iterator[RaySession]:
    """One local Ray (2 CPUs, private temp folder) for every test of this folder."""
    yield from local_ray("rb-rel-")
