"""A generation worker's memory, weights as stored vs float32 (issue 31, "Memory").

For each ``--weights`` setting, runs the demo job for real (``racer-batch submit jobs/demo.yaml --local --wait``,
one actor, its output in a temporary folder) and samples, every ``--interval`` seconds, every process under
it: the Ray worker that runs ``GenerationActor`` (its process title starts ``ray::GenerationActor``) is the
one measured. Reported per setting: that worker's peak RSS (resident set: the figure a container limit or
``top`` counts) and its peak USS (pages no other process shares: what a second worker would add), the same at
the last sample (the worker idle after its last row), the job's wall seconds and its rows. Writes
``<out>/memory-<stamp>.json`` and ``.md``.

    python -m benchmarks.memory                          # as_stored and float32, ~2 min each here
    python -m benchmarks.memory --weights as_stored --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks import common

ACTOR_TITLE = "ray::GenerationActor"
MB = 1e6


class Sampler(threading.Thread):
    """Polls the descendants of ``pid`` and keeps the peak RSS/USS of the generation actor's process."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = psutil.Process(pid), interval
        self.peak_rss = self.peak_uss = 0
        self.last_rss = self.last_uss = 0  # the last sample: the worker after its last row (steady state)
        self.actor_pids: set[int] = set()
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                procs = self.root.children(recursive=True)
            except psutil.Error:
                break
            for p in procs:
                try:
                    if not " ".join(p.cmdline()).startswith(ACTOR_TITLE):
                        continue
                    info = p.memory_full_info()
                except psutil.Error:
                    continue
                self.actor_pids.add(p.pid)
                self.samples += 1
                self.last_rss, self.last_uss = info.rss, info.uss
                self.peak_rss = max(self.peak_rss, info.rss)
                self.peak_uss = max(self.peak_uss, info.uss)
            self.done.wait(self.interval)


def run_job(weights: str, *, job: str, max_new: int, interval: float) -> dict:
    """One demo job on ``weights``; its actor's peak memory, wall seconds and rows."""
    out = Path(tempfile.mkdtemp(prefix=f"racer-mem-{weights}-"))
    exe = shutil.which("racer-batch", path=str(Path(sys.executable).parent)) or "racer-batch"
    cmd = [exe, "submit", job, "--local", "--wait", "--json", "--output", str(out / "out"),
           "--max-new-tokens", str(max_new), "--set", f"model.weights={weights}"]
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = Sampler(proc.pid, interval)
    sampler.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    sampler.done.set()
    sampler.join()
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    if not sampler.samples:
        raise RuntimeError(f"no process titled {ACTOR_TITLE!r} was seen under the job: nothing measured")
    try:
        status = json.loads(stdout[stdout.index("{"):])
    except ValueError:
        status = {}
    return {"weights": weights, "peak_rss_mb": round(sampler.peak_rss / MB, 1),
            "peak_uss_mb": round(sampler.peak_uss / MB, 1), "last_rss_mb": round(sampler.last_rss / MB, 1),
            "last_uss_mb": round(sampler.last_uss / MB, 1), "samples": sampler.samples,
            "actor_processes": len(sampler.actor_pids), "wall_s": round(wall, 1),
            "rows_done": status.get("rows_done", status.get("done")), "state": status.get("state")}


def _shown(path: str) -> str:
    """``path`` relative to the repository where it lies inside it."""
    try:
        return str(Path(path).resolve().relative_to(common.ROOT))
    except ValueError:
        return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="as_stored,float32", help="model.weights settings, one job each")
    ap.add_argument("--job", default=str(common.ROOT / "jobs" / "demo.yaml"),
                    help="job spec to run (default jobs/demo.yaml)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per row (default 96)")
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    ap.add_argument("--out", default=str(common.OUT), help="results folder (default: the repository's benchmarks/)")
    args = ap.parse_args(argv)
    rows = [run_job(w, job=args.job, max_new=args.max_new_tokens, interval=args.interval)
            for w in filter(None, args.weights.split(","))]
    for r in rows:
        print(json.dumps(r))
    stamp = common.stamp()
    command = common.command("memory", argv)
    summary = {"command": command, "machine": common.machine(), "rows": rows, "job": args.job,
               "max_new_tokens": args.max_new_tokens}
    lines = [f"# Worker memory {stamp}", "", f"Reproduce: `{command}`", "",
             f"Machine: {common.machine_line(summary['machine'])}. The demo job ({_shown(args.job)}, one actor, "
             f"{args.max_new_tokens} new tokens per row), sampled every {args.interval} s: the peak of the Ray "
             f"worker process running `GenerationActor`.", "",
             "| model.weights | peak RSS MB | peak USS MB | last RSS MB | last USS MB | job wall s | samples |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['weights']} | {r['peak_rss_mb']} | {r['peak_uss_mb']} | {r['last_rss_mb']} | {r['last_uss_mb']} | "
              f"{r['wall_s']} | {r['samples']} |"
              for r in rows]
    _, mpath = common.write_results(args.out, f"memory-{stamp}", summary, "\n".join(lines))
    print(f"wrote {mpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
