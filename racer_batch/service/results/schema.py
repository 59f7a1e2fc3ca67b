"""The output schema of the part files, derived from ``RowRecord`` (service/results/record.py, where the fields and
the counting rules are written down). Every part file has exactly this schema (an all-error or empty shard
included); this module keeps the names that readers of the output import."""

from __future__ import annotations

from typing import Iterable, Mapping, Union

import pyarrow as pa

from racer_batch.service.results.record import (
    OUTPUT_SCHEMA,
    SAMPLE_TYPE,
    SCHEMA_VERSION,
    STATUSES,
    RowRecord,
    now_utc,
    records_table,
)

__all__ = ["OUTPUT_SCHEMA", "SAMPLE_TYPE", "SCHEMA_VERSION", "STATUSES", "now_utc", "to_table"]


def to_table(records: Iterable[Union[RowRecord, Mapping]]) -> pa.Table:
    """Records (RowRecord, or Parquet-row dicts) -> Table with exactly OUTPUT_SCHEMA (missing keys are null;
    unknown keys are an AssertionError)."""
    return records_table(records, OUTPUT_SCHEMA)
