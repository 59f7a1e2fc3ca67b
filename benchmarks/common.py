"""What every benchmark module shares: the machine, results files, the Markdown writer, prompt sampling, small
statistics and the two-revision child processes (``host`` and ``kernel_ab`` time two git revisions of
``racer_batch`` in alternating processes).

Imports of ``racer_batch`` happen inside the functions: a child process runs one of these modules against an
older revision's package, which need not have everything the current one has.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks"
RESULT_PREFIX = "RESULT "


# ---- machine and results files --------------------------------------------------------------------------------
def machine() -> dict:
    """The CPU (model name, family/model, ISA), cores, load, Python and torch: ``racer_batch.bench.machine``."""
    from racer_batch.bench import machine as product_machine

    return product_machine()


def machine_line(m: Optional[Mapping[str, Any]] = None) -> str:
    """One line naming the machine for a Markdown header: ``racer_batch.bench.machine_line``."""
    from racer_batch.bench import machine_line as product_machine_line

    return product_machine_line(dict(m or machine()))


def stamp() -> str:
    """A results file's time stamp: ``YYYYmmdd-HHMMSS`` (local time)."""
    return time.strftime("%Y%m%d-%H%M%S")


def write_results(out_dir: Path | str, name: str, data: Mapping[str, Any], md: str) -> tuple[Path, Path]:
    """Write ``<out_dir>/<name>.json`` (``data``, indented, with ``code_revision``: :func:`revision`) and
    ``<name>.md`` (``md``); returns both paths.

    A module that rewrites its files as it goes (a long run stopped midway keeps what it measured) calls this
    again with the same ``name``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out / f"{name}.json", out / f"{name}.md"
    data = {"code_revision": revision(), **data}  # which code was measured (a results file's own key wins)
    jpath.write_text(json.dumps(data, indent=1, default=str) + "\n")
    mpath.write_text(md.rstrip("\n") + "\n")
    return jpath, mpath


def md_table(head: Sequence[str], body: Iterable[Sequence[Any]]) -> str:
    """The one Markdown table writer (``racer_batch.report.markdown.md_table``)."""
    from racer_batch.report.markdown import md_table as product_md_table

    return product_md_table(head, body)


def md_records(rows: Mapping[str, Mapping[str, Any]], cols: Sequence[str], *, key: str = "method") -> str:
    """One table row per ``rows`` item: ``racer_batch.report.markdown.md_records``."""
    from racer_batch.report.markdown import md_records as product_md_records

    return product_md_records(rows, cols, key=key)


# ---- arguments and statistics ---------------------------------------------------------------------------------
def prog(module: str) -> str:
    """How a module is run, for its ``--help``: ``python -m benchmarks.<module>``."""
    return f"python -m benchmarks.{module}"


def command(module: str, argv: Optional[Sequence[str]] = None) -> str:
    """The command that reproduces this run, each argument quoted for a POSIX shell where it needs it.

    >>> command("host", ["--grid", "tiny-random=1,8;smollm2-135m=1", "--tag", "a b"])
    "python -m benchmarks.host --grid 'tiny-random=1,8;smollm2-135m=1' --tag 'a b'"
    """
    return shlex.join(["python", "-m", f"benchmarks.{module}", *(sys.argv[1:] if argv is None else argv)])


def revision() -> str:
    """The code measured: ``git describe --always --dirty`` of this checkout ('' outside git)."""
    return git("describe", "--always", "--dirty")


def int_list(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``.

    Raises:
        ValueError: an empty list or an item that is not an integer.

    >>> int_list("1, 8,32")
    [1, 8, 32]
    """
    items = [int(x) for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"expected comma-separated integers, got {text!r}")
    return items


