"""End to end against the real Redis and a local Ray: submit -> worker (Ray actors) -> Parquet output."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from racer_batch.service.execution.local import make_executor, run_until_done
from racer_batch.service.execution.worker import Worker
from racer_batch.service.results.output import read_output
from racer_batch.service.results.schema import OUTPUT_SCHEMA
from tests.fixtures import rescue_job, submit_standin_job, worker_process

pytestmark = pytest.mark.service


def test_end_to_end_real_model(ray_session, queue, redis_url, tmp_path):
    """The default model through Ray actors: one-turn and multi-turn rows, read back with the schema."""
    rows = [
        {"id": "code", "route": "code", "prompt": "Write a Python function that adds two numbers.", "turns": None},
        {"id": "math", "route": "reasoning", "prompt": "What is 12 times 11? Answer briefly.", "turns": None},
        {"id": "two-turn", "route": "chat", "prompt": None,
         "turns": ["Name a primary colour.", "Now name another one."]},
        {"id": "empty", "route": "chat", "prompt": "", "turns": None},
    ]
    spec, sub = submit_standin_job(queue, tmp_path, rows, **{"model.name": "smollm2-135m", "preset": "racer-cpu",
                                                    "generation.max_new_tokens": 8, "output.shard_rows": 2})
    run = run_until_done(queue, sub.job_id, url=redis_url, prefix=queue.prefix, executor_kind="ray")
    assert run.state == "done"
    for p in sorted(Path(spec.output.path).glob("part-*.parquet")):
        assert pq.read_schema(p).remove_metadata().equals(OUTPUT_SCHEMA.remove_metadata())
    out = {r["id"]: r for r in read_output(spec.output.path).to_pylist()}
    assert sorted(out) == sorted(r["id"] for r in rows)
    for rid in ("code", "math", "two-turn"):
        r = out[rid]
        assert r["status"] == "ok" and r["text"] and r["output_tokens"] > 0, r
        assert r["steps"] >= 1 and r["mat"] >= 1.0 and sum(r["accepted_hist"]) == r["steps"]
        assert r["method"] == "racer" and r["device"] == "cpu" and r["worker"].startswith("local/a0@")
    assert len(out["two-turn"]["turn_texts"]) == 2
    assert out["empty"]["status"] == "error" and "prompt is empty" in out["empty"]["error"]
    st = queue.status(sub.job_id)
    assert st.rows_done == 4 and st.totals.ok == 3 and set(st.route_mat()) == {"code", "reasoning", "chat"}
    rows_stream = queue.recent_rows(sub.job_id, 10)
    assert {r["id"] for r in rows_stream} == set(out)


def test_multiturn_and_job_scope_on_tiny_model(ray_session, queue, redis_url, tmp_path):
    """tiny-random model: multi-turn rows answered in order; two jobs reuse the actor's model."""
    rows = [{"id": i, "prompt": None, "turns": [f"question {i}", "follow-up", "and one more"]} for i in range(3)]
    spec, sub = submit_standin_job(queue, tmp_path, rows, **{"model.name": "tiny-random",
                                                             "generation.max_new_tokens": 6})
    assert run_until_done(queue, sub.job_id, url=redis_url, prefix=queue.prefix, executor_kind="ray").state == "done"
    t = read_output(spec.output.path).to_pylist()
    assert [len(r["turn_texts"]) for r in t] == [3, 3, 3]
    assert all(r["status"] == "ok" and r["output_tokens"] <= 18 for r in t)


def test_resume_after_killing_worker(ray_session, queue, redis_url, tmp_path):
    """A worker process is SIGKILLed mid-job; a second worker reclaims the expired lease and finishes.
    Every input id appears exactly once."""
    rows = [{"id": f"r{i:02d}", "prompt": f"prompt {i}"} for i in range(24)]
    spec, sub = submit_standin_job(queue, tmp_path, rows, **{"model.name": "stand-in?ms_per_step=20",
                                                    "generation.max_new_tokens": 10})
    with worker_process(tmp_path / "doomed.log", "--no-ray", redis_url=redis_url, prefix=queue.prefix,
                        name="doomed"):  # SIGKILLed when the block ends
        deadline = time.time() + 60
        while queue.status(sub.job_id).shards_done < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert queue.status(sub.job_id).shards_done >= 2
    rescue_job(queue, sub.job_id, redis_url, shards_below=6)
    st = queue.status(sub.job_id)
    assert st.state == "done" and st.rows_done == 24
    ids = [r["id"] for r in read_output(spec.output.path).to_pylist()]
    assert sorted(ids) == [r["id"] for r in rows]  # every id exactly once
    assert int(queue.job_fields(sub.job_id)["attempts"]) == 2


def test_actor_killed_mid_shard_is_retried(ray_session, queue, redis_url, tmp_path):
    """An actor dies in the middle of a shard: it is restarted, the shard redone, every id exactly once."""
    import threading

    rows = [{"id": i, "prompt": f"p {i}"} for i in range(12)]
    spec, sub = submit_standin_job(queue, tmp_path, rows, **{"model.name": "stand-in?ms_per_step=10",
                                                    "generation.max_new_tokens": 10})
    executor = make_executor("ray", url=redis_url, prefix=queue.prefix, name="victim")
    w = Worker(queue, executor, name="victim", lease_s=10)
    th = threading.Thread(target=lambda: w.run(max_jobs=1, idle_exit_s=20))
    th.start()
    try:
        deadline = time.time() + 60
        while queue.status(sub.job_id).rows_done < 6 and time.time() < deadline:
            time.sleep(0.02)
        ray_session.ray.kill(executor.actors[0], no_restart=True)
        th.join(timeout=90)
    finally:
        executor.shutdown()
    st = queue.status(sub.job_id)
    assert st.state == "done" and st.totals.ok == 12
    ids = sorted(r["id"] for r in read_output(spec.output.path).to_pylist())
    assert ids == sorted(str(i) for i in range(12))
