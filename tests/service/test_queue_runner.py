"""Queue leases and the shard runner against the real Redis, with the stand-in engine (no Ray)."""

from __future__ import annotations

import json
import threading
import time

import pyarrow.parquet as pq
import pytest

from racer_batch.service.execution.actors import RedisSink
from racer_batch.service.execution.local import run_until_done
from racer_batch.service.execution.runner import RowRunner, ShardTask
from racer_batch.service.job.spec import load_spec
from racer_batch.service.results.output import OutputError, part_path, read_manifest, read_output
from racer_batch.service.results.schema import OUTPUT_SCHEMA
from racer_batch.service.submit import submit_job
from tests.fixtures import base_overrides, queue_url, submit_standin_job, write_parquet
from tests.standin import RAISE_MARKER

pytestmark = pytest.mark.service


def test_lease_claim_renew_reclaim(queue, tmp_path):
    _, sub = submit_standin_job(queue, tmp_path, [{"id": 1, "prompt": "x"}])
    a = queue.claim(consumer="A", lease_ms=400, block_ms=0)
    assert a is not None and a.job_id == sub.job_id and not a.reclaimed
    assert queue.claim(consumer="B", lease_ms=400, block_ms=0) is None  # A holds a fresh lease
    assert queue.renew(a)
    time.sleep(0.6)  # A stops renewing: its lease expires
    b = queue.claim(consumer="B", lease_ms=400, block_ms=0)
    assert b is not None and b.job_id == sub.job_id and b.reclaimed
    assert not queue.renew(a), "the old owner must learn it lost the job"
    assert queue.renew(b)
    assert RedisSink(queue).verdict(sub.job_id, "A") == "lease-lost"
    assert RedisSink(queue).verdict(sub.job_id, "B") == "go"
    queue.finish(b, state="done")
    assert queue.status(sub.job_id).state == "done"
    assert queue.claim(consumer="C", lease_ms=1, block_ms=0) is None


def _submit_at(queue, tmp_path, *, priority: int, out: str):
    """Submit a stand-in job over tmp_path/in.parquet at ``priority``, its output in tmp_path/``out``."""
    return submit_job(queue, load_spec(None, base_overrides(tmp_path, priority=priority,
                                                            **{"output.path": str(tmp_path / out)})))


def test_priority_and_cancel_queued(queue, tmp_path):
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    low = _submit_at(queue, tmp_path, priority=1, out="o1")
    high = _submit_at(queue, tmp_path, priority=8, out="o2")
    mid = _submit_at(queue, tmp_path, priority=5, out="o3")
    assert queue.cancel(mid.job_id) == "cancelled"
    first = queue.claim(consumer="A", lease_ms=10_000, block_ms=0)
    second = queue.claim(consumer="A", lease_ms=10_000, block_ms=0)
    assert (first.job_id, second.job_id) == (high.job_id, low.job_id)  # the cancelled job is skipped
    assert queue.claim(consumer="A", lease_ms=10_000, block_ms=0) is None


def test_bad_rows_never_kill_the_job(queue, tmp_path):
    rows = [
        {"id": "ok-1", "prompt": "hello there", "max_new_tokens": None, "top_p": None},
        {"id": "null", "prompt": None, "max_new_tokens": None, "top_p": None},
        {"id": "empty", "prompt": "", "max_new_tokens": None, "top_p": None},
        {"id": "too-long", "prompt": "word " * 600, "max_new_tokens": None, "top_p": None},
        {"id": "bad-param", "prompt": "x", "max_new_tokens": -3, "top_p": None},
        {"id": "bad-top-p", "prompt": "x", "max_new_tokens": None, "top_p": 7.0},
        {"id": "model-error", "prompt": f"x {RAISE_MARKER}", "max_new_tokens": None, "top_p": None},
        {"id": "ok-2", "prompt": "bye", "max_new_tokens": 3, "top_p": None},
    ]
    spec, sub = submit_standin_job(queue, tmp_path, rows, **{"model.name": "stand-in?context=500"})
    run = run_until_done(queue, sub.job_id, url=queue_url(queue),
                         prefix=queue.prefix, executor_kind="thread")
    assert run.state == "done"
    out = {r["id"]: r for r in read_output(spec.output.path).to_pylist()}
    assert sorted(out) == sorted(r["id"] for r in rows)
    expect = {"null": "all null", "empty": "prompt is empty", "too-long": "context is 500",
              "bad-param": "max_new_tokens = -3", "bad-top-p": "top_p = 7.0",
              "model-error": "model error: RuntimeError"}
    for rid, msg in expect.items():
        assert out[rid]["status"] == "error" and msg in out[rid]["error"], (rid, out[rid]["error"])
        assert out[rid]["error"].startswith(f"row {rid!r}")
    assert out["ok-1"]["status"] == "ok" and out["ok-2"]["output_tokens"] == 3
    st = queue.status(sub.job_id)
    assert (st.totals.ok, st.totals.error) == (2, 6)
    assert {e["id"] for e in queue.errors(sub.job_id)} == set(expect)


