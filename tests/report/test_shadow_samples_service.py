"""The spec's ``shadow:`` block and ``n_samples`` through RowRunner.run_shard (stand-in engine, no Redis/Ray)."""

from __future__ import annotations

import hashlib
import json

import pyarrow.parquet as pq
import pytest
from report_fixtures import base_overrides, write_parquet

from racer_batch.service.execution.runner import RowRunner, ShardTask
from racer_batch.service.job.inputs import plan_input
from racer_batch.service.job.spec import SpecError, load_spec
from racer_batch.service.results.output import read_output
from racer_batch.service.results.schema import OUTPUT_SCHEMA
from racer_batch.service.results.shadow import SHADOW_SCHEMA, read_shadow, sample_seed, shadow_selected


def _run(tmp_path, rows, **over):
    write_parquet(tmp_path / "in.parquet", rows)
    spec = load_spec(None, base_overrides(tmp_path, **{"output.shard_rows": len(rows), **over}))
    plan = plan_input(spec.input)
    task = ShardTask(job_id="job-x", shard=0, row_start=0, row_stop=len(rows), spec=spec.stored(),
                     plan=plan.to_dict(), spec_hash=spec.spec_hash(), owner="t")
    runner = RowRunner(worker_name="t")
    out = runner.run_shard(task.to_dict())
    return spec, runner, out


def test_shadow_preset_resolves_inline_and_defaults_keep_the_hash(tmp_path):
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    plain = load_spec(None, base_overrides(tmp_path))
    spec = load_spec(None, base_overrides(tmp_path, **{"shadow.config": "ar", "shadow.fraction": 0.5}))
    assert spec.shadow.decoding().method == "ar" and spec.shadow.label == "ar"
    assert spec.stored()["shadow"]["config"]["method"] == "ar"  # workers need no preset files
    assert plain.spec_hash() != spec.spec_hash()
    # a spec without the new keys hashes as before they existed (resume of older output folders still works)
    old = plain.model_dump(mode="json", exclude={"name", "preset", "resources", "priority", "redis_url",
                                                 "n_samples", "shadow"})
    del old["input"]["columns"]["reference"]  # added later; feeds only the shadow analysis, never hashed
    del old["model"]["dtype"]  # added later (issue 12); left out of the hash while None
    del old["model"]["weights"]  # added later (issue 31); never hashed (as stored or float32: the same outputs)
    assert old["input"]["prompt_format"] == "auto"
    old["input"]["prompt_format"] = "chat"  # the default before auto existed (issue 28); auto hashes as chat
    assert plain.spec_hash() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    renamed = load_spec(None, base_overrides(tmp_path, **{"input.columns.reference": "answer"}))
    assert renamed.input.columns.reference == "answer" and renamed.spec_hash() == plain.spec_hash()
    with pytest.raises(SpecError, match="shadow.config"):
        load_spec(None, base_overrides(tmp_path, **{"shadow.config": "no-such-preset"}))
    with pytest.raises(SpecError, match="shadow.fraction = 1.5"):
        load_spec(None, base_overrides(tmp_path, **{"shadow.config": "ar", "shadow.fraction": 1.5}))


def test_shadow_rows_run_on_the_same_worker_interleaved(tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"prompt number {i}"} for i in range(12)]
    spec, runner, out = _run(tmp_path, rows, **{"shadow.config": "ar", "shadow.fraction": 0.5, "shadow.seed": 3})
    expected = sorted(r["id"] for r in rows if shadow_selected(3, r["id"], 0.5))
    assert 0 < len(expected) < 12
    sh = read_shadow(spec.output.path)
    assert sh.schema.equals(SHADOW_SCHEMA)
    recs = sh.to_pylist()
    assert sorted({r["id"] for r in recs}) == expected and len(recs) == 2 * len(expected)
    main = {r["id"]: r for r in read_output(spec.output.path).to_pylist()}
    for rid in expected:
        m, b = [r for r in recs if r["id"] == rid and r["side"] == "method"], [
            r for r in recs if r["id"] == rid and r["side"] == "baseline"]
        assert len(m) == len(b) == 1 and m[0]["ran_first"] != b[0]["ran_first"]
        assert b[0]["method"] == "ar" and m[0]["method"] == "racer" and m[0]["worker"] == b[0]["worker"] == "t"
        assert m[0]["text"] == main[rid]["text"] == b[0]["text"]  # the stand-in is deterministic per seed
        assert b[0]["seed"] == main[rid]["seed"]
    assert {r["ran_first"] for r in recs if r["side"] == "baseline"} == {True, False}  # both orders occur
    assert out.summary["rows"] == 12 and out.summary["shadow_rows"] == len(expected)  # shadow rows: not job rows
    runner.end_job("job-x")
    assert runner._states == {}  # the shadow state is freed with the job's


def test_n_samples_distinct_recorded_seeds(tmp_path):
    rows = [{"id": i, "prompt": f"question {i}"} for i in range(3)]
    spec, _, out = _run(tmp_path, rows, n_samples=4, **{"generation.temperature": 0.7, "seed": 100})
    table = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert table.schema.equals(OUTPUT_SCHEMA, check_metadata=False)
    got = table.to_pylist()
    assert len(got) == 3 and out.summary["rows"] == 3  # one output row per input row
    for r in got:
        seeds = [s["seed"] for s in r["samples"]]
        assert [s["sample"] for s in r["samples"]] == [0, 1, 2, 3]
        assert seeds[0] == r["seed"] == 100 + r["row_idx"]
        assert seeds == [sample_seed(r["seed"], k) for k in range(4)] and len(set(seeds)) == 4
        assert len({s["text"] for s in r["samples"]}) == 4  # the stand-in's text follows the seed
        assert r["text"] == r["samples"][0]["text"]
        assert r["output_tokens"] == sum(s["output_tokens"] for s in r["samples"])


def test_sample_seeds_distinct_for_many_samples():
    for row_seed in (0, 1, 2**63 - 1, 123456789):
        seeds = [sample_seed(row_seed, k) for k in range(5000)]
        assert len(set(seeds)) == 5000 and all(0 <= s < 2**63 for s in seeds)
