"""Submit: validate the spec and the input, claim the output folder, queue the job.

Nothing is queued unless everything checks out. Submitting the same spec with the same output folder again
resumes the earlier job (same job id; committed shards are skipped, shards whose input rows changed are
redone: service/results/resume.py).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pyarrow as pa

from racer_batch.service.execution.queue import JobQueue
from racer_batch.service.job.inputs import InputError, InputPlan, check_ids, plan_input
from racer_batch.service.job.spec import JobSpec
from racer_batch.service.results.manifest import job_manifest
from racer_batch.service.results.output import OutputError, check_output_folder, read_manifest, write_manifest
from racer_batch.service.results.resume import ResumePlan, plan_resume
from racer_batch.service.results.shadow import shadow_selected


@dataclass
class SubmitOutcome:
    job_id: str
    plan: InputPlan
    action: str  # "queued" | "resumed" | "already queued" | "already running"
    shards_total: int = 0
    shards_kept: int = 0  # shards the output folder already holds for this spec and these input rows
    notes: list[str] = field(default_factory=list)  # shards to be redone and why (resume.ResumePlan.describe)

    @property
    def shards_left(self) -> int:
        """Shards still to run (0: a re-submit of a finished job only has to print its summary)."""
        return max(0, self.shards_total - self.shards_kept)


def new_job_id() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def validate_job(spec: JobSpec) -> InputPlan:
    """Input checks (raises InputError): files, columns and types, ids present and unique; a job with relaxed
    (output-changing) acceptance must have at least one row in its shadow sample, so that the report can
    show what the speed gain cost (issue 8)."""
    plan = plan_input(spec.input)
    corpus = spec.decoding.corpus_path
    if corpus and "://" not in corpus and not os.path.isfile(corpus):
        raise InputError(f"decoding.corpus_path = {corpus!r}: no such file (a relative path is taken from the "
                         "job file's folder, or from the current folder for a --set override)")
    relaxed = spec.decoding.acceptance != "lossless" and spec.shadow is not None
    select = None
    if relaxed:
        seed, fraction = spec.shadow.seed, spec.shadow.fraction
        select = lambda row_id: shadow_selected(seed, row_id, fraction)  # noqa: E731
    sampled = check_ids(spec.input, plan, select=select)
    if relaxed and sampled == 0:
        raise InputError(
            f"decoding.acceptance = {spec.decoding.acceptance!r} changes outputs, but shadow.fraction = "
            f"{spec.shadow.fraction:g} (seed {spec.shadow.seed}) selects none of the {plan.num_rows} rows, so "
            "nothing would be compared against lossless decoding; raise shadow.fraction (1.0 shadows every row)")
    return plan


def _resources_not_applied(fields: dict, spec: JobSpec, state: str) -> list[str]:
    """A note per ``resources`` key this submit gives another value than the queued or running job has
    (``fields``: its Redis hash): the job keeps its own (they are read when a worker takes the job), so saying
    nothing would hide that the new value was dropped."""
    try:
        had = json.loads(fields["spec"]).get("resources", {})
    except (KeyError, ValueError):
        return []
    now = spec.stored().get("resources", {})
    return [f"not applied: resources.{key} = {now[key]!r} (the {state} job keeps {had.get(key)!r}; cancel it "
            "and submit again to change it, or let it finish)"
            for key in sorted(now) if key in had and had[key] != now[key]]


def job_name(spec: JobSpec) -> str:
    """The name ``list`` shows for a job whose spec names none (``submit --input FILE``): its input's file or
    folder name, e.g. ``prompts.jsonl``."""
    return Path(spec.input.path.rstrip("/")).name or spec.input.path


def _pick_job_id(spec: JobSpec, prior: Optional[str], job_id: Optional[str]) -> str:
    """The job id to submit under: the one asked for, else the output folder's earlier job (``prior``), else a
    new one. Raises OutputError when the folder belongs to another job than the one asked for."""
    if prior and job_id and job_id != prior:
        raise OutputError(f"output.path = {spec.output.path!r} belongs to job {prior}, not {job_id}")
    return job_id or prior or new_job_id()


def _plan_resume(spec: JobSpec, plan: InputPlan, prior: Optional[str]) -> ResumePlan:
    """Which shards the output folder already holds for these input rows (none unless resuming ``prior``).
    Raises InputError when the input cannot be read back to compare."""
    try:
        return plan_resume(spec, plan) if prior else ResumePlan()
    except (OSError, AssertionError, pa.ArrowException) as exc:
        raise InputError(f"cannot read the input to compare it with {spec.output.path!r}: {exc}") from None


def submit_job(queue: JobQueue, spec: JobSpec, *, job_id: Optional[str] = None) -> SubmitOutcome:
    """Validate and queue. On a resume the input is compared with the folder's part files, and the outcome
    says how many shards are kept and which are redone (the worker decides again when it runs the job).

    Raises InputError, OutputError or SpecError (all ValueError) on bad input."""
    plan = validate_job(spec)
    spec_hash = spec.spec_hash()
    prior = check_output_folder(spec.output.path, spec_hash=spec_hash, spec=spec.stored())
    job_id = _pick_job_id(spec, prior, job_id)
    num_shards = plan.num_shards(spec.output.shard_rows)
    fields = queue.job_fields(job_id) if queue.job_exists(job_id) else {}
    state = fields.get("state")  # None: Redis does not know the job
    if state in ("queued", "running"):
        return SubmitOutcome(job_id=job_id, plan=plan, action=f"already {state}", shards_total=num_shards,
                             notes=_resources_not_applied(fields, spec, state))
    resume = _plan_resume(spec, plan, prior)
    if prior and state == "done" and len(resume.done) >= num_shards:
        # finished, and the folder still holds every shard for these rows: nothing to queue, and the job keeps
        # its run's figures (queueing it again would start a new, empty run's clock)
        return SubmitOutcome(job_id=job_id, plan=plan, action="already done", shards_total=num_shards,
                             shards_kept=len(resume.done), notes=resume.describe())
    if read_manifest(spec.output.path) is None:  # claim the folder for this job and spec
        write_manifest(spec.output.path, job_manifest(job_id, spec, plan, state="queued", done={}))
    # status counts the kept shards from now on, not only once a worker has taken the job (before the enqueue:
    # a worker may take it at once and commit shards of its own)
    queue.sync_committed(job_id, resume.done)
    queue.enqueue(job_id=job_id, spec=spec.stored(), plan=plan.to_dict(), priority=spec.priority,
                  name=spec.name or job_name(spec))
    return SubmitOutcome(job_id=job_id, plan=plan, action="resumed" if prior else "queued",
                         shards_total=num_shards, shards_kept=len(resume.done), notes=resume.describe())
