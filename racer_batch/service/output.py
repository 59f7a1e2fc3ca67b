"""Output folder: one Parquet part file per shard, committed by an atomic rename, plus manifest.json.

The part files are the truth. Each carries its shard's summary in the Parquet key-value metadata
(``racer_batch.shard``), so the manifest can always be rebuilt from them: a shard counts as committed when
its file exists, was written for the same spec hash, covers its full row range and has no cancelled rows.
A re-run rewrites only uncommitted shards, and since a shard's rows always go to the same file name,
every input id appears exactly once however often a shard is retried.

Layout::

    out/demo/manifest.json
    out/demo/part-00000.parquet      rows [0, shard_rows)
    out/demo/part-00001.parquet      rows [shard_rows, 2*shard_rows)
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from racer_batch.service.schema import OUTPUT_SCHEMA, SCHEMA_VERSION, now_utc, to_table

MANIFEST = "manifest.json"
SHARD_META_KEY = b"racer_batch.shard"


class OutputError(ValueError):
    """An output folder that cannot be used (not writable, or holding another job's results)."""


def part_path(out_dir: str | Path, shard: int) -> Path:
    return Path(out_dir) / f"part-{shard:05d}.parquet"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_part(out_dir: str | Path, shard: int, records: list[dict], *, shard_meta: dict) -> Path:
    """Write a part file atomically: a hidden temporary file in the same folder, fsync, rename."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = to_table(records)
    meta = dict(table.schema.metadata or {})
    meta[SHARD_META_KEY] = json.dumps(shard_meta, sort_keys=True).encode()
    table = table.replace_schema_metadata(meta)
    final = part_path(out, shard)
    tmp = out / f".{final.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh, compression="zstd")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(out)
    return final


def read_shard_meta(path: str | Path) -> Optional[dict]:
    """The summary stored in a part file's footer, or None when the file is missing or unreadable."""
    try:
        md = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowInvalid):
        return None
    raw = md.get(SHARD_META_KEY)
    return json.loads(raw) if raw else None


def shard_complete(out_dir: str | Path, shard: int, *, spec_hash: str, row_range: tuple[int, int]) -> Optional[dict]:
    """The shard's summary when its part file is complete for this spec, else None."""
    meta = read_shard_meta(part_path(out_dir, shard))
    if not meta or meta.get("spec_hash") != spec_hash:
        return None
    if (meta.get("row_start"), meta.get("row_stop")) != tuple(row_range) or meta.get("cancelled", 0):
        return None
    return meta


def committed_shards(out_dir: str | Path, *, spec_hash: str, ranges: dict[int, tuple[int, int]]) -> dict[int, dict]:
    """Shards whose part file is complete for this spec: {shard: summary}. ``ranges``: shard -> rows."""
    if not Path(out_dir).is_dir():
        return {}
    existing = {int(p.stem.split("-", 1)[1]) for p in Path(out_dir).glob("part-*.parquet")
                if p.stem.split("-", 1)[1].isdigit()}
    done = {}
    for shard in sorted(existing & set(ranges)):
        meta = shard_complete(out_dir, shard, spec_hash=spec_hash, row_range=ranges[shard])
        if meta is not None:
            done[shard] = meta
    return done


def read_manifest(out_dir: str | Path) -> Optional[dict]:
    p = Path(out_dir) / MANIFEST
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise OutputError(f"cannot read {p}: {exc}") from None


def write_manifest(out_dir: str | Path, manifest: dict) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = dict(manifest, schema_version=SCHEMA_VERSION, updated_at=now_utc().isoformat())
    tmp = out / f".{MANIFEST}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, out / MANIFEST)


def check_output_folder(out_dir: str | Path, *, spec_hash: str) -> Optional[str]:
    """At submit: make sure the folder is usable. Returns the job id of an earlier run of the same spec
    (so a re-submit resumes it), None for a fresh folder. Raises OutputError otherwise."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(f"output.path = {str(out)!r} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"output.path = {str(out)!r}: cannot create folder: {exc.strerror}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise OutputError(f"output.path = {str(out)!r}: folder is not writable")
    man = read_manifest(out)
    if man is None:
        stray = sorted(p.name for p in out.glob("part-*.parquet"))
        if stray:
            raise OutputError(
                f"output.path = {str(out)!r} holds part files ({stray[0]}, ...) but no manifest; "
                "choose an empty folder"
            )
        return None
    if man.get("spec_hash") != spec_hash:
        raise OutputError(
            f"output.path = {str(out)!r} holds job {man.get('job_id')} with a different spec "
            f"(spec hash {man.get('spec_hash')} != {spec_hash}); choose another output folder or empty it"
        )
    return man.get("job_id")


def read_output(out_dir: str | Path) -> pa.Table:
    """All part files of a job as one table (declared schema)."""
    parts = sorted(Path(out_dir).glob("part-*.parquet"))
    if not parts:
        return OUTPUT_SCHEMA.empty_table()
    return pa.concat_tables([pq.read_table(p, schema=OUTPUT_SCHEMA) for p in parts])
