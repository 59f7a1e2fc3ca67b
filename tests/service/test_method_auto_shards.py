"""``decoding.method: auto`` on a real tiny model through the row runner: every row's output is that of a fixed
lossless method, each route tries every candidate, the rows name the method that answered them, and the
shard summary carries the evidence and the choice per route (with B = 1 and B = 4)."""

from __future__ import annotations

import pytest

from racer_batch.report.build import build_report, render_md
from racer_batch.report.load import load_output
from racer_batch.service.execution.runner import RowRunner, ShardTask, default_engine
from racer_batch.service.job.inputs import plan_input
from racer_batch.service.job.spec import load_spec
from racer_batch.service.results.manifest import job_manifest
from racer_batch.service.results.output import read_manifest, read_output, write_manifest
from tests.fixtures import write_parquet
from tests.helpers import tiny_bundle

PROMPTS = ["abcabd the cat and the hat", "hello world, hello there", "0123012301 0123", "mississippi miss"]


def _spec(tmp_path, out: str, method: str, streams: int):
    return load_spec(None, {"input.path": str(tmp_path / "in.parquet"), "output.path": str(tmp_path / out),
                            "model.name": "tiny", "generation.max_new_tokens": 24, "output.shard_rows": 16,
                            "decoding.method": method, "decoding.capacity": 8,
                            "resources.streams_per_actor": streams})


def _task(spec) -> dict:
    return ShardTask(job_id="j", shard=0, row_start=0, row_stop=16, spec=spec.stored(),
                     plan=plan_input(spec.input).to_dict(), spec_hash=spec.spec_hash(), owner="t").to_dict()


@pytest.fixture
def by_forwards(monkeypatch):
    """Each finished row is charged 1 ms per target forward in place of its actor time, so a route's choice follows
    the candidates' tokens per forward only. With wall time, two candidates within the machine's noise of each
    other swap places from run to run: CI failed twice on that (2026-12-07), once where a later actor's own rows
    moved a route's choice, once where the manifest's pooled figures, recomputed from milliseconds rounded to 0.1,
    ranked two near-equal candidates the other way. These tests are about how the evidence travels, not about
    the timer."""
    from racer_batch.service.execution.auto import MethodChooser

    observe = MethodChooser.observe

    def charged_per_forward(self, route, method, *, tokens, steps, busy_ms, decode_ms=None, scale=1.0):
        observe(self, route, method, tokens=tokens, steps=steps, busy_ms=float(steps), decode_ms=float(steps))

    monkeypatch.setattr(MethodChooser, "observe", charged_per_forward)


@pytest.mark.parametrize("streams", [1, 4])
def test_method_auto_answers_as_a_fixed_method_and_reports_its_choice(tmp_path, streams, by_forwards):
    bundle = tiny_bundle(seed=3, head_scale=60.0)
    rows = [{"id": f"r{i:02d}", "prompt": PROMPTS[i % 4], "route": "ab"[i % 2]} for i in range(16)]
    write_parquet(tmp_path / "in.parquet", rows)
    out = {}
    for method in ("racer", "auto"):
        spec = _spec(tmp_path, method, method, streams)
        runner = RowRunner(worker_name="t", loader=lambda model, **kw: bundle, engine_factory=default_engine)
        res = runner.run_shard(_task(spec))
        assert res.committed and res.summary["ok"] == 16, res
        out[method] = read_output(spec.output.path).to_pylist()
        # one engine (one runner, one KV pool, one copy of the weights) for every candidate: their rows share
        # each batched forward; one draft state per candidate
        assert len(runner._engines) == 1
        assert len(runner._states) == (3 if method == "auto" else 1)
    same = ("id", "text", "output_tokens", "finish_reason", "status")
    assert [{k: r[k] for k in same} for r in out["auto"]] == [{k: r[k] for k in same} for r in out["racer"]]
    ev = res.summary["method_auto"]
    assert sorted(ev) == ["a", "b"]
    for route in ("a", "b"):
        got = [r["method"] for r in out["auto"] if r["route"] == route]
        assert all(got.count(m) >= 1 for m in ("racer", "pld", "ar")), got  # each candidate tried first
        cands = ev[route]["candidates"]
        assert {m: c["rows"] for m, c in cands.items()} == {m: got.count(m) for m in ("racer", "pld", "ar")}
        assert ev[route]["choice"] == max(cands, key=lambda m: cands[m]["compared_tokens_per_s"])
        assert all(c["tokens_per_s"] > 0 and c["compared_tokens_per_s"] > 0 and c["mat"] >= 1.0 for c in cands.values())
    assert {r["config_hash"] for r in out["auto"]} == {_spec(tmp_path, "x", "auto", streams).decoding.config_hash()}
    # the manifest pools the shard's evidence; the report marks each route's choice
    manifest = job_manifest("j", spec, plan_input(spec.input), state="done", done={0: res.summary})
    write_manifest(spec.output.path, manifest)
    rep = build_report(load_output(spec.output.path), n_boot=10, with_charts=False)
    pooled = read_manifest(spec.output.path)["method_auto"]
    for g in ev:  # one shard: the pooled counters are the shard's (tokens/s recomputed from rounded ms)
        assert pooled[g]["choice"] == ev[g]["choice"]
        for m, c in ev[g]["candidates"].items():
            assert {k: pooled[g]["candidates"][m][k] for k in ("rows", "tokens", "steps", "mat")} == \
                {k: c[k] for k in ("rows", "tokens", "steps", "mat")}
    assert {g: d["choice"] for g, d in rep.method_choice.items()} == {g: ev[g]["choice"] for g in ev}
    assert "## Method per route (method auto)" in render_md(rep)
    assert runner.active_jobs == ["j"]
    runner.end_job("j")
    assert runner._states == {} and runner._choosers == {}


