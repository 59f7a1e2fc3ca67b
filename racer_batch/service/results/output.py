"""Output folder: one Parquet part file per shard, committed by an atomic rename, plus _manifest.json.

The part files are the truth. Each carries its shard's summary in the Parquet key-value metadata
(``racer_batch.shard``: counts, spec hash, row range and the fingerprint of the input rows it answered) and
the per-row fingerprints (``racer_batch.rows``), so the manifest can always be rebuilt from them: a shard
counts as committed when its file exists, was written for the same spec hash, covers its full row range, has
no cancelled rows and answered the rows the input holds now (service/results/resume.py). A re-run rewrites only
uncommitted shards, and since a shard's rows always go to the same file name, every input id appears exactly
once however often a shard is retried.

Layout: the folder is a Parquet dataset (``pyarrow.parquet.read_table(folder)``, DuckDB's
``read_parquet('folder/*.parquet')``, Ray Data's ``read_parquet(folder)``): everything that is not an
output row has a name starting with ``_`` (or ``.`` for temporary files), which dataset readers skip::

    out/demo/_manifest.json
    out/demo/part-00000.parquet        rows [0, shard_rows)
    out/demo/part-00001.parquet        rows [shard_rows, 2*shard_rows)
    out/demo/_shadow-00000.parquet     shadow pairs of shard 0 (jobs with a ``shadow:`` block)
    out/demo/_report/                  ``racer-batch report`` (default folder)
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from racer_batch.service.results.record import RowRecord
from racer_batch.service.results.schema import OUTPUT_SCHEMA, SCHEMA_VERSION, now_utc, to_table
from racer_batch.service.results.sinks import write_parquet_atomic

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"
SHARD_META_KEY = b"racer_batch.shard"
ROWS_META_KEY = b"racer_batch.rows"  # [[id, row fingerprint], ...] in row order
PART_GLOB = "part-*.parquet"


class OutputError(ValueError):
    """An output folder that cannot be used (not writable, or holding another job's results)."""


def part_path(out_dir: str | Path, shard: int) -> Path:
    return Path(out_dir) / f"part-{shard:05d}.parquet"


def write_part(out_dir: str | Path, shard: int, records: list[RowRecord], *, shard_meta: dict,
               row_fingerprints: Optional[list[tuple[str, str]]] = None) -> Path:
    """Write a part file atomically (sinks.write_parquet_atomic: temporary file, fsync, rename).

    ``shard_meta`` goes into the footer as the shard's summary; ``row_fingerprints`` (``[(id, row
    fingerprint)]`` in row order, see inputs.row_fingerprint) beside it, so a resume can name changed rows."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = to_table(records)
    meta = dict(table.schema.metadata or {})
    meta[SHARD_META_KEY] = json.dumps(shard_meta, sort_keys=True).encode()
    if row_fingerprints is not None:
        meta[ROWS_META_KEY] = json.dumps([list(r) for r in row_fingerprints]).encode()
    table = table.replace_schema_metadata(meta)
    final = write_parquet_atomic(part_path(out, shard), table)
    return final


def read_part_footer(path: str | Path) -> tuple[Optional[dict], Optional[list[tuple[str, str]]]]:
    """(shard summary, row fingerprints) from a part file's footer; (None, None) when the file is missing or
    unreadable, a None row list for a file written before row fingerprints existed."""
    try:
        md = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowInvalid):
        return None, None
    raw, rows = md.get(SHARD_META_KEY), md.get(ROWS_META_KEY)
    return (json.loads(raw) if raw else None), ([tuple(r) for r in json.loads(rows)] if rows else None)


def read_shard_meta(path: str | Path) -> Optional[dict]:
    """The summary stored in a part file's footer, or None when the file is missing or unreadable."""
    return read_part_footer(path)[0]


def meta_matches(meta: Optional[dict], *, spec_hash: str, row_range: tuple[int, int]) -> bool:
    """True when a shard summary is complete for this spec and row range (the input rows are checked apart)."""
    return bool(meta) and meta.get("spec_hash") == spec_hash and (
        (meta.get("row_start"), meta.get("row_stop")) == tuple(row_range)) and not meta.get("cancelled", 0)


def shard_complete(out_dir: str | Path, shard: int, *, spec_hash: str, row_range: tuple[int, int],
                   input_fingerprint: Optional[str] = None) -> Optional[dict]:
    """The shard's summary when its part file is complete for this spec (and, given ``input_fingerprint``,
    for these input rows), else None."""
    meta = read_shard_meta(part_path(out_dir, shard))
    if not meta_matches(meta, spec_hash=spec_hash, row_range=row_range):
        return None
    if input_fingerprint is not None and meta.get("input_fingerprint") != input_fingerprint:
        return None
    return meta


def existing_parts(out_dir: str | Path) -> dict[int, Path]:
    """{shard: path} of the part files in the folder."""
    out = Path(out_dir)
    if not out.is_dir():
        return {}
    found = {}
    for p in out.glob(PART_GLOB):
        num = p.stem.split("-", 1)[1]
        if num.isdigit():
            found[int(num)] = p
    return dict(sorted(found.items()))


def _manifest_path(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    return out / MANIFEST


def read_manifest(out_dir: str | Path) -> Optional[dict]:
    """The folder's manifest (``_manifest.json``), or None.
    Raises OutputError when it exists but cannot be read."""
    p = _manifest_path(out_dir)
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


def check_output_folder(out_dir: str | Path, *, spec_hash: str, spec: Optional[dict] = None) -> Optional[str]:
    """At submit: make sure the folder is usable. Returns the job id of an earlier run of the same spec
    (so a re-submit resumes it), None for a fresh folder.

    ``spec`` (``JobSpec.stored()``) lets the refusal of a different spec name the keys that differ.

    Raises:
        OutputError: not a folder, not writable, part files without a manifest, or another spec's results.
    """
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
        stray = sorted(p.name for p in out.glob(PART_GLOB))
        if stray:
            raise OutputError(
                f"output.path = {str(out)!r} holds part files ({stray[0]}, ...) but no manifest; "
                "choose an empty folder"
            )
        return None
    if man.get("spec_hash") != spec_hash:
        diff = spec_differences(man.get("spec") or {}, spec) if spec is not None else []
        what = f": {'; '.join(diff)}" if diff else ""
        raise OutputError(
            f"output.path = {str(out)!r} holds job {man.get('job_id')} with a different spec "
            f"(spec hash {man.get('spec_hash')} != {spec_hash}){what}; choose another output folder or empty it"
            + (", or set the folder's values again (--set KEY=VALUE) to resume it" if diff else "")
        )
    return man.get("job_id")


_NOT_OUTPUT = ("name", "preset", "resources", "priority", "redis_url")


def _flat(d: dict, head: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{head}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def spec_differences(old: dict, new: dict, *, limit: int = 5) -> list[str]:
    """Output-affecting keys whose value differs between two stored specs, as ``key = OLD in the folder,
    NEW now`` (at most ``limit``, then a count). A key missing from the older spec is left out: it did not
    exist when that spec was written.

    >>> spec_differences({"seed": 1, "generation": {"top_p": 1.0}}, {"seed": 2, "generation": {"top_p": 1.0}})
    ['seed = 1 in the folder, 2 now']
    """
    a = {k: v for k, v in _flat(old).items() if k.split(".")[0] not in _NOT_OUTPUT}
    b = {k: v for k, v in _flat(new).items() if k.split(".")[0] not in _NOT_OUTPUT}
    keys = [k for k in sorted(a) if k in b and a[k] != b[k]]
    shown = [f"{k} = {a[k]!r} in the folder, {b[k]!r} now" for k in keys[:limit]]
    if len(keys) > limit:
        shown.append(f"and {len(keys) - limit} more")
    return shown


def read_output(out_dir: str | Path) -> pa.Table:
    """All part files of a job as one table (declared schema)."""
    parts = list(existing_parts(out_dir).values())
    if not parts:
        return OUTPUT_SCHEMA.empty_table()
    return pa.concat_tables([pq.read_table(p, schema=OUTPUT_SCHEMA) for p in parts])
