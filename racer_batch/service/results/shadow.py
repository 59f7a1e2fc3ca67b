"""Shadow rows and sample seeds: the pure pieces shared by the worker and ``racer-batch shadow``.

A *shadow* run decodes a deterministic sample of a job's rows a second time with a baseline decoding config
(say ``ar``) on the same worker, right before or right after the row itself, so that machine drift hits
both sides alike. Each sampled row gives two records in ``shadow-*.parquet``: ``side = "method"`` (the job's
config) and ``side = "baseline"``. The report compares texts (greedy decoding must match exactly) and times.

A record of a shadow file is a ``ShadowRecord`` (service/results/record.py: the side's ``RowRecord`` plus run, side,
order, temperature and reference); ``SHADOW_SCHEMA`` is derived there from ``RowRecord``'s columns.

Which rows: ``shadow_selected(seed, row_id, fraction)`` hashes (seed, row id), so the sample does not depend
on sharding, row order or which worker runs the row, and a re-run picks the same rows.

Example::

    >>> shadow_selected(7, "code-01", 1.0), shadow_selected(7, "code-01", 0.0)
    (True, False)
    >>> sample_seed(10, 0), sample_seed(10, 1) != sample_seed(10, 2)
    (10, True)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Mapping, Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq

from racer_batch.service.results.record import SHADOW_SCHEMA, ShadowRecord, records_table  # SHADOW_SCHEMA: re-exported
from racer_batch.service.results.sinks import write_parquet_atomic

SEED_MOD = 2**63
# Odd, so k -> k * SEED_STRIDE is one-to-one modulo 2**63: the seeds of one prompt's samples never collide.
SEED_STRIDE = 0x9E3779B97F4A7C15 % SEED_MOD
SHADOW_FILE_GLOB = "_shadow-*.parquet"  # "_": outside the Parquet dataset of the part files


def _unit_hash(*parts: object) -> float:
    """A uniform number in [0, 1) from the parts (sha256; stable across processes and Python versions)."""
    blob = "\0".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big") / 2.0**64


def shadow_selected(seed: int, row_id: str, fraction: float) -> bool:
    """True when the row with this id belongs to the shadow sample (about ``fraction`` of all rows)."""
    return _unit_hash("shadow", seed, row_id) < fraction


def baseline_first(seed: int, row_id: str) -> bool:
    """Which side of a shadow pair runs first (half the rows each way, decided by the hash)."""
    return _unit_hash("order", seed, row_id) < 0.5


def sample_seed(row_seed: int, sample: int) -> int:
    """Seed of sample ``sample`` of a row: sample 0 keeps the row's seed; the seeds of one row are distinct."""
    assert sample >= 0, f"sample index must be >= 0, got {sample}"
    return (row_seed + sample * SEED_STRIDE) % SEED_MOD


def shadow_path(out_dir: str | Path, name: str) -> Path:
    """``shadow_path(out, "00003")`` -> out/_shadow-00003.parquet (a shard's); post-hoc runs use a tag."""
    return Path(out_dir) / f"_shadow-{name}.parquet"


def write_shadow(path: str | Path, records: Iterable[Union[ShadowRecord, Mapping]], *,
                 meta: Optional[dict] = None) -> Path:
    """Write shadow records (ShadowRecord, or shadow-row dicts) atomically and durably, through the same
    writer as the part files (sinks.write_parquet_atomic). ``meta`` goes into the footer as JSON."""
    table = records_table(records, SHADOW_SCHEMA)
    if meta:
        table = table.replace_schema_metadata({b"racer_batch.shadow": json.dumps(meta, sort_keys=True).encode()})
    return write_parquet_atomic(path, table)


def read_shadow(out_dir: str | Path) -> pa.Table:
    """Every shadow file of an output folder as one table (SHADOW_SCHEMA; empty when there are none).

    Reading with the schema fills a column missing from an older file with nulls (``reference``)."""
    files = sorted(Path(out_dir).glob(SHADOW_FILE_GLOB))
    if not files:
        return SHADOW_SCHEMA.empty_table()
    return pa.concat_tables([pq.read_table(f, schema=SHADOW_SCHEMA) for f in files])
