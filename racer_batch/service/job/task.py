"""One shard of a job as the execution layer hands it to an actor (``ShardTask``) and what the actor hands back
(``ShardResult``): plain data over the job's spec and input plan, so the layers that run, meter and record
shards can all name them without importing each other."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from racer_batch.service.job.inputs import InputPlan
from racer_batch.service.job.spec import JobSpec


@dataclass
class ShardTask:
    """What an actor needs to run one shard.

    In the worker's process ``spec`` and ``plan`` are the validated objects (threads share them as they are);
    across a process boundary (Ray) ``to_dict`` sends ``JobSpec.stored()`` and ``InputPlan.to_dict()``, and
    the receiving RowRunner validates the spec once per job and spec hash (``RowRunner.spec_of``)."""

    job_id: str
    shard: int
    row_start: int
    row_stop: int
    spec: Union[JobSpec, dict]
    plan: Union[InputPlan, dict]
    spec_hash: str
    owner: str  # the worker holding the job's lease
    attempt: int = 1
    rows: Optional[list] = None  # [(row_idx, raw record)] read by the worker; None: the runner reads them

    def to_dict(self) -> dict:
        """Plain data for Ray: the spec as ``JobSpec.stored()``, the plan as ``InputPlan.to_dict()``."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if isinstance(self.spec, JobSpec):
            d["spec"] = self.spec.stored()
        if isinstance(self.plan, InputPlan):
            d["plan"] = self.plan.to_dict()
        return d

    @classmethod
    def of(cls, task: Union["ShardTask", dict]) -> "ShardTask":
        return task if isinstance(task, ShardTask) else cls(**task)

    @property
    def row_range(self) -> tuple[int, int]:
        return self.row_start, self.row_stop


@dataclass
class ShardResult:
    """What one shard attempt returns (plain data: it crosses Ray by pickling).

    Attributes:
        summary: the shard's summary as its part file's footer and the manifest keep it
            (``ShardWriter.summary``: the Tally JSON, row range, hashes, worker, attempt, ``elapsed_s``,
            ``streams``, ``batch_sizes``).
        stopped: None, or why the attempt stopped early (``runner.CANCELLED``, ``runner.LEASE_LOST``).
        written: whether the part file was committed.
        path: the part file's path.
    """

    summary: dict
    stopped: Optional[str] = None
    written: bool = False
    path: str = ""

    @property
    def committed(self) -> bool:
        """The part file holds this attempt's rows and the job goes on: count the shard as done."""
        return self.written and self.stopped is None

    @property
    def streams(self) -> int:
        """Rows the actor had in flight at once (``streams_per_actor``, auto resolved)."""
        return int(self.summary.get("streams") or 1)

    @property
    def elapsed_s(self) -> Optional[float]:
        return self.summary.get("elapsed_s")
