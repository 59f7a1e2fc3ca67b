"""Fault injection against a real Redis and a local Ray: a generation actor's process killed mid-shard, a
private Redis restarted mid-job with its data lost, cancel during a long row.

The other two faults of issue 6 are tested in tests/service (referenced in docs/reliability.md):
a worker process SIGKILLed mid-job and reclaimed by another (test_service_ray.py::
test_resume_after_killing_worker) and an actor removed with ray.kill (test_actor_killed_mid_shard_is_retried).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import time

import pyarrow.parquet as pq
import pytest

from racer_batch.service.execution.local import make_executor
from racer_batch.service.execution.queue import JobQueue, connect
from racer_batch.service.execution.worker import Worker
from racer_batch.service.results.output import part_path, read_manifest, read_output
from racer_batch.service.submit import submit_job
from tests.fixtures import submit_standin_job

from .util import BackgroundWorker, assert_each_id_once, wait_for

pytestmark = pytest.mark.service


def _shard_attempt(out_dir, shard: int) -> int:
    meta = json.loads(pq.read_schema(part_path(out_dir, shard)).metadata[b"racer_batch.shard"])
    return int(meta["attempt"])


def _run_on_private_redis(srv, prefix: str, tmp_path, rows: list[dict], *, name: str, ms_per_step: int,
                          max_new_tokens: int):
    """Submit a stand-in job over ``rows`` to the private Redis ``srv`` under ``prefix`` and start a worker
    ``name`` (Ray actors, lease 3 s) on a background thread. Returns (queue, spec, submit result, executor,
    background worker)."""
    q = JobQueue(connect(srv.url), prefix=prefix)
    spec, sub = submit_standin_job(q, tmp_path, rows, **{"model.name": f"stand-in?ms_per_step={ms_per_step}&mat=2",
                                                         "generation.max_new_tokens": max_new_tokens})
    executor = make_executor("ray", url=srv.url, prefix=prefix, name=name)
    return q, spec, sub, executor, BackgroundWorker(Worker(q, executor, name=name, lease_s=3, poll_s=0.2)).start()


def test_actor_process_sigkilled_mid_shard(ray_session, queue, redis_url, tmp_path):
    """The OS kills a generation actor's process (as the OOM killer would) while a shard is half done:
    the worker restarts the actor, the shard is redone from its first row, the job completes, every id
    appears exactly once, and the killed shard's part file records attempt 2."""
    rows = [{"id": f"r{i:02d}", "prompt": f"prompt number {i}"} for i in range(12)]
    spec, sub = submit_standin_job(queue, tmp_path, rows, **{"model.name": "stand-in?ms_per_step=15&mat=2",
                                                             "generation.max_new_tokens": 10})
    executor = make_executor("ray", url=redis_url, prefix=queue.prefix, name="oom")
    executor.prepare(spec.resources)  # same shape as the job's: the worker keeps this pool
    pid_before = int(ray_session.ray.get(executor.actors[0].describe.remote())["worker"].rsplit(":", 1)[1])
    bg = BackgroundWorker(Worker(queue, executor, name="oom", lease_s=10), max_jobs=1, idle_exit_s=30).start()
    try:
        def half_done() -> bool:  # a shard that has finished some of its rows but not all
            inflight = queue.r.hgetall(queue.k_job(sub.job_id, "inflight"))
            return any(0 < json.loads(v)["rows"] < 4 for v in inflight.values())

        wait_for(half_done, timeout_s=60, what="a shard half done", poll_s=0.005)
        killed = {int(s) for s, v in queue.r.hgetall(queue.k_job(sub.job_id, "inflight")).items()
                  if 0 < json.loads(v)["rows"] < 4}
        os.kill(pid_before, signal.SIGKILL)
        bg.thread.join(timeout=90)
        assert bg.error is None, bg.error
    finally:
        bg.stop()
        executor.shutdown()
    st = queue.status(sub.job_id)
    assert st.state == "done" and st.totals.ok == 12 and st.rows_done == 12, st.to_dict()
    assert_each_id_once(spec.output.path, [r["id"] for r in rows])
    assert all(_shard_attempt(spec.output.path, s) == 2 for s in killed)
    man = read_manifest(spec.output.path)
    assert man["state"] == "done" and man["totals"]["rows"] == 12


