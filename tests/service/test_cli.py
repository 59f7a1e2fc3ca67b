"""The service commands through click's test runner (stand-in model, thread executor, real Redis)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from service_helpers import write_parquet

from racer_batch.cli_service import register
from racer_batch.service.queue import redact_url

pytestmark = pytest.mark.service
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def cli():
    @click.group()
    def main() -> None:
        """test harness"""

    register(main)
    return main


def _spec(tmp_path: Path, rows: list[dict]) -> Path:
    write_parquet(tmp_path / "in.parquet", rows)
    spec = tmp_path / "job.yaml"
    spec.write_text("input: {path: in.parquet}\noutput: {path: out, shard_rows: 3}\n"
                    "model: {name: stand-in}\ngeneration: {max_new_tokens: 4}\n")
    return spec


def test_submit_local_status_list_errors(cli, tmp_path, redis_url, prefix):
    spec = _spec(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": ""}, {"id": "c", "prompt": "y"}])
    common = ["--redis-url", redis_url, "--prefix", prefix]
    res = CliRunner().invoke(cli, ["submit", str(spec), "--local", "--executor", "thread", "--json", *common])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    job_id, final = lines[0], json.loads(lines[-1])
    assert final["state"] == "done" and final["rows_done"] == 3 and final["error"] == 1
    res = CliRunner().invoke(cli, ["status", job_id, "--json", *common])
    assert json.loads(res.stdout)["ok"] == 2
    res = CliRunner().invoke(cli, ["list", "--json", *common])
    assert [j["job_id"] for j in json.loads(res.stdout)] == [job_id]
    res = CliRunner().invoke(cli, ["errors", job_id, "--json", *common])
    assert [e["id"] for e in json.loads(res.stdout)] == ["b"]
    res = CliRunner().invoke(cli, ["cancel", job_id, *common])
    assert res.stdout.strip() == f"{job_id}: done"
    res = CliRunner().invoke(cli, ["status", "nope", *common])
    assert res.exit_code == 2 and "no job 'nope'" in res.output


def test_submit_refuses_bad_spec_and_input(cli, tmp_path, redis_url, prefix):
    common = ["--redis-url", redis_url, "--prefix", prefix]
    spec = _spec(tmp_path, [{"id": 1, "prompt": "x"}, {"id": 1, "prompt": "y"}])
    res = CliRunner().invoke(cli, ["submit", str(spec), *common])
    assert res.exit_code == 2 and "nothing queued: duplicate ids" in res.output and "'1'" in res.output
    res = CliRunner().invoke(cli, ["submit", str(spec), "--capacity", "0", *common])
    assert res.exit_code == 2 and "decoding.capacity = 0" in res.output
    res = CliRunner().invoke(cli, ["submit", str(spec), "--set", "resources.gpus=2", *common])
    assert res.exit_code == 2 and "resources.gpus = 2: Extra inputs are not permitted" in res.output
    res = CliRunner().invoke(cli, ["list", "--json", *common])
    assert json.loads(res.stdout) == []  # nothing was queued


def test_unreachable_redis_is_a_clear_error(cli, tmp_path):
    spec = _spec(tmp_path, [{"id": 1, "prompt": "x"}])
    res = CliRunner().invoke(cli, ["submit", str(spec), "--redis-url", "redis://:hunter2@127.0.0.1:1/0"])
    assert res.exit_code == 4 and "cannot reach Redis at redis://:***@127.0.0.1:1/0" in res.output
    assert "hunter2" not in res.output


def test_redact_url():
    assert redact_url("rediss://user:s3cret@h:6380/1") == "rediss://user:***@h:6380/1"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_service_layer_does_not_import_click():
    code = ("import sys; import racer_batch.service, racer_batch.service.local, racer_batch.service.worker; "
            "print('click' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_local_submit_starts_private_redis_when_none_answers(cli, tmp_path):
    """`submit --local` with no Redis at the URL: a private redis-server runs the job and is stopped after."""
    import shutil

    from racer_batch.service.local import free_port

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on the PATH")
    spec = _spec(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    port = free_port()
    res = CliRunner().invoke(cli, ["submit", str(spec), "--local", "--executor", "thread", "--json",
                                   "--redis-url", f"redis://127.0.0.1:{port}/0"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["rows_done"] == 2
    assert "started a private redis-server" in res.output
    assert sorted(p.name for p in (tmp_path / "out").glob("part-*.parquet")) == ["part-00000.parquet"]


def test_progress_lines_without_a_terminal_and_ctrl_c_exit_code(cli, tmp_path, redis_url, prefix, monkeypatch):
    spec = _spec(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    common = ["--redis-url", redis_url, "--prefix", prefix]
    res = CliRunner().invoke(cli, ["submit", str(spec), "--local", "--executor", "thread", *common])
    assert res.exit_code == 0, res.output
    job_id = res.stdout.strip().splitlines()[0]
    # the test runner's stderr is not a terminal: plain progress lines, the last one with every row done
    progress = [ln for ln in res.stderr.splitlines() if ln.startswith(f"{job_id}: ")]
    assert progress and progress[-1].startswith(f"{job_id}: 2/2 rows") and "done" in progress[-1], res.stderr

    import racer_batch.service.local as local

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(local, "run_until_done", interrupted)
    res = CliRunner().invoke(cli, ["submit", str(spec), "--local", "--executor", "thread", "--output",
                                   str(tmp_path / "out2"), *common])
    assert res.exit_code == 130 and "interrupted" in res.output


def test_worker_help_has_its_own_exit_codes(cli):
    res = CliRunner().invoke(cli, ["worker", "--help"])
    assert res.exit_code == 0 and "SIGTERM" in res.output and "with --wait" not in res.output
