"""Bad input through the command line: every case ends with a clear message that names the row, column or
key (exit code 2, nothing queued) or, for problems inside one row, a row with status=error and a message
that names it; never a stack trace. Real Redis; the stand-in model on the thread executor."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from racer_batch.service.results.output import read_manifest, read_output
from racer_batch.service.results.schema import OUTPUT_SCHEMA
from tests.fixtures import ROOT, base_overrides, write_parquet

pytestmark = pytest.mark.service


def _job_file(tmp_path: Path, *, input_name: str = "in.parquet", out: str = "out", extra: str = "") -> Path:
    spec = tmp_path / "job.yaml"
    spec.write_text(f"input: {{path: {input_name}}}\noutput: {{path: {json.dumps(out)}, shard_rows: 3}}\n"
                    f"model: {{name: stand-in}}\ngeneration: {{max_new_tokens: 4}}\n{extra}")
    return spec


def _invoke(cli, args: list[str], redis_url: str, prefix: str):
    res = CliRunner().invoke(cli, [*args, "--redis-url", redis_url, "--prefix", prefix])
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res


def _nothing_queued(cli, redis_url: str, prefix: str) -> None:
    assert json.loads(_invoke(cli, ["list", "--json"], redis_url, prefix).stdout) == []


@pytest.mark.parametrize("rows, schema, message", [
    pytest.param([{"key": 1, "prompt": "x"}], None, "missing id column 'id'", id="missing-id-column"),
    pytest.param([{"id": 1, "text": "x"}], None, "needs one of the columns 'prompt', 'messages' or 'turns'",
                 id="missing-prompt-column"),
    pytest.param([{"id": 1.5, "prompt": "x"}], None, "column 'id' has type double, expected string or integer",
                 id="id-float"),
    pytest.param([{"id": 1, "prompt": 7}], None, "column 'prompt' has type int64, expected string",
                 id="prompt-int"),
    pytest.param([{"id": 1, "prompt": "x", "temperature": "hot"}], None,
                 "column 'temperature' has type string, expected number", id="temperature-string"),
    pytest.param([{"id": 1, "messages": "hello"}], None,
                 "column 'messages' has type string, expected list of {role, content}", id="messages-string"),
    pytest.param([{"id": 1, "prompt": "x", "stop": [1, 2]}], None,
                 "column 'stop' has type list<element: int64>, expected string or list of strings", id="stop-ints"),
    pytest.param([{"id": "a", "prompt": b"\xff\xfe"}], pa.schema([("id", pa.string()), ("prompt", pa.binary())]),
                 "column 'prompt' has type binary, expected string", id="prompt-bytes"),
    pytest.param([{"id": "a", "prompt": "x"}, {"id": None, "prompt": "y"}], None, "row 1 ", id="null-id"),
    pytest.param([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], None,
                 "duplicate ids in input: 1 id appears more than once (1 extra row): 'a'", id="duplicate-id"),
])
def test_bad_columns_refused_at_submit(cli, tmp_path, redis_url, prefix, rows, schema, message):
    write_parquet(tmp_path / "in.parquet", rows, schema)
    res = _invoke(cli, ["submit", str(_job_file(tmp_path))], redis_url, prefix)
    assert res.exit_code == 2 and "nothing queued" in res.output and message in res.output, res.output
    _nothing_queued(cli, redis_url, prefix)


def test_invalid_utf8_in_a_prompt_is_a_row_error(cli, tmp_path, redis_url, prefix):
    """A JSONL file with bytes that are not UTF-8 in one prompt: the job runs, that row gets status=error
    naming the row and the column, the other rows are answered."""
    (tmp_path / "in.jsonl").write_bytes(b'{"id": "good", "prompt": "hello"}\n'
                                        b'{"id": "bad", "prompt": "caf\xe9 latin-1"}\n'
                                        b'{"id": "also-good", "prompt": "bye"}\n')
    res = _invoke(cli, ["submit", str(_job_file(tmp_path, input_name="in.jsonl")), "--local", "--executor", "thread",
                        "--json"], redis_url, prefix)
    assert res.exit_code == 0, res.output
    out = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert out["good"]["status"] == "ok" and out["also-good"]["status"] == "ok"
    assert out["bad"]["status"] == "error"
    assert (out["bad"]["error"].startswith("row 'bad'") and "'prompt'" in out["bad"]["error"]
            and "UTF-8" in out["bad"]["error"])
    job_id = res.stdout.splitlines()[0]
    errs = json.loads(_invoke(cli, ["errors", job_id, "--json"], redis_url, prefix).stdout)
    assert [e["id"] for e in errs] == ["bad"]


def test_invalid_utf8_in_an_id_refused_at_submit(cli, tmp_path, redis_url, prefix):
    (tmp_path / "in.jsonl").write_bytes(b'{"id": "a", "prompt": "x"}\n{"id": "b\xff", "prompt": "y"}\n')
    res = _invoke(cli, ["submit", str(_job_file(tmp_path, input_name="in.jsonl"))], redis_url, prefix)
    assert res.exit_code == 2 and "row 1" in res.output and "id" in res.output and "UTF-8" in res.output, res.output
    _nothing_queued(cli, redis_url, prefix)


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_zero_row_input_ends_done_with_an_empty_output(cli, tmp_path, redis_url, prefix, kind):
    if kind == "parquet":
        write_parquet(tmp_path / "in.parquet", [], pa.schema([("id", pa.string()), ("prompt", pa.string())]))
    else:
        (tmp_path / "in.jsonl").write_text("")
    name = "in.parquet" if kind == "parquet" else "in.jsonl"
    res = _invoke(cli, ["submit", str(_job_file(tmp_path, input_name=name)), "--local", "--executor", "thread",
                        "--json"], redis_url, prefix)
    assert res.exit_code == 0, res.output
    assert "0 rows in 0 shards" in res.output
    final = json.loads(res.stdout.strip().splitlines()[-1])
    assert final["state"] == "done" and final["rows_total"] == 0
    assert read_manifest(tmp_path / "out")["state"] == "done"
    assert read_output(tmp_path / "out").schema.equals(OUTPUT_SCHEMA) and read_output(tmp_path / "out").num_rows == 0


def test_one_row_input(cli, tmp_path, redis_url, prefix):
    write_parquet(tmp_path / "in.parquet", [{"id": 42, "prompt": "only one"}])
    res = _invoke(cli, ["submit", str(_job_file(tmp_path)), "--local", "--executor", "thread", "--json"],
                  redis_url, prefix)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["ok"] == 1
    assert [p.name for p in (tmp_path / "out").glob("part-*.parquet")] == ["part-00000.parquet"]
    assert [r["id"] for r in read_output(tmp_path / "out").to_pylist()] == ["42"]


_PLAN_PROBE = textwrap.dedent("""
    import json, sys, tracemalloc
    import pyarrow as pa
    from racer_batch.service.job.inputs import plan_input, check_ids
    from racer_batch.service.job.spec import load_spec
    from racer_batch.service.execution.worker import ShardFeed

    def hwm_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    spec = load_spec(None, {"input.path": sys.argv[1], "output.path": sys.argv[2], "output.shard_rows": 64})
    base = hwm_mb()
    tracemalloc.start()
    plan = plan_input(spec.input)
    check_ids(spec.input, plan)
    plan_peak = tracemalloc.get_traced_memory()[1]
    plan_hwm = hwm_mb()
    tracemalloc.reset_peak()
    feed = ShardFeed(plan, columns=list(spec.input.columns.model_dump().values()), shard_rows=64, skip=frozenset())
    shards = rows = 0
    while (s := feed.next()) is not None:  # the worker's read path: one shard in memory at a time
        shards += 1
        rows += len(feed.rows[s])
        feed.committed(s)
    print(json.dumps({"rows": plan.num_rows, "shards": shards, "read": rows, "base_mb": base,
                      "plan_hwm_mb": plan_hwm, "feed_hwm_mb": hwm_mb(), "plan_traced_mb": plan_peak / 2**20,
                      "feed_traced_mb": tracemalloc.get_traced_memory()[1] / 2**20,
                      "arrow_peak_mb": pa.default_memory_pool().max_memory() / 2**20}))
