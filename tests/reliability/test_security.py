"""Security: job specs cannot execute code; model code runs only when the spec asks for it and the worker
allows it; credentials never appear in logs, command output, the output folder, the report, Redis or Ray's
logs; one job's draft state never serves another job. Real Redis (a private one with a password where
needed) and a local Ray."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from racer_batch.service.execution.actors import ThreadExecutor
from racer_batch.service.execution.local import make_executor
from racer_batch.service.execution.queue import JobQueue, connect, redact_url
from racer_batch.service.execution.worker import Worker
from racer_batch.service.job.spec import load_spec
from racer_batch.service.results.output import read_output
from racer_batch.service.submit import submit_job
from tests.fixtures import ROOT, base_overrides, write_parquet

pytestmark = pytest.mark.service


def _clean(res) -> None:
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)


# ---- specs cannot execute code
@pytest.mark.parametrize("payload", [
    "input: !!python/object/apply:os.system ['touch {marker}']\n",
    "name: !!python/object/apply:subprocess.call [['touch', '{marker}']]\n",
    "model: {{name: !!python/object/new:os.system ['touch {marker}']}}\n",
    "preset: !!python/name:os.system\n",
])
def test_spec_with_python_tags_is_refused(cli, tmp_path, redis_url, prefix, payload):
    marker = tmp_path / "pwned"
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    spec = tmp_path / "job.yaml"
    spec.write_text("output: {path: out}\n" + payload.format(marker=marker))
    res = CliRunner().invoke(cli, ["submit", str(spec), "--redis-url", redis_url, "--prefix", prefix])
    _clean(res)
    assert res.exit_code == 2 and "is not valid YAML" in res.output and "python/" in res.output, res.output
    assert not marker.exists()


def test_override_with_python_tag_is_refused(cli, tmp_path, redis_url, prefix):
    marker = tmp_path / "pwned"
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    spec = tmp_path / "job.yaml"
    spec.write_text("input: {path: in.parquet}\noutput: {path: out}\nmodel: {name: stand-in}\n")
    res = CliRunner().invoke(cli, ["submit", str(spec), "--set",
                                   f"name=!!python/object/apply:os.system ['touch {marker}']",
                                   "--redis-url", redis_url, "--prefix", prefix])
    _clean(res)
    assert res.exit_code == 2 and "override name: cannot read value" in res.output, res.output
    assert not marker.exists()


_FORBIDDEN_IMPORTS = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
_FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def test_service_code_has_no_pickle_eval_or_unsafe_yaml():
    """Static check of the service and its CLI: values are JSON, YAML is safe_load, nothing is evaluated.
    (Ray pickles task arguments between our own processes; nothing a user submits is unpickled.)"""
    files = (sorted((ROOT / "racer_batch" / "service").glob("*.py"))
             + sorted((ROOT / "racer_batch" / "cli").glob("*.py")))
    problems = []
    for f in files:
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                problems += [f"{f.name}:{node.lineno} import {a.name}" for a in node.names
                             if a.name.split(".")[0] in _FORBIDDEN_IMPORTS]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _FORBIDDEN_IMPORTS:
                problems.append(f"{f.name}:{node.lineno} from {node.module} import")
            elif isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                owner = fn.value.id if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) else ""
                if isinstance(fn, ast.Name) and name in _FORBIDDEN_CALLS:
                    problems.append(f"{f.name}:{node.lineno} {name}()")
                if owner == "yaml" and name in ("load", "unsafe_load", "full_load", "load_all", "unsafe_load_all"):
                    problems.append(f"{f.name}:{node.lineno} yaml.{name}()")
    assert not problems, problems


def test_redis_holds_only_json(queue, redis_url, tmp_path):
    """After a job, every value the service wrote under its prefix is JSON or a plain scalar (no pickles)."""
    from racer_batch.service.execution.local import run_until_done

    write_parquet(tmp_path / "in.parquet", [{"id": i, "prompt": "p" if i else ""} for i in range(5)])
    spec = load_spec(None, base_overrides(tmp_path))
    sub = submit_job(queue, spec)
    assert run_until_done(queue, sub.job_id, url=redis_url, prefix=queue.prefix, executor_kind="thread").state == "done"
    r = queue.r
    values = []
    for key in r.scan_iter(f"{queue.prefix}*"):
        kind = r.type(key)
        if kind == "hash":
            values += list(r.hgetall(key).values())
        elif kind == "stream":
            values += [v for _, fields in r.xrange(key) for v in fields.values()]
        elif kind == "zset":
            values += r.zrange(key, 0, -1)
        else:
            values.append(r.get(key) if kind == "string" else "")
    assert len(values) > 20
    for v in values:  # decode_responses=True: binary (a pickle) would not even decode as UTF-8
        if v[:1] in ("{", "["):
            json.loads(v)
        assert not v.startswith("\x80"), v[:20]
    assert any(v.startswith("{") for v in values)


# ---- trust_remote_code
def _evil_model(folder: Path, marker: Path) -> Path:
    """A model folder whose configuration code touches ``marker`` when imported (stands in for any code)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evil", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                     "AutoModelForCausalLM": "configuration_evil.EvilForCausalLM"}}))
    (folder / "configuration_evil.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('model code ran')\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
        "class EvilForCausalLM:\n    pass\n")
    return folder


