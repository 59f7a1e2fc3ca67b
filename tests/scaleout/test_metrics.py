"""Prometheus metrics of the worker: pure counting, the registry, and a real scrape over HTTP (real Redis,
stand-in engine on worker threads; the CLI test runs ``racer-batch worker --metrics-port``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from racer_batch.service.execution.actors import ThreadExecutor
from racer_batch.service.execution.local import free_port
from racer_batch.service.execution.worker import Worker
from racer_batch.service.job.spec import load_spec
from racer_batch.service.job.task import ShardResult
from racer_batch.service.results.metrics import MeteredExecutor, WorkerMetrics
from racer_batch.service.results.output import read_output
from racer_batch.service.results.record import RowRecord
from racer_batch.service.results.tally import Tally
from racer_batch.service.submit import submit_job
from tests.standin import RAISE_MARKER

ROOT = Path(__file__).resolve().parents[2]

ROWS = [
    {"id": "a1", "prompt": "one two three", "route": "chat"},
    {"id": "a2", "prompt": "four five", "route": "chat"},
    {"id": "a3", "prompt": "six", "route": "chat"},
    {"id": "b1", "prompt": "seven eight", "route": "code"},
    {"id": "b2", "prompt": "nine", "route": "code"},
    {"id": "b3", "prompt": f"ten {RAISE_MARKER}", "route": "code"},
]


def _rec(route, status, **counts):
    return RowRecord(id=f"{route}-{status}", row_idx=0, shard=0, route=route, status=status, job_id="j", **counts)


def test_tally_routes_on_hand_made_records():
    c = Tally()
    c.observe_row(_rec("chat", "ok", output_tokens=10, steps=4, accepted_hist=[1, 2, 1], prefill_ms=5.0,
                       decode_ms=20.0))
    c.observe_row(_rec("chat", "error", output_tokens=None, steps=None, accepted_hist=None))
    c.observe_row(_rec("code", "cancelled", output_tokens=3, steps=3, accepted_hist=[3]))
    chat, code = c.routes["chat"], c.routes["code"]
    assert (chat.ok, chat.error, chat.cancelled, chat.output_tokens, chat.accepted_tokens, chat.steps,
            chat.gen_ms) == (1, 1, 0, 10, 4, 4, 25.0)
    assert code.cancelled == 1 and code.accepted_tokens == 0
    d = c.to_dict()
    assert Tally.from_dict(d) == c and Tally.from_dict(d).to_dict() == d
    assert d["routes"]["chat"]["accepted_hist"] == [1, 2, 1]  # per-route counts survive the JSON
    with pytest.raises(AssertionError, match="unknown status 'weird'"):
        c.observe_row(_rec("x", "weird"))


def _shard_result(*, written: bool, stopped, elapsed_s=None) -> ShardResult:
    t = Tally()
    for _ in range(2):
        t.observe_row(_rec("chat", "ok", output_tokens=5, steps=3, accepted_hist=[1, 1, 1], decode_ms=500.0))
    t.observe_row(_rec("chat", "error", output_tokens=2, steps=1, accepted_hist=[1], decode_ms=500.0))
    assert (t.output_tokens, t.accepted_tokens, t.steps, t.gen_ms) == (12, 6, 7, 1500.0)
    return ShardResult(summary=dict(t.to_dict(), elapsed_s=elapsed_s), stopped=stopped, written=written)


def test_registry_counts_and_forgets_old_jobs():
    m = WorkerMetrics(worker="w1", keep_jobs=1)
    m.observe_shard("j1", _shard_result(written=True, stopped=None, elapsed_s=2.0))
    m.observe_shard("j1", _shard_result(written=False, stopped="cancelled", elapsed_s=1.0))
    m.observe_shard_error("j1")
    get = m.registry.get_sample_value
    assert get("racer_batch_rows_total", {"job": "j1", "route": "chat", "status": "ok"}) == 4
    assert get("racer_batch_errors_total", {"job": "j1", "route": "chat", "kind": "row"}) == 2
    assert get("racer_batch_errors_total", {"job": "j1", "route": "", "kind": "shard"}) == 1
    assert get("racer_batch_accepted_tokens_total", {"job": "j1", "route": "chat"}) == 12
    assert get("racer_batch_generation_seconds_total", {"job": "j1", "route": "chat"}) == 3.0
    assert get("racer_batch_shards_total", {"job": "j1", "outcome": "committed"}) == 1
    assert get("racer_batch_shards_total", {"job": "j1", "outcome": "cancelled"}) == 1
    assert get("racer_batch_shard_seconds_count") == 2
    m.job_ended("j1")
    m.observe_shard("j2", _shard_result(written=True, stopped=None))
    m.job_ended("j2")  # keep_jobs=1: j1's series go
    assert get("racer_batch_rows_total", {"job": "j1", "route": "chat", "status": "ok"}) is None
    assert get("racer_batch_rows_total", {"job": "j2", "route": "chat", "status": "ok"}) == 2


def _scrape(port: int) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} from the worker's /metrics endpoint, once no shard is
    outstanding (a shard's counts land from its future's callback, just after the worker sees the result)."""
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            text = resp.read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        if out.get(("racer_batch_running_shards", ())) == 0 or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def _expected(out_dir: str) -> dict[str, dict]:
    """Per-route truth from the Parquet output."""
    exp: dict[str, dict] = {}
    for r in read_output(out_dir).to_pylist():
        e = exp.setdefault(r["route"], {"ok": 0, "error": 0, "tokens": 0, "steps": 0, "accepted": 0})
        e[r["status"]] += 1
        e["tokens"] += r["output_tokens"] or 0
        e["steps"] += r["steps"] or 0
        e["accepted"] += sum(k * n for k, n in enumerate(r["accepted_hist"] or []))
    return exp