""")


def test_100k_rows_plan_in_bounded_memory(cli, tmp_path, redis_url, prefix):
    """100,000 rows of 1 KB prompts (about 100 MB of text): planning (schema, row counts, id check) and the
    worker's shard-by-shard read stay far below the size of the prompts; submit queues the job."""
    n = 100_000
    filler = "lorem ipsum dolor sit amet " * 37  # ~1 KB
    table = pa.table({"id": pa.array([f"row-{i:06d}" for i in range(n)]),
                      "prompt": pa.array([f"{i} {filler}" for i in range(n)])})
    prompt_mb = table.column("prompt").nbytes / 2**20
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=8192)
    del table
    out = subprocess.run([sys.executable, "-c", _PLAN_PROBE, str(tmp_path / "in.parquet"), str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)
    print("100k-row planning memory:", json.dumps({k: round(v, 1) for k, v in m.items()}),
          f"prompts {prompt_mb:.0f} MB")
    assert m["rows"] == m["read"] == n and m["shards"] == 1563
    assert prompt_mb > 90
    assert m["plan_traced_mb"] < 24, m  # the id set (100k short strings) dominates
    assert m["plan_hwm_mb"] - m["base_mb"] < 56, m
    assert m["feed_hwm_mb"] - m["base_mb"] < 72, m  # about one row group (8 MB of prompts) plus allocator slack
    assert m["feed_traced_mb"] < 16 and m["arrow_peak_mb"] < 32, m
    res = _invoke(cli, ["submit", str(_job_file(tmp_path))], redis_url, prefix)
    assert res.exit_code == 0 and "100000 rows in 33334 shards" in res.output, res.output


@pytest.mark.parametrize("how", ["under-a-file", "immutable", "proc"])
def test_output_folder_not_writable(cli, tmp_path, redis_url, prefix, how):
    """Tests run as root, so permission bits stop nothing: use places that refuse root as well."""
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    if how == "under-a-file":
        (tmp_path / "afile").write_text("not a folder")
        out, expect = str(tmp_path / "afile" / "out"), "cannot create folder: Not a directory"
    elif how == "proc":
        out, expect = f"/proc/rb-rel-{os.getpid()}/out", "cannot create folder"
    else:
        if shutil.which("chattr") is None:
            pytest.skip("chattr not available")
        (tmp_path / "ro").mkdir()
        if subprocess.run(["chattr", "+i", str(tmp_path / "ro")], capture_output=True).returncode != 0:
            pytest.skip("cannot set the immutable attribute here")
        out, expect = str(tmp_path / "ro"), "folder is not writable"
    try:
        res = _invoke(cli, ["submit", str(_job_file(tmp_path, out=out))], redis_url, prefix)
    finally:
        if how == "immutable":
            subprocess.run(["chattr", "-i", str(tmp_path / "ro")], check=True)
    assert res.exit_code == 2 and f"output.path = {out!r}" in res.output and expect in res.output, res.output
    _nothing_queued(cli, redis_url, prefix)


def test_output_folder_turns_read_only_after_submit(tmp_path, queue, redis_url):
    """The folder was writable at submit but not when the worker starts: the job fails with a message that
    names the folder; the worker lives on."""
    from racer_batch.service.execution.actors import ThreadExecutor
    from racer_batch.service.execution.worker import Worker
    from racer_batch.service.job.spec import load_spec
    from racer_batch.service.submit import submit_job


    if shutil.which("chattr") is None:
        pytest.skip("chattr not available")
    write_parquet(tmp_path / "in.parquet", [{"id": i, "prompt": "x"} for i in range(3)])
    spec = load_spec(None, base_overrides(tmp_path))
    sub = submit_job(queue, spec)
    if subprocess.run(["chattr", "+i", spec.output.path], capture_output=True).returncode != 0:
        pytest.skip("cannot set the immutable attribute here")
    ex = ThreadExecutor(redis_url, prefix=queue.prefix)
    try:
        w = Worker(queue, ex, name="ro", lease_s=5)
        assert w.run(max_jobs=1, idle_exit_s=10) == 1
    finally:
        subprocess.run(["chattr", "-i", spec.output.path], check=True)
        ex.shutdown()
    fields = queue.job_fields(sub.job_id)
    assert fields["state"] == "failed", fields
    assert spec.output.path in fields["message"] and "not permitted" in fields["message"], fields["message"]


@pytest.mark.parametrize("extra, message", [
    pytest.param("colour: red\n", 'colour = "red": unknown key', id="unknown-top-key"),
    pytest.param("decoding: {capacityy: 8}\n", "decoding.capacityy = 8: unknown key (did you mean 'capacity'?)",
                 id="unknown-nested-key"),
    pytest.param("decoding: {capacity: 5000}\n", "decoding.capacity = 5000", id="capacity-out-of-range"),
    pytest.param("priority: 12\n", "priority = 12: must be <= 9", id="priority-range"),
    pytest.param("priority: high\n", 'priority = "high"', id="priority-type"),
    pytest.param("generation: {temperature: -1}\n", "generation.temperature = -1", id="temperature-range"),
    pytest.param("resources: {num_actors: 0}\n", "num_actors must be in 1..4096", id="actors-range"),
    pytest.param("preset: nope\n", "preset = 'nope': no such preset", id="unknown-preset"),
    pytest.param("decoding:\n\tcapacity: 8\n", "is not valid YAML", id="tab-in-yaml"),
])
def test_bad_spec_refused(cli, tmp_path, redis_url, prefix, extra, message):
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    res = _invoke(cli, ["submit", str(_job_file(tmp_path, extra=extra))], redis_url, prefix)
    assert res.exit_code == 2 and message in res.output, res.output


def test_bad_spec_through_the_real_entry_point(tmp_path, redis_url, prefix):
    """The installed command (python -m racer_batch): a one-line message on stderr, exit 2, no traceback."""
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    spec = _job_file(tmp_path, extra="decoding: {capacity: 0, bogus: 1}\n")
    out = subprocess.run([sys.executable, "-m", "racer_batch", "submit", str(spec), "--redis-url", redis_url,
                          "--prefix", prefix], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert "decoding.capacity = 0" in out.stderr and "decoding.bogus = 1" in out.stderr, out.stderr


def test_per_row_parameters_out_of_range(cli, tmp_path, redis_url, prefix):
    """Per-row values out of range make that row an error naming the row, the field and the value; the
    other rows are answered and `errors` lists exactly the bad ones."""
    rows = [
        {"id": "ok", "prompt": "fine", "max_new_tokens": None, "temperature": None, "top_p": None, "seed": None},
        {"id": "top-p", "prompt": "x", "max_new_tokens": None, "temperature": None, "top_p": 7.0, "seed": None},
        {"id": "zero-tokens", "prompt": "x", "max_new_tokens": 0, "temperature": None, "top_p": None, "seed": None},
        {"id": "cold", "prompt": "x", "max_new_tokens": None, "temperature": -0.5, "top_p": None, "seed": None},
        {"id": "neg-seed", "prompt": "x", "max_new_tokens": None, "temperature": None, "top_p": None, "seed": -4},
    ]
    write_parquet(tmp_path / "in.parquet", rows)
    res = _invoke(cli, ["submit", str(_job_file(tmp_path)), "--local", "--executor", "thread", "--json"],
                  redis_url, prefix)
    assert res.exit_code == 0, res.output
    job_id = res.stdout.splitlines()[0]
    errs = {e["id"]: e for e in json.loads(_invoke(cli, ["errors", job_id, "--json"], redis_url, prefix).stdout)}
    expect = {"top-p": "top_p = 7.0", "zero-tokens": "max_new_tokens = 0", "cold": "temperature = -0.5",
              "neg-seed": "seed = -4"}
    assert set(errs) == set(expect)
    for rid, text in expect.items():
        assert errs[rid]["error"].startswith(f"row {rid!r}") and text in errs[rid]["error"], errs[rid]
    table = _invoke(cli, ["errors", job_id], redis_url, prefix)
    assert "top_p = 7.0" in table.output.replace("\n", " ") or "top_p" in table.output


def test_shard_read_skips_whole_row_groups(tmp_path):
    """A shard in the middle of a file starts reading at its row group and yields exactly its rows."""
    from racer_batch.service.job.inputs import iter_raw_rows, plan_input
    from racer_batch.service.job.spec import load_spec


    pq.write_table(pa.table({"id": [f"r{i:02d}" for i in range(35)], "prompt": ["p"] * 35}),
                   tmp_path / "in.parquet", row_group_size=10)
    spec = load_spec(None, base_overrides(tmp_path))
    plan = plan_input(spec.input)
    got = [(i, r["id"]) for i, r in iter_raw_rows(plan, 15, 27, ["id", "prompt"])]
    assert got == [(i, f"r{i:02d}") for i in range(15, 27)]
    assert [i for i, _ in iter_raw_rows(plan, 30, 35, ["id"])] == [30, 31, 32, 33, 34]
