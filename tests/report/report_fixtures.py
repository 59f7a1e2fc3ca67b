"""Report-test helpers (re-exported from tests/helpers.py; a conftest.py cannot be imported by name)."""

from helpers import base_overrides, write_parquet

__all__ = ["base_overrides", "write_parquet"]
