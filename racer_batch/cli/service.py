"""Service commands of the ``racer-batch`` CLI: submit, status, list, cancel, errors, worker.

``register(main)`` adds them to the top-level click group (racer_batch/cli.py). Flags become a JobSpec /
plain arguments here and are handed to racer_batch.service, which never imports click.

Exit codes (same numbers as the main CLI; each command's --help lists only its own): 0 success; 2 invalid
spec, flag or input (nothing queued), or no such job; 4 Redis or Ray unreachable; 5 the job ended failed or
cancelled (submit --wait); 1 anything unexpected.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Optional

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Column, Table

from racer_batch.service import queue as q
from racer_batch.service.inputs import InputError
from racer_batch.service.output import OutputError
from racer_batch.service.spec import SpecError, load_spec, parse_override
from racer_batch.types import METHODS

EXIT_OK, EXIT_INTERNAL, EXIT_INPUT, EXIT_SERVICE, EXIT_JOB_FAILED = 0, 1, 2, 4, 5
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it
PREFIX_ENV = "RACER_BATCH_PREFIX"
PLAIN_PROGRESS_S = 10.0  # without a terminal: one progress line at most this often

_EPILOG = """\b
Exit codes:
  0  success
  2  invalid job spec, flag or input (nothing queued)
  4  Redis or Ray unreachable
  5  the job ended failed or cancelled (with --wait)
  130  interrupted (Ctrl-C); a --local job goes back to the queue
"""

_STATUS_EPILOG = """\b
Exit codes:
  0  success
  2  no such job
  4  Redis unreachable
  130  interrupted (Ctrl-C) while watching; the job goes on
"""

_JOB_EPILOG = """\b
Exit codes:
  0  success
  2  no such job
  4  Redis unreachable
"""

_LIST_EPILOG = """\b
Exit codes:
  0  success
  4  Redis unreachable
"""

_WORKER_EPILOG = """\b
Exit codes:
  0  stopped after --max-jobs, --idle-exit, SIGTERM or Ctrl-C (the current job goes back to the queue)
  4  Redis or Ray unreachable, or the metrics port cannot be bound
"""

err_console = Console(stderr=True, soft_wrap=True)
out_console = Console()


class ServiceExit(click.ClickException):
    """A clean one-line error with a documented exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.exit_code = code


def _redis_options(f):
    f = click.option("--prefix", envvar=PREFIX_ENV, default=q.DEFAULT_PREFIX, show_default=True,
                     help=f"Redis key prefix (env {PREFIX_ENV}); separates deployments sharing one Redis.")(f)
    f = click.option("--redis-url", default=None,
                     help="Redis URL (redis://[:password@]host:port/db, rediss:// for TLS); default: the "
                          "spec's redis_url, then REDIS_URL, then redis://127.0.0.1:6379/0.")(f)
    return f


def _queue(url: str, prefix: str) -> q.JobQueue:
    try:
        return q.JobQueue.from_url(url, prefix=prefix)
    except q.QueueUnavailable as exc:
        raise ServiceExit(str(exc), EXIT_SERVICE) from None


