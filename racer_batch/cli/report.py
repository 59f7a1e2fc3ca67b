"""Report commands of the ``racer-batch`` CLI: report, shadow, export.

``register(group)`` adds them to a click group (the top-level one). JOB_OR_OUTPUT is an output folder, or a
job id looked up in Redis (``--redis-url`` / ``--prefix`` as for the service commands). Flags become plain
arguments here and are handed to racer_batch.report, which never imports click. Exit codes: the table in
exit_codes.py; each command's --help lists its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click
from rich.console import Console

from racer_batch.report.load import ReportError, load_output, resolve_output
from racer_batch.service.execution import queue as q

from .exit_codes import CliExit, ExitCode, epilog
from .options import redis_options, set_torch_threads

_LOOKUP = (ExitCode.SERVICE, "Redis, to look up a job id")
_REPORT_EPILOG = epilog(ExitCode.OK, ExitCode.INTERNAL,
                        (ExitCode.INPUT, "unknown job id, not an output folder, unknown --by column, bad value"),
                        _LOOKUP, ExitCode.INTERRUPTED)
_SHADOW_EPILOG = epilog(ExitCode.OK, ExitCode.INTERNAL,
                        (ExitCode.INPUT, "unknown job id, not an output folder, bad baseline or value"),
                        (ExitCode.MODEL, "the job's model"), _LOOKUP, ExitCode.INTERRUPTED)
_EXPORT_EPILOG = epilog(ExitCode.OK, ExitCode.INTERNAL,
                        (ExitCode.INPUT, "unknown job id, not an output folder, bad value"),
                        _LOOKUP, ExitCode.INTERRUPTED)

err_console = Console(stderr=True, highlight=False, soft_wrap=True)

_redis_options = redis_options(
    url_help="Redis URL to look up a job id (default: REDIS_URL, then redis://127.0.0.1:6379/0).",
    prefix_help=", used to look up a job id.")


def _job_options(f):
    f = _redis_options(f)
    return click.argument("job", metavar="JOB_OR_OUTPUT")(f)


def _load(job: str, redis_url: Optional[str], prefix: str):
    """JOB_OR_OUTPUT -> the loaded output folder (racer_batch.report.load); exit 2 or 4 when it cannot be."""
    def queue() -> q.JobQueue:
        try:
            return q.JobQueue.from_url(q.resolve_url(redis_url), prefix=prefix)
        except q.QueueUnavailable as exc:
            raise CliExit(f"{job!r} is not a folder, and Redis is needed to look it up: {exc}",
                          ExitCode.SERVICE) from None

    try:
        return load_output(resolve_output(job, queue=queue))
    except ReportError as exc:
        raise CliExit(str(exc), ExitCode.INPUT) from None


@click.command(epilog=_REPORT_EPILOG)
@_job_options
@click.option("--by", default="route", show_default=True,
              help="Output column to group rows by (route, model, method, worker, ...).")
@click.option("--price-per-gpu-hour", "price", type=click.FloatRange(0), default=None,
              help="Price of one device-hour (a GPU; one CPU actor on CPU-only jobs) for cost per million tokens.")
@click.option("--format", "formats", type=click.Choice(["md", "html", "json"]), multiple=True,
              help="Output format(s), repeatable (default: all three).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for the report and its PNG charts (default: <output folder>/_report).")
@click.option("--title", default=None, help="Report title (default: the job's name and id).")
def report(job: str, redis_url: Optional[str], prefix: str, by: str, price: Optional[float],
           formats: tuple[str, ...], out_dir: Optional[str], title: Optional[str]) -> None:
    """Per-route rows, tokens, time, MAT, acceptance, cost and (from shadow rows) speedup, with charts."""
    from racer_batch.report.build import build_report, write_report

    data = _load(job, redis_url, prefix)
    if by not in data.rows.column_names:
        raise CliExit(f"--by {by!r}: not an output column (columns: {', '.join(data.rows.column_names)})",
                      ExitCode.INPUT)
    rep = build_report(data, by=by, price_per_device_hour=price, title=title)
    out = Path(out_dir) if out_dir else data.out_dir / "_report"
    written = write_report(rep, out, formats=formats or ("md", "html", "json"))
    for line in rep.summary_lines():
        err_console.print(line)
    for p in written:
        click.echo(str(p))


@click.command(epilog=_SHADOW_EPILOG)
@_job_options
@click.option("--baseline", required=True,
              help="Baseline preset (shipped: ar, pld, racer-cpu, racer-paper; or ./configs/<name>.yaml) "
                   "or a YAML path.")
@click.option("--fraction", type=click.FloatRange(0, 1, min_open=True), default=0.05, show_default=True,
              help="Share of rows to shadow (hash of seed and row id; the spec's shadow: rule).")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Sampling seed.")
@click.option("--max-rows", type=click.IntRange(1), default=None, help="Stop after this many sampled rows.")
@click.option("--device", default=None, help="Device for the model (default: the model loader's choice).")
@click.option("--torch-threads", type=click.IntRange(1, 512), default=1, show_default=True,
              help="Intra-op torch threads (one is fastest for the small default model on shared CPUs).")
def shadow(job: str, redis_url: Optional[str], prefix: str, baseline: str, fraction: float, seed: int,
           max_rows: Optional[int], device: Optional[str], torch_threads: int) -> None:
    """Re-run a sample of a finished job's rows with its config and with BASELINE, interleaved, here."""
    from racer_batch.models import ModelLoadError
    from racer_batch.report.shadow import analyze
    from racer_batch.report.shadow_run import run_posthoc_shadow

    data = _load(job, redis_url, prefix)
    set_torch_threads(torch_threads)

    def on_row(i: int, n: int, rid: str) -> None:
        err_console.print(f"  shadowed {i}/{n}: {rid}")

    try:
        path, n = run_posthoc_shadow(data, baseline=baseline, fraction=fraction, seed=seed, max_rows=max_rows,
                                     device=device, on_row=on_row)
    except ReportError as exc:
        raise CliExit(str(exc), ExitCode.INPUT) from None
    except ModelLoadError as exc:
        raise CliExit(f"cannot load the job's model: {exc}", ExitCode.MODEL) from None
    import pyarrow.parquet as pq

    job_rows = {r["row_idx"]: r for r in data.rows.to_pylist()}
    for res in analyze(pq.read_table(path).to_pylist(), job_rows=job_rows, decoding=data.spec.get("decoding")):
        d = res.to_dict()
        ci = d["speed_ratio_ci95"]
        cap = d["capability"]
        acc = ""
        if cap and cap["method"]["scored"]:
            acc = (f", accuracy {_pct(cap['method']['accuracy'])} vs {_pct(cap['baseline']['accuracy'])}"
                   f" ({cap['method']['scored']} scored turns)")
        err_console.print(
            f"{d['route']}: {d['pairs_ok']} pairs, greedy exact match "
            f"{_pct(d['greedy_exact_match_rate'])}, speed ratio {_num(d['speed_ratio'])}x"
            + (f" (95% CI {ci[0]:.2f}-{ci[1]:.2f})" if ci else "")
            + f", MAT {_num(d['mat_method'])} vs {_num(d['mat_baseline'])}" + acc
            + (f"; relaxed acceptance ({d['acceptance_rule']}): outputs differ by design" if d["relaxed"] else ""))
    click.echo(str(path))


@click.command(epilog=_EXPORT_EPILOG)
@_job_options
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet"]), default="jsonl", show_default=True)
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="File to write (default: <output folder>/_chat.jsonl or _chat.parquet).")
@click.option("--all-status", is_flag=True, help="Also export failed and cancelled rows (default: status ok only).")
def export(job: str, redis_url: Optional[str], prefix: str, fmt: str, out_path: Optional[str],
           all_status: bool) -> None:
    """Export the answers as chat records: the input messages plus the assistant turn(s), one per sample."""
    from racer_batch.report.export import export_chat

    data = _load(job, redis_url, prefix)
    out = Path(out_path) if out_path else data.out_dir / f"_chat.{fmt}"
    try:
        n, skipped = export_chat(data, out, fmt=fmt, only_ok=not all_status)
    except ReportError as exc:
        raise CliExit(str(exc), ExitCode.INPUT) from None
    err_console.print(f"{n} chat records written ({skipped} rows or samples skipped: not ok)")
    click.echo(str(out))


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _num(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


COMMANDS = (report, shadow, export)


def register(group: click.Group) -> None:
    """Add the report commands to a click group (the top-level ``racer-batch`` one)."""
    for cmd in COMMANDS:
        group.add_command(cmd)
