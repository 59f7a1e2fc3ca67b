"""The batch service, split along a row's path (docs/architecture.md, "A row's journey"):

- ``job/``: the job definition and its inputs (spec, input plan, submit);
- ``execution/``: queue, worker, executors and actors, the row runner;
- ``results/``: the row record, the tally, the sinks and the output folder.

Layering (STYLE.md habit 1): ``cli.service`` -> ``service`` -> ``engine``; nothing here imports click.
"""

from racer_batch.service.execution.queue import (
    DEFAULT_PREFIX, JobQueue, JobStatus, QueueUnavailable, connect, redact_url, resolve_url,
)
from racer_batch.service.execution.runner import RowRunner, ShardTask
from racer_batch.service.execution.worker import Worker
from racer_batch.service.job.inputs import InputError, InputPlan, check_ids, parse_row, plan_input
from racer_batch.service.job.spec import JobSpec, SpecError, load_spec
from racer_batch.service.job.submit import SubmitOutcome, submit_job, validate_job
from racer_batch.service.results.output import OutputError, read_manifest, read_output
from racer_batch.service.results.record import RowRecord
from racer_batch.service.results.schema import OUTPUT_SCHEMA
from racer_batch.service.results.tally import Tally

__all__ = [
    "DEFAULT_PREFIX", "InputError", "InputPlan", "JobQueue", "JobSpec", "JobStatus", "OUTPUT_SCHEMA", "OutputError",
    "QueueUnavailable", "RowRecord", "RowRunner", "ShardTask", "Tally", "SpecError", "SubmitOutcome", "Worker", "check_ids", "connect",
    "load_spec", "parse_row", "plan_input", "read_manifest", "read_output", "redact_url", "resolve_url",
    "submit_job", "validate_job",
]