@pytest.mark.parametrize("spec_trusts, worker_allows, code_runs, message", [
    (True, False, False, "model.trust_remote_code is set but this worker was not started with --allow-remote-code"),
    (False, True, False, "trust_remote_code"),
    (True, True, True, None),
], ids=["spec-only", "worker-only", "both"])
def test_remote_code_needs_spec_and_worker(queue, redis_url, tmp_path, spec_trusts, worker_allows, code_runs, message):
    marker = tmp_path / "code-ran"
    model = _evil_model(tmp_path / f"evil-{uuid.uuid4().hex[:8]}", marker)
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    spec = load_spec(None, base_overrides(tmp_path, **{"model.name": str(model),
                                                       "model.trust_remote_code": spec_trusts}))
    sub = submit_job(queue, spec)
    ex = ThreadExecutor(redis_url, prefix=queue.prefix, allow_remote_code=worker_allows)
    try:
        assert Worker(queue, ex, name="gate", lease_s=5).run(max_jobs=1, idle_exit_s=10) == 1
    finally:
        ex.shutdown()
        for d in Path.home().joinpath(".cache/huggingface/modules/transformers_modules").glob(f"{model.name}*"):
            shutil.rmtree(d, ignore_errors=True)
    fields = queue.job_fields(sub.job_id)
    assert fields["state"] == "failed"  # the fake model never loads; what matters is whether its code ran
    assert marker.exists() == code_runs
    if message:
        assert message in fields["message"], fields["message"]


