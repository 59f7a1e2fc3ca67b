"""Several rows of a shard in flight on one actor (``resources.streams_per_actor``, issue 14 part 3).

The oracle is the same job at B = 1: with B rows decoded together (their draft trees verified in one
forward, a finished row's place taken by the next row), every row's output must be that of the B = 1 run,
whatever its batch-mates do (a bad row, a model error, a cancel). The part file keeps row order.

The stand-in engine (tests/standin.py) answers from the prompt and seed only, never from ``ms_per_step`` or
the batch: the B = 1 references of the Ray tests run it with ``ms_per_step=0`` to stay fast, and the
comparisons leave out the columns that name the model, worker or times.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from racer_batch.service.execution.local import make_executor, run_until_done
from racer_batch.service.execution.runner import NullSink, RowRunner, ShardTask, default_engine
from racer_batch.service.execution.worker import Worker
from racer_batch.service.job.inputs import plan_input
from racer_batch.service.job.spec import SpecError, load_spec
from racer_batch.service.results.output import part_path, read_output
from racer_batch.service.results.shadow import read_shadow
from racer_batch.service.submit import submit_job
from tests.fixtures import (
    base_overrides,
    queue_url,
    rescue_job,
    submit_standin_job,
    worker_process,
    write_parquet,
)
from tests.standin import RAISE_MARKER, StandInEngine

pytestmark = pytest.mark.service

# the output columns, which must not depend on B (not times, worker, model name, finished_at)
SAME = ("id", "row_idx", "shard", "route", "status", "error", "text", "turn_texts", "prompt_tokens",
        "output_tokens", "finish_reason", "seed", "samples")
# how the drafts fared: the same too unless the rows share a job-scoped draft state (then batch-mates learn
# from each other in another order than at B = 1, and the real engine's drafts differ; never its outputs)
STEPS = ("steps", "accepted_hist")


def _content(rows: list[dict], *, steps: bool = True) -> dict[str, dict]:
    """{id: the columns that must not depend on B} (``steps``: with STEPS)."""
    return {r["id"]: {k: r[k] for k in SAME + (STEPS if steps else ())} for r in rows}


def _shard_meta(out_dir, shard: int) -> dict:
    return json.loads(pq.read_schema(part_path(out_dir, shard)).metadata[b"racer_batch.shard"])


def _rows(n: int, *, bad: tuple[int, ...] = (), model_error: tuple[int, ...] = (), base_tokens: int = 6) -> list[dict]:
    """``n`` rows of different lengths (per-row max_new_tokens); ``bad``: no prompt at all (a parse error);
    ``model_error``: the stand-in raises on them."""
    rows = []
    for i in range(n):
        prompt = None if i in bad else f"prompt {i} {RAISE_MARKER}" if i in model_error else f"prompt number {i}"
        rows.append({"id": f"r{i:02d}", "prompt": prompt, "max_new_tokens": base_tokens + (7 * i) % 11})
    return rows


def _task(spec, *, job_id: str, shard: int = 0, lo: int = 0, hi: int) -> dict:
    return ShardTask(job_id=job_id, shard=shard, row_start=lo, row_stop=hi, spec=spec.stored(),
                     plan=plan_input(spec.input).to_dict(), spec_hash=spec.spec_hash(), owner="t").to_dict()


class RecordingSink(NullSink):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def observe(self, record, *, progress) -> None:
        self.seen.append(record.id)
        assert progress.rows == len(self.seen)


# ---- the setting
def test_streams_per_actor_setting_is_a_resource():
    """1..64 or auto, default 1; a resource, so not in the spec hash; the error names the key and value."""
    over = {"input.path": "in.parquet", "output.path": "out"}
    assert load_spec(None, over).resources.streams_per_actor == 1
    four = load_spec(None, dict(over, **{"resources.streams_per_actor": 4}))
    auto = load_spec(None, dict(over, **{"resources.streams_per_actor": "auto"}))
    assert (four.resources.streams_per_actor, auto.resources.streams_per_actor) == (4, "auto")
    assert four.spec_hash() == auto.spec_hash() == load_spec(None, over).spec_hash()
    for bad in (0, 65, "many"):
        with pytest.raises(SpecError, match="resources.streams_per_actor"):
            load_spec(None, dict(over, **{"resources.streams_per_actor": bad}))


def test_submit_flag_sets_streams_per_actor(cli, tmp_path, redis_url, prefix, queue):
    """``submit --streams-per-actor`` sets the resource (an integer or auto); a bad value names the flag."""
    from click.testing import CliRunner

    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    common = ["submit", "--input", str(tmp_path / "in.parquet"), "--model", "stand-in",
              "--redis-url", redis_url, "--prefix", prefix]
    for value, want in (("3", 3), ("auto", "auto")):
        res = CliRunner().invoke(cli, [*common, "--output", str(tmp_path / f"o{value}"), "--streams-per-actor", value])
        assert res.exit_code == 0, res.output
        spec = json.loads(queue.job_fields(res.stdout.strip().splitlines()[0])["spec"])
        assert spec["resources"]["streams_per_actor"] == want
    for bad in ("0", "lots"):
        res = CliRunner().invoke(cli, [*common, "--streams-per-actor", bad])
        assert res.exit_code == 2 and "--streams-per-actor" in res.output, res.output
        assert "Value error" not in res.output, res.output  # the validator's own words, not pydantic's heading
    res = CliRunner().invoke(cli, [*common, "--streams-per-actor", "lots"])  # the same words as in a YAML spec
    assert ("resources.streams_per_actor = \"lots\": streams_per_actor must be an integer 1..64 or 'auto', got "
            "'lots' (given by --streams-per-actor)") in res.output, res.output
    res = CliRunner().invoke(cli, [*common, "--streams-per-actor", "0"])
    assert 'resources.streams_per_actor = "0": streams_per_actor must be in 1..64 or \'auto\', got 0' in res.output


def test_the_worker_says_how_many_rows_each_shard_had_in_flight(cli, tmp_path, redis_url, prefix, queue):
    """The worker's own log (Ray actors log at WARNING) names each committed shard's rows in flight, so
    ``auto``'s choice shows without reading the manifest."""
    from click.testing import CliRunner

    write_parquet(tmp_path / "in.parquet", _rows(3))
    spec = load_spec(None, base_overrides(tmp_path, **{"output.path": str(tmp_path / "o"),
                                                       "resources.streams_per_actor": "auto"}))
    sub = submit_job(queue, spec)
    res = CliRunner().invoke(cli, ["worker", "--no-ray", "--max-jobs", "1", "--redis-url", redis_url,
                                   "--prefix", prefix])
    assert res.exit_code == 0, res.output
    assert f"job {sub.job_id}: shard 0 committed (1/1 shards; rows ok 3, error 0; 2 rows in flight at once)" \
        in res.stderr, res.stderr
    assert ": 3 rows in 1 shard\n" in res.stderr  # one shard, not "1 shards"


