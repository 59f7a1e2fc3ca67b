"""The batch service: job specs, input planning, the Redis queue, shard runners, workers, Parquet output.

Layering (STYLE.md habit 1): ``cli.service`` -> ``service`` -> ``engine``; nothing here imports click.
"""

from racer_batch.service.inputs import InputError, InputPlan, check_ids, parse_row, plan_input
from racer_batch.service.output import OutputError, read_manifest, read_output
from racer_batch.service.queue import (
    DEFAULT_PREFIX, JobQueue, JobStatus, QueueUnavailable, connect, redact_url, resolve_url,
)
from racer_batch.service.runner import RowRunner, ShardTask
from racer_batch.service.schema import OUTPUT_SCHEMA
from racer_batch.service.spec import JobSpec, SpecError, load_spec
from racer_batch.service.submit import SubmitOutcome, submit_job, validate_job
from racer_batch.service.worker import Worker

__all__ = [
    "DEFAULT_PREFIX", "InputError", "InputPlan", "JobQueue", "JobSpec", "JobStatus", "OUTPUT_SCHEMA", "OutputError",
    "QueueUnavailable", "RowRunner", "ShardTask", "SpecError", "SubmitOutcome", "Worker", "check_ids", "connect",
    "load_spec", "parse_row", "plan_input", "read_manifest", "read_output", "redact_url", "resolve_url",
    "submit_job", "validate_job",
]
