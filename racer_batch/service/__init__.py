"""The batch service, split along a row's path (docs/architecture.md, "A row's journey"):

- ``job/``: the job definition and its inputs (spec, input plan, the shard task);
- ``results/``: the row record, the tally, the sinks, the output folder, the manifest and resume;
- ``execution/``: queue, worker, executors and actors, the row runner;
- ``submit.py``: validate a job, claim its output folder, queue it.

Each layer imports only those listed before it (tests/unit/test_import_cycles.py holds every folder to no cycle).

Layering (docs/method.md 10.1): ``cli.service`` -> ``service`` -> ``engine``; nothing here imports click.
"""

from racer_batch.service.execution.queue import (
    DEFAULT_PREFIX,
    JobQueue,
    JobStatus,
    QueueUnavailable,
    connect,
    redact_url,
    resolve_url,
)
from racer_batch.service.execution.runner import RowRunner, ShardTask
from racer_batch.service.execution.worker import Worker
from racer_batch.service.job.inputs import InputError, InputPlan, check_ids, plan_input
from racer_batch.service.job.rows import parse_row
from racer_batch.service.job.spec import JobSpec, SpecError, load_spec
from racer_batch.service.results.output import OutputError, read_manifest, read_output
from racer_batch.service.results.record import RowRecord
from racer_batch.service.results.schema import OUTPUT_SCHEMA
from racer_batch.service.results.tally import Tally
from racer_batch.service.submit import SubmitOutcome, submit_job, validate_job

__all__ = [
    "DEFAULT_PREFIX", "InputError", "InputPlan", "JobQueue", "JobSpec", "JobStatus", "OUTPUT_SCHEMA", "OutputError",
    "QueueUnavailable", "RowRecord", "RowRunner", "ShardTask", "Tally", "SpecError", "SubmitOutcome", "Worker",
    "check_ids", "connect",
    "load_spec", "parse_row", "plan_input", "read_manifest", "read_output", "redact_url", "resolve_url",
    "submit_job", "validate_job",
]
