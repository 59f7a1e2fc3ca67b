"""Service commands of the ``racer-batch`` CLI: submit, status, list, cancel, errors, worker.

``register(group)`` adds them to a click group (the top-level one in racer_batch/cli/__init__.py). Flags
become a JobSpec / plain arguments here and are handed to racer_batch.service, which never imports click.
What they print is in render.py; their exit codes are the table in exit_codes.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Optional

import click
from rich.table import Column, Table

from racer_batch.service.execution import queue as q
from racer_batch.service.execution.queue import plural
from racer_batch.service.job.inputs import InputError
from racer_batch.service.job.spec import SpecError, load_spec, parse_override
from racer_batch.service.results.output import OutputError
from racer_batch.values import AUTO_METHOD, METHODS

from .exit_codes import CliExit, ExitCode, epilog
from .options import redis_options
from .render import JobProgress, err_console, fmt, print_table, status_table, summary_lines

_REDIS = (ExitCode.SERVICE, "Redis")
_NO_JOB = (ExitCode.INPUT, "no such job")
_SUBMIT_EPILOG = epilog(
    ExitCode.OK, ExitCode.INTERNAL,
    (ExitCode.INPUT, "invalid job spec, flag or input (nothing queued)"),
    (ExitCode.SERVICE, "Redis or Ray"),
    (ExitCode.JOB_FAILED, "with --wait or --local"),
    (ExitCode.INTERRUPTED, "a --local job goes back to the queue; a watched one goes on"),
)
_STATUS_EPILOG = epilog(ExitCode.OK, ExitCode.INTERNAL, _NO_JOB, _REDIS,
                        (ExitCode.INTERRUPTED, "while watching; the job goes on"))
_JOB_EPILOG = epilog(ExitCode.OK, ExitCode.INTERNAL, _NO_JOB, _REDIS, ExitCode.INTERRUPTED)
_LIST_EPILOG = epilog(ExitCode.OK, ExitCode.INTERNAL, (ExitCode.INPUT, "bad option value"), _REDIS,
                      ExitCode.INTERRUPTED)
_WORKER_EPILOG = epilog(
    (ExitCode.OK, "stopped after --max-jobs, --idle-exit, SIGTERM or Ctrl-C (the current job goes back to the "
                  "queue)"),
    ExitCode.INTERNAL,
    (ExitCode.INPUT, "bad option value"),
    (ExitCode.SERVICE, "Redis or Ray, or the metrics port cannot be bound; the Ray head went away (the job "
                       "in hand goes back to the queue)"),
    (ExitCode.INTERRUPTED, "during start-up, before it waits for jobs"),
)

_redis_options = redis_options(
    url_help="Redis URL (redis://[:password@]host:port/db, rediss:// for TLS); default: the spec's redis_url, "
             "then REDIS_URL, then redis://127.0.0.1:6379/0.",
    prefix_help="; separates deployments sharing one Redis.")


def _queue(url: str, prefix: str) -> q.JobQueue:
    try:
        return q.JobQueue.from_url(url, prefix=prefix)
    except q.QueueUnavailable as exc:
        raise CliExit(str(exc), ExitCode.SERVICE) from None


def _no_job(job_id: str, prefix: str) -> CliExit:
    return CliExit(f"no job {job_id!r} (prefix {prefix!r})", ExitCode.INPUT)


def _watch(queue: q.JobQueue, job_id: str, *, interval_s: float = 1.0) -> q.JobStatus:
    """Progress bar until the job ends; returns the final status."""
    st = queue.status(job_id)
    with JobProgress(job_id, st.rows_total) as prog:
        try:
            while True:
                st = queue.status(job_id)
                done = st.state in q.TERMINAL
                prog.update(st, force=done)
                if done:
                    return st
                time.sleep(interval_s)
        except KeyboardInterrupt:
            raise CliExit(f"interrupted; job {job_id} goes on (racer-batch status {job_id})",
                          ExitCode.INTERRUPTED) from None


# ---- submit
# submit's override flags: click parameter name -> (flag, spec key)
_OVERRIDE_FLAGS = {
    "input_path": ("--input", "input.path"), "output_path": ("--output", "output.path"),
    "model": ("--model", "model.name"), "preset": ("--preset", "preset"),
    "method": ("--method", "decoding.method"), "capacity": ("--capacity", "decoding.capacity"),
    "max_new_tokens": ("--max-new-tokens", "generation.max_new_tokens"),
    "num_actors": ("--num-actors", "resources.num_actors"),
    "streams_per_actor": ("--streams-per-actor", "resources.streams_per_actor"),
    "shard_rows": ("--shard-rows", "output.shard_rows"),
    "priority": ("--priority", "priority"), "seed": ("--seed", "seed"),
}
# flags parsed to an int here (their fields would answer other text with pydantic's union errors);
# --streams-per-actor goes through as text: its field's own validator reads it and names the range
_INT_OR_AUTO = ("--capacity", "--num-actors")


@click.command(epilog=_SUBMIT_EPILOG)
@click.argument("spec_file", metavar="[SPEC]", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--local", is_flag=True, help="Run the job here: local Ray + Redis (private redis-server if none).")
@click.option("--wait", is_flag=True, help="Wait for the job to end and print a summary (implied by --local).")
@click.option("--job-id", default=None, help="Re-run this job id (resume).")
@click.option("--input", "input_path", default=None, help="Override input.path (required without SPEC).")
@click.option("--output", "output_path", default=None,
              help="Override output.path (without SPEC: default out/<input file name without extension>).")
@click.option("--model", default=None, help="Override model.name.")
@click.option("--preset", default=None,
              help="Override the preset (shipped: ar, pld, racer-cpu, racer-paper; or ./configs/<name>.yaml).")
@click.option("--method", type=click.Choice([*METHODS, AUTO_METHOD]), default=None,
              help="Override decoding.method (auto: each route picks among decoding.auto_methods by measured "
              "tokens/s).")
@click.option("--capacity", default=None, help="Override decoding.capacity (integer or auto).")
@click.option("--max-new-tokens", type=int, default=None, help="Override generation.max_new_tokens.")
@click.option("--num-actors", default=None, help="Override resources.num_actors (integer or auto).")
@click.option("--streams-per-actor", default=None,
              help="Override resources.streams_per_actor: rows each actor decodes at once (1..64 or auto).")
@click.option("--shard-rows", type=int, default=None, help="Override output.shard_rows.")
@click.option("--priority", type=int, default=None, help="Override priority (0..9, 9 first).")
@click.option("--seed", type=int, default=None, help="Override seed.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override any key, e.g. decoding.ngram=8.")
@click.option("--executor", type=click.Choice(["ray", "thread"]), default="ray", show_default=True,
              help="With --local: Ray actors, or threads of this process.")
@click.option("--json", "as_json", is_flag=True, help="Print the final status as JSON (with --wait/--local).")
@_redis_options
def submit(spec_file: Optional[str], local: bool, wait: bool, job_id: Optional[str], sets: tuple[str, ...],
           executor: str, as_json: bool, redis_url: Optional[str], prefix: str, **flags: Any) -> None:
    """Validate a job and its input, queue it, print its id.

    SPEC is a job YAML (docs/service.md). Without it the flags say everything: --input is required, the
    output goes to out/<input file name> unless --output is given, and every other key takes its default
    (model smollm2-135m, RACER with the default decoding settings, 256 new tokens, greedy, shards of 64
    rows, the model's own chat template with no system prompt).
    """
    spec = _submit_spec(spec_file, sets=sets, flags=flags)
    with contextlib.ExitStack() as cleanup:  # stops what this command started, last first
        url = q.resolve_url(redis_url, spec.redis_url)
        if local:
            url = _ensure_redis(url, cleanup)
        queue = _queue(url, prefix)
        outcome = _queue_job(queue, spec, job_id=job_id)
        if not (local or wait):
            return
        if outcome.action == "already done":  # nothing queued: the finished job's own summary
            st = queue.status(outcome.job_id)
        elif local:
            # nothing left to run: the embedded worker only marks the job done, so no Ray to start
            kind = executor if outcome.shards_left else "thread"
            if kind == "ray":
                cleanup.callback(_shutdown_local_ray)
            st = _run_local(queue, outcome.job_id, url=url, prefix=prefix, executor=kind)
        else:
            st = _watch(queue, outcome.job_id)
        if as_json:
            click.echo(json.dumps(st.to_dict()))
        else:
            for line in summary_lines(st, prefix=prefix):
                err_console.print(line, highlight=False)
    if st.state != "done":
        sys.exit(ExitCode.JOB_FAILED)


def _submit_spec(spec_file: Optional[str], *, sets: tuple[str, ...], flags: dict[str, Any]) -> Any:
    """The JobSpec from SPEC (or none), ``--set KEY=VALUE`` and the override flags (flags beat --set beat the
    file); any error is a CliExit with exit 2 whose message names the flag or the file."""
    assert set(flags) == set(_OVERRIDE_FLAGS), f"submit flags without a spec key: {set(flags) ^ set(_OVERRIDE_FLAGS)}"
    if spec_file is None and flags["input_path"] is None:
        raise CliExit("without a SPEC file, --input is required (--output defaults to out/<input file name>)",
                      ExitCode.INPUT)
    if spec_file is None and flags["output_path"] is None:
        flags = dict(flags, output_path=os.path.join("out", _stem(flags["input_path"])))
    overrides, labels = _set_overrides(sets)
    for name, (flag, key) in _OVERRIDE_FLAGS.items():
        val = flags[name]
        if val is None:
            continue
        overrides[key] = _int(val, flag) if flag in _INT_OR_AUTO and val != "auto" else val
        labels[key] = flag
    try:
        return load_spec(spec_file, overrides, override_labels=labels)
    except SpecError as exc:
        raise CliExit(str(exc), ExitCode.INPUT) from None


def _set_overrides(sets: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    """``--set KEY=VALUE`` flags -> ({key: value}, {key: "--set KEY"}); a bad one is a CliExit (exit 2)."""
    overrides: dict[str, Any] = {}
    labels: dict[str, str] = {}
    try:
        for s in sets:
            k, v = parse_override(s)
            overrides[k] = v
            labels[k] = f"--set {k}"
    except SpecError as exc:
        raise CliExit(str(exc), ExitCode.INPUT) from None
    return overrides, labels


def _ensure_redis(url: str, cleanup: contextlib.ExitStack) -> str:
    """``submit --local``: the URL of a Redis that answers; a private redis-server (stopped by ``cleanup``) when
    none does at ``url``."""
    from racer_batch.service.execution.local import ensure_redis

    try:
        url, private = ensure_redis(url)
    except q.QueueUnavailable as exc:
        raise CliExit(str(exc), ExitCode.SERVICE) from None
    if private is not None:
        cleanup.callback(private.stop)
        err_console.print(f"no Redis answered; started a private redis-server at {q.redact_url(url)} "
                          "for this run (its state is dropped at the end; the output folder keeps the results)")
    return url


def _queue_job(queue: q.JobQueue, spec: Any, *, job_id: Optional[str]) -> Any:
    """Queue (or resume) the job; prints its id on stdout and what was planned on stderr."""
    from racer_batch.service.submit import submit_job

    try:
        outcome = submit_job(queue, spec, job_id=job_id)
    except (InputError, OutputError) as exc:
        raise CliExit(f"nothing queued: {exc}", ExitCode.INPUT) from None
    click.echo(outcome.job_id)
    kept = f", {plural(outcome.shards_kept, 'shard')} already done" if outcome.shards_kept else ""
    err_console.print(f"{outcome.action}: {plural(outcome.plan.num_rows, 'row')} in "
                      f"{plural(outcome.shards_total, 'shard')}{kept} -> {spec.output.path}", highlight=False)
    for note in outcome.notes:
        err_console.print(note, highlight=False)
    return outcome


def _stem(path: str) -> str:
    """``data/prompts.jsonl`` -> ``prompts``; a folder or glob -> its last plain name part."""
    name = os.path.basename(os.path.normpath(path.split("*", 1)[0])) or "job"
    return name.split(".", 1)[0] or "job"


def _int(v: str, flag: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise CliExit(f"{flag} must be an integer or auto, got {v!r}", ExitCode.INPUT) from None


def _shutdown_local_ray() -> None:
    from racer_batch.service.execution.local import shutdown_local_ray

    shutdown_local_ray()


def _run_local(queue: q.JobQueue, job_id: str, *, url: str, prefix: str, executor: str) -> q.JobStatus:
    from racer_batch.service.execution.local import init_local_ray, run_until_done

    if executor == "ray":
        err_console.print("starting local Ray ...")
        try:
            init_local_ray()
        except Exception as exc:  # noqa: BLE001 - Ray raises many types at start; all mean "unavailable"
            raise CliExit(f"cannot start local Ray: {exc}", ExitCode.SERVICE) from None
    st = queue.status(job_id)
    with JobProgress(job_id, st.rows_total) as prog:
        try:
            run_until_done(queue, job_id, url=url, prefix=prefix, executor_kind=executor,
                           on_tick=lambda: prog.update(queue.status(job_id)))
        except KeyboardInterrupt:
            raise CliExit(f"interrupted; job {job_id} handed back to the queue", ExitCode.INTERRUPTED) from None
        prog.update(queue.status(job_id), force=True)
    return queue.status(job_id)


# ---- read commands
@click.command(epilog=_STATUS_EPILOG)
@click.argument("job_id", metavar="JOB")
@click.option("--watch", is_flag=True, help="Show a progress bar until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@_redis_options
def status(job_id: str, watch: bool, as_json: bool, redis_url: Optional[str], prefix: str) -> None:
    """Counts, rows/s, ETA and per-route MAT of JOB."""
    queue = _queue(q.resolve_url(redis_url), prefix)
    try:
        st = _watch(queue, job_id) if watch else queue.status(job_id)
    except KeyError:
        raise _no_job(job_id, prefix) from None
    if as_json:
        click.echo(json.dumps(st.to_dict()))
    else:
        print_table(status_table(st, prefix=prefix))


@click.command("list", epilog=_LIST_EPILOG)
@click.option("--limit", type=click.IntRange(1, 10_000), default=20, show_default=True, help="Jobs to show.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list of job statuses.")
@_redis_options
def list_jobs(limit: int, as_json: bool, redis_url: Optional[str], prefix: str) -> None:
    """Recent jobs, newest first."""
    queue = _queue(q.resolve_url(redis_url), prefix)
    jobs = queue.list_jobs(limit)
    if as_json:
        click.echo(json.dumps([j.to_dict() for j in jobs]))
        return
    t = Table("name", "state", "rows", "errors", "MAT", "model/method", "output")
    t.columns.insert(0, Column("job", no_wrap=True, min_width=22))
    for j in jobs:
        t.add_row(j.job_id, j.name or "", j.state, f"{j.rows_done}/{j.rows_total}", str(j.totals.error),
                  fmt(j.mat), f"{j.model}/{j.method}", j.output or "")
    print_table(t)


@click.command(epilog=_JOB_EPILOG)
@click.argument("job_id", metavar="JOB")
@_redis_options
def cancel(job_id: str, redis_url: Optional[str], prefix: str) -> None:
    """Stop JOB at the next step boundary; finished shards are kept (re-submit resumes)."""
    queue = _queue(q.resolve_url(redis_url), prefix)
    try:
        state = queue.cancel(job_id)
    except KeyError:
        raise _no_job(job_id, prefix) from None
    click.echo(f"{job_id}: {state}")


@click.command(epilog=_JOB_EPILOG)
@click.argument("job_id", metavar="JOB")
@click.option("--limit", type=click.IntRange(1, 2000), default=20, show_default=True, help="Failed rows to show.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list of the failed rows.")
@_redis_options
def errors(job_id: str, limit: int, as_json: bool, redis_url: Optional[str], prefix: str) -> None:
    """A sample of JOB's failed rows (most recent last)."""
    queue = _queue(q.resolve_url(redis_url), prefix)
    try:
        queue.job_fields(job_id)
    except KeyError:
        raise _no_job(job_id, prefix) from None
    rows = queue.errors(job_id, limit)
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        err_console.print(f"job {job_id}: no failed rows")
        return
    t = Table("row", "id", "route", "error")
    for r in rows:
        t.add_row(str(r.get("row_idx")), str(r.get("id")), str(r.get("route")), str(r.get("error")))
    print_table(t)


# ---- worker
@click.command(epilog=_WORKER_EPILOG)
@click.option("--ray-address", default=None, help="Join this Ray cluster (default: start a local Ray).")
@click.option("--no-ray", is_flag=True, help="Run shards on threads of this process instead of Ray actors.")
@click.option("--num-cpus", type=int, default=None, help="CPUs for a local Ray (default: all).")
@click.option("--lease-s", type=click.FloatRange(2, 3600), default=30.0, show_default=True,
              help="Lease length: a job whose worker stops renewing is reclaimed after this long.")
@click.option("--max-jobs", type=int, default=None, help="Exit after this many jobs.")
@click.option("--idle-exit", type=float, default=None, help="Exit after this many seconds with nothing queued.")
@click.option("--name", default=None, help="Worker name (consumer name in the queue).")
@click.option("--actor-start-timeout", type=click.FloatRange(1, 3600), default=120.0, show_default=True,
              help="Seconds a started Ray actor may wait for a node with room before its shard is retried on "
                   "the others (the cluster shrank).")
@click.option("--allow-remote-code", is_flag=True, help="Allow jobs that set model.trust_remote_code.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, envvar="RACER_BATCH_METRICS_PORT",
              help="Serve Prometheus metrics on this port at /metrics (env RACER_BATCH_METRICS_PORT; off by default).")
@click.option("--metrics-host", default="0.0.0.0", show_default=True, help="Address the metrics endpoint binds.")
@_redis_options
def worker(ray_address: Optional[str], no_ray: bool, num_cpus: Optional[int], lease_s: float,
           max_jobs: Optional[int], idle_exit: Optional[float], name: Optional[str], actor_start_timeout: float,
           allow_remote_code: bool, metrics_port: Optional[int], metrics_host: str, redis_url: Optional[str],
           prefix: str) -> None:
    """Take jobs from the queue and run them on a pool of Ray actors (one per GPU, else one on the CPUs).

    With --ray-address the actors spread over the cluster's nodes (Ray's SPREAD strategy). A lost node's
    shards are retried on the nodes left; with no room left the job waits, its status line says so. When
    the head stops answering, the job in hand goes back to the queue and the worker exits (code 4)."""
    from racer_batch.service.execution.actors import ClusterLost
    from racer_batch.service.execution.local import init_local_ray, make_executor
    from racer_batch.service.execution.worker import Worker, worker_id

    url = q.resolve_url(redis_url)
    queue = _queue(url, prefix)
    name = name or worker_id()
    with contextlib.ExitStack() as cleanup:  # stops what this command started, last first
        if not no_ray:
            try:
                init_local_ray(address=ray_address, num_cpus=num_cpus)
            except Exception as exc:  # noqa: BLE001 - any Ray start/connect failure
                raise CliExit(f"cannot start or reach Ray: {exc}", ExitCode.SERVICE) from None
            cleanup.callback(_shutdown_local_ray)
        executor = make_executor("thread" if no_ray else "ray", url=url, prefix=prefix, name=name,
                                 allow_remote_code=allow_remote_code, actor_start_timeout_s=actor_start_timeout)
        if metrics_port is not None:
            executor = _metered(executor, cleanup, worker=name, port=metrics_port, host=metrics_host)
        cleanup.callback(executor.shutdown)
        # one line per job taken, shard committed and job ended, at every log level (stderr)
        w = Worker(queue, executor, name=name, lease_s=lease_s,
                   report=lambda line: err_console.print(f"{time.strftime('%H:%M:%S')} {line}", highlight=False))
        stopping = threading.Event()
        # SIGTERM (Kubernetes, systemd): stop taking jobs, hand the current one back to the queue at once.
        signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())
        err_console.print(f"worker {name} on {q.redact_url(url)} prefix {prefix!r}: waiting for jobs")
        try:
            n = w.run(max_jobs=max_jobs, idle_exit_s=idle_exit, stop=stopping.is_set)
        except KeyboardInterrupt:
            n = w.jobs_run
        except ClusterLost as exc:
            raise CliExit(f"worker {name}: {exc}; stopping after {w.jobs_run} job(s)", ExitCode.SERVICE) from None
    err_console.print(f"worker {name}: {n} job(s) run")


def _metered(executor: Any, cleanup: contextlib.ExitStack, *, worker: str, port: int, host: str) -> Any:
    """``worker --metrics-port``: serve Prometheus metrics (closed by ``cleanup``) and count through them."""
    from racer_batch.service.results.metrics import MeteredExecutor, WorkerMetrics

    metrics = WorkerMetrics(worker=worker)
    try:
        bound = metrics.serve(port, host=host)
    except OSError as exc:
        executor.shutdown()
        raise CliExit(f"cannot serve metrics on {host}:{port}: {exc}", ExitCode.SERVICE) from None
    cleanup.callback(metrics.close)
    err_console.print(f"metrics: http://{host}:{bound}/metrics")
    return MeteredExecutor(executor, metrics)


COMMANDS = (submit, status, list_jobs, cancel, errors, worker)


def register(group: click.Group) -> None:
    """Add the service commands to a click group (the top-level ``racer-batch`` one)."""
    for cmd in COMMANDS:
        group.add_command(cmd)
