"""RowRecord, Tally and the Parquet writer: the typed row path (service/results/record.py, tally.py, sinks.py).

Pure tests on hand-made engine results and records, plus one shard through RowRunner (stand-in engine, no
Redis/Ray) to check that a dict task's spec is validated once per job and spec hash."""

from __future__ import annotations

import datetime as dt
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from racer_batch.service.execution import runner as runner_mod
from racer_batch.service.execution.runner import RowRunner, ShardTask
from racer_batch.service.job.inputs import plan_input
from racer_batch.service.job.spec import load_spec
from racer_batch.service.results import sinks
from racer_batch.service.results.output import read_output
from racer_batch.service.results.record import (
    OUTPUT_SCHEMA,
    SAMPLE_TYPE,
    SHADOW_SCHEMA,
    RowOrigin,
    RowRecord,
    ShadowRecord,
    records_table,
)
from racer_batch.service.results.shadow import read_shadow, shadow_path, write_shadow
from racer_batch.service.results.tally import Tally
from racer_batch.values import GenerationResult, RowStats
from tests.fixtures import base_overrides, write_parquet

SCHEMA_VERSION = 1
# The schemas as they were written out by hand before issue 13: folders written then must still read.
OLD_SAMPLE_TYPE = pa.struct([
    pa.field("sample", pa.int32()), pa.field("seed", pa.int64()), pa.field("status", pa.string()),
    pa.field("text", pa.string()), pa.field("turn_texts", pa.list_(pa.string())),
    pa.field("output_tokens", pa.int64()), pa.field("finish_reason", pa.string()),
])

# The result columns both old schemas held, in this order.
OLD_RESULT_FIELDS = [
    pa.field("status", pa.string(), nullable=False),
    pa.field("error", pa.string()),
    pa.field("text", pa.string()),
    pa.field("turn_texts", pa.list_(pa.string())),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("output_tokens", pa.int64()),
    pa.field("finish_reason", pa.string()),
    pa.field("steps", pa.int64()),
    pa.field("mat", pa.float64()),
    pa.field("accepted_hist", pa.list_(pa.int64())),
]

OLD_OUTPUT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("row_idx", pa.int64(), nullable=False),
        pa.field("shard", pa.int32(), nullable=False),
        pa.field("route", pa.string(), nullable=False),
        *OLD_RESULT_FIELDS,
        pa.field("accepted_retrieval", pa.int64()),
        pa.field("accepted_logits", pa.int64()),
        pa.field("accepted_both", pa.int64()),
        pa.field("accepted_other", pa.int64()),
        pa.field("prefill_ms", pa.float64()),
        pa.field("decode_ms", pa.float64()),
        pa.field("draft_ms", pa.float64()),
        pa.field("verify_ms", pa.float64()),
        pa.field("update_ms", pa.float64()),
        # the row's share of shared forwards (streams_per_actor > 1, issue 14); older files read back null here
        pa.field("device_ms", pa.float64()),
        pa.field("tokens_per_s", pa.float64()),
        pa.field("worker", pa.string()),
        pa.field("device", pa.string()),
        # the Ray node that answered (issue 15); older files read back null here
        pa.field("node", pa.string()),
        pa.field("model", pa.string()),
        pa.field("method", pa.string()),
        pa.field("config_hash", pa.string()),
        pa.field("seed", pa.int64()),
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("finished_at", pa.timestamp("ms", tz="UTC")),
        # n_samples > 1 only (else null): every answer with its own seed; the row's text is sample 0's.
        pa.field("samples", pa.list_(OLD_SAMPLE_TYPE)),
    ],
    metadata={b"racer_batch.schema_version": str(SCHEMA_VERSION).encode()},
)

OLD_SHADOW_SCHEMA = pa.schema(
    [
        pa.field("run", pa.string(), nullable=False),  # "job" (in the job) or "posthoc:<baseline>"
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("id", pa.string(), nullable=False),
        pa.field("row_idx", pa.int64(), nullable=False),
        pa.field("shard", pa.int32()),
        pa.field("route", pa.string(), nullable=False),
        pa.field("side", pa.string(), nullable=False),  # "method" | "baseline"
        pa.field("ran_first", pa.bool_()),
        pa.field("method", pa.string()),
        pa.field("config_hash", pa.string()),
        *OLD_RESULT_FIELDS,
        pa.field("prefill_ms", pa.float64()),
        pa.field("decode_ms", pa.float64()),
        pa.field("tokens_per_s", pa.float64()),
        pa.field("seed", pa.int64()),
        pa.field("temperature", pa.float64()),
        pa.field("worker", pa.string()),
        pa.field("device", pa.string()),
        pa.field("finished_at", pa.timestamp("ms", tz="UTC")),
        # The row's reference answer per turn (input column ``reference``; null entries: none). Added for the
        # capability comparison (issue 8); files written before it read back with nulls here (read_shadow).
        pa.field("reference", pa.list_(pa.string())),
    ]
)


