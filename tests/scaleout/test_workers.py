"""Several workers on one queue (issue 15): two ``racer-batch worker`` processes (threads for shards, so no Ray
is needed for what is tested here: the queue, its leases and the output) and three jobs of different
priorities on the real Redis under a private prefix.

The failure reported against celery and rq is a job that runs twice once its visibility timeout passes. Here a
worker is SIGKILLed mid-job: the other takes the job over only after the lease, as its one owner, and the
output holds every id once, no part file holding a row twice.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from racer_batch.service.results.output import existing_parts
from tests.fixtures import submit_standin_job, worker_process
from tests.reliability.util import assert_each_id_once, wait_for

pytestmark = pytest.mark.service

LEASE_S = 3.0
PRIORITIES = {"high": 9, "mid": 5, "low": 1}


def _submit(queue, tmp_path: Path, name: str, priority: int):
    rows = [{"id": f"{name}-{i:02d}", "prompt": f"{name} prompt {i}"} for i in range(16)]
    spec, sub = submit_standin_job(queue, tmp_path / name, rows, **{
        "model.name": "stand-in?ms_per_step=100&mat=2", "output.shard_rows": 2, "priority": priority,
        "name": name})
    return spec, sub, [r["id"] for r in rows]


def test_two_workers_three_jobs_one_killed(queue, redis_url, tmp_path):
    """Worker A starts and takes the high-priority job, then worker B starts and takes the middle one; the
    low one waits for the first free worker. A is SIGKILLed mid-job. After its lease runs out, B takes A's
    job over (reclaimed) and finishes it from the shards A committed. Each job had one owner at a time (the
    queue's lease history; rows and part files name one worker each, A's all written before the kill, B's
    after it took over), jobs started in priority order, and every output holds each id once."""
    jobs = {name: _submit(queue, tmp_path, name, prio) for name, prio in PRIORITIES.items()}
    job_ids = {name: sub.job_id for name, (_, sub, _) in jobs.items()}
    logs = {w: tmp_path / f"{w}.log" for w in ("A", "B")}
    with worker_process(logs["A"], "--no-ray", redis_url=redis_url, prefix=queue.prefix, name="A",
                        lease_s=LEASE_S) as a:
        wait_for(lambda: queue.status(job_ids["high"]).owner == "A" or a.poll() is not None, timeout_s=90,
                 what="worker A to take the high-priority job")
        with worker_process(logs["B"], "--no-ray", redis_url=redis_url, prefix=queue.prefix, name="B",
                            lease_s=LEASE_S) as b:
            wait_for(lambda: queue.status(job_ids["mid"]).owner == "B" or b.poll() is not None, timeout_s=90,
                     what="worker B to take the middle job")
            wait_for(lambda: queue.status(job_ids["high"]).shards_done >= 2 or a.poll() is not None,
                     timeout_s=90, what="two shards of the high job")
            high = queue.status(job_ids["high"])
            assert a.poll() is None and high.state == "running" and high.shards_done < 8, high.to_dict()
            t_kill = time.time()
            os.kill(a.pid, signal.SIGKILL)
            a.wait(timeout=30)
            wait_for(lambda: all(queue.status(j).state == "done" for j in job_ids.values()) or b.poll() is not None,
                     timeout_s=120, what="the three jobs to end")
            assert b.poll() is None, logs["B"].read_text()
            b.send_signal(signal.SIGTERM)  # idle now: it exits 0
            assert b.wait(timeout=30) == 0, logs["B"].read_text()

    history = {name: queue.lease_history(j) for name, j in job_ids.items()}
    for name, events in history.items():
        print(name, [(e["event"], e["owner"], round(e["at"] - t_kill, 2)) for e in events])
    # one owner at a time: A held the high job until it died; B took it over only afterwards, as a reclaim
    assert [(e["event"], e["owner"], e.get("reclaimed")) for e in history["high"]] == [
        ("taken", "A", "0"), ("taken", "B", "1"), ("done", "B", None)]
    takeover_s = history["high"][1]["at"] - t_kill
    assert takeover_s > 0
    assert [(e["event"], e["owner"]) for e in history["mid"]] == [("taken", "B"), ("done", "B")]
    assert [e["event"] for e in history["low"]] == ["taken", "done"] and history["low"][0]["owner"] == "B"
    # priority order of starts
    first = {name: events[0]["at"] for name, events in history.items()}
    assert first["high"] < first["mid"] < first["low"]
    assert int(queue.job_fields(job_ids["high"])["attempts"]) == 2

    for name, (spec, sub, ids) in jobs.items():
        rows = assert_each_id_once(spec.output.path, ids)
        assert queue.status(sub.job_id).totals.ok == 16
        for shard, path in existing_parts(spec.output.path).items():
            part = pq.read_table(path).to_pylist()
            assert len({r["id"] for r in part}) == len(part) == 2  # no row twice in a part file
            owners = {r["worker"].split("/")[0] for r in part}
            meta = json.loads(pq.read_schema(path).metadata[b"racer_batch.shard"])
            assert len(owners) == 1 and meta["worker"].split("/")[0] in owners, (name, shard, owners, meta)
        if name == "high":
            by = {w: [r for r in rows if r["worker"].startswith(f"{w}/")] for w in ("A", "B")}
            assert by["A"] and by["B"] and len(by["A"]) + len(by["B"]) == 16
            assert max(r["finished_at"].timestamp() for r in by["A"]) < t_kill
            assert min(r["finished_at"].timestamp() for r in by["B"]) > history["high"][1]["at"]
        else:
            assert all(r["worker"].startswith("B/") for r in rows)
    text = logs["B"].read_text()
    assert f"job {job_ids['high']}: taken by B (reclaimed)" in text, text
    print(f"B took the killed worker's job over {takeover_s:.1f} s after the kill (lease {LEASE_S:g} s)")


def test_a_worker_paused_past_its_lease_writes_nothing_after_the_take_over(queue, redis_url, tmp_path):
    """The visibility-timeout failure itself: worker A is not killed but paused (SIGSTOP) mid-job for longer
    than its lease, worker B takes the job over, then A runs on (SIGCONT). A finds it lost the lease: its
    shard in flight is not written, it does not end the job, and B's run is the only one in the output; every
    id once."""
    spec, sub, ids = _submit(queue, tmp_path, "paused", 5)
    logs = {w: tmp_path / f"{w}.log" for w in ("A", "B")}
    with worker_process(logs["A"], "--no-ray", redis_url=redis_url, prefix=queue.prefix, name="A",
                        lease_s=LEASE_S) as a:
        wait_for(lambda: queue.status(sub.job_id).shards_done >= 2 or a.poll() is not None, timeout_s=90,
                 what="two shards by worker A")
        assert a.poll() is None and queue.status(sub.job_id).shards_done < 8, logs["A"].read_text()
        t_stop = time.time()
        os.kill(a.pid, signal.SIGSTOP)
        try:
            with worker_process(logs["B"], "--no-ray", redis_url=redis_url, prefix=queue.prefix, name="B",
                                lease_s=LEASE_S) as b:
                wait_for(lambda: queue.status(sub.job_id).owner == "B" or b.poll() is not None, timeout_s=90,
                         what="worker B to take the job over")
                t_cont = time.time()
                os.kill(a.pid, signal.SIGCONT)
                wait_for(lambda: queue.status(sub.job_id).state == "done" or b.poll() is not None, timeout_s=90,
                         what="the job to end")
                time.sleep(1.0)  # A has woken up and looked at its lease by now
                for proc in (a, b):
                    assert proc.poll() is None
                    proc.send_signal(signal.SIGTERM)
                assert b.wait(timeout=30) == 0, logs["B"].read_text()
                assert a.wait(timeout=30) == 0, logs["A"].read_text()
        finally:
            if a.poll() is None:
                os.kill(a.pid, signal.SIGCONT)
    history = queue.lease_history(sub.job_id)
    print([(e["event"], e["owner"], round(e["at"] - t_stop, 2)) for e in history],
          f"A resumed at +{t_cont - t_stop:.1f} s")
    assert [(e["event"], e["owner"], e.get("reclaimed")) for e in history] == [
        ("taken", "A", "0"), ("taken", "B", "1"), ("done", "B", None)]
    rows = assert_each_id_once(spec.output.path, ids)
    by_a = [r for r in rows if r["worker"].startswith("A/")]
    assert by_a and all(r["finished_at"].timestamp() < t_stop for r in by_a)  # nothing of A after the pause
    for path in existing_parts(spec.output.path).values():
        meta = json.loads(pq.read_schema(path).metadata[b"racer_batch.shard"])
        part = pq.read_table(path).to_pylist()
        assert {r["worker"].split("/")[0] for r in part} == {meta["worker"].split("/")[0]}
        assert all(r["status"] == "ok" for r in part)
    assert "lease lost to another worker" in logs["A"].read_text()