def median(xs: Iterable[Optional[float]]) -> Optional[float]:
    """The median of the values that are not None; None when there are none.

    >>> median([3.0, None, 1.0, 2.0]), median([None])
    (2.0, None)
    """
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def median_ms(fn: Any, reps: int) -> float:
    """Median wall milliseconds of ``reps`` calls of ``fn()``."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(ts)


def ratio(a: Optional[float], b: Optional[float], nd: int = 3) -> Optional[float]:
    """``a / b`` rounded to ``nd`` decimals; None when either is missing or zero.

    >>> ratio(3.0, 2.0), ratio(1.0, 0.0), ratio(None, 1.0)
    (1.5, None, None)
    """
    return round(a / b, nd) if a and b else None


# ---- prompts --------------------------------------------------------------------------------------------------
def spec_bench_prompts(n: int) -> list:
    """``n`` Spec-Bench questions, short and long categories alternating (``benchdata.spec_bench_mix``): the
    prompts of the throughput and host-time benchmarks.

    Raises:
        ValueError: ``n`` < 1.
    """
    from racer_batch.benchdata import spec_bench_mix

    if n < 1:
        raise ValueError(f"the number of prompts must be >= 1, got {n}")
    return spec_bench_mix(n)


# ---- two revisions in child processes -------------------------------------------------------------------------
def git(*args: str) -> str:
    """``git -C ROOT *args``'s stdout, stripped ('' when git fails)."""
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False).stdout.strip()


def default_base() -> str:
    """``origin/main`` where this clone has it, else ``HEAD``."""
    return "origin/main" if git("rev-parse", "--verify", "--quiet", "origin/main^{commit}") else "HEAD"


def unpack(rev: str, dest: Path) -> Path:
    """The folder holding the ``racer_batch`` package of ``rev`` (``WORKTREE``: this checkout as it is).

    Raises:
        subprocess.CalledProcessError: ``git archive`` failed (an unknown revision).
    """
    if rev == "WORKTREE":
        return ROOT
    dest.mkdir(parents=True, exist_ok=True)
    tar = dest / "src.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(tar), rev, "racer_batch"], check=True)
    with tarfile.open(tar) as tf:
        tf.extractall(dest, filter="data")
    tar.unlink()
    return dest


def describe(rev: str) -> str:
    """``rev`` and the commit it named (the worktree: HEAD's, and whether tracked files had changes)."""
    if rev == "WORKTREE":
        dirty = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
        return f"WORKTREE (at {git('rev-parse', '--short', 'HEAD')}{dirty})"
    return f"{rev} ({git('rev-parse', '--short', rev)})"


def run_child(module: str, args: Sequence[str], *, src: Path, tmp: Path, timeout_s: Optional[float] = None,
              what: str = "") -> dict:
    """Run ``python -m benchmarks.<module> *args`` against the ``racer_batch`` package in ``src``; return the
    JSON the child printed on its ``RESULT`` line.

    The child's working directory is a folder under ``tmp`` holding only a link to this harness, and
    ``PYTHONPATH`` starts with ``src``: the harness is this checkout's, the product is the revision's (the
    child checks that with :func:`check_origin`).

    Raises:
        RuntimeError: the child failed, ran past ``timeout_s`` or printed no result.
    """
    home = tmp / "harness"
    home.mkdir(parents=True, exist_ok=True)
    link = home / "benchmarks"
    if not link.exists():
        link.symlink_to(Path(__file__).resolve().parent, target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")])))
    label = f"child on {src}" + (f" ({what})" if what else "")
    try:
        proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=str(home), env=env,
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{label} ran past {timeout_s:.0f} s") from exc
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"{label} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def check_origin(src: str | Path) -> Path:
    """In a child: the folder ``racer_batch`` was imported from, which must be under ``src``.

    Raises:
        SystemExit: ``racer_batch`` came from elsewhere (the measurement would be of the wrong revision).
    """
    import racer_batch

    want, got = Path(src).resolve(), Path(racer_batch.__file__).resolve()
    if want not in got.parents:
        raise SystemExit(f"racer_batch was imported from {got}, not from the revision's folder {want}")
    return got.parent


def print_result(data: Mapping[str, Any]) -> None:
    """In a child: the ``RESULT`` line :func:`run_child` reads."""
    print(RESULT_PREFIX + json.dumps(data), flush=True)
