"""Shadow rows and sample seeds: the pure pieces shared by the worker and ``racer-batch shadow``.

A *shadow* run decodes a deterministic sample of a job's rows a second time with a baseline decoding config
(say ``ar``) on the same worker, right before or right after the row itself, so that machine drift hits
both sides alike. Each sampled row gives two records in ``shadow-*.parquet``: ``side = "method"`` (the job's
config) and ``side = "baseline"``. The report compares texts (greedy decoding must match exactly) and times.

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
import os
import uuid
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

SEED_MOD = 2**63
# Odd, so k -> k * SEED_STRIDE is one-to-one modulo 2**63: the seeds of one prompt's samples never collide.
SEED_STRIDE = 0x9E3779B97F4A7C15 % SEED_MOD
SHADOW_FILE_GLOB = "_shadow-*.parquet"  # "_": outside the Parquet dataset of the part files
LEGACY_SHADOW_GLOB = "shadow-*.parquet"  # folders written before issue 13
SIDES = ("method", "baseline")


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


SHADOW_SCHEMA = pa.schema(
    [
        pa.field("run", pa.string(), nullable=False),  # "job" (in the job) or "posthoc:<baseline>"
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("id", pa.string(), nullable=False),
        pa.field("row_idx", pa.int64(), nullable=False),
        pa.field("shard", pa.int32()),
        pa.field("route", pa.string(), nullable=False),
        pa.field("side", pa.string(), nullable=False),  # "method" | "baseline"
        pa.field("ran_first", pa.bool_()),
        pa.field("method", pa.string()),
        pa.field("config_hash", pa.string()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("text", pa.string()),
        pa.field("turn_texts", pa.list_(pa.string())),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("output_tokens", pa.int64()),
        pa.field("finish_reason", pa.string()),
        pa.field("steps", pa.int64()),
        pa.field("mat", pa.float64()),
        pa.field("accepted_hist", pa.list_(pa.int64())),
        pa.field("prefill_ms", pa.float64()),
        pa.field("decode_ms", pa.float64()),
        pa.field("tokens_per_s", pa.float64()),
        pa.field("seed", pa.int64()),
        pa.field("temperature", pa.float64()),
        pa.field("worker", pa.string()),
        pa.field("device", pa.string()),
        pa.field("finished_at", pa.timestamp("ms", tz="UTC")),
        # The row's reference answer per turn (input column ``reference``; null entries: none). Added for the
        # capability comparison (issue 8); files written before it read back with nulls here (read_shadow).
        pa.field("reference", pa.list_(pa.string())),
    ]
)


def shadow_record(rec: dict, *, run: str, side: str, ran_first: bool, temperature: float,
                  reference: Optional[list[Optional[str]]] = None) -> dict:
    """Project an output record (OUTPUT_SCHEMA fields) onto SHADOW_SCHEMA, with the row's ``reference``
    answers (one per turn, or None; see inputs.parse_reference)."""
    assert side in SIDES, f"side must be one of {SIDES}, got {side!r}"
    out = {name: rec.get(name) for name in SHADOW_SCHEMA.names}
    out.update(run=run, side=side, ran_first=ran_first, temperature=float(temperature),
               reference=list(reference) if reference is not None else None)
    return out


def shadow_table(records: list[dict]) -> pa.Table:
    for r in records:
        extra = set(r) - set(SHADOW_SCHEMA.names)
        assert not extra, f"shadow record for row {r.get('row_idx')} has fields outside the schema: {sorted(extra)}"
    return pa.Table.from_pydict({n: [r.get(n) for r in records] for n in SHADOW_SCHEMA.names}, schema=SHADOW_SCHEMA)


def shadow_path(out_dir: str | Path, name: str) -> Path:
    """``shadow_path(out, "00003")`` -> out/_shadow-00003.parquet (a shard's); post-hoc runs use a tag."""
    return Path(out_dir) / f"_shadow-{name}.parquet"


def write_shadow(path: str | Path, records: list[dict], *, meta: Optional[dict] = None) -> Path:
    """Write shadow records atomically (hidden temporary name in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = shadow_table(records)
    if meta:
        table = table.replace_schema_metadata({b"racer_batch.shadow": json.dumps(meta, sort_keys=True).encode()})
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_shadow(out_dir: str | Path) -> pa.Table:
    """Every shadow file of an output folder as one table (SHADOW_SCHEMA; empty when there are none).

    Reading with the schema fills a column missing from an older file with nulls (``reference``)."""
    files = sorted(Path(out_dir).glob(SHADOW_FILE_GLOB)) + sorted(Path(out_dir).glob(LEGACY_SHADOW_GLOB))
    if not files:
        return SHADOW_SCHEMA.empty_table()
    return pa.concat_tables([pq.read_table(f, schema=SHADOW_SCHEMA) for f in files])