# ---- the runner, directly (no Redis, no Ray)
def test_runner_batches_rows_and_keeps_row_order(tmp_path):
    """B = 4 on the stand-in: rows of different lengths with a bad row and a model error; the part file
    holds the rows in row order, identical to B = 1; telemetry saw every row once; the forwards were
    batched four at a time."""
    rows = _rows(11, bad=(2,), model_error=(5,))
    write_parquet(tmp_path / "in.parquet", rows)
    out = {}
    for b in (1, 4):
        spec = load_spec(None, base_overrides(tmp_path, **{"output.path": str(tmp_path / f"b{b}"),
                                                           "output.shard_rows": 11,
                                                           "resources.streams_per_actor": b}))
        sink = RecordingSink()
        res = RowRunner(worker_name="t", sink=sink).run_shard(_task(spec, job_id=f"j{b}", hi=11))
        assert res.committed and res.summary["rows"] == 11 and (res.summary["ok"], res.summary["error"]) == (9, 2)
        assert res.streams == b
        assert sorted(sink.seen) == [r["id"] for r in rows]
        out[b] = read_output(spec.output.path).to_pylist()
        assert [r["id"] for r in out[b]] == [r["id"] for r in rows]  # row order
    assert _content(out[4]) == _content(out[1])
    assert "all null" in _content(out[4])["r02"]["error"] and "model error" in _content(out[4])["r05"]["error"]
    meta = _shard_meta(tmp_path / "b4", 0)
    assert max(int(k) for k in meta["batch_sizes"]) == 4 and meta["streams"] == 4
    assert meta["weights"] == "float32"  # the loaded bundle's weights, recorded whatever model.weights said
    assert set(_shard_meta(tmp_path / "b1", 0)["batch_sizes"]) == {"1"}  # B = 1: one stream per step


