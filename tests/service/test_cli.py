"""The service commands through click's test runner (stand-in model, thread executor, real Redis)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from racer_batch.service.execution.queue import redact_url
from tests.fixtures import write_parquet

pytestmark = pytest.mark.service
ROOT = Path(__file__).resolve().parents[2]


def _spec(tmp_path: Path, rows: list[dict]) -> Path:
    write_parquet(tmp_path / "in.parquet", rows)
    spec = tmp_path / "job.yaml"
    spec.write_text("input: {path: in.parquet}\noutput: {path: out, shard_rows: 3}\n"
                    "model: {name: stand-in}\ngeneration: {max_new_tokens: 4}\n")
    return spec


def _run_here(cli, spec: Path, common: list[str]):
    """``submit SPEC --local --executor thread``, which must succeed: (the CLI result, the job id it printed)."""
    res = CliRunner().invoke(cli, ["submit", str(spec), "--local", "--executor", "thread", *common])
    assert res.exit_code == 0, res.output
    return res, res.stdout.strip().splitlines()[0]


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
    assert res.exit_code == 2 and "resources.gpus = 2: unknown key (did you mean 'gpus_per_actor'?)" in res.output
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
    code = ("import sys; import racer_batch.service, racer_batch.service.execution.local, "
            "racer_batch.service.execution.worker; "
            "print('click' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_local_submit_starts_private_redis_when_none_answers(cli, tmp_path):
    """`submit --local` with no Redis at the URL: a private redis-server runs the job and is stopped after."""
    import shutil

    from racer_batch.service.execution.local import free_port

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
    res, job_id = _run_here(cli, spec, common)
    # the test runner's stderr is not a terminal: plain progress lines, the last one with every row done
    progress = [ln for ln in res.stderr.splitlines() if ln.startswith(f"{job_id}: ")]
    assert progress and progress[-1].startswith(f"{job_id}: 2/2 rows") and "done" in progress[-1], res.stderr

    import racer_batch.service.execution.local as local

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(local, "run_until_done", interrupted)
    res = CliRunner().invoke(cli, ["submit", str(spec), "--local", "--executor", "thread", "--output",
                                   str(tmp_path / "out2"), *common])
    assert res.exit_code == 130 and "interrupted" in res.output


def test_worker_help_has_its_own_exit_codes(cli):
    res = CliRunner().invoke(cli, ["worker", "--help"])
    assert res.exit_code == 0 and "SIGTERM" in res.output and "with --wait" not in res.output


# ---- issue 13, part 6: what a new user's trial tripped over
def test_a_job_whose_rows_all_failed_fails_and_points_to_errors(cli, tmp_path, redis_url, prefix):
    spec = _spec(tmp_path, [{"id": "a", "prompt": ""}, {"id": "b", "prompt": " "}])
    res = CliRunner().invoke(cli, ["submit", str(spec), "--local", "--executor", "thread",
                                   "--redis-url", redis_url, "--prefix", prefix])
    assert res.exit_code == 5, res.output
    job_id = res.stdout.strip().splitlines()[0]
    assert f"job {job_id}: failed" in res.stderr and "every row failed" in res.stderr
    assert f"racer-batch errors {job_id} --prefix {prefix}" in res.stderr  # the test's prefix is not the default
    res = CliRunner().invoke(cli, ["status", job_id, "--redis-url", redis_url, "--prefix", prefix])
    assert f"racer-batch errors {job_id} --prefix {prefix}" in res.stdout


def _six_rows_claimed(tmp_path: Path, queue):
    """A stand-in job of 6 rows in 2 shards, submitted and claimed by worker ``w``: (submit outcome, lease)."""
    from racer_batch.service.job.spec import load_spec
    from racer_batch.service.submit import submit_job

    write_parquet(tmp_path / "in.parquet", [{"id": i, "prompt": f"p {i}"} for i in range(6)])
    spec = load_spec(None, {"input.path": str(tmp_path / "in.parquet"), "output.path": str(tmp_path / "out"),
                            "model.name": "stand-in", "output.shard_rows": 3})
    sub = submit_job(queue, spec)
    return sub, queue.claim(consumer="w", lease_ms=60_000, block_ms=0)


def test_status_counts_the_rows_a_cancel_left_unanswered(cli, tmp_path, redis_url, prefix, queue):
    sub, lease = _six_rows_claimed(tmp_path, queue)
    queue.finish(lease, state="cancelled")  # cancelled before any shard was committed
    res = CliRunner().invoke(cli, ["status", sub.job_id, "--json", "--redis-url", redis_url, "--prefix", prefix])
    assert json.loads(res.stdout)["cancelled"] == 6
    res = CliRunner().invoke(cli, ["status", sub.job_id, "--redis-url", redis_url, "--prefix", prefix])
    assert "cancelled 6" in res.stdout


def test_status_says_when_the_owner_stopped_renewing(cli, tmp_path, redis_url, prefix, queue):
    import time

    from racer_batch.service.job.spec import load_spec
    from racer_batch.service.submit import submit_job

    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    spec = load_spec(None, {"input.path": str(tmp_path / "in.parquet"), "output.path": str(tmp_path / "out"),
                            "model.name": "stand-in"})
    sub = submit_job(queue, spec)
    lease = queue.claim(consumer="gone-worker", lease_ms=3_000, block_ms=0)
    assert queue.renew(lease)
    fresh = queue.status(sub.job_id)
    assert fresh.state == "running" and not fresh.stalled and fresh.lease_s == 3.0
    time.sleep(2.2)  # more than two thirds of the lease without a renewal: the owner is presumed dead
    st = queue.status(sub.job_id)
    assert st.stalled and st.eta_s is None
    res = CliRunner().invoke(cli, ["status", sub.job_id, "--redis-url", redis_url, "--prefix", prefix])
    assert "owner gone-worker stopped renewing its lease" in res.stdout, res.stdout
    assert "any worker polling the queue takes the job over" in res.stdout  # none may be running
    assert json.loads(CliRunner().invoke(cli, ["status", sub.job_id, "--json", "--redis-url", redis_url,
                                               "--prefix", prefix]).stdout)["stalled"] is True


def test_status_of_a_handed_back_job_says_it_is_not_running(cli, tmp_path, redis_url, prefix, queue):
    from racer_batch.service.results.tally import Tally

    sub, lease = _six_rows_claimed(tmp_path, queue)
    queue.commit_shard(sub.job_id, 0, Tally(rows=3, ok=3, output_tokens=12, steps=6).to_dict())
    running = CliRunner().invoke(cli, ["status", sub.job_id, "--redis-url", redis_url, "--prefix", prefix]).stdout
    assert "rows/s" in running and "not running" not in running, running
    queue.release(lease, message="worker w stopped")  # handed back: the run's clock is reset
    res = CliRunner().invoke(cli, ["status", sub.job_id, "--redis-url", redis_url, "--prefix", prefix])
    assert "not running (queued; 3 rows committed by earlier runs)" in res.stdout, res.stdout
    assert "0.00 rows/s" not in res.stdout and "3/6" in res.stdout


def test_list_and_errors_tables_are_not_cut_in_a_pipe(cli, tmp_path, redis_url, prefix):
    long_id = "row-" + "x" * 110
    deep = tmp_path / ("a-rather-long-folder-name-" * 4) / "out"
    spec = _spec(tmp_path, [{"id": long_id, "prompt": ""}, {"id": "ok", "prompt": "y"}])
    common = ["--redis-url", redis_url, "--prefix", prefix]
    res = CliRunner().invoke(cli, ["submit", str(spec), "--local", "--executor", "thread", "--output", str(deep),
                                   *common])
    assert res.exit_code == 0, res.output
    job_id = res.stdout.strip().splitlines()[0]
    listed = CliRunner().invoke(cli, ["list", *common]).stdout
    assert any(str(deep) in line and job_id in line for line in listed.splitlines()), listed
    errs = CliRunner().invoke(cli, ["errors", job_id, *common]).stdout
    assert any(long_id in line and "prompt is empty" in line for line in errs.splitlines()), errs


def test_worker_shows_activity_at_the_default_log_level(cli, tmp_path, redis_url, prefix, queue):
    from racer_batch.service.job.spec import load_spec
    from racer_batch.service.submit import submit_job

    write_parquet(tmp_path / "in.parquet", [{"id": i, "prompt": f"p {i}"} for i in range(4)])
    spec = load_spec(None, {"input.path": str(tmp_path / "in.parquet"), "output.path": str(tmp_path / "out"),
                            "model.name": "stand-in", "output.shard_rows": 2})
    sub = submit_job(queue, spec)
    res = CliRunner().invoke(cli, ["worker", "--no-ray", "--max-jobs", "1", "--redis-url", redis_url,
                                   "--prefix", prefix])
    assert res.exit_code == 0, res.output
    assert f"job {sub.job_id}: taken by" in res.stderr
    assert f"job {sub.job_id}: shard 1 committed" in res.stderr or f"job {sub.job_id}: shard 0 committed" in res.stderr
    assert f"job {sub.job_id}: done (2/2 shards)" in res.stderr


def test_resubmitting_a_finished_local_job_starts_no_ray(cli, tmp_path, redis_url, prefix):
    spec = _spec(tmp_path, [{"id": "a", "prompt": "x"}])
    common = ["--redis-url", redis_url, "--prefix", prefix]
    _run_here(cli, spec, common)
    res = CliRunner().invoke(cli, ["submit", str(spec), "--local", "--wait", *common])  # the default: Ray
    assert res.exit_code == 0, res.output
    assert "1 shard already done" in res.stderr and "starting local Ray" not in res.output
    assert "rows: 1/1" in res.stderr
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_resubmitting_a_finished_job_queues_nothing_and_keeps_its_figures(cli, tmp_path, redis_url, prefix, queue):
    spec = _spec(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    common = ["--redis-url", redis_url, "--prefix", prefix]
    res, job_id = _run_here(cli, spec, common)
    before = queue.status(job_id)
    assert before.state == "done" and before.elapsed_s > 0
    for extra in ([], ["--wait"]):  # without --local: nothing for a worker to take
        res = CliRunner().invoke(cli, ["submit", str(spec), *extra, *common])
        assert res.exit_code == 0, res.output
        assert "already done: 2 rows in 1 shard, 1 shard already done" in res.stderr, res.stderr
        after = queue.status(job_id)
        assert after.state == "done" and after.started_at == before.started_at
        assert after.finished_at == before.finished_at
    assert "rows: 2/2" in res.stderr  # --wait printed the finished job's own summary
    assert queue.claim(consumer="probe", lease_ms=1000, block_ms=0) is None  # nothing was queued


def test_resubmitting_a_queued_job_with_other_resources_says_they_are_not_applied(cli, tmp_path, redis_url, prefix):
    spec = _spec(tmp_path, [{"id": "a", "prompt": "x"}])
    common = ["--redis-url", redis_url, "--prefix", prefix]
    res = CliRunner().invoke(cli, ["submit", str(spec), "--streams-per-actor", "4", *common])  # queued, no worker
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(cli, ["submit", str(spec), "--streams-per-actor", "1", *common])
    assert res.exit_code == 0, res.output
    assert "already queued" in res.stderr
    assert "not applied: resources.streams_per_actor = 1 (the queued job keeps 4;" in res.stderr, res.stderr
    res = CliRunner().invoke(cli, ["submit", str(spec), "--streams-per-actor", "4", *common])  # same: no note
    assert "already queued" in res.stderr and "not applied" not in res.stderr


def test_submit_without_a_spec_file(cli, tmp_path, redis_url, prefix, monkeypatch):
    write_parquet(tmp_path / "prompts.parquet", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    monkeypatch.chdir(tmp_path)
    common = ["--redis-url", redis_url, "--prefix", prefix]
    res = CliRunner().invoke(cli, ["submit", "--input", "prompts.parquet", "--model", "stand-in", "--local",
                                   "--executor", "thread", "--json", *common])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["rows_done"] == 2
    assert (tmp_path / "out" / "prompts" / "part-00000.parquet").exists()  # the documented default output
    res = CliRunner().invoke(cli, ["list", "--json", *common])
    assert [j["name"] for j in json.loads(res.stdout)] == ["prompts.parquet"]  # named after its input
    res = CliRunner().invoke(cli, ["list", *common])
    assert "prompts.parquet" in res.stdout
    res = CliRunner().invoke(cli, ["submit", "--model", "stand-in", *common])
    assert res.exit_code == 2 and "--input is required" in res.output


def test_a_flag_error_is_not_blamed_on_the_spec_file(cli, tmp_path, redis_url, prefix):
    spec = _spec(tmp_path, [{"id": 1, "prompt": "x"}])
    common = ["--redis-url", redis_url, "--prefix", prefix]
    res = CliRunner().invoke(cli, ["submit", str(spec), "--shard-rows", "0", *common])
    assert res.exit_code == 2 and "invalid option (command line)" in res.output
    assert "given by --shard-rows" in res.output and "invalid job spec" not in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(spec.read_text() + "priority: 42\n")
    res = CliRunner().invoke(cli, ["submit", str(bad), *common])
    assert res.exit_code == 2 and f"invalid job spec ({bad})" in res.output and "given by" not in res.output


@pytest.mark.parametrize("command", ["status", "list", "cancel", "errors"])
def test_read_commands_show_only_their_own_exit_codes(cli, command):
    res = CliRunner().invoke(cli, [command, "--help"])
    assert res.exit_code == 0 and "Exit codes" in res.output
    assert "--wait" not in res.output and "nothing queued" not in res.output and "  5  " not in res.output
    assert ("no such job" in res.output) == (command != "list")


def test_readme_command_lines_paste_without_making_a_pipeline():
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash")[1:]
    lines = [ln for b in blocks for ln in b.split("```")[0].splitlines()]
    assert lines and not [ln for ln in lines if "| racer-batch" in ln]


def test_status_after_a_cancel_counts_a_partial_shards_answered_rows(cli, tmp_path, redis_url, prefix, queue):
    """Found in a new user's trial: a cancel mid-shard left that shard's part file with one answered row, but
    status dropped it (the in-flight tally was deleted) and counted it as cancelled."""
    from racer_batch.service.job.spec import load_spec
    from racer_batch.service.results.tally import Tally
    from racer_batch.service.submit import submit_job

    write_parquet(tmp_path / "in.parquet", [{"id": i, "prompt": f"p {i}"} for i in range(9)])
    spec = load_spec(None, {"input.path": str(tmp_path / "in.parquet"), "output.path": str(tmp_path / "out"),
                            "model.name": "stand-in", "output.shard_rows": 3})
    sub = submit_job(queue, spec)
    lease = queue.claim(consumer="w", lease_ms=60_000, block_ms=0)
    queue.commit_shard(sub.job_id, 0, Tally(rows=3, ok=3, output_tokens=30).to_dict())
    partial = Tally(rows=3, ok=1, cancelled=2, output_tokens=10)  # shard 1: one row answered, then the cancel
    queue.record_row(sub.job_id, {"id": "3", "status": "cancelled"}, shard=1, progress=partial)
    queue.finish(lease, state="cancelled")
    st = json.loads(CliRunner().invoke(cli, ["status", sub.job_id, "--json", "--redis-url", redis_url,
                                             "--prefix", prefix]).stdout)
    assert (st["ok"], st["cancelled"], st["rows_done"], st["output_tokens"]) == (4, 5, 4, 40)
    res = CliRunner().invoke(cli, ["status", sub.job_id, "--redis-url", redis_url, "--prefix", prefix])
    assert "4/9" in res.stdout and "ok 4" in res.stdout and "cancelled 5" in res.stdout


@pytest.mark.parametrize("where", ["closed-port", "unknown-host"])
def test_worker_with_an_unreachable_ray_address_exits_4_at_once(cli, redis_url, prefix, where):
    """A ``--ray-address`` nobody answers at: ``ray.init`` alone would retry it for ever; the worker checks the
    head's GCS port first and exits 4 with one line naming the address."""
    import time

    from racer_batch.service.execution.local import free_port

    address = f"127.0.0.1:{free_port()}" if where == "closed-port" else "not-a-host.invalid:6379"
    t0 = time.monotonic()
    res = CliRunner().invoke(cli, ["worker", "--ray-address", address, "--max-jobs", "1", "--idle-exit", "1",
                                   "--redis-url", redis_url, "--prefix", prefix])
    assert res.exit_code == 4, res.output
    assert f"cannot start or reach Ray: the Ray head at {address} does not answer" in res.output
    assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit)
    assert time.monotonic() - t0 < 30, "a bound on a hang, not a timing claim"