def test_output_schema_multiturn_and_manifest(queue, tmp_path):
    rows = [{"id": i, "prompt": f"p {i}", "turns": None} for i in range(9)]
    rows[4] = {"id": 4, "prompt": None, "turns": ["first question", "second", "third"]}
    spec, sub = submit_standin_job(queue, tmp_path, rows)
    assert run_until_done(queue, sub.job_id, url=queue_url(queue), prefix=queue.prefix,
                          executor_kind="thread").state == "done"
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert [p.name for p in parts] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    for p in parts:
        assert pq.read_schema(p).remove_metadata().equals(OUTPUT_SCHEMA.remove_metadata())
    t = read_output(tmp_path / "out")
    assert t.schema.remove_metadata().equals(OUTPUT_SCHEMA.remove_metadata())
    r4 = next(r for r in t.to_pylist() if r["id"] == "4")
    assert len(r4["turn_texts"]) == 3 and r4["text"] == r4["turn_texts"][-1]
    assert r4["output_tokens"] == 24 and r4["steps"] == 3 * 5 and r4["mat"] == pytest.approx(1.6)
    assert sum(r4["accepted_hist"]) == r4["steps"]
    assert r4["model"] == "stand-in?mat=2" and r4["config_hash"] == spec.decoding.config_hash()
    man = read_manifest(tmp_path / "out")
    assert man["state"] == "done" and man["num_rows"] == 9 and len(man["shards"]) == 3
    assert man["totals"]["rows"] == 9 and "redis_url" not in man["spec"]


def test_runner_reuses_model_and_frees_job_state(tmp_path):
    write_parquet(tmp_path / "in.parquet", [{"id": i, "prompt": f"p {i}"} for i in range(4)])
    runner = RowRunner(worker_name="t")
    from racer_batch.service.job.inputs import plan_input

    for job in ("job-a", "job-b"):
        spec = load_spec(None, base_overrides(tmp_path, **{"output.path": str(tmp_path / job)}))
        plan = plan_input(spec.input)
        task = ShardTask(job_id=job, shard=0, row_start=0, row_stop=4, spec=spec.stored(), plan=plan.to_dict(),
                         spec_hash=spec.spec_hash(), owner="t")
        out = runner.run_shard(task.to_dict())
        assert out.summary["rows"] == 4 and out.summary["ok"] == 4 and out.committed
    assert runner.models_loaded == 1
    assert sorted(runner.active_jobs) == ["job-a", "job-b"]
    engine, state = runner._states["job-a"]
    assert state.rows_seen == 4  # one state per job, shared by its rows
    assert runner.end_job("job-a") and state.freed and runner.active_jobs == ["job-b"]


def test_resubmit_resumes_and_other_spec_refused(queue, tmp_path):
    spec, sub = submit_standin_job(queue, tmp_path, [{"id": i, "prompt": "p"} for i in range(6)])
    assert run_until_done(queue, sub.job_id, url=queue_url(queue), prefix=queue.prefix,
                          executor_kind="thread").state == "done"
    again = submit_job(queue, spec)
    assert again.job_id == sub.job_id and again.action == "already done" and again.shards_left == 0
    with pytest.raises(OutputError, match="different spec"):
        submit_job(queue, load_spec(None, base_overrides(tmp_path, **{"generation.max_new_tokens": 9})))


