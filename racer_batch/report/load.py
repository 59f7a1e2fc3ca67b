"""Find a job's output folder and read what a report needs: the rows, the manifest, the shadow rows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from racer_batch.service.job.inputs import InputPlan
from racer_batch.service.job.spec import JobSpec
from racer_batch.service.results.output import read_manifest, read_output
from racer_batch.service.results.shadow import read_shadow


class ReportError(ValueError):
    """A job or output folder that cannot be reported on; the message names the path or job id."""


@dataclass
class JobData:
    """Everything read from one output folder."""

    out_dir: Path
    manifest: dict
    rows: pa.Table  # OUTPUT_SCHEMA
    shadow: pa.Table  # SHADOW_SCHEMA (empty when the job has no shadow rows)

    @property
    def job_id(self) -> str:
        return str(self.manifest.get("job_id") or (self.rows.column("job_id")[0].as_py() if self.rows.num_rows
                                                   else self.out_dir.name))

    @property
    def spec(self) -> dict:
        return self.manifest.get("spec") or {}

    def job_input(self) -> tuple[JobSpec, InputPlan]:
        """The job's validated spec and its input plan, from the manifest (to read the input rows again).

        Raises:
            ReportError: the manifest lacks the spec or the input plan.
        """
        if not self.manifest.get("spec") or not self.manifest.get("input"):
            raise ReportError(f"{self.out_dir}: the manifest lacks the job's spec or input plan")
        return JobSpec.model_validate(self.manifest["spec"]), InputPlan.from_dict(self.manifest["input"])


def load_output(out_dir: str | Path) -> JobData:
    """Read an output folder (part files + manifest + shadow files). Raises ReportError."""
    out = Path(out_dir)
    if not out.is_dir():
        raise ReportError(f"{str(out)!r} is not an output folder")
    manifest = read_manifest(out)
    parts = sorted(out.glob("part-*.parquet"))
    if manifest is None and not parts:
        raise ReportError(f"{str(out)!r} holds no manifest.json and no part-*.parquet files")
    return JobData(out_dir=out, manifest=manifest or {}, rows=read_output(out), shadow=read_shadow(out))


def resolve_output(job_or_path: str, *, queue: Optional[Any] = None) -> Path:
    """An existing folder is taken as the output folder; anything else as a job id looked up in Redis
    (``queue`` is a JobQueue, or a zero-argument callable returning one, only called when needed)."""
    p = Path(job_or_path)
    if p.is_dir():
        return p
    if queue is None:
        raise ReportError(f"{job_or_path!r} is neither an output folder nor a job id (no Redis to look it up)")
    q = queue() if callable(queue) else queue
    try:
        fields = q.job_fields(job_or_path)
    except KeyError:
        raise ReportError(f"{job_or_path!r} is neither an output folder nor a known job id") from None
    out = fields.get("output") or json.loads(fields.get("spec") or "{}").get("output", {}).get("path")
    if not out or not Path(out).is_dir():
        raise ReportError(f"job {job_or_path}: output folder {out!r} not found on this machine")
    return Path(out)