def test_actors_get_the_workers_racer_and_hf_variables(monkeypatch):
    """init_local_ray hands the actors (on every node of a joined cluster) each RACER_* / HF_* variable of the
    worker through runtime_env env_vars; other variables stay behind. ray.init is mocked."""
    import ray

    from racer_batch.service.execution import local

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(local, "check_head_address", lambda address: None)
    monkeypatch.setenv("RACER_KERNEL_ISA", "avx2-test")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NOT_RACER_VAR", "x")
    local.init_local_ray(address="10.0.0.1:6379")
    env = calls[0]["runtime_env"]["env_vars"]
    assert env["RACER_KERNEL_ISA"] == "avx2-test" and env["HF_HUB_OFFLINE"] == "1"
    assert ("NOT_RACER_VAR" not in env
            and (Path(env["PYTHONPATH"].split(":")[0]) / "racer_batch" / "__init__.py").is_file())
    assert calls[0]["address"] == "10.0.0.1:6379"


def test_ctrl_c_of_submit_local_queues_the_job_and_the_rerun_times_itself(tmp_path, queue, redis_url, prefix):
    """One SIGINT to a running ``submit --local`` (a real process, as a terminal's Ctrl-C): it exits 130 saying
    the job went back to the queue, quietly (no traceback), ``status`` then says queued with no owner, and the
    resumed run finishes every row once and reports its own wall time, not the first run's plus its own."""
    import os
    import signal
    import time

    import pyarrow.parquet as pq

    # 16 rows in 8 shards of ~1.2 s each: the interrupt lands with most of the job still to run, however slow
    # the machine
    rows = [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(16)]
    write_parquet(tmp_path / "in.parquet", rows)
    spec = tmp_path / "job.yaml"
    spec.write_text("input: {path: in.parquet}\noutput: {path: out, shard_rows: 2}\n"
                    "model: {name: 'stand-in?ms_per_step=150&mat=1'}\ngeneration: {max_new_tokens: 4}\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), RACER_BATCH_ENGINE_HOOK="tests.standin:STANDIN_HOOK")
    cmd = [sys.executable, "-m", "racer_batch", "submit", str(spec), "--local", "--executor", "thread", "--json",
           "--redis-url", redis_url, "--prefix", prefix]
    t0 = time.monotonic()
    # a terminal's default for SIGINT: a runner started in the background (CI's `nohup ... &`) passes it on ignored
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        jobs = []
        while time.monotonic() < deadline and proc.poll() is None:
            jobs = queue.list_jobs()
            if jobs and queue.status(jobs[0].job_id).shards_done >= 1:
                break
            time.sleep(0.05)
        assert jobs and queue.status(jobs[0].job_id).shards_done >= 1, "the job never got going"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    first_s = time.monotonic() - t0
    job_id = jobs[0].job_id
    assert proc.returncode == 130, err
    assert "handed back to the queue" in err and "Traceback" not in err, err
    st = queue.status(job_id)
    assert st.state == "queued" and st.owner is None and st.shards_done < 8, (st.to_dict(), err,
                                                                              queue.lease_history(job_id))
    time.sleep(1.0)  # a gap between the two runs: a wall time spanning both would hold it
    t1 = time.monotonic()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    rerun_s = time.monotonic() - t1
    assert res.returncode == 0, res.stderr
    final = json.loads(res.stdout.strip().splitlines()[-1])
    assert final["state"] == "done" and final["rows_done"] == 16
    # its own run only: within the second process's lifetime (counting from the first run would add first_s
    # and the gap, over 5 s)
    assert final["elapsed_s"] <= rerun_s + 0.5, (final, rerun_s, first_s)
    ids = [r["id"] for r in pq.read_table(tmp_path / "out").to_pylist()]
    assert sorted(ids) == sorted(r["id"] for r in rows)