def test_auto_is_bounded_by_the_shards_rows_and_engines_grow(tmp_path):
    """``auto`` asks the engine (the stand-in picks the most) among 1, 2, 4, 8 at most the shard's rows; a
    later job wanting more streams gets an engine with more room, and the job states move to it."""
    write_parquet(tmp_path / "in.parquet", _rows(3))
    runner = RowRunner(worker_name="t")
    spec = load_spec(None, base_overrides(tmp_path, **{"output.path": str(tmp_path / "a"),
                                                       "resources.streams_per_actor": "auto"}))
    assert runner.run_shard(_task(spec, job_id="a", hi=3)).streams == 2
    engine = runner._states["a"][0]
    assert engine.streams == 4  # shard_rows = 4 bounds the room made
    spec8 = load_spec(None, base_overrides(tmp_path, **{"output.path": str(tmp_path / "b"), "output.shard_rows": 16,
                                                        "resources.streams_per_actor": 8}))
    assert runner.run_shard(_task(spec8, job_id="b", hi=3)).streams == 3
    assert runner._states["a"][0] is runner._states["b"][0] and runner._states["a"][0].streams == 8


def test_the_engine_factory_is_asked_for_room_once_whatever_b(tmp_path):
    """The runner asks its engine factory for an engine with room for the job's streams, B = 1 included (no
    branch on what the engine looks like), once per decoding config, and streams every row through it."""
    made = []
    write_parquet(tmp_path / "in.parquet", _rows(4))
    for b in (1, 4):
        spec = load_spec(None, base_overrides(tmp_path, **{"resources.streams_per_actor": b,
                                                           "output.path": str(tmp_path / f"out{b}")}))
        runner = RowRunner(worker_name="t",
                           engine_factory=lambda bundle, cfg, **kw: made.append(kw) or StandInEngine(bundle, cfg, **kw))
        for _ in range(2):
            res = runner.run_shard(_task(spec, job_id="j", hi=4))
            assert res.streams == b and res.summary["ok"] == 4
    assert made == [{"streams": 1}, {"streams": 4}]


# ---- a real tiny model (the engine's StreamBatch under the runner)
class _ChatCharTokenizer:
    """helpers.CharTokenizer with a tiny chat template: ``<role>content;`` per message, then ``<a>``."""

    def __init__(self, base) -> None:
        self._base = base
        self.chat_template = "test"

    def __getattr__(self, name):
        return getattr(self._base, name)

    def __call__(self, text: str, add_special_tokens: bool = True):
        return self._base(text, add_special_tokens)

    def __len__(self) -> int:
        return len(self._base)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True):
        text = "".join(f"<{m['role'][0]}>{m['content']};" for m in messages) + ("<a>" if add_generation_prompt else "")
        known = self._base.ALPHABET[: self._base.vocab_size]
        return self._base("".join(c if c in known else " " for c in text))["input_ids"]


