"""Fixtures shared by the kernel tests."""

import pytest

from racer_batch.engine.kernels import cpu_ops


@pytest.fixture()
def isa_restored():
    """Put our CPU kernels' instruction set and stored-GEMM row threshold back as they were after a test that
    switches them (``set_isa``, ``set_stored_rows``)."""
    ops = cpu_ops()
    old = ops.isa()
    old_rows = ops.set_stored_rows(-1)
    ops.set_stored_rows(old_rows)
    yield
    ops.set_isa(old)
    ops.set_stored_rows(old_rows)
