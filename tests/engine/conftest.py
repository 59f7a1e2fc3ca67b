"""Fixtures shared by the kernel tests."""

import pytest

from racer_batch.engine.kernels import cpu_ops


@pytest.fixture()
def isa_restored():
    """Put our CPU kernels' instruction set back as it was after a test that switches it (``set_isa``)."""
    ops = cpu_ops()
    old = ops.isa()
    yield
    ops.set_isa(old)