def test_a_finished_folder_submitted_under_a_new_prefix_shows_its_kept_shards_at_once(queue, redis_url, tmp_path):
    """The folder is the truth: a Redis that does not know the job (another prefix, or data lost) learns its
    kept shards at submit, so status says 6/6 before any worker has run."""
    from racer_batch.service.execution.queue import JobQueue

    spec, sub = submit_standin_job(queue, tmp_path, [{"id": i, "prompt": f"p {i}"} for i in range(6)],
                                   **{"output.shard_rows": 3})
    assert run_until_done(queue, sub.job_id, url=queue_url(queue), prefix=queue.prefix,
                          executor_kind="thread").state == "done"
    moved = JobQueue.from_url(redis_url, prefix=queue.prefix + "moved:")  # under the test's prefix: dropped after
    again = submit_job(moved, spec)
    assert (again.job_id, again.action, again.shards_kept) == (sub.job_id, "resumed", 2)
    st = moved.status(sub.job_id)
    assert (st.state, st.shards_done, st.rows_done, st.totals.ok) == ("queued", 2, 6, 6), st.to_dict()
    assert run_until_done(moved, sub.job_id, url=redis_url, prefix=moved.prefix,
                          executor_kind="thread").state == "done"
    final = moved.status(sub.job_id)
    assert final.rows_done == 6 and final.base_rows == 6
    from racer_batch.cli.render import summary_lines

    speed = [ln for ln in summary_lines(final) if ln.startswith("speed:")]
    assert speed == ["speed: nothing generated in this run (every row was kept from earlier runs)"], speed


def test_a_stalled_owner_rows_in_flight_are_not_counted_done_and_a_takeover_drops_them(queue, tmp_path):
    """Rows a dead owner's unfinished shard had answered are redone by the next owner (part files are
    written per shard): a stalled status leaves them out of rows done and says so; a takeover clears them."""
    from racer_batch.service.results.tally import Tally

    _, sub = submit_standin_job(queue, tmp_path, [{"id": i, "prompt": f"p {i}"} for i in range(6)],
                                **{"output.shard_rows": 3})
    lease = queue.claim(consumer="gone-worker", lease_ms=1_500, block_ms=0)
    queue.commit_shard(sub.job_id, 0, Tally(rows=3, ok=3, output_tokens=9, steps=6).to_dict())
    queue.record_row(sub.job_id, {"id": "3", "status": "ok"}, shard=1,
                     progress=Tally(rows=2, ok=2, output_tokens=5, steps=4))
    assert queue.renew(lease)
    fresh = queue.status(sub.job_id)
    assert (fresh.stalled, fresh.rows_done, fresh.rows_lost) == (False, 5, 0)
    time.sleep(1.1)  # over two thirds of the lease without a renewal
    st = queue.status(sub.job_id)
    assert (st.stalled, st.rows_done, st.rows_lost, st.totals.output_tokens) == (True, 3, 2, 9), st.to_dict()
    assert st.lost_note == "2 rows answered by unfinished shards, not counted: the next owner redoes them"
    import io

    from rich.console import Console

    from racer_batch.cli.render import status_table

    out = io.StringIO()
    Console(file=out, width=400).print(status_table(st, prefix=queue.prefix))
    shown = out.getvalue()
    assert "rows lost" in shown and "3/6" in shown and "stalled: no progress counted" in shown, shown
    assert "rows/s" not in shown  # a falling rate while nobody works would mislead
    assert st.to_dict()["rows_lost"] == 2
    time.sleep(0.5)  # the lease has run out: another worker takes the job over
    taken = queue.claim(consumer="next-worker", lease_ms=1_500, block_ms=0)  # reclaims entries idle this long
    assert taken is not None and taken.reclaimed
    after = queue.status(sub.job_id)
    assert (after.stalled, after.owner, after.rows_done, after.rows_lost) == (False, "next-worker", 3, 0)


def test_cancel_keeps_finished_shards_then_resume(queue, tmp_path):
    rows = [{"id": i, "prompt": f"p {i}"} for i in range(12)]
    spec, sub = submit_standin_job(queue, tmp_path, rows, **{"model.name": "stand-in?ms_per_step=15",
                                                "generation.max_new_tokens": 20})
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("run", run_until_done(
        queue, sub.job_id, url=queue_url(queue), prefix=queue.prefix, executor_kind="thread")))
    th.start()
    deadline = time.time() + 30
    while queue.status(sub.job_id).shards_done < 1 and time.time() < deadline:
        time.sleep(0.05)
    t_cancel = time.time()
    assert queue.cancel(sub.job_id) == "cancelling"
    th.join(timeout=30)
    assert result["run"].state == "cancelled"
    assert time.time() - t_cancel < 3.0
    st = queue.status(sub.job_id)
    assert 1 <= st.shards_done < 3
    done_ids = [r["id"] for r in read_output(spec.output.path).to_pylist() if r["status"] == "ok"]
    assert len(done_ids) == len(set(done_ids)) >= 4
    committed_before = st.rows_done
    # re-submit: committed shards are skipped, the rest run, every id exactly once
    again = submit_job(queue, spec)
    assert again.job_id == sub.job_id
    assert run_until_done(queue, sub.job_id, url=queue_url(queue), prefix=queue.prefix,
                          executor_kind="thread").state == "done"
    ids = [r["id"] for r in read_output(spec.output.path).to_pylist()]
    assert sorted(ids, key=int) == [str(i) for i in range(12)]
    assert queue.status(sub.job_id).base_rows == committed_before  # rows/s counts this run only
    assert all(r["status"] == "ok" for r in read_output(spec.output.path).to_pylist())
    assert json.loads(queue.r.hget(queue.k_job(sub.job_id), "spec"))["output"]["path"] == spec.output.path