ORIGIN = RowOrigin(id="r1", row_idx=3, shard=0, route="chat", seed=7, worker="w", device="cpu", model="m",
                   method="racer", config_hash="h", job_id="j")


def _turn(text: str, *, prompt: int, out: int, steps: int, hist: dict, src=(0, 0, 0, 0), ms=(10.0, 90.0),
          finish="eos") -> GenerationResult:
    stats = RowStats(steps=steps, emitted_tokens=out, accepted_hist=hist, accepted_retrieval=src[0],
                     accepted_logits=src[1], accepted_both=src[2], accepted_other=src[3], draft_ms=1.0,
                     verify_ms=2.0, update_ms=3.0)
    return GenerationResult(token_ids=list(range(out)), text=text, finish_reason=finish, prompt_tokens=prompt,
                            output_tokens=out, prefill_ms=ms[0], decode_ms=ms[1], stats=stats)


def test_schemas_are_derived_and_unchanged():
    assert OUTPUT_SCHEMA.equals(OLD_OUTPUT_SCHEMA, check_metadata=True)
    assert SHADOW_SCHEMA.equals(OLD_SHADOW_SCHEMA, check_metadata=True)
    assert SAMPLE_TYPE.equals(OLD_SAMPLE_TYPE)
    assert [f.name for f in OUTPUT_SCHEMA] == list(RowRecord.__dataclass_fields__)  # one place defines them


def test_record_from_turns_sums_the_turns():
    # turn 1: 5 prompt, 6 out, 3 steps, hist {0: 1, 2: 1, 3: 1}; turn 2: 9 prompt, 4 out, 2 steps, hist {0: 1, 3: 1}
    turns = [_turn("first", prompt=5, out=6, steps=3, hist={0: 1, 2: 1, 3: 1}, src=(2, 3, 0, 0)),
             _turn("second", prompt=9, out=4, steps=2, hist={0: 1, 3: 1}, src=(0, 0, 3, 0), finish="length")]
    rec = RowRecord.from_turns(turns, status="ok", error=None, origin=ORIGIN)
    assert (rec.id, rec.row_idx, rec.route, rec.seed, rec.job_id) == ("r1", 3, "chat", 7, "j")
    assert (rec.text, rec.turn_texts, rec.finish_reason) == ("second", ["first", "second"], "length")
    assert (rec.prompt_tokens, rec.output_tokens, rec.steps) == (14, 10, 5)
    assert rec.accepted_hist == [2, 0, 1, 2] and rec.accepted_tokens == 2 + 6
    assert (rec.accepted_retrieval, rec.accepted_logits, rec.accepted_both, rec.accepted_other) == (2, 3, 3, 0)
    assert (rec.prefill_ms, rec.decode_ms, rec.draft_ms, rec.verify_ms, rec.update_ms) == (20.0, 180.0, 2.0, 4.0, 6.0)
    assert rec.mat == 2.0 and rec.tokens_per_s == pytest.approx(10 / 0.2)
    assert RowRecord.from_row(rec.to_row()) == rec
    empty = RowRecord.from_turns([], status="error", error="boom", origin=ORIGIN)  # the first turn raised
    assert (empty.text, empty.output_tokens, empty.steps, empty.mat, empty.tokens_per_s) == (None, 0, 0, None, None)
    with pytest.raises(AssertionError, match="unknown status 'odd'"):
        RowRecord.from_turns(turns, status="odd", error=None, origin=ORIGIN)


def test_record_from_samples_sums_answers_and_keeps_sample_0s_text():
    a = RowRecord.from_turns([_turn("a0", prompt=5, out=6, steps=3, hist={0: 1, 2: 1})], status="ok", error=None,
                             origin=ORIGIN)
    b = RowRecord.from_turns([_turn("b0", prompt=5, out=2, steps=2, hist={0: 2}, finish="length")],
                             status="error", error="late", origin=ORIGIN)
    rec = RowRecord.from_samples([(a, 7), (b, 99)])
    assert (rec.text, rec.status, rec.error) == ("a0", "error", "late")  # the first non-ok answer's status
    assert (rec.prompt_tokens, rec.output_tokens, rec.steps, rec.accepted_hist) == (10, 8, 5, [3, 0, 1])
    assert rec.mat == pytest.approx(8 / 5)
    assert [(s.sample, s.seed, s.status, s.text, s.output_tokens) for s in rec.samples] == [
        (0, 7, "ok", "a0", 6), (1, 99, "error", "b0", 2)]
    table = records_table([rec], OUTPUT_SCHEMA)
    assert table.schema.equals(OUTPUT_SCHEMA) and RowRecord.from_row(table.to_pylist()[0]) == rec


