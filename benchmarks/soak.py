"""Soak: many short rows through one generation actor; check that memory and Redis state stay bounded.

    python -m benchmarks.soak                    # 2,000 rows, tiny-random model, 4 new tokens each
    python -m benchmarks.soak --rows 300 --tag short

One job runs on a local Ray with a single GenerationActor and the Redis at REDIS_URL (a unique key prefix,
deleted at the end). While it runs, the driver samples every ``--sample-s`` seconds:

* ``actor_rss_mb``: the actor process's resident memory (/proc/<pid>/status, read from outside the actor);
* ``automaton_nodes`` / ``draft_state_mb``: the job's draft state inside the actor (a ``__ray_call__`` probe,
  answered between shards since the actor runs one call at a time);
* ``row_stream_len``: XLEN of the job's telemetry stream (capped at ~ROW_STREAM_MAXLEN by MAXLEN ~);
* ``redis_state_kb``: MEMORY USAGE summed over the job's other keys (job hash, shard summaries, in-flight
  progress, error stream): grows only by one small shard summary per shard;
* ``queue_len``: entries in the queue streams (the job's own entry until it is acknowledged and deleted).

The summary gives each series' slope per 1,000 rows after a warm-up (least squares). Writes
benchmarks/soak[_<tag>].json and .md (``common.write_results``, with ``common.machine()``); ``run_soak`` is what
tests/reliability/test_soak.py calls.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks import common
from racer_batch.service.execution.local import init_local_ray, make_executor, shutdown_local_ray
from racer_batch.service.execution.queue import ROW_STREAM_MAXLEN, JobQueue, connect, resolve_url
from racer_batch.service.execution.worker import Worker
from racer_batch.service.job.spec import load_spec
from racer_batch.service.submit import submit_job
from tests.standin import use_standin

WORDS = ("river", "stone", "quiet", "market", "engine", "winter", "copper", "garden", "signal", "harbor", "yellow",
         "planet", "bridge", "letter", "silver", "forest", "window", "number", "candle", "motion", "shadow", "orbit")


def write_prompts(path: Path, rows: int, *, seed: int = 0) -> None:
    """Distinct short prompts (random word sequences), so the automaton keeps meeting new n-grams."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(rows)]
    pq.write_table(pa.table({"id": [f"s{i:06d}" for i in range(rows)], "prompt": prompts}), path)


