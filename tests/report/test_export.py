"""`racer-batch export`: chat-format JSONL (input messages + the assistant turn), one record per sample."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from report_fixtures import base_overrides, write_parquet

from racer_batch.report.export import CHAT_SCHEMA, export_chat
from racer_batch.report.load import load_output
from racer_batch.service.execution.runner import RowRunner, ShardTask
from racer_batch.service.job.inputs import plan_input
from racer_batch.service.job.spec import load_spec
from racer_batch.service.results.output import read_output, write_manifest
from racer_batch.service.results.shadow import sample_seed

ROWS = [
    {"id": "p", "prompt": "a plain prompt", "messages": None, "turns": None},
    {"id": "m", "prompt": None, "messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hello"}], "turns": None},
    {"id": "t", "prompt": None, "messages": None, "turns": ["first turn", "second turn"]},
    {"id": "bad", "prompt": "", "messages": None, "turns": None},  # empty prompt: status error
]


def _job(tmp_path, **over):
    write_parquet(tmp_path / "in.parquet", ROWS)
    spec = load_spec(None, base_overrides(tmp_path, **{"output.shard_rows": 3, **over}))
    plan = plan_input(spec.input)
    runner = RowRunner(worker_name="t")
    for shard in range(plan.num_shards(3)):
        lo, hi = plan.shard_range(shard, 3)
        runner.run_shard(ShardTask(job_id="job-e", shard=shard, row_start=lo, row_stop=hi, spec=spec.stored(),
                                   plan=plan.to_dict(), spec_hash=spec.spec_hash(), owner="t").to_dict())
    write_manifest(spec.output.path, {"job_id": "job-e", "spec": spec.stored(), "input": plan.to_dict(),
                                      "spec_hash": spec.spec_hash(), "state": "done"})
    return spec


def test_jsonl_chat_format_with_samples(tmp_path):
    spec = _job(tmp_path, n_samples=3, seed=40, **{"generation.temperature": 0.9,
                                                    "generation.system_prompt": "sys"})
    out = {r["id"]: r for r in read_output(spec.output.path).to_pylist()}
    n, skipped = export_chat(load_output(spec.output.path), tmp_path / "chat.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text().splitlines()]
    assert n == len(lines) == 9 and skipped == 1  # 3 good rows x 3 samples; the bad row is left out
    by = {(r["id"], r["sample"]): r for r in lines}
    p0 = by[("p", 0)]
    assert p0["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "a plain prompt"},
                              {"role": "assistant", "content": out["p"]["text"]}]
    assert [by[("p", k)]["seed"] for k in range(3)] == [sample_seed(40, k) for k in range(3)]  # row 0: seed 40
    assert len({by[("p", k)]["messages"][-1]["content"] for k in range(3)}) == 3  # distinct samples
    assert by[("p", 2)]["messages"][-1]["content"] == out["p"]["samples"][2]["text"]
    # a messages row keeps its own system message (the spec's is not added twice)
    assert [m["role"] for m in by[("m", 1)]["messages"]] == ["system", "user", "assistant"]
    assert by[("m", 1)]["messages"][0]["content"] == "be brief"
    # a multi-turn row interleaves each user turn with its answer
    t = by[("t", 0)]["messages"]
    assert [m["role"] for m in t] == ["system", "user", "assistant", "user", "assistant"]
    assert [t[1]["content"], t[3]["content"]] == ["first turn", "second turn"]
    assert [t[2]["content"], t[4]["content"]] == out["t"]["samples"][0]["turn_texts"]
    for r in lines:
        assert set(r) == set(CHAT_SCHEMA.names) and r["job_id"] == "job-e" and r["model"].startswith("stand-in")


def test_single_sample_parquet_and_cli(tmp_path):
    spec = _job(tmp_path)
    n, skipped = export_chat(load_output(spec.output.path), tmp_path / "chat.parquet", fmt="parquet",
                             only_ok=False)
    table = pq.read_table(tmp_path / "chat.parquet")
    assert table.schema.equals(CHAT_SCHEMA) and n == table.num_rows == 4 and skipped == 0
    assert [r["sample"] for r in table.to_pylist()] == [0, 0, 0, 0]

    from racer_batch.cli import main

    res = CliRunner().invoke(main, ["export", spec.output.path, "--format", "jsonl"])
    assert res.exit_code == 0, res.output
    path = res.output.strip().splitlines()[-1]
    assert path.endswith("/_chat.jsonl") and len(open(path).read().splitlines()) == 3


def test_export_needs_the_manifest(tmp_path):
    spec = _job(tmp_path)
    (tmp_path / "out" / "_manifest.json").write_text("{}")
    from racer_batch.report.load import ReportError

    with pytest.raises(ReportError, match="lacks the job's spec"):
        export_chat(load_output(spec.output.path), tmp_path / "x.jsonl")
