"""A job's saved draft state through a killed worker (issue 30): a worker decoding a real (tiny random) model is
SIGKILLed mid-job; a second worker reclaims the job, its shards start from the state the first one saved, and
the job ends with every id once and every row's output that of a cold run of the same job."""

from __future__ import annotations

import json
import time

import pytest

from racer_batch.drafters.snapshot import FILE_NAME
from racer_batch.service.execution.local import make_executor
from racer_batch.service.execution.worker import Worker
from racer_batch.service.results.output import read_output
from tests.fixtures import submit_standin_job, worker_process

pytestmark = pytest.mark.service

PROMPTS = ["abcabd the cat and the hat", "hello world, hello there", "0123012301 0123", "mississippi miss"]


def _meta(out_dir, shard: int) -> dict:
    import pyarrow.parquet as pq

    from racer_batch.service.results.output import part_path

    return json.loads(pq.read_schema(part_path(out_dir, shard)).metadata[b"racer_batch.shard"])


def _finish(queue, job_id: str, redis_url: str, name: str) -> None:
    w = Worker(queue, make_executor("thread", url=redis_url, prefix=queue.prefix, name=name), name=name, lease_s=3)
    try:
        assert w.run(max_jobs=1, idle_exit_s=20) == 1
    finally:
        w.executor.shutdown()


def test_a_killed_workers_saved_state_warms_the_rescuer(queue, redis_url, tmp_path):
    rows = [{"id": f"r{i:02d}", "prompt": PROMPTS[i % 4]} for i in range(24)]
    over = {"model.name": "tiny-random", "generation.max_new_tokens": 48, "output.shard_rows": 4,
            "decoding.capacity": 8}
    # the cold reference: the same rows, the setting off, one worker in this process
    cold_spec, cold = submit_standin_job(queue, tmp_path, rows, **dict(over, **{
        "output.path": str(tmp_path / "cold"), "resources.warm_draft_state": False}))
    _finish(queue, cold.job_id, redis_url, "cold")
    spec, sub = submit_standin_job(queue, tmp_path, rows, **dict(over, **{"output.path": str(tmp_path / "warm")}))
    with worker_process(tmp_path / "doomed.log", "--no-ray", redis_url=redis_url, prefix=queue.prefix,
                        name="doomed") as proc:  # SIGKILLed when the block ends
        deadline = time.monotonic() + 120
        while queue.status(sub.job_id).shards_done < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)
        assert queue.status(sub.job_id).shards_done >= 2, (tmp_path / "doomed.log").read_text()[-2000:]
    done_by_doomed = queue.status(sub.job_id).shards_done
    assert done_by_doomed < 6 and (tmp_path / "warm" / FILE_NAME).exists()
    _finish(queue, sub.job_id, redis_url, "rescuer")
    got, want = read_output(tmp_path / "warm").to_pylist(), read_output(tmp_path / "cold").to_pylist()
    assert sorted(r["id"] for r in got) == [r["id"] for r in rows]  # every id once
    same = ("id", "text", "output_tokens", "finish_reason", "status")
    assert sorted([{k: r[k] for k in same} for r in got], key=lambda r: r["id"]) == \
        sorted([{k: r[k] for k in same} for r in want], key=lambda r: r["id"])
    metas = [_meta(tmp_path / "warm", s) for s in range(6)]
    rescued = [m for m in metas if m["worker"].startswith("rescuer")]
    assert rescued and all(m["warm_commits"] >= done_by_doomed for m in rescued), metas
    assert all(_meta(tmp_path / "cold", s)["warm_commits"] == 0 for s in range(6))