def _rss_mb(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _probe_state(actor_self, job_id: str) -> dict:
    """Runs inside the actor (via __ray_call__): the size of the job's draft state."""
    got = actor_self.runner._states.get(job_id)
    state = got[1] if got else None
    has_automaton = state is not None and (state.automaton is not None or state.native is not None)
    return {"automaton_nodes": state.automaton_nodes if has_automaton else None,
            "draft_state_mb": state.memory_bytes / 2**20 if state is not None else None}


def slope_per_1k_rows(samples: list[dict], key: str, *, warmup_frac: float = 0.25) -> Optional[float]:
    """Least-squares slope of ``key`` against rows_done, per 1,000 rows, over samples after the warm-up.

    Example: samples (rows_done, rss) = (0, 100), (500, 101), (1000, 102) with no warm-up -> 2.0 per 1k rows.
    """
    last = max((s["rows_done"] for s in samples), default=0)
    pts = [(s["rows_done"], s[key]) for s in samples
           if s.get(key) is not None and s["rows_done"] >= warmup_frac * last]
    if len(pts) < 3 or len({x for x, _ in pts}) < 2:
        return None
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    return 1000.0 * sxy / sxx


def _redis_sample(queue: JobQueue, job_id: str) -> dict:
    rows_key = queue.k_job(job_id, "rows")
    others = [k for k in queue.r.scan_iter(f"{queue.k_job(job_id)}*") if k != rows_key]
    return {"rows_done": queue.status(job_id).rows_done, "row_stream_len": queue.r.xlen(rows_key),
            "redis_state_kb": sum(queue.r.memory_usage(k) or 0 for k in others) / 1024,
            "queue_len": sum(queue.r.xlen(queue.k_queue(p)) for p in range(10))}


def run_soak(*, rows: int, redis_url: str, model: str = "tiny-random", max_new_tokens: int = 4,
             shard_rows: int = 50, max_nodes: int = 4000, sample_s: float = 1.0,
             workdir: Optional[str] = None) -> dict:
    """Run one soak job on the current (or a new local) Ray; returns {"config", "samples", "summary"}."""
    use_standin()  # `stand-in` model names: the test stand-in engine, here and in the workers started here
    init_local_ray(num_cpus=2)  # a no-op when Ray is already up (tests)
    import ray

    own_dir = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix="rb-soak-"))
    prefix = f"rbsoak-{uuid.uuid4().hex[:8]}:"
    queue = JobQueue(connect(redis_url), prefix=prefix)
    executor = make_executor("ray", url=redis_url, prefix=prefix, name="soak")
    config = {"rows": rows, "model": model, "max_new_tokens": max_new_tokens, "shard_rows": shard_rows,
              "max_nodes": max_nodes, "row_stream_maxlen": ROW_STREAM_MAXLEN, "sample_s": sample_s}
    samples: list[dict] = []
    try:
        write_prompts(work / "in.parquet", rows)
        spec = load_spec(None, {
            "input.path": str(work / "in.parquet"), "output.path": str(work / "out"), "model.name": model,
            "generation.max_new_tokens": max_new_tokens, "output.shard_rows": shard_rows,
            "resources.num_actors": 1, "decoding.max_nodes": max_nodes, "decoding.capacity": 8,
            "generation.system_prompt": None})
        job_id = submit_job(queue, spec).job_id
        executor.prepare(spec.resources)  # the worker keeps this pool (same shape)
        actor = executor.actors[0]
        pid = int(ray.get(actor.describe.remote())["worker"].rsplit(":", 1)[1])
        worker = Worker(queue, executor, name="soak", lease_s=30)
        th = threading.Thread(target=lambda: worker.run(max_jobs=1, idle_exit_s=60), daemon=True)
        t0 = time.monotonic()
        th.start()
        probe = None
        state_now: dict = {}
        while th.is_alive():
            if probe is None:
                probe = actor.__ray_call__.remote(_probe_state, job_id)
            ready, _ = ray.wait([probe], timeout=0)
            if ready:
                state_now = ray.get(ready[0])
                probe = None
            samples.append(dict(_redis_sample(queue, job_id), t_s=round(time.monotonic() - t0, 2),
                                actor_rss_mb=_rss_mb(pid), automaton_nodes=state_now.get("automaton_nodes"),
                                draft_state_mb=state_now.get("draft_state_mb")))
            state_now = {}  # a probe result is recorded once, at the rows done when it came back
            th.join(timeout=sample_s)
        final = queue.status(job_id)
        samples.append(dict(_redis_sample(queue, job_id), t_s=round(time.monotonic() - t0, 2),
                            actor_rss_mb=_rss_mb(pid), automaton_nodes=None, draft_state_mb=None))
        wall_s = time.monotonic() - t0
        nodes = [s["automaton_nodes"] for s in samples if s["automaton_nodes"] is not None]
        summary = {
            "state": final.state, "rows_done": final.rows_done, "ok": final.totals.ok, "wall_s": round(wall_s, 1),
            "rows_per_s": round(final.rows_done / wall_s, 2) if wall_s else None,
            "actor_rss_mb_first": next((s["actor_rss_mb"] for s in samples if s["actor_rss_mb"]), None),
            "actor_rss_mb_max": max((s["actor_rss_mb"] for s in samples if s["actor_rss_mb"]), default=None),
            "automaton_nodes_max": max(nodes, default=None), "automaton_samples": len(nodes),
            "row_stream_len_max": max(s["row_stream_len"] for s in samples),
            "redis_state_kb_max": max(s["redis_state_kb"] for s in samples),
            "queue_len_max": max(s["queue_len"] for s in samples), "queue_len_end": samples[-1]["queue_len"],
            "shards": -(-rows // shard_rows),
            "slope_per_1k_rows": {k: slope_per_1k_rows(samples, k) for k in
                                  ("actor_rss_mb", "automaton_nodes", "draft_state_mb", "row_stream_len",
                                   "redis_state_kb")},
        }
    finally:
        executor.shutdown()
        keys = list(queue.r.scan_iter(f"{prefix}*"))
        if keys:
            queue.r.delete(*keys)
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
    return {"config": config, "samples": samples, "summary": summary}


def render_md(result: dict, *, lines_max: int = 25) -> str:
    """Markdown: the header, the summary, the slopes, then about ``lines_max`` samples of the curve."""
    s, c = result["summary"], result["config"]
    maxes = {"actor_rss_mb": s["actor_rss_mb_max"], "automaton_nodes": s["automaton_nodes_max"],
             "row_stream_len": s["row_stream_len_max"], "redis_state_kb": s["redis_state_kb_max"]}
    slopes = common.md_table(["series", "slope per 1,000 rows (after warm-up)", "max"],
                             [[k, None if slope is None else f"{slope:+.3f}", _round(maxes.get(k))]
                              for k, slope in s["slope_per_1k_rows"].items()])
    probed = [x for x in result["samples"] if x["automaton_nodes"] is not None]
    every = max(1, len(probed) // lines_max)
    curve = common.md_table(
        ["t (s)", "rows", "actor RSS (MB)", "automaton nodes", "draft state (MB)", "row stream", "Redis state (KB)"],
        [[round(x["t_s"]), x["rows_done"], _round(x["actor_rss_mb"]), x["automaton_nodes"],
          _round(x["draft_state_mb"], 2), x["row_stream_len"], _round(x["redis_state_kb"])]
         for x in probed[::every] + result["samples"][-1:]])
    return "\n".join([f"# Soak: {c['rows']} rows, {c['model']}, {c['max_new_tokens']} new tokens, one actor", "",
                      f"Reproduce: `{result['command']}`", "", f"Machine: {common.machine_line(result['machine'])}.",
                      "", json.dumps(s), "", slopes, "", curve])


def _round(v: Optional[float], nd: int = 1) -> Optional[float]:
    return None if v is None else round(v, nd)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog("soak"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--model", default="tiny-random", help="tiny-random or a stand-in model name")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--shard-rows", type=int, default=20)
    ap.add_argument("--max-nodes", type=int, default=4000, help="automaton node pool (decoding.max_nodes)")
    ap.add_argument("--sample-s", type=float, default=0.5)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--tag", default="", help="file name suffix: benchmarks/soak_<tag>.json")
    ap.add_argument("--out", default=str(common.OUT))
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        result = run_soak(rows=args.rows, redis_url=resolve_url(args.redis_url), model=args.model,
                          max_new_tokens=args.max_new_tokens, shard_rows=args.shard_rows, max_nodes=args.max_nodes,
                          sample_s=args.sample_s)
    finally:
        shutdown_local_ray()
    result.update(command=common.command("soak", argv),
                  machine=common.machine(), written_at=common.stamp())
    md = render_md(result)
    common.write_results(args.out, "soak" + (f"_{args.tag}" if args.tag else ""), result, md)
    print(md)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