def test_a_later_actor_starts_from_the_evidence_the_others_shared_in_redis(tmp_path, queue, by_forwards):
    """Two runners (two actors) of one job with Redis sinks: the second runs shard 1 after the first ran
    shard 0 and explores nothing (every route's rows go to the choice the first actor's evidence makes); the
    output equals a fixed racer run's; the shard summaries keep each actor's own rows (rows charged per forward:
    ``by_forwards``)."""
    from racer_batch.service.execution.actors import RedisSink

    bundle = tiny_bundle(seed=3, head_scale=60.0)
    rows = [{"id": f"r{i:02d}", "prompt": PROMPTS[i % 4], "route": "ab"[i % 2]} for i in range(32)]
    write_parquet(tmp_path / "in.parquet", rows)
    outputs = {}
    for method in ("racer", "auto"):
        spec = _spec(tmp_path, method, method, 4)
        summaries = []
        for shard in (0, 1):
            runner = RowRunner(worker_name=f"w{shard}", loader=lambda model, **kw: bundle,
                               engine_factory=default_engine, sink=RedisSink(queue))
            task = ShardTask(job_id="j", shard=shard, row_start=16 * shard, row_stop=16 * shard + 16,
                             spec=spec.stored(), plan=plan_input(spec.input).to_dict(), spec_hash=spec.spec_hash(),
                             owner="t").to_dict()
            res = runner.run_shard(task)
            assert res.committed, res
            summaries.append(res.summary)
        outputs[method] = sorted(read_output(spec.output.path).to_pylist(), key=lambda r: r["id"])
    same = ("id", "text", "output_tokens", "finish_reason", "status")
    assert [{k: r[k] for k in same} for r in outputs["auto"]] == [{k: r[k] for k in same} for r in outputs["racer"]]
    first, second = (s["method_auto"] for s in summaries)
    for route in ("a", "b"):
        later = [r["method"] for r in outputs["auto"] if r["route"] == route and r["row_idx"] >= 16]
        assert later == [first[route]["choice"]] * 8, (route, later, first[route])
        assert {m for m, c in second[route]["candidates"].items() if c["rows"]} == {first[route]["choice"]}
    assert sum(c["rows"] for s in (first, second) for e in s.values() for c in e["candidates"].values()) == 32
    key = queue.k_evidence("j", _spec(tmp_path, "auto", "auto", 4).spec_hash())
    assert queue.r.exists(key)
    queue.delete_job("j")
    assert not queue.r.exists(key)


def test_redis_evidence_sums_the_others_skips_what_it_cannot_read_and_survives_a_lost_redis(
        queue, redis_server_factory, caplog):
    from racer_batch.service.execution.actors import RedisEvidence
    from racer_batch.service.execution.queue import JobQueue

    a, b, c = (RedisEvidence(queue, "j", "h") for _ in range(3))
    a.publish("r", "pld", {"rows": 2, "tokens": 100, "busy_ms": 50.0})
    b.publish("r", "pld", {"rows": 1, "tokens": 10, "busy_ms": 5.0})
    b.publish("r", "pld", {"rows": 3, "tokens": 30, "busy_ms": 15.0})  # replaces b's earlier totals
    queue.r.hset(a.key, "garbage", "x")
    queue.r.hset(a.key, "z\tr\tar", "{not json")
    assert c.others() == {"r": {"pld": {"rows": 5, "tokens": 130, "busy_ms": 65.0}}}
    assert a.others() == {"r": {"pld": {"rows": 3, "tokens": 30, "busy_ms": 15.0}}}
    assert RedisEvidence(queue, "j", "other-spec").others() == {}  # another spec hash reads another hash
    # first rows are claimed atomically, job-wide, per route and candidate; claims are not evidence
    assert [a.claim("r", "pld"), b.claim("r", "pld"), c.claim("r", "ar"), c.claim("q", "pld")] == [1, 2, 1, 1]
    assert c.others() == {"r": {"pld": {"rows": 5, "tokens": 130, "busy_ms": 65.0}}}
    srv = redis_server_factory()
    lost = RedisEvidence(JobQueue.from_url(srv.url, prefix="p:"), "j", "h")
    lost.publish("r", "ar", {"rows": 1})
    srv.stop()
    with caplog.at_level("WARNING"):
        lost.publish("r", "ar", {"rows": 2})
        assert lost.others() == {}
        assert lost.claim("r", "ar") is None  # cannot tell: the chooser goes by what it has read
    assert sum("not shared" in r.getMessage() for r in caplog.records) == 1  # logged once while it fails
