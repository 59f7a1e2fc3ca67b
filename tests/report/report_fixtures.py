"""Report-test helpers (re-exported from tests/helpers.py; a conftest.py cannot be imported by name)."""

from racer_batch.service.execution.runner import RowRunner, ShardTask
from racer_batch.service.job.inputs import plan_input
from racer_batch.service.job.spec import load_spec
from racer_batch.service.results.output import write_manifest
from tests.fixtures import base_overrides, write_parquet

__all__ = ["base_overrides", "finished_job", "write_parquet"]


def finished_job(tmp_path, rows, *, job_id: str = "job-p", runner=None, **over):
    """Run a small job in-process (shards of 4 rows, RowRunner; stand-in model unless overridden) and write its
    manifest, so tmp_path/out looks like a finished job's output folder. Returns the JobSpec."""
    write_parquet(tmp_path / "in.parquet", rows)
    spec = load_spec(None, base_overrides(tmp_path, **{"output.shard_rows": 4, **over}))
    plan = plan_input(spec.input)
    runner = runner or RowRunner(worker_name="t")
    for shard in range(plan.num_shards(4)):
        lo, hi = plan.shard_range(shard, 4)
        runner.run_shard(ShardTask(job_id=job_id, shard=shard, row_start=lo, row_stop=hi, spec=spec.stored(),
                                   plan=plan.to_dict(), spec_hash=spec.spec_hash(), owner="t").to_dict())
    write_manifest(spec.output.path, {"job_id": job_id, "name": job_id.removeprefix("job-"), "state": "done",
                                      "spec": spec.stored(), "spec_hash": spec.spec_hash(), "input": plan.to_dict(),
                                      "model": spec.model.name, "method": spec.decoding.method})
    return spec
