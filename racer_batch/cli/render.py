"""What the service commands print: the status table, the end-of-job summary, progress lines and tables.

Results go to stdout (``out_console``, plain ``click.echo``); messages and progress go to stderr
(``err_console``), so a script can capture a job id or ``--json`` output alone.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from racer_batch.service.execution import queue as q
from racer_batch.service.execution.queue import plural
from racer_batch.service.execution.worker import errors_command

PLAIN_PROGRESS_S = 10.0  # without a terminal: one progress line at most this often

err_console = Console(stderr=True, soft_wrap=True)
out_console = Console()


def fmt(v: Optional[float], spec: str = ".2f", none: str = "-") -> str:
    """``fmt(2.345)`` -> "2.35", ``fmt(None)`` -> "-"."""
    return none if v is None else format(v, spec)


def eta(s: Optional[float]) -> str:
    """Seconds -> ``H:MM:SS`` (``eta(3725)`` -> "1:02:05"); None -> "-"."""
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def status_table(st: q.JobStatus, *, prefix: str = q.DEFAULT_PREFIX) -> Table:
    """``racer-batch status JOB``: one row per fact (state, owner, rows, shards, tokens, speed, routes)."""
    t = Table(title=f"job {st.job_id}" + (f" ({st.name})" if st.name else ""), show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("state", st.state + (f"  ({st.message})" if st.message else ""))
    if st.stalled:
        t.add_row("owner", st.stall_note)
        if st.lost_note:
            t.add_row("rows lost", st.lost_note)
    t.add_row("model / method", f"{st.model} / {st.method}")
    t.add_row("rows", f"{st.rows_done}/{st.rows_total}  ok {st.totals.ok}  error {st.totals.error}  "
                      f"cancelled {st.cancelled_rows}")
    if st.totals.error:
        t.add_row("errors", errors_command(st.job_id, prefix))
    t.add_row("shards", f"{st.shards_done}/{st.shards_total}")
    if st.fault_note:
        t.add_row("faults", st.fault_note)
    t.add_row("output tokens", f"{st.totals.output_tokens}  (steps {st.totals.steps}, MAT {fmt(st.mat)})")
    t.add_row("throughput", _waiting(st) or _rate(st))
    for route, r in st.route_mat().items():
        t.add_row(f"route {route}", f"rows {r['rows']}, tokens {r['output_tokens']}, MAT {fmt(r['mat'])}")
    if st.output:
        t.add_row("output", st.output)
    return t


def _rate(st: q.JobStatus) -> str:
    """status's throughput line of a job a run is working on; a stalled one shows no rate (it only falls)."""
    if st.stalled:
        return f"stalled: no progress counted until another worker takes the job (elapsed {eta(st.elapsed_s)})"
    return (f"{st.rows_per_s:.2f} rows/s, {st.tokens_per_s:.1f} tokens/s, elapsed {eta(st.elapsed_s)}, "
            f"ETA {eta(st.eta_s)}")


def summary_lines(st: q.JobStatus, *, prefix: str = q.DEFAULT_PREFIX) -> list[str]:
    """The end-of-job summary of ``submit --wait`` / ``--local`` (stderr), one string per line."""
    gen_s = (st.totals.device_ms or st.totals.gen_ms) / 1000.0  # rows sharing forwards count their share
    resumed = f", {st.base_rows} done before this run" if st.base_rows else ""
    if st.base_rows and st.totals.output_tokens <= st.base_tokens:  # every shard was kept: nothing to time
        speed = "speed: nothing generated in this run (every row was kept from earlier runs)"
    else:
        speed = (f"speed: {st.tokens_per_s:.1f} tokens/s over this run's wall time ({st.elapsed_s:.1f} s, start-up "
                 f"included); {(st.totals.output_tokens / gen_s) if gen_s > 0 else 0:.1f} tokens/s while generating"
                 + (" (all runs)" if st.base_tokens else ""))
    lines = [
        f"job {st.job_id}: {st.state}" + (f" ({st.message})" if st.message else ""),
        f"rows: {st.rows_done}/{st.rows_total} (ok {st.totals.ok}, error {st.totals.error}, "
        f"cancelled {st.cancelled_rows}{resumed})",
        f"tokens: {st.totals.output_tokens} output tokens in {st.totals.steps} steps, MAT {fmt(st.mat)}",
        speed,
    ]
    for route, r in st.route_mat().items():
        lines.append(f"  route {route}: {r['rows']} rows, {r['output_tokens']} tokens, MAT {fmt(r['mat'])}")
    if st.totals.error:
        lines.append(f"errors: {plural(st.totals.error, 'row')} failed; "
                     f"see them with: {errors_command(st.job_id, prefix)}")
    lines.append(f"output: {st.output}")
    return lines


def print_table(t: Table) -> None:
    """A table on stdout; in a pipe or a file at its full width, never cut at 80 columns."""
    if out_console.is_terminal:
        out_console.print(t)
    else:
        Console(width=100_000).print(t, soft_wrap=False)


def _waiting(st: q.JobStatus) -> Optional[str]:
    """``not running (queued; 6 rows committed by earlier runs)`` for a job no run is working on (never started,
    or handed back to the queue: its run's clock was reset), where rows/s and the elapsed time would read 0."""
    if st.state != "queued" and st.started_at:
        return None
    done = f"; {plural(st.rows_done, 'row')} committed by earlier runs" if st.rows_done else ""
    return f"not running ({st.state}{done})"


def _progress_info(st: q.JobStatus) -> str:
    if st.stalled:
        return f"{st.state}  {st.stall_note}"
    if waiting := _waiting(st):
        return waiting
    return (f"{st.state}  MAT {fmt(st.mat)}  {st.rows_per_s:.2f} rows/s  {st.tokens_per_s:.1f} tok/s  "
            f"ETA {eta(st.eta_s)}")


class JobProgress:
    """A rich progress bar on a terminal; plain lines (at most one per PLAIN_PROGRESS_S, and the last one) in a
    log or pipe, where a live bar would print nothing until the end."""

    def __init__(self, job_id: str, total: int, *, plain: Optional[bool] = None) -> None:
        self.job_id = job_id
        self.total = total
        self.plain = (not err_console.is_terminal) if plain is None else plain
        self._prog: Optional[Progress] = None
        self._last_line = -1.0
        self._last_text = ""

    def __enter__(self) -> "JobProgress":
        if not self.plain:
            self._prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[info]}"), console=err_console).__enter__()
            self._task = self._prog.add_task(self.job_id, total=self.total, info="")
        return self

    def update(self, st: q.JobStatus, *, force: bool = False) -> None:
        """Show ``st``; plain mode prints when PLAIN_PROGRESS_S passed, or on ``force`` if the line changed."""
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
