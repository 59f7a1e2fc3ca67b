"""Plain helpers for service tests (a module of its own: test modules import it by name, which a
conftest.py cannot safely be, since every test folder has one)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def base_overrides(tmp_path: Path, **extra) -> dict:
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