@pytest.mark.parametrize("scope", ["job", "request"])
def test_tiny_model_b4_equals_b1_with_turns_samples_and_shadow(tmp_path, scope):
    """The real engine on a tiny random model: B = 4 gives every row, sample and shadow record of B = 1,
    with a multi-turn row, n_samples = 2 (sampled, seeded), a greedy row, a bad row and a shadow baseline
    (ar) on every row. With draft state per request even the steps and acceptance are B = 1's; with the
    job's shared state the rows learn from their batch-mates, so only the outputs must agree."""
    import dataclasses

    from tests.helpers import tiny_bundle

    base = tiny_bundle(seed=1, head_scale=60.0)
    bundle = dataclasses.replace(base, tokenizer=_ChatCharTokenizer(base.tokenizer))
    rows = [{"id": f"t{i}", "prompt": p, "turns": None, "temperature": None}
            for i, p in enumerate(["abcabcabd", "hello world, hello", "0123012301", "the cat sat on the mat",
                                   "mississippi miss", "xyz"])]
    rows[2] = {"id": "t2", "prompt": None, "turns": ["abab abab", "and again", "once more"], "temperature": None}
    rows[4]["temperature"] = 0.0
    rows.append({"id": "bad", "prompt": None, "turns": None, "temperature": None})
    write_parquet(tmp_path / "in.parquet", rows)
    out, shadow, sizes = {}, {}, {}
    widths = (1, 4, "auto") if scope == "request" else (1, 4)
    for b in widths:
        spec = load_spec(None, {
            "input.path": str(tmp_path / "in.parquet"), "output.path": str(tmp_path / f"b{b}"),
            "output.shard_rows": len(rows), "model.name": "tiny-test", "decoding.method": "racer",
            "decoding.capacity": 8, "decoding.scope": scope, "generation.max_new_tokens": 14,
            "generation.temperature": 0.8,
            "n_samples": 2, "shadow.config": {"method": "ar"}, "shadow.fraction": 1.0,
            "resources.streams_per_actor": b})
        runner = RowRunner(worker_name="t", loader=lambda model, **kw: bundle, engine_factory=default_engine)
        res = runner.run_shard(_task(spec, job_id="tiny", hi=len(rows)))
        assert res.committed and (res.summary["ok"], res.summary["error"]) == (6, 1), res
        out[b] = read_output(spec.output.path).to_pylist()
        shadow[b] = sorted(((r["id"], r["side"], r["ran_first"], r["text"], r["status"])
                            for r in read_shadow(spec.output.path).to_pylist()))
        sizes[b] = _shard_meta(spec.output.path, 0)["batch_sizes"]
        assert runner._engines[spec.decoding.config_hash()].streams == (len(rows) if b == "auto" else b)
    for b in widths[1:]:
        assert _content(out[b], steps=scope == "request") == _content(out[1], steps=scope == "request"), b
        assert shadow[b] == shadow[1] and len(shadow[1]) == 2 * 6
    assert {r["side"] for r in read_shadow(tmp_path / "b4").to_pylist()} == {"method", "baseline"}
    assert max(int(k) for k in sizes[4]) >= 3  # rows really shared forwards
    t2 = _content(out[4])["t2"]
    assert len(t2["turn_texts"]) == 3 and [s["sample"] for s in t2["samples"]] == [0, 1]
    assert all(len(r["samples"]) == 2 for r in out[4] if r["status"] == "ok")


# ---- against the real Redis and a local Ray (stand-in engine)
def _reference(queue, tmp_path: Path, rows: list[dict], **over) -> dict[str, dict]:
    """The B = 1 outputs of the job (the stand-in without its sleep: same words, see the module docstring)."""
    spec, sub = submit_standin_job(queue, tmp_path, rows, **dict(over, **{
        "model.name": "stand-in?mat=1", "output.path": str(tmp_path / "ref"), "resources.streams_per_actor": 1}))
    assert run_until_done(queue, sub.job_id, url=queue_url(queue), prefix=queue.prefix,
                          executor_kind="thread").state == "done"
    return _content(read_output(spec.output.path).to_pylist())


def _reference_and_b4_job(queue, tmp_path: Path, rows: list[dict], *, shard_rows: int, ms_per_step: int):
    """The B = 1 outputs of the job (``_reference``), then the same job submitted at B = 4, the stand-in taking
    ``ms_per_step`` per step, its output in tmp_path/b4. Returns (the B = 1 outputs, spec, submit result)."""
    over = {"output.shard_rows": shard_rows}
    ref = _reference(queue, tmp_path, rows, **over)
    spec, sub = submit_standin_job(queue, tmp_path, rows, **dict(over, **{
        "model.name": f"stand-in?ms_per_step={ms_per_step}&mat=1", "output.path": str(tmp_path / "b4"),
        "resources.streams_per_actor": 4}))
    return ref, spec, sub


def _each_id_once(out_dir, rows: list[dict]) -> list[dict]:
    got = read_output(out_dir).to_pylist()
    ids = [r["id"] for r in got]
    assert sorted(ids) == [r["id"] for r in rows], "every id exactly once"
    return got