# ---- rendering
def _fmt(v: Optional[float], spec: str = ".2f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _eta(s: Optional[float]) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def status_table(st: q.JobStatus) -> Table:
    t = Table(title=f"job {st.job_id}" + (f" ({st.name})" if st.name else ""), show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("state", st.state + (f"  ({st.message})" if st.message else ""))
    if st.stalled:
        t.add_row("owner", st.stall_note)
    t.add_row("model / method", f"{st.model} / {st.method}")
    t.add_row("rows", f"{st.rows_done}/{st.rows_total}  ok {st.totals.ok}  error {st.totals.error}  "
                      f"cancelled {st.cancelled_rows}")
    if st.totals.error:
        t.add_row("errors", f"racer-batch errors {st.job_id}")
    t.add_row("shards", f"{st.shards_done}/{st.shards_total}")
    t.add_row("output tokens", f"{st.totals.output_tokens}  (steps {st.totals.steps}, MAT {_fmt(st.mat)})")
    t.add_row("throughput", f"{st.rows_per_s:.2f} rows/s, {st.tokens_per_s:.1f} tokens/s, "
                            f"elapsed {_eta(st.elapsed_s)}, ETA {_eta(st.eta_s)}")
    for route, r in st.route_mat().items():
        t.add_row(f"route {route}", f"rows {r['rows']}, tokens {r['output_tokens']}, MAT {_fmt(r['mat'])}")
    if st.output:
        t.add_row("output", st.output)
    return t


def summary_lines(st: q.JobStatus) -> list[str]:
    gen_s = st.totals.gen_ms / 1000.0
    resumed = f", {st.base_rows} done before this run" if st.base_rows else ""
    lines = [
        f"job {st.job_id}: {st.state}" + (f" ({st.message})" if st.message else ""),
        f"rows: {st.rows_done}/{st.rows_total} (ok {st.totals.ok}, error {st.totals.error}, "
        f"cancelled {st.cancelled_rows}{resumed})",
        f"tokens: {st.totals.output_tokens} output tokens in {st.totals.steps} steps, MAT {_fmt(st.mat)}",
        f"speed: {st.tokens_per_s:.1f} tokens/s over this run's wall time ({st.elapsed_s:.1f} s, start-up included); "
        f"{(st.totals.output_tokens / gen_s) if gen_s > 0 else 0:.1f} tokens/s while generating",
    ]
    for route, r in st.route_mat().items():
        lines.append(f"  route {route}: {r['rows']} rows, {r['output_tokens']} tokens, MAT {_fmt(r['mat'])}")
    if st.totals.error:
        lines.append(f"errors: {_n(st.totals.error, 'row')} failed; see them with: racer-batch errors {st.job_id}")
    lines.append(f"output: {st.output}")
    return lines


def _print_table(t: Table) -> None:
    """A table on stdout; in a pipe or a file at its full width, never cut at 80 columns."""
    if out_console.is_terminal:
        out_console.print(t)
    else:
        Console(width=100_000).print(t, soft_wrap=False)


def _n(count: int, noun: str) -> str:
    """``_n(1, "shard")`` -> "1 shard", ``_n(3, "shard")`` -> "3 shards"."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), console=err_console)


class _JobProgress:
    """A rich progress bar on a terminal; plain lines (at most one per PLAIN_PROGRESS_S, and the last one) in a
    log or pipe, where a live bar would print nothing until the end."""

    def __init__(self, job_id: str, total: int, *, plain: Optional[bool] = None) -> None:
        self.job_id = job_id
        self.total = total
        self.plain = (not err_console.is_terminal) if plain is None else plain
        self._prog: Optional[Progress] = None
        self._last_line = -1.0
        self._last_text = ""

    def __enter__(self) -> "_JobProgress":
        if not self.plain:
            self._prog = _progress().__enter__()
            self._task = self._prog.add_task(self.job_id, total=self.total, info="")
        return self

    def update(self, st: q.JobStatus, *, force: bool = False) -> None:
        if self._prog is not None:
            self._prog.update(self._task, completed=st.rows_done, info=_progress_info(st))
            return
        text = f"{self.job_id}: {st.rows_done}/{st.rows_total} rows  {_progress_info(st)}"
        now = time.monotonic()
        if (force and text != self._last_text) or now - self._last_line >= PLAIN_PROGRESS_S:
            err_console.print(text, highlight=False, soft_wrap=True)
            self._last_line, self._last_text = now, text

    def __exit__(self, *exc: Any) -> None:
        if self._prog is not None:
            self._prog.__exit__(*exc)


def _progress_info(st: q.JobStatus) -> str:
    if st.stalled:
        return f"{st.state}  {st.stall_note}"
    return (f"{st.state}  MAT {_fmt(st.mat)}  {st.rows_per_s:.2f} rows/s  {st.tokens_per_s:.1f} tok/s  "
            f"ETA {_eta(st.eta_s)}")


def _watch(queue: q.JobQueue, job_id: str, *, interval_s: float = 1.0) -> q.JobStatus:
    """Progress bar until the job ends; returns the final status."""
    st = queue.status(job_id)
    with _JobProgress(job_id, st.rows_total) as prog:
        try:
            while True:
                st = queue.status(job_id)
                done = st.state in q.TERMINAL
                prog.update(st, force=done)
                if done:
                    return st
                time.sleep(interval_s)
        except KeyboardInterrupt:
            raise ServiceExit(f"interrupted; job {job_id} goes on (racer-batch status {job_id})",
                              EXIT_INTERRUPTED) from None


# ---- commands
_FLAG_KEYS = (("--input", "input.path"), ("--output", "output.path"), ("--model", "model.name"),
              ("--preset", "preset"), ("--method", "decoding.method"), ("--capacity", "decoding.capacity"),
              ("--max-new-tokens", "generation.max_new_tokens"), ("--num-actors", "resources.num_actors"),
              ("--shard-rows", "output.shard_rows"), ("--priority", "priority"), ("--seed", "seed"))


@click.command(epilog=_EPILOG)
@click.argument("spec_file", metavar="[SPEC]", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--local", is_flag=True, help="Run the job here: local Ray + Redis (private redis-server if none).")
@click.option("--wait", is_flag=True, help="Wait for the job to end and print a summary (implied by --local).")
@click.option("--job-id", default=None, help="Re-run this job id (resume).")
@click.option("--input", "input_path", default=None, help="Override input.path (required without SPEC).")
@click.option("--output", "output_path", default=None,
              help="Override output.path (without SPEC: default out/<input file name without extension>).")
@click.option("--model", default=None, help="Override model.name.")
@click.option("--preset", default=None, help="Override the preset (configs/<name>.yaml).")
@click.option("--method", type=click.Choice(METHODS), default=None, help="Override decoding.method.")
@click.option("--capacity", default=None, help="Override decoding.capacity (integer or auto).")
@click.option("--max-new-tokens", type=int, default=None, help="Override generation.max_new_tokens.")
@click.option("--num-actors", default=None, help="Override resources.num_actors (integer or auto).")
@click.option("--shard-rows", type=int, default=None, help="Override output.shard_rows.")
@click.option("--priority", type=int, default=None, help="Override priority (0..9, 9 first).")
@click.option("--seed", type=int, default=None, help="Override seed.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override any key, e.g. decoding.ngram=8.")
@click.option("--executor", type=click.Choice(["ray", "thread"]), default="ray", show_default=True,
              help="With --local: Ray actors, or threads of this process.")
@click.option("--json", "as_json", is_flag=True, help="Print the final status as JSON (with --wait/--local).")
@_redis_options
def submit(spec_file: Optional[str], local: bool, wait: bool, job_id: Optional[str], input_path: Optional[str],
           output_path: Optional[str], model: Optional[str], preset: Optional[str], method: Optional[str],
           capacity: Optional[str], max_new_tokens: Optional[int], num_actors: Optional[str],
           shard_rows: Optional[int], priority: Optional[int], seed: Optional[int], sets: tuple[str, ...],
           executor: str, as_json: bool, redis_url: Optional[str], prefix: str) -> None:
    """Validate a job and its input, queue it, print its id.

    SPEC is a job YAML (docs/service.md). Without it the flags say everything: --input is required, the
    output goes to out/<input file name> unless --output is given, and every other key takes its default
    (model smollm2-135m, RACER with the default decoding settings, 256 new tokens, greedy, shards of 64
    rows, the model's own chat template with no system prompt).
    """
    if spec_file is None and input_path is None:
        raise ServiceExit("without a SPEC file, --input is required (--output defaults to "
                          "out/<input file name>)", EXIT_INPUT)
    if spec_file is None and output_path is None:
        output_path = os.path.join("out", _stem(input_path))
    overrides: dict[str, Any] = {}
    labels: dict[str, str] = {}
    try:
        for s in sets:
            k, v = parse_override(s)
            overrides[k] = v
            labels[k] = f"--set {k}"
    except SpecError as exc:
        raise ServiceExit(str(exc), EXIT_INPUT) from None
    values = dict(zip((f for f, _ in _FLAG_KEYS), (input_path, output_path, model, preset, method, capacity,
                                                     max_new_tokens, num_actors, shard_rows, priority, seed)))
    for flag, key in _FLAG_KEYS:
        val = values[flag]
        if val is None:
            continue
        if flag in ("--capacity", "--num-actors") and val != "auto":
            val = _int(val, flag)
        overrides[key] = val
        labels[key] = flag
    from racer_batch.service.submit import submit_job

    try:
        spec = load_spec(spec_file, overrides, override_labels=labels)
    except SpecError as exc:
        raise ServiceExit(str(exc), EXIT_INPUT) from None
    url = q.resolve_url(redis_url, spec.redis_url)
    private = None
    ray_started = False
    if local:
        from racer_batch.service.local import ensure_redis

        try:
            url, private = ensure_redis(url)
        except q.QueueUnavailable as exc:
            raise ServiceExit(str(exc), EXIT_SERVICE) from None
        if private is not None:
            err_console.print(f"no Redis answered; started a private redis-server at {q.redact_url(url)} "
                              "for this run (its state is dropped at the end; the output folder keeps the results)")
    try:
        queue = _queue(url, prefix)
        try:
            outcome = submit_job(queue, spec, job_id=job_id)
        except (InputError, OutputError) as exc:
            raise ServiceExit(f"nothing queued: {exc}", EXIT_INPUT) from None
        click.echo(outcome.job_id)
        kept = f", {outcome.shards_kept} already done" if outcome.shards_kept else ""
        err_console.print(f"{outcome.action}: {outcome.plan.num_rows} rows in "
                          f"{_n(outcome.shards_total, 'shard')}{kept} -> {spec.output.path}", highlight=False)
        for note in outcome.notes:
            err_console.print(note, highlight=False)
        if not (local or wait):
            return
        if local:
            # nothing left to run: the embedded worker only marks the job done, so no Ray to start
            kind = executor if outcome.shards_left else "thread"
            ray_started = kind == "ray"
            st = _run_local(queue, outcome.job_id, url=url, prefix=prefix, executor=kind)
        else:
            st = _watch(queue, outcome.job_id)
        if as_json:
            click.echo(json.dumps(st.to_dict()))
        else:
            for line in summary_lines(st):
                err_console.print(line, highlight=False)
        if st.state != "done":
            sys.exit(EXIT_JOB_FAILED)
    finally:
        if ray_started:
            from racer_batch.service.local import shutdown_local_ray

            shutdown_local_ray()
        if private is not None:
            private.stop()


def _stem(path: str) -> str:
    """``data/prompts.jsonl`` -> ``prompts``; a folder or glob -> its last plain name part."""
    name = os.path.basename(os.path.normpath(path.split("*", 1)[0])) or "job"
    return name.split(".", 1)[0] or "job"


def _int(v: str, flag: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise ServiceExit(f"{flag} must be an integer or auto, got {v!r}", EXIT_INPUT) from None


def _run_local(queue: q.JobQueue, job_id: str, *, url: str, prefix: str, executor: str) -> q.JobStatus:
    from racer_batch.service.local import init_local_ray, run_until_done

    if executor == "ray":
        err_console.print("starting local Ray ...")
        try:
            init_local_ray()
        except Exception as exc:  # noqa: BLE001 - Ray raises many types at start; all mean "unavailable"
            raise ServiceExit(f"cannot start local Ray: {exc}", EXIT_SERVICE) from None
    st = queue.status(job_id)
    with _JobProgress(job_id, st.rows_total) as prog:
        try:
            run_until_done(queue, job_id, url=url, prefix=prefix, executor_kind=executor,
                           on_tick=lambda: prog.update(queue.status(job_id)))
        except KeyboardInterrupt:
            raise ServiceExit(f"interrupted; job {job_id} handed back to the queue", EXIT_INTERRUPTED) from None
        prog.update(queue.status(job_id), force=True)
    return queue.status(job_id)


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
        raise ServiceExit(f"no job {job_id!r} (prefix {prefix!r})", EXIT_INPUT) from None
    if as_json:
        click.echo(json.dumps(st.to_dict()))
    else:
        _print_table(status_table(st))


@click.command("list", epilog=_LIST_EPILOG)
@click.option("--limit", type=click.IntRange(1, 10_000), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
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
                  _fmt(j.mat), f"{j.model}/{j.method}", j.output or "")
    _print_table(t)


@click.command(epilog=_JOB_EPILOG)
@click.argument("job_id", metavar="JOB")
@_redis_options
def cancel(job_id: str, redis_url: Optional[str], prefix: str) -> None:
    """Stop JOB at the next step boundary; finished shards are kept (re-submit resumes)."""
    queue = _queue(q.resolve_url(redis_url), prefix)
    try:
        state = queue.cancel(job_id)
    except KeyError:
        raise ServiceExit(f"no job {job_id!r} (prefix {prefix!r})", EXIT_INPUT) from None
    click.echo(f"{job_id}: {state}")


@click.command(epilog=_JOB_EPILOG)
@click.argument("job_id", metavar="JOB")
@click.option("--limit", type=click.IntRange(1, 2000), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@_redis_options
def errors(job_id: str, limit: int, as_json: bool, redis_url: Optional[str], prefix: str) -> None:
    """A sample of JOB's failed rows (most recent last)."""
    queue = _queue(q.resolve_url(redis_url), prefix)
    try:
        queue.job_fields(job_id)
    except KeyError:
        raise ServiceExit(f"no job {job_id!r} (prefix {prefix!r})", EXIT_INPUT) from None
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
    _print_table(t)


@click.command(epilog=_WORKER_EPILOG)
@click.option("--ray-address", default=None, help="Join this Ray cluster (default: start a local Ray).")
@click.option("--no-ray", is_flag=True, help="Run shards on threads of this process instead of Ray actors.")
@click.option("--num-cpus", type=int, default=None, help="CPUs for a local Ray (default: all).")
@click.option("--lease-s", type=click.FloatRange(2, 3600), default=30.0, show_default=True,
              help="Lease length: a job whose worker stops renewing is reclaimed after this long.")
@click.option("--max-jobs", type=int, default=None, help="Exit after this many jobs.")
@click.option("--idle-exit", type=float, default=None, help="Exit after this many seconds with nothing queued.")
@click.option("--name", default=None, help="Worker name (consumer name in the queue).")
@click.option("--allow-remote-code", is_flag=True, help="Allow jobs that set model.trust_remote_code.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, envvar="RACER_BATCH_METRICS_PORT",
              help="Serve Prometheus metrics on this port at /metrics (env RACER_BATCH_METRICS_PORT; off by default).")
@click.option("--metrics-host", default="0.0.0.0", show_default=True, help="Address the metrics endpoint binds.")
@_redis_options
def worker(ray_address: Optional[str], no_ray: bool, num_cpus: Optional[int], lease_s: float,
           max_jobs: Optional[int], idle_exit: Optional[float], name: Optional[str], allow_remote_code: bool,
           metrics_port: Optional[int], metrics_host: str, redis_url: Optional[str], prefix: str) -> None:
    """Take jobs from the queue and run them on a pool of Ray actors (one per GPU, else one on the CPUs)."""
    from racer_batch.service.local import init_local_ray, make_executor
    from racer_batch.service.worker import Worker, worker_id

    url = q.resolve_url(redis_url)
    queue = _queue(url, prefix)
    name = name or worker_id()
    if not no_ray:
        try:
            init_local_ray(address=ray_address, num_cpus=num_cpus)
        except Exception as exc:  # noqa: BLE001 - any Ray start/connect failure
            raise ServiceExit(f"cannot start or reach Ray: {exc}", EXIT_SERVICE) from None
    executor = make_executor("thread" if no_ray else "ray", url=url, prefix=prefix, name=name,
                             allow_remote_code=allow_remote_code)
    metrics = None
    if metrics_port is not None:
        from racer_batch.service.metrics import MeteredExecutor, WorkerMetrics

        metrics = WorkerMetrics(worker=name)
        try:
            bound = metrics.serve(metrics_port, host=metrics_host)
        except OSError as exc:
            executor.shutdown()
            raise ServiceExit(f"cannot serve metrics on {metrics_host}:{metrics_port}: {exc}", EXIT_SERVICE) from None
        executor = MeteredExecutor(executor, metrics)
        err_console.print(f"metrics: http://{metrics_host}:{bound}/metrics")
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
    finally:
        executor.shutdown()
        if metrics is not None:
            metrics.close()
        if not no_ray:
            from racer_batch.service.local import shutdown_local_ray

            shutdown_local_ray()
    err_console.print(f"worker {name}: {n} job(s) run")


COMMANDS = (submit, status, list_jobs, cancel, errors, worker)


def register(main: click.Group) -> None:
    """Add the service commands to the top-level ``racer-batch`` group."""
    for cmd in COMMANDS:
        main.add_command(cmd)


@click.group()
@click.option("--log-level", default="warning", type=click.Choice(["debug", "info", "warning", "error"]))
def standalone(log_level: str) -> None:
    """The service commands alone (``python -m racer_batch.cli_service``)."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")


register(standalone)

if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    standalone()