def test_turns_see_earlier_answers(tmp_path):
    """Each turn is generated on the conversation so far, including the model's own earlier answers."""
    from racer_batch.service.job.inputs import plan_input
    from tests.standin import StandInEngine

    seen: list = []

    class Recording(StandInEngine):
        def stream(self, prompt, params=None, **kw):
            seen.append([dict(m) for m in prompt])
            return (yield from super().stream(prompt, params, **kw))

    write_parquet(tmp_path / "in.parquet", [{"id": "m", "turns": ["q1", "q2"]}])
    spec = load_spec(None, base_overrides(tmp_path, **{"generation.system_prompt": "sys"}))
    runner = RowRunner(worker_name="t", engine_factory=lambda bundle, cfg, **kw: Recording(bundle, cfg, **kw))
    task = ShardTask(job_id="j", shard=0, row_start=0, row_stop=1, spec=spec.stored(),
                     plan=plan_input(spec.input).to_dict(), spec_hash=spec.spec_hash(), owner="t")
    runner.run_shard(task.to_dict())
    row = read_output(spec.output.path).to_pylist()[0]
    a1, a2 = row["turn_texts"]
    assert seen == [
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
         {"role": "assistant", "content": a1}, {"role": "user", "content": "q2"}],
    ]
    assert row["text"] == a2