def test_redis_restart_with_data_lost_recovers_from_manifest(ray_session, redis_server_factory, tmp_path):
    """A private Redis (no persistence) is killed mid-job and started again empty. The worker keeps its
    thread through the outage (reconnecting with backoff), notices the job is gone, and stops; re-submitting
    the same spec finds the job id in the output folder's manifest and resumes: committed shards are kept,
    the rest run, every id appears exactly once."""
    srv = redis_server_factory()
    rows = [{"id": f"r{i:02d}", "prompt": f"prompt {i}"} for i in range(24)]
    q, spec, sub, executor, bg = _run_on_private_redis(
        srv, "rbrel-restart:", tmp_path, rows, name="survivor", ms_per_step=20, max_new_tokens=10)
    try:
        wait_for(lambda: q.status(sub.job_id).shards_done >= 2, timeout_s=90, what="two shards committed")
        srv.stop()  # SIGKILL: nothing saved
        time.sleep(1.5)  # the worker and the actor see connection errors meanwhile
        srv.start()
        assert not q.job_exists(sub.job_id), "the restarted Redis must have lost the job"
        committed_before = sorted(read_manifest(spec.output.path)["shards"])
        wait_for(lambda: bg.worker.jobs_run >= 1, timeout_s=60, what="the worker to drop the lost job")
        assert bg.thread.is_alive() and bg.error is None, f"worker died: {bg.error!r}"
        # recovery: re-submit the same spec; the folder's manifest gives the job id back
        again = submit_job(q, spec)
        assert again.job_id == sub.job_id and again.action == "resumed"
        wait_for(lambda: q.status(sub.job_id).state == "done", timeout_s=90, what="the resumed job to finish")
    finally:
        bg.stop()
        executor.shutdown()
    assert bg.error is None, bg.error
    st = q.status(sub.job_id)
    print(f"redis restart: {len(committed_before)} shards in the manifest before the outage, "
          f"{st.base_rows} rows committed when the resumed run started, {st.rows_done} rows in the end")
    assert st.rows_done == 24 and st.totals.ok == 24
    assert st.base_rows >= 8  # the resumed run started from the shards committed before the outage
    out = assert_each_id_once(spec.output.path, [r["id"] for r in rows])
    assert all(r["status"] == "ok" for r in out)
    assert len(committed_before) >= 1


def test_cancel_during_a_long_row(ray_session, queue, redis_url, tmp_path):
    """Cancel while one row is generating for a long time (stand-in: 200 ms per step, 2000 tokens): the
    row stops within one step of the cancel, earlier shards stay committed, the job ends cancelled."""
    step_ms = 200
    rows = [{"id": "short", "prompt": "quick one", "max_new_tokens": 2},
            {"id": "long", "prompt": "a very long answer", "max_new_tokens": 2000}]
    spec, sub = submit_standin_job(queue, tmp_path, rows,
                                   **{"model.name": f"stand-in?ms_per_step={step_ms}&mat=1",
                                      "output.shard_rows": 1})
    executor = make_executor("ray", url=redis_url, prefix=queue.prefix, name="canceller")
    bg = BackgroundWorker(Worker(queue, executor, name="canceller", lease_s=10), max_jobs=1, idle_exit_s=30).start()
    try:
        wait_for(lambda: queue.status(sub.job_id).shards_done >= 1, timeout_s=60, what="the short row's shard")
        time.sleep(1.0)  # the long row is now some steps in
        t_cancel = dt.datetime.now(dt.timezone.utc)
        assert queue.cancel(sub.job_id) == "cancelling"
        wait_for(lambda: queue.status(sub.job_id).state == "cancelled", timeout_s=30, what="the job to end")
    finally:
        bg.stop()
        executor.shutdown()
    out = {r["id"]: r for r in read_output(spec.output.path).to_pylist()}
    assert out["short"]["status"] == "ok"  # the finished shard stays
    long_row = out["long"]
    assert long_row["status"] == "cancelled" and long_row["finish_reason"] == "cancelled", long_row
    assert 3 <= long_row["output_tokens"] < 100, long_row["output_tokens"]
    late_s = (long_row["finished_at"] - t_cancel).total_seconds()
    print(f"cancel: long row stopped {late_s:.3f} s after the cancel (one step = {step_ms} ms), "
          f"{long_row['output_tokens']} tokens, {long_row['steps']} steps")
    # within one step: the actor checks the flag at most every 50 ms, the engine at every step boundary
    assert late_s < step_ms / 1000 + 0.35, f"row stopped {late_s:.3f} s after the cancel"
    st = queue.status(sub.job_id)
    assert st.state == "cancelled" and st.shards_done == 1