def _check(samples: dict, job_id: str, exp: dict[str, dict]) -> None:
    def val(name: str, **labels) -> float:
        return samples.get((name, tuple(sorted(dict(job=job_id, **labels).items()))), 0.0)

    assert exp["chat"]["ok"] == 3 and exp["code"] == dict(exp["code"], ok=2, error=1)
    for route, e in exp.items():
        assert val("racer_batch_rows_total", route=route, status="ok") == e["ok"]
        assert val("racer_batch_rows_total", route=route, status="error") == e["error"]
        assert val("racer_batch_errors_total", route=route, kind="row") == e["error"]
        assert val("racer_batch_output_tokens_total", route=route) == e["tokens"]
        assert val("racer_batch_steps_total", route=route) == e["steps"]
        assert val("racer_batch_accepted_tokens_total", route=route) == e["accepted"] > 0
    assert val("racer_batch_shards_total", outcome="committed") == 2


def _submit(queue, tmp_path: Path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "in.parquet")
    spec = load_spec(None, {"input.path": str(tmp_path / "in.parquet"), "output.path": str(tmp_path / "out"),
                            "model.name": "stand-in?mat=3", "generation.max_new_tokens": 8,
                            "output.shard_rows": 4, "resources.num_actors": 2})
    return spec, submit_job(queue, spec).job_id


@pytest.mark.service
def test_scrape_in_process_worker(queue, redis_url, tmp_path):
    spec, job_id = _submit(queue, tmp_path)
    metrics = WorkerMetrics(worker="test-worker")
    port = metrics.serve(0, host="127.0.0.1")
    executor = MeteredExecutor(ThreadExecutor(redis_url, prefix=queue.prefix), metrics)
    try:
        assert Worker(queue, executor, lease_s=10).run(max_jobs=1) == 1
        samples = _scrape(port)
    finally:
        executor.shutdown()
        metrics.close()
    assert queue.status(job_id).state == "done"
    _check(samples, job_id, _expected(spec.output.path))
    assert samples[("racer_batch_running_shards", ())] == 0
    assert samples[("racer_batch_worker_info", (("worker", "test-worker"),))] == 1


@pytest.mark.service
def test_cli_worker_serves_metrics(queue, redis_url, tmp_path):
    spec, job_id = _submit(queue, tmp_path)
    port = free_port()
    exe = Path(sys.executable).with_name("racer-batch")
    cmd = [str(exe), "worker", "--no-ray", "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
           "--idle-exit", "60", "--redis-url", redis_url, "--prefix", queue.prefix]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    try:
        deadline = time.monotonic() + 60
        while queue.status(job_id).state != "done":
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "job did not finish within 60 s"
            time.sleep(0.2)
        samples = _scrape(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _check(samples, job_id, _expected(spec.output.path))
    assert proc.returncode == 0, proc.stdout.read().decode()


def test_retries_and_lost_nodes_are_counted():
    """MeteredExecutor counts a shard attempt after the first as a retry, and the nodes the executor reports
    lost, under the job of the shards it runs."""
    import concurrent.futures as cf
    import dataclasses

    from racer_batch.service.execution.runner import ShardTask

    class Inner:  # an executor whose shards are done at once and that has lost two nodes
        slots = 1

        def submit(self, slot, task):
            fut = cf.Future()
            fut.set_result(_shard_result(written=True, stopped=None, elapsed_s=1.0))
            return fut

        def lost_nodes(self):
            return ["node-a", "node-b"]

    m = WorkerMetrics(worker="w")
    ex = MeteredExecutor(Inner(), m)
    task = ShardTask(job_id="j", shard=0, row_start=0, row_stop=3, spec={}, plan={}, spec_hash="h", owner="w")
    ex.submit(0, task)
    ex.submit(0, dataclasses.replace(task, attempt=2))
    assert ex.lost_nodes() == ["node-a", "node-b"]
    get = m.registry.get_sample_value
    assert get("racer_batch_shard_retries_total", {"job": "j"}) == 1
    assert get("racer_batch_nodes_lost_total", {"job": "j"}) == 2
    assert get("racer_batch_shards_total", {"job": "j", "outcome": "committed"}) == 2

