"""Service-test helpers (re-exported from tests/helpers.py, shared with the report and reliability tests)."""

from helpers import base_overrides, write_parquet

__all__ = ["base_overrides", "write_parquet"]
