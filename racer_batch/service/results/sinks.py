"""Where a row's record goes: the sink interfaces, and the one atomic Parquet writer.

A row's ``RowRecord`` and its shard's ``Tally`` feed separate consumers, each through one small method:

=================================  ==========================  =============================================
sink                               method                      what it does
=================================  ==========================  =============================================
``actors.RedisSink``               ``observe(record, ...)``    row stream, error stream, in-flight progress
``runner.ShardWriter``             ``observe(record)``         collects the part file (and shadow file) rows
``metrics.WorkerMetrics``          ``shard_done(job, tally)``  Prometheus counters of the worker process
``report.aggregate.aggregate``     ``Tally.observe_row``       the report's per-route statistics
=================================  ==========================  =============================================

The part file and the shadow file are both written by ``write_parquet_atomic``: a hidden temporary file in
the same folder, flushed and fsynced, renamed over the final name, then the folder fsynced, so a crash leaves
either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Optional, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from racer_batch.service.results.record import RowRecord
from racer_batch.service.results.tally import Tally


class RowSink(Protocol):
    """Consumes each finished row as it comes (telemetry). ``progress`` is the shard attempt's tally so far."""

    def observe(self, record: RowRecord, *, progress: Tally) -> None: ...


class ShardDoneSink(Protocol):
    """Consumes a shard attempt's tally when it returns. ``outcome``: committed | cancelled | lease_lost |
    not_written; ``elapsed_s``: the attempt's wall time on its actor (None: unknown)."""

    def shard_done(self, job_id: str, tally: Tally, *, outcome: str, elapsed_s: Optional[float]) -> None: ...


def write_parquet_atomic(path: str | Path, table: pa.Table) -> Path:
    """Write ``table`` to ``path`` (zstd) atomically and durably; creates the folder. Returns ``path``.

    Raises:
        OSError: the folder cannot be created or written (the temporary file is removed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh, compression="zstd")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return path


def _fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (best effort: some file systems cannot fsync a folder)."""
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
