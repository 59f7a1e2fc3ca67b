"""Helpers of the report tests (a module of its own: several conftest.py files share that module name)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def base_overrides(tmp_path: Path, **extra) -> dict:
    """A small job on the stand-in engine (no model download, a few ms per row)."""
    d = {
        "input.path": str(tmp_path / "in.parquet"),
        "output.path": str(tmp_path / "out"),
        "model.name": "stand-in?mat=2",
        "generation.max_new_tokens": 8,
        "output.shard_rows": 4,
        "resources.num_actors": 1,
    }
    d.update(extra)
    return d