def test_b4_job_cancelled_mid_shard_then_resumed_equals_b1(ray_session, queue, redis_url, tmp_path):
    """B = 4 on a Ray actor, with a bad row and a model error, cancelled while a shard has rows done, rows in
    flight and rows not started: the rows in flight end ``cancelled`` at their next step, those not started
    are marked so, the rows that ended are B = 1's; re-submitted, the job ends with every id once and every
    output identical to the B = 1 run."""
    from tests.reliability.util import BackgroundWorker, wait_for

    rows = _rows(30, bad=(13,), model_error=(16,), base_tokens=30)
    ref, spec, sub = _reference_and_b4_job(queue, tmp_path, rows, shard_rows=10, ms_per_step=25)
    executor = make_executor("ray", url=redis_url, prefix=queue.prefix, name="b4")
    bg = BackgroundWorker(Worker(queue, executor, name="b4", lease_s=10), max_jobs=1, idle_exit_s=30).start()
    try:
        def shard1_partly_done() -> bool:
            got = queue.r.hget(queue.k_job(sub.job_id, "inflight"), "1")
            return got is not None and json.loads(got)["rows"] >= 3

        wait_for(shard1_partly_done, timeout_s=90, what="shard 1 with some rows done", poll_s=0.005)
        assert queue.cancel(sub.job_id) == "cancelling"
        wait_for(lambda: queue.status(sub.job_id).state == "cancelled", timeout_s=60, what="the job to end")
        bg.thread.join(timeout=60)
        assert bg.error is None, bg.error
    finally:
        bg.stop()
        executor.shutdown()
    partial = {r["id"]: r for r in pq.read_table(part_path(spec.output.path, 1)).to_pylist()}
    assert sorted(partial) == [f"r{i}" for i in range(10, 20)]  # the stopped shard, written for inspection
    in_flight = [i for i, r in partial.items() if r["status"] == "cancelled" and r["finish_reason"] == "cancelled"]
    not_started = [i for i, r in partial.items() if r["status"] == "cancelled" and "before this row ran" in r["error"]]
    ended = [i for i, r in partial.items() if r["status"] != "cancelled"]
    assert in_flight and not_started and len(ended) >= 3, {i: (r["status"], r["error"]) for i, r in partial.items()}
    assert all(0 < partial[i]["output_tokens"] < ref[i]["output_tokens"] for i in in_flight)
    assert _content(list(map(partial.get, ended))) == {i: ref[i] for i in ended}
    assert ref["r13"]["status"] == "error" and "r13" in ended  # the bad row ends at once, alone
    assert _shard_meta(spec.output.path, 0)["streams"] == 4
    assert max(int(k) for k in _shard_meta(spec.output.path, 0)["batch_sizes"]) == 4

    again = submit_job(queue, spec)
    assert again.job_id == sub.job_id and again.action == "resumed"
    assert run_until_done(queue, sub.job_id, url=redis_url, prefix=queue.prefix, executor_kind="ray").state == "done"
    assert _content(_each_id_once(spec.output.path, rows)) == ref
    st = queue.status(sub.job_id)
    assert st.rows_done == 30 and (st.totals.ok, st.totals.error) == (28, 2)


def test_b4_worker_killed_mid_job_resumed_elsewhere_equals_b1(ray_session, queue, redis_url, tmp_path):
    """A worker running B = 4 is SIGKILLed mid-shard; a second worker (Ray actors) reclaims the expired
    lease and finishes the job: every id exactly once, every output identical to the B = 1 run."""
    rows = _rows(24, bad=(5,), model_error=(18,), base_tokens=16)
    ref, spec, sub = _reference_and_b4_job(queue, tmp_path, rows, shard_rows=8, ms_per_step=20)
    with worker_process(tmp_path / "doomed.log", "--no-ray", redis_url=redis_url, prefix=queue.prefix,
                        name="doomed") as proc:  # SIGKILLed when the block ends
        def mid_job() -> bool:  # a shard committed and another one part done
            inflight = queue.r.hgetall(queue.k_job(sub.job_id, "inflight"))
            return queue.status(sub.job_id).shards_done >= 1 and any(
                0 < json.loads(v)["rows"] < 8 for v in inflight.values())

        deadline = time.monotonic() + 90
        while not mid_job() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)
        assert mid_job(), "the doomed worker never got mid-job"
    rescue_job(queue, sub.job_id, redis_url, shards_below=3)
    st = queue.status(sub.job_id)
    assert st.state == "done" and st.rows_done == 24 and int(queue.job_fields(sub.job_id)["attempts"]) == 2
    assert _content(_each_id_once(spec.output.path, rows)) == ref
    metas = [_shard_meta(spec.output.path, s) for s in range(3)]
    assert any(m["worker"].startswith("rescuer") for m in metas) and all(m["streams"] == 4 for m in metas)
    assert all(max(int(k) for k in m["batch_sizes"]) == 4 for m in metas)