def test_from_row_refuses_unknown_columns():
    with pytest.raises(AssertionError, match=r"outside the schema: \['colour'\]"):
        RowRecord.from_row({"id": "x", "row_idx": 0, "colour": "red"})


def test_tally_observe_merge_and_json():
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    a = RowRecord.from_turns([_turn("x", prompt=5, out=6, steps=3, hist={0: 1, 2: 1})], status="ok", error=None,
                             origin=ORIGIN)
    a.finished_at = t0 + dt.timedelta(seconds=10)  # generated for 0.1 s: started at +9.9 s
    b = RowRecord.without_answer(status="error", error="bad", origin=RowOrigin(id="r2", row_idx=4, route="code"))
    one, two = Tally(), Tally()
    one.observe_row(a)
    two.observe_row(b)
    two.observe_row(a, devices=2.0)
    total = Tally().merge(one).merge(two)
    assert (total.rows, total.ok, total.error, total.output_tokens, total.steps) == (3, 2, 1, 12, 6)
    assert total.accepted_hist == [2, 0, 2] and total.accepted_tokens == 4 and total.mat == 2.0
    assert total.gen_ms == 200.0 and total.device_ms == 300.0
    assert total.first_start_s == pytest.approx(t0.timestamp() + 9.9)
    assert (total.routes["chat"].rows, total.routes["code"].error) == (2, 1)
    back = Tally.from_dict(json.loads(json.dumps(total.to_dict())))
    assert back == total
    # a summary written before issue 13 (routes as [rows, output_tokens, steps]) still reads
    old = Tally.from_dict({"rows": 3, "ok": 2, "error": 1, "cancelled": 0, "output_tokens": 12, "steps": 6,
                           "gen_ms": 200.0, "routes": {"chat": [2, 12, 6]}})
    assert (old.rows, old.routes["chat"].output_tokens, old.routes["chat"].mat) == (3, 12, 2.0)


def test_part_and_shadow_files_share_the_fsynced_writer(tmp_path, monkeypatch):
    synced = []
    real = sinks.os.fsync
    monkeypatch.setattr(sinks.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    rec = RowRecord.from_turns([_turn("x", prompt=5, out=6, steps=3, hist={0: 1, 2: 1})], status="ok", error=None,
                               origin=ORIGIN)
    pair = [ShadowRecord(row=rec, side="method", ran_first=True, temperature=0.0, reference=["x"]),
            ShadowRecord(row=rec, side="baseline", ran_first=False, temperature=0.0)]
    path = write_shadow(shadow_path(tmp_path, "00000"), pair, meta={"shard": 0})
    assert len(synced) == 2  # the file, then the folder after the rename
    back = [ShadowRecord.from_row(r) for r in read_shadow(tmp_path).to_pylist()]
    assert [(r.side, r.ran_first, r.reference, r.row.text) for r in back] == [
        ("method", True, ["x"], "x"), ("baseline", False, None, "x")]
    assert json.loads(pq.read_schema(path).metadata[b"racer_batch.shadow"]) == {"shard": 0}
    assert not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(AssertionError, match="side must be one of"):
        ShadowRecord(row=rec, side="left")


def test_dict_tasks_validate_the_spec_once_per_job(tmp_path, monkeypatch):
    rows = [{"id": f"r{i}", "prompt": f"prompt {i}"} for i in range(4)]
    write_parquet(tmp_path / "in.parquet", rows)
    spec = load_spec(None, base_overrides(tmp_path, **{"output.shard_rows": 2}))
    plan = plan_input(spec.input)
    calls = []
    real = runner_mod.JobSpec.model_validate
    monkeypatch.setattr(runner_mod.JobSpec, "model_validate", lambda d: (calls.append(1), real(d))[1])
    runner = RowRunner(worker_name="t")
    for shard in range(2):
        lo, hi = plan.shard_range(shard, 2)
        task = ShardTask(job_id="j", shard=shard, row_start=lo, row_stop=hi, spec=spec, plan=plan,
                         spec_hash=spec.spec_hash(), owner="t")
        out = runner.run_shard(task.to_dict())  # as a Ray actor gets it
        assert out.committed and out.summary["rows"] == 2 and out.summary["routes"]["default"]["ok"] == 2
    assert len(calls) == 1
    same = ShardTask(job_id="j", shard=0, row_start=0, row_stop=2, spec=spec, plan=plan,
                     spec_hash=spec.spec_hash(), owner="t")
    runner.run_shard(same)  # in-process: the JobSpec object itself, nothing validated
    assert len(calls) == 1
    assert sorted(read_output(spec.output.path).column("id").to_pylist()) == [r["id"] for r in rows]