def test_sigterm_hands_the_job_back(queue, redis_url, tmp_path):
    """A worker told to stop (SIGTERM) re-queues its job at once instead of waiting for the lease to expire."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec, sub = submit_standin_job(queue, tmp_path, [{"id": i, "prompt": "p"} for i in range(40)],
                     **{"model.name": "stand-in?ms_per_step=20", "generation.max_new_tokens": 10})
    proc = subprocess.Popen(
        [sys.executable, "-m", "racer_batch", "worker", "--no-ray", "--lease-s", "600",
         "--redis-url", redis_url, "--prefix", queue.prefix, "--name", "polite"],
        env=dict(os.environ, PYTHONPATH=str(root)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while queue.status(sub.job_id).rows_done < 2 and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    fields = queue.job_fields(sub.job_id)
    assert fields["state"] == "queued" and "released by polite" in fields["message"]
    # the next run is measured from its own start: no start time, resume base or in-flight rows carried over
    assert not {"started_at", "base_rows", "base_tokens"} & set(fields)
    assert queue.r.exists(queue.k_job(sub.job_id, "inflight")) == 0
    lease = queue.claim(consumer="next", lease_ms=600_000, block_ms=0)  # no lease wait: taken at once
    assert lease is not None and lease.job_id == sub.job_id and not lease.reclaimed
    queue.mark_run_base(sub.job_id)
    st = queue.status(sub.job_id)
    assert st.base_rows == st.rows_done >= 2 and st.started_at is not None


def test_error_outside_rows_fails_the_job_not_the_rows(queue, redis_url, tmp_path):
    """A fault that is not a row's (here: the engine cannot make a draft state) fails the job with its
    message after retries; no row is marked as an error for it."""
    from racer_batch.service.execution.actors import ThreadExecutor
    from racer_batch.service.execution.worker import Worker
    from tests.standin import StandInEngine

    class Broken(StandInEngine):
        def new_state(self):
            raise TypeError("draft state cannot be built")

    spec, sub = submit_standin_job(queue, tmp_path, [{"id": i, "prompt": "p"} for i in range(3)])
    ex = ThreadExecutor(redis_url, prefix=queue.prefix,
                        runner_options={"engine_factory": lambda bundle, cfg, **kw: Broken(bundle, cfg, **kw)})
    w = Worker(queue, ex, name="w", lease_s=5)
    assert w.run(max_jobs=1, idle_exit_s=5) == 1
    ex.shutdown()
    fields = queue.job_fields(sub.job_id)
    assert fields["state"] == "failed" and "TypeError: draft state cannot be built" in fields["message"]
    assert not list((tmp_path / "out").glob("part-*.parquet"))


def test_embedded_worker_runs_only_its_own_job(queue, redis_url, tmp_path):
    """`submit --local` must not run (or hold) other jobs waiting in the same queue, even ones ahead of it."""
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}, {"id": 2, "prompt": "y"}])
    other = _submit_at(queue, tmp_path, priority=9, out="o1")
    older = _submit_at(queue, tmp_path, priority=5, out="o2")
    mine = _submit_at(queue, tmp_path, priority=5, out="o3")
    run = run_until_done(queue, mine.job_id, url=redis_url, prefix=queue.prefix, executor_kind="thread", lease_s=5)
    assert run.state == "done"
    for job in (other, older):
        fields = queue.job_fields(job.job_id)
        assert fields["state"] == "queued" and "owner" not in fields
        assert not list((tmp_path / ("o1" if job is other else "o2")).glob("part-*.parquet"))
    # they are still claimable by a real worker, highest priority first
    first = queue.claim(consumer="real", lease_ms=10_000, block_ms=0)
    assert first is not None and first.job_id == other.job_id


def test_shards_retried_counts_distinct_shards_and_retries_apart(queue, tmp_path):
    """One shard retried twice and another once: ``2 shards retried (3 retries)``, not 3 shards."""
    _, sub = submit_standin_job(queue, tmp_path, [{"id": i, "prompt": f"p {i}"} for i in range(4)])
    for shard in (0, 0, 1):
        queue.note_shard_retried(sub.job_id, shard)
    st = queue.status(sub.job_id)
    assert (st.shards_retried, st.shard_retries) == (2, 3)
    assert st.to_dict()["shards_retried"] == 2 and st.to_dict()["shard_retries"] == 3
    assert st.fault_note == "2 shards retried (3 retries)"


class _FlakyNodes:
    """A ThreadExecutor whose first ``fail`` shard attempts die as a crash; ``node`` says whether the crash
    is the node's fault (``node_fault``)."""

    def __init__(self, inner, *, fail: int, node: bool) -> None:
        self.inner, self.fail, self.node, self.restarts = inner, fail, node, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, slot, task):
        import concurrent.futures as cf

        if self.fail > 0:
            self.fail -= 1
            fut = cf.Future()
            fut.set_exception(RuntimeError("actor lost"))
            return fut
        return self.inner.submit(slot, task)

    def is_crash(self, exc):
        return isinstance(exc, RuntimeError) and str(exc) == "actor lost"

    def node_fault(self, slot, exc):
        return self.node

    def restart(self, slot):
        self.restarts += 1
        return True


@pytest.mark.parametrize("node", [True, False])
def test_node_faults_do_not_use_up_a_shards_attempts(queue, tmp_path, node):
    """Five crashes in a row on a one-shard job: node faults (the actor's node died) are retried without
    counting against ``max_shard_attempts`` (3), so the rows are answered on attempt 6; plain crashes (a
    poison row) end the shard after 3 attempts with its rows written as errors."""
    from racer_batch.service.execution.actors import ThreadExecutor
    from racer_batch.service.execution.worker import Worker

    spec, sub = submit_standin_job(queue, tmp_path, [{"id": i, "prompt": f"p {i}"} for i in range(2)],
                                   **{"output.shard_rows": 2})
    ex = _FlakyNodes(ThreadExecutor(queue_url(queue), prefix=queue.prefix, name="t"), fail=5, node=node)
    w = Worker(queue, ex, name="t", lease_s=5.0, poll_s=0.05)
    try:
        assert w.run(max_jobs=1, idle_exit_s=10) == 1
    finally:
        ex.inner.shutdown()
    rows = read_output(spec.output.path)
    st = queue.status(sub.job_id)
    assert st.state == ("done" if node else "failed"), st.to_dict()  # all rows failed: the job fails
    assert (st.shards_retried, st.shard_retries) == (1, 5 if node else 2), st.to_dict()
    meta = json.loads(pq.read_schema(part_path(spec.output.path, 0)).metadata[b"racer_batch.shard"])
    if node:
        assert {r["status"] for r in rows.to_pylist()} == {"ok"} and meta["attempt"] == 6
    else:
        assert {r["status"] for r in rows.to_pylist()} == {"error"}