def test_redis_down_when_the_job_ends(ray_session, redis_server_factory, tmp_path):
    """Redis (with persistence) goes away while the last shard runs and comes back after the worker tried to
    finish the job: the worker survives the failed writes, the job's lease expires, the job is taken again
    and, its shards all committed in the output folder, ends done without redoing any row."""
    srv = redis_server_factory(persist=True)
    rows = [{"id": f"r{i}", "prompt": f"prompt {i}"} for i in range(4)]
    q, spec, sub, executor, bg = _run_on_private_redis(
        srv, "rbrel-down-at-end:", tmp_path, rows, name="patient", ms_per_step=100, max_new_tokens=6)
    try:
        wait_for(lambda: q.status(sub.job_id).rows_done >= 1, timeout_s=60, what="the first row")
        srv.stop()
        # the manifest says done just before the worker marks the job done in Redis, which is away
        wait_for(lambda: (read_manifest(spec.output.path) or {}).get("state") == "done", timeout_s=60,
                 what="the worker to reach the end of the job")
        time.sleep(2.0)
        srv.start()
        assert q.job_exists(sub.job_id), "persistence must have kept the job"
        wait_for(lambda: q.status(sub.job_id).state == "done", timeout_s=60, what="the job to end done")
        assert bg.thread.is_alive() and bg.error is None, f"worker died: {bg.error!r}"
    finally:
        bg.stop()
        executor.shutdown()
    assert bg.error is None, bg.error
    out = assert_each_id_once(spec.output.path, [r["id"] for r in rows])
    assert all(r["status"] == "ok" for r in out)
    assert _shard_attempt(spec.output.path, 0) == 1  # not redone


def _descendants(root: int) -> dict[int, bytes]:
    """{pid: command line} of every live process below ``root`` (zombies left out)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":
            parents[int(name)] = int(fields[1])
    found, frontier = {}, [root]
    while frontier:
        cur = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == cur and pid not in found:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        found[pid] = fh.read()
                except OSError:
                    continue
                frontier.append(pid)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
def test_a_killed_workers_own_ray_dies_with_it(redis_url, prefix, tmp_path):
    """kill -9 of a worker that started its own local Ray: every Ray process it started (raylet, GCS,
    DashboardAgent, RuntimeEnvAgent, idle workers) ends too, not minutes later."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log_fh:
        proc = subprocess.Popen([sys.executable, "-m", "racer_batch", "worker", "--num-cpus", "1",
                                 "--idle-exit", "600", "--redis-url", redis_url, "--prefix", prefix],
                                env=dict(os.environ, PYTHONPATH=str(root)), stdout=subprocess.DEVNULL,
                                stderr=log_fh)
    try:
        wait_for(lambda: b"waiting for jobs" in log_path.read_bytes() or proc.poll() is not None, timeout_s=180,
                 what="the worker's local Ray to start")
        assert proc.poll() is None, log_path.read_text()
        ray_procs = {pid: cmd for pid, cmd in _descendants(proc.pid).items() if b"rb-ray-" in cmd}
        assert any(b"agent" in cmd for cmd in ray_procs.values()), ray_procs
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: not [p for p in ray_procs if _alive(p)], timeout_s=60, poll_s=0.2,
             what=f"the worker's Ray processes to end: {[ray_procs[p][:80] for p in ray_procs if _alive(p)]}")