def test_rows_sharing_forwards_count_their_share_of_device_time():
    """Four streams in one forward: each row's device_ms is its share (about a quarter of the step) rather
    than its whole latency, so the tally's device time is about the batch's wall time, not B times it; an
    old-style record (device_ms None) counts its generation time."""
    from racer_batch import GenerationParams
    from racer_batch.engine.batch import StreamBatch
    from racer_batch.service.results.record import RowRecord
    from racer_batch.service.results.tally import Tally
    from tests.standin import StandInEngine, load_standin

    engine = StandInEngine(load_standin("stand-in?ms_per_step=20&mat=2"))
    batch = StreamBatch()
    for i in range(4):
        batch.add(i, engine.stream(f"prompt {i}", GenerationParams(max_new_tokens=8)))
    t0 = time.perf_counter()
    done = []
    while len(batch):
        done += batch.step()
    wall_ms = (time.perf_counter() - t0) * 1000.0
    shares = [sum(f.device_ms.values()) for f in done]
    for f in done:  # the prompt forward's part of each row's share, per runner (method auto leaves it out)
        assert f.prefill_ms.keys() == f.device_ms.keys()
        assert all(0.0 < f.prefill_ms[k] < f.device_ms[k] for k in f.device_ms)
    latencies = [f.result.prefill_ms + f.result.decode_ms for f in done]
    assert sum(shares) <= wall_ms * 1.05
    assert sum(latencies) > 2.0 * sum(shares)  # each row's latency holds its batch-mates' shares too
    t = Tally()
    t.observe_row(RowRecord(id="a", row_idx=0, shard=0, route="r", status="ok", job_id="j", prefill_ms=10.0,
                            decode_ms=90.0, device_ms=25.0))
    t.observe_row(RowRecord(id="b", row_idx=1, shard=0, route="r", status="ok", job_id="j", prefill_ms=10.0,
                            decode_ms=90.0))
    assert t.device_ms == 125.0 and t.gen_ms == 200.0


def test_streams_per_actor_values():
    from racer_batch.service.job.spec import Resources

    assert Resources(streams_per_actor="AUTO").streams_per_actor == "auto"
    assert Resources(streams_per_actor="4").streams_per_actor == 4
    for bad in (True, "fast", 4.5, None, 0, 65, -1):
        with pytest.raises(ValueError, match="streams_per_actor must be"):
            Resources(streams_per_actor=bad)


@pytest.mark.parametrize("streams", [1, 2])
def test_a_cpu_job_reports_device_time_per_route(streams, cli, tmp_path, redis_url, prefix):
    """A job on the CPU (tiny-random, a real engine) counts device time on every route: each row its share of the
    actor's time (every step's wall time split among the rows in it, its prefill whole): a row alone, its
    generation time; the report's device s and tokens per device-second are positive per route."""
    import json

    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from racer_batch.report.build import build_report
    from racer_batch.report.load import load_output

    rows = [{"id": f"r{i}", "prompt": f"Say {i} things.", "route": "ab"[i % 2]} for i in range(4)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "job.yaml").write_text("input: {path: in.jsonl}\noutput: {path: out}\nmodel: {name: tiny-random}\n"
                                       "generation: {max_new_tokens: 12}\n"
                                       f"resources: {{streams_per_actor: {streams}}}\n")
    res = CliRunner().invoke(cli, ["submit", str(tmp_path / "job.yaml"), "--local", "--executor", "thread", "--json",
                                   "--redis-url", redis_url, "--prefix", prefix])
    assert res.exit_code == 0, res.output
    out = pq.read_table(tmp_path / "out").to_pylist()
    assert len(out) == 4 and all(r["status"] == "ok" for r in out)
    for r in out:
        assert r["device_ms"] > 0, r
        if streams == 1:
            assert r["device_ms"] <= r["prefill_ms"] + r["decode_ms"] + 1.0, r
    rep = build_report(load_output(tmp_path / "out"), n_boot=10, with_charts=False)
    for route in ("a", "b"):
        d = rep.routes[route]
        assert d["device_s"] > 0 and d["tokens_per_device_s"] > 0, (route, d)