def test_worker_command_refuses_remote_code_by_default(queue, redis_url, tmp_path):
    """The real `worker` command, started without --allow-remote-code."""
    marker = tmp_path / "code-ran"
    model = _evil_model(tmp_path / f"evil-{uuid.uuid4().hex[:8]}", marker)
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    spec = load_spec(None, base_overrides(tmp_path, **{"model.name": str(model), "model.trust_remote_code": True}))
    sub = submit_job(queue, spec)
    out = subprocess.run([sys.executable, "-m", "racer_batch", "worker", "--no-ray", "--max-jobs", "1",
                          "--idle-exit", "10", "--redis-url", redis_url, "--prefix", queue.prefix],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    fields = queue.job_fields(sub.job_id)
    assert fields["state"] == "failed" and "--allow-remote-code" in fields["message"]
    assert not marker.exists()


# ---- credentials
def test_password_redis_works_and_never_leaks(cli, ray_session, redis_server_factory, tmp_path):
    """A Redis with a password: a job runs through Ray actors with the password in the URL (from the spec
    file); without it or with a wrong one, a clear message and exit 4. The password appears nowhere: not
    in command output, the worker's debug log, the output folder (manifest, part files, report), Redis, or
    Ray's session logs."""
    from racer_batch.cli import main as racer_main

    secret = f"pw-{uuid.uuid4().hex}"
    srv = redis_server_factory(password=secret)
    prefix = "rbrel-pw:"
    write_parquet(tmp_path / "in.parquet", [{"id": i, "prompt": f"p {i}" if i != 2 else ""} for i in range(6)])
    job = tmp_path / "job.yaml"
    job.write_text(f"input: {{path: in.parquet}}\noutput: {{path: out, shard_rows: 3}}\n"
                   f"model: {{name: 'stand-in?mat=2'}}\ngeneration: {{max_new_tokens: 6}}\n"
                   f"resources: {{num_actors: 1}}\nredis_url: {json.dumps(srv.url)}\n")
    outputs: list[str] = []

    # without the password / with a wrong one: clear message, exit 4
    for url in (srv.url_without_password, srv.url.replace(secret, "wrong-" + secret[:6])):
        res = CliRunner().invoke(cli, ["list", "--redis-url", url, "--prefix", prefix])
        _clean(res)
        assert res.exit_code == 4 and redact_url(url) in res.output, res.output
        outputs.append(res.output)
    assert "needs a password: put it in the URL" in outputs[0], outputs[0]
    assert "refused the credentials: invalid username-password pair" in outputs[1], outputs[1]

    # submit (the URL comes from the spec file), then a worker on Ray actors with the password URL
    res = CliRunner().invoke(cli, ["submit", str(job), "--prefix", prefix])
    _clean(res)
    assert res.exit_code == 0, res.output
    outputs.append(res.output)
    job_id = res.stdout.strip().splitlines()[0]
    q = JobQueue(connect(srv.url), prefix=prefix)
    executor = make_executor("ray", url=srv.url, prefix=prefix, name="pw")
    try:
        assert Worker(q, executor, name="pw", lease_s=10).run(max_jobs=1, idle_exit_s=30) == 1
    finally:
        executor.shutdown()
    assert q.status(job_id).state == "done"
    assert sorted(r["id"] for r in read_output(tmp_path / "out").to_pylist()) == [str(i) for i in range(6)]

    # the read side, with the URL on the command line
    for args in (["status", job_id], ["status", job_id, "--json"], ["list"], ["errors", job_id], ["cancel", job_id]):
        res = CliRunner().invoke(cli, [*args, "--redis-url", srv.url, "--prefix", prefix])
        _clean(res)
        assert res.exit_code == 0, (args, res.output)
        outputs.append(res.output)
    res = CliRunner().invoke(racer_main, ["report", job_id, "--redis-url", srv.url, "--prefix", prefix,
                                          "--format", "md", "--format", "json"])
    _clean(res)
    assert res.exit_code == 0, res.output
    outputs.append(res.output)

    # a worker process with debug logging, on a second job (thread executor: its log is all in one place)
    write_parquet(tmp_path / "in2.parquet", [{"id": "x", "prompt": "hello"}])
    spec2 = load_spec(None, base_overrides(tmp_path, **{"input.path": str(tmp_path / "in2.parquet"),
                                                        "output.path": str(tmp_path / "out2")}))
    submit_job(q, spec2)
    proc = subprocess.run([sys.executable, "-m", "racer_batch", "--log-level", "debug", "worker",
                           "--no-ray", "--max-jobs", "1", "--idle-exit", "10", "--redis-url", srv.url,
                           "--prefix", prefix], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert "***" in proc.stderr  # the worker prints its (redacted) Redis URL
    outputs += [proc.stdout, proc.stderr]

    for text in outputs:
        assert secret not in text
    leaks = [str(p) for folder in (tmp_path / "out", tmp_path / "out2", Path(ray_session.temp_dir))
             for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaks, leaks
    assert (tmp_path / "out" / "_report").is_dir()
    for key in q.r.scan_iter(f"{prefix}*"):
        assert secret not in json.dumps(_dump_key(q.r, key))


def _dump_key(r, key: str):
    kind = r.type(key)
    if kind == "hash":
        return r.hgetall(key)
    if kind == "stream":
        return r.xrange(key)
    if kind == "zset":
        return r.zrange(key, 0, -1)
    return r.get(key) if kind == "string" else None


# ---- one job's draft state never serves another job
def test_engine_job_states_are_isolated():
    """Engine level (tiny random model): a second job's state starts empty, and a prompt the first job
    already answered gets no retrieval help in the second job (same steps and acceptance as on a fresh
    engine), while inside the first job the repeat is drafted from its own earlier answer (the control)."""
    import torch

    from racer_batch import DecodingConfig, Engine, GenerationParams
    from tests.helpers import tiny_bundle

    torch.set_num_threads(1)
    engine = Engine(tiny_bundle(eos=False), DecodingConfig(method="racer", capacity=8))
    params = GenerationParams(max_new_tokens=40)
    prompt = "hello world abc"
    job_a = engine.new_state()
    first = engine.generate(prompt, params, state=job_a)
    repeat = engine.generate(prompt, params, state=job_a)
    assert repeat.text == first.text and repeat.stats.steps < first.stats.steps  # control: the state helps
    assert job_a.automaton_nodes > 0 and job_a.store_known > 0
    job_b = engine.new_state()
    assert job_b is not job_a and job_b.state_id != job_a.state_id
    assert job_b.automaton_nodes == 0 and job_b.store_known == 0  # starts empty
    engine.free_state(job_a)
    assert job_a.freed and job_a.automaton is None and job_a.store is None and job_a.native is None
    with pytest.raises(ValueError, match="freed"):
        engine.generate(prompt, params, state=job_a)
    in_b = engine.generate(prompt, params, state=job_b)
    assert in_b.text == first.text
    assert (in_b.stats.steps, in_b.stats.accepted_hist, in_b.stats.accepted_retrieval) == \
        (first.stats.steps, first.stats.accepted_hist, first.stats.accepted_retrieval)


def test_actor_job_states_are_isolated(ray_session, queue, redis_url, tmp_path):
    """Actor level: two jobs with the same rows run one after the other on the same Ray actor (tiny-random
    model, loaded once). Each job's rows get exactly the same acceptance statistics, so the second job
    started from an empty draft state; the repeated prompt inside each job does get retrieval help (the
    control); after the jobs the actor holds no draft state."""
    rows = [{"id": f"{k}", "prompt": "Tell me about the sea and the sky."} for k in ("first", "repeat")]
    write_parquet(tmp_path / "in.parquet", rows)
    specs = {}
    for name, prio in (("a", 9), ("b", 1)):
        specs[name] = load_spec(None, base_overrides(tmp_path, **{
            "model.name": "tiny-random", "generation.max_new_tokens": 24, "output.path": str(tmp_path / name),
            "priority": prio, "decoding.capacity": 8}))
        submit_job(queue, specs[name])
    executor = make_executor("ray", url=redis_url, prefix=queue.prefix, name="shared")
    try:
        assert Worker(queue, executor, name="shared", lease_s=30).run(max_jobs=2, idle_exit_s=30) == 2
        actor_view = ray_session.ray.get(executor.actors[0].__ray_call__.remote(
            lambda self: {"active": self.runner.active_jobs, "models_loaded": self.runner.models_loaded}))
    finally:
        executor.shutdown()
    out = {name: {r["id"]: r for r in read_output(spec.output.path).to_pylist()} for name, spec in specs.items()}
    assert len({r["worker"] for job in out.values() for r in job.values()}) == 1  # one actor served both
    assert actor_view == {"active": [], "models_loaded": 1}
    keys = ("status", "text", "steps", "accepted_hist", "accepted_retrieval", "accepted_logits")
    for rid in ("first", "repeat"):
        assert {k: out["a"][rid][k] for k in keys} == {k: out["b"][rid][k] for k in keys}, rid
    for job in out.values():
        assert job["repeat"]["accepted_retrieval"] > job["first"]["accepted_retrieval"]
        assert job["repeat"]["steps"] < job["first"]["steps"]