def test_node_faults_are_bounded(queue, tmp_path):
    """A cluster that fails under a shard for ever: after ``max_node_faults`` the job fails (no spinning), and
    no row is written as an error."""
    from racer_batch.service.execution.actors import ThreadExecutor
    from racer_batch.service.execution.worker import Worker

    _, sub = submit_standin_job(queue, tmp_path, [{"id": 1, "prompt": "p"}])
    ex = _FlakyNodes(ThreadExecutor(queue_url(queue), prefix=queue.prefix, name="t"), fail=10**6, node=True)
    w = Worker(queue, ex, name="t", lease_s=5.0, poll_s=0.05, max_node_faults=4)
    try:
        assert w.run(max_jobs=1, idle_exit_s=10) == 1
    finally:
        ex.inner.shutdown()
    st = queue.status(sub.job_id)
    assert st.state == "failed" and "lost to node faults 5 times" in (st.message or ""), st.to_dict()
    assert st.totals.error == 0 and ex.fail == 10**6 - 5


def test_a_suspect_node_gets_no_new_actor(monkeypatch):
    """RayExecutor.node_fault on an actor whose node Ray still lists alive but whose raylet does not answer:
    a node fault; the node becomes suspect, has no room (``_free_places``), and the restarted actor is pinned
    (node affinity) to the live node with room. A crash on a node whose raylet answers is not a node fault.
    Ray is faked: no cluster is started."""
    import concurrent.futures as cf
    import types

    import ray

    from racer_batch.service.execution import actors
    from racer_batch.service.execution.actors import PoolShape, RayExecutor

    nodes = [{"NodeID": n, "Alive": True, "Resources": {"CPU": 1.0}, "NodeManagerAddress": "127.0.0.1",
              "NodeManagerPort": port} for n, port in (("dying", 1), ("busy", 2), ("free", 3))]
    ex = RayExecutor("redis://127.0.0.1:6379/0", prefix="p", name="t")
    ex._ray = types.SimpleNamespace(nodes=lambda: nodes, exceptions=ray.exceptions, is_initialized=lambda: False)
    monkeypatch.setattr(actors, "_raylet_answers", lambda node, timeout_s=1.0: node["NodeID"] != "dying")
    ex.shape = PoolShape(num_actors=2, cpus_per_actor=1.0, gpus_per_actor=0.0)
    ex.actors = [object(), object()]
    for slot, node in enumerate(("dying", "busy")):
        ex._placed[slot] = cf.Future()
        ex._placed[slot].set_result(node)
    assert ex._free_places() == 1  # the dying node's place is counted while nothing is known
    assert not ex.node_fault(1, RuntimeError("crash"))  # a crash on a node that answers: the shard's fault
    assert ex.node_fault(0, ray.exceptions.ActorUnavailableError("gone", None))
    ex.actors[0] = None
    ex._placed.pop(0)
    assert ex._rooms()[0] == {"free": 1}  # the suspect node has no room, though Ray lists it alive with 1 CPU
    started = []
    monkeypatch.setattr(ex, "_start", lambda slot, node=None: started.append((slot, node)))
    ex._start_where_room(0)
    assert started == [(0, "free")]


def test_thread_executor_sets_torch_threads_like_an_actor_and_gives_them_back(redis_url, queue):
    """`--executor thread` / `worker --no-ray` run rows with the job's torch_threads (auto: 1) as a Ray actor
    does, not with the process's own count; shutdown restores that count for whatever runs next."""
    import torch
    from transformers.utils import logging as hf_logging

    from racer_batch.service.execution.actors import ThreadExecutor
    from racer_batch.service.job.spec import Resources

    before = torch.get_num_threads()
    ex = ThreadExecutor(redis_url, prefix=queue.prefix)
    try:
        torch.set_num_threads(3)  # a count that is neither auto's 1 nor the 2 asked for below
        ex.prepare(Resources())
        assert torch.get_num_threads() == 1
        assert not hf_logging.is_progress_bar_enabled()
        ex.prepare(Resources(torch_threads=2))
        assert torch.get_num_threads() == 2
    finally:
        ex.shutdown()
        hf_logging.enable_progress_bar()
    assert torch.get_num_threads() == 3
    torch.set_num_threads(before)
