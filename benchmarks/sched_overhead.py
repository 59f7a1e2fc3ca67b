"""Scheduling overhead of the batch service, and processes vs threads as generation streams (CPU only).

Part ``overhead`` (docs/scaleout.md, issue 7 part 2): jobs on the stand-in engine (fixed cost per step, it
sleeps, so 8 actors on 2 cores measure the service and not CPU contention) run through the real path:
Redis queue and lease, a Worker, a pool of 1, 2, 4, 8 Ray actors (fractional CPUs), Redis telemetry per row,
Parquet part files and the manifest. For each pool size:

    overhead share = (actors * job wall time - generation time) / generation time

where generation time is the sum over rows of the engine's own prefill + decode time (what the stand-in
spent sleeping). The share is split with the shard summaries: inside the actor (row parsing, Redis
telemetry, cancel probes) vs outside it (Ray dispatch, Parquet write, worker loop, idle actors at the
tail). Redis, Parquet and Ray round trips are also timed on their own, per row. Target: at most 2%.

Part ``streams`` (issue 7 part 3): ``tiny-random`` (a real torch model whose step is mostly Python, as a
GPU step is mostly launch and drafting overhead) on N = 1, 2, 4 streams as Ray actor processes with
fractional CPUs vs as threads of one process (ThreadExecutor: the GIL is shared), and the stand-in (a
step that waits, as a GPU kernel does) as fractional actors vs threads.

Writes ``benchmarks/sched_overhead.{json,md}`` and ``benchmarks/streams_cpu.{json,md}``
(``common.write_results``; the machine as ``common.machine()`` at the start and at the end). A benchmark, not a
test: it asserts nothing about speed. Needs the Redis at ``--redis-url``; starts its own local Ray.

    python -m benchmarks.sched_overhead                  # both parts (~4 min on 2 cores)
    python -m benchmarks.sched_overhead --part overhead --actors 1,2,4,8 --ms-per-step 20
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks import common
from racer_batch.service.execution.actors import RayExecutor, RedisSink, ThreadExecutor
from racer_batch.service.execution.local import init_local_ray, shutdown_local_ray
from racer_batch.service.execution.queue import JobQueue, connect
from racer_batch.service.execution.worker import Worker
from racer_batch.service.job.spec import load_spec
from racer_batch.service.results.output import read_output, write_part
from racer_batch.service.results.record import RowRecord
from racer_batch.service.results.tally import Tally
from racer_batch.service.submit import submit_job
from tests.standin import use_standin

log = logging.getLogger("sched_overhead")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


# ---- one job, timed
def write_input(path: Path, *, num_rows: int, tag: str) -> Path:
    rows = [{"id": f"{tag}-{i}", "prompt": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(6 + i % 5))}
            for i in range(num_rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def run_job(queue: JobQueue, worker: Worker, work: Path, *, tag: str, num_rows: int, overrides: dict) -> dict:
    """Submit a job, claim it, run it with ``worker`` and time ``run_job`` (claim excluded). Returns its wall
    time, its rows (``RowRecord``) and their ``Tally``."""
    inp = write_input(work / f"{tag}.parquet", num_rows=num_rows, tag=tag)
    spec = load_spec(None, dict(overrides, **{"input.path": str(inp), "output.path": str(work / f"out-{tag}")}))
    job_id = submit_job(queue, spec).job_id
    lease = queue.claim(consumer=worker.name, lease_ms=int(worker.lease_s * 1000), block_ms=5000)
    assert lease is not None and lease.job_id == job_id, f"claimed {lease} instead of job {job_id}"
    t0 = time.perf_counter()
    state = worker.run_job(lease)
    wall_s = time.perf_counter() - t0
    assert state == "done", f"job {tag} ended {state}: {queue.job_fields(job_id).get('message')}"
    records = [RowRecord.from_row(r) for r in read_output(spec.output.path).to_pylist()]
    tally = Tally()
    for rec in records:
        tally.observe_row(rec)
    assert tally.rows == tally.ok == num_rows, f"job {tag}: rows missing or failed"
    shards = queue.committed(job_id)
    return {
        "job_id": job_id, "wall_s": wall_s, "records": records, "tally": tally, "out_dir": spec.output.path,
        "gen_s": tally.gen_ms / 1000.0,
        "in_actor_s": sum(float(m["elapsed_s"]) for m in shards.values()),
        "output_tokens": tally.output_tokens,
        "workers": sorted({r.worker for r in records}),
    }


def actor_memory_mb(executor: RayExecutor) -> list[dict]:
    """RSS and USS of each actor process (the pid is the tail of the runner's worker name)."""
    import psutil
    import ray

    out = []
    for a in executor.actors:
        pid = int(ray.get(a.describe.remote(), timeout=30)["worker"].rsplit(":", 1)[1])
        mem = psutil.Process(pid).memory_full_info()
        out.append({"pid": pid, "rss_mb": round(mem.rss / 2**20, 1), "uss_mb": round(mem.uss / 2**20, 1)})
    return out


# ---- component timings, each on its own
def time_components(queue: JobQueue, executor: RayExecutor, sample: list[RowRecord], work: Path, *,
                    shard_rows: int, repeats: int = 200) -> dict:
    """Milliseconds of: one row's Redis telemetry write, one cancel/lease probe, one Parquet part file of
    ``shard_rows`` rows, one Ray actor round trip."""
    import ray

    sink = RedisSink(queue)
    job = f"bench-{uuid.uuid4().hex[:6]}"
    queue.r.hset(queue.k_job(job), mapping={"owner": "me", "cancel": "0"})
    rec = dataclasses.replace(sample[0], job_id=job)
    prog = Tally()

    record_ms = common.median_ms(lambda: sink.observe(rec, progress=prog), repeats)
    probe_ms = common.median_ms(lambda: sink.verdict(job, "me"), repeats)
    for k in ("", "rows", "inflight"):
        queue.r.delete(queue.k_job(job, k))
    recs = (sample * (shard_rows // max(1, len(sample)) + 1))[:shard_rows]
    pdir = work / "parquet-timing"
    parquet_ms = common.median_ms(lambda: write_part(pdir, 0, recs, shard_meta={"rows": len(recs)}), 20)
    shutil.rmtree(pdir, ignore_errors=True)
    actor = executor.actors[0]
    ray_ms = common.median_ms(lambda: ray.get(actor.describe.remote()), 50)
    return {"redis_record_row_ms": round(record_ms, 3), "redis_probe_ms": round(probe_ms, 3),
            "parquet_part_ms": round(parquet_ms, 2), "ray_roundtrip_ms": round(ray_ms, 3)}


# ---- part 2: scheduling overhead
def overhead(queue: JobQueue, url: str, work: Path, args: argparse.Namespace) -> dict:
    standin = f"stand-in?ms_per_step={args.ms_per_step}&mat={args.mat}"
    results = []
    components: Optional[dict] = None
    executor = RayExecutor(url, prefix=queue.prefix, name="bench")
    worker = Worker(queue, executor, name=f"bench-{os.getpid()}", lease_s=60)
    try:
        for n in args.actors:
            res = {"num_actors": n, "cpus_per_actor": round(args.cpus / n, 4), "torch_threads": 1}
            over = {"model.name": standin, "generation.max_new_tokens": args.max_new_tokens,
                    "output.shard_rows": args.shard_rows, "resources.num_actors": n,
                    "resources.cpus_per_actor": args.cpus / n}
            run_job(queue, worker, work, tag=f"warm{n}", num_rows=n * args.shard_rows, overrides=over)
            job = run_job(queue, worker, work, tag=f"n{n}", num_rows=n * args.rows_per_actor, overrides=over)
            rows = job["records"]
            busy_s = n * job["wall_s"]
            row_gen_ms = 1000.0 * job["gen_s"] / len(rows)
            if components is None:
                components = time_components(queue, executor, rows, work, shard_rows=args.shard_rows)
            res.update(
                rows=len(rows), wall_s=round(job["wall_s"], 3), rows_per_s=round(len(rows) / job["wall_s"], 3),
                ideal_rows_per_s=round(n / (job["gen_s"] / len(rows)), 3),
                output_tokens=job["output_tokens"], row_gen_ms=round(row_gen_ms, 2),
                overhead_ms_per_row=round(1000.0 * (busy_s - job["gen_s"]) / len(rows), 2),
                overhead_share=round((busy_s - job["gen_s"]) / job["gen_s"], 4),
                in_actor_share=round((job["in_actor_s"] - job["gen_s"]) / job["gen_s"], 4),
                outside_actor_share=round((busy_s - job["in_actor_s"]) / job["gen_s"], 4),
                actors_used=len(job["workers"]), actor_memory=actor_memory_mb(executor),
            )
            results.append(res)
            log.info("overhead %s", {k: v for k, v in res.items() if k != "actor_memory"})
    finally:
        executor.shutdown()
    assert components is not None
    row_gen_ms = statistics.mean(r["row_gen_ms"] for r in results)
    probes_per_row = row_gen_ms / 50.0  # RowRunner probes Redis at most every 50 ms
    per_row = {
        "redis_ms": round(components["redis_record_row_ms"] + probes_per_row * components["redis_probe_ms"], 3),
        "parquet_ms": round(components["parquet_part_ms"] / args.shard_rows, 3),
        "ray_ms": round(components["ray_roundtrip_ms"] / args.shard_rows, 3),
    }
    per_row["share_of_row"] = {k: round(v / row_gen_ms, 5) for k, v in per_row.items()}
    return {"config": {"model": standin, "max_new_tokens": args.max_new_tokens, "shard_rows": args.shard_rows,
                       "rows_per_actor": args.rows_per_actor, "ray_logical_cpus": args.cpus,
                       "ms_per_token": args.ms_per_step / args.mat},
            "results": results, "components_ms": components, "components_per_row": per_row, "target_share": 0.02}


# ---- part 3: streams as processes vs threads
def streams(queue: JobQueue, url: str, work: Path, args: argparse.Namespace) -> dict:
    cases = [("tiny-random", {"model.name": "tiny-random", "decoding.method": "racer", "decoding.capacity": 16,
                              "generation.max_new_tokens": 64}, args.stream_rows),
             ("stand-in", {"model.name": f"stand-in?ms_per_step={args.ms_per_step}&mat={args.mat}",
                           "generation.max_new_tokens": args.max_new_tokens}, args.stream_rows)]
    try:
        import torch

        torch.set_num_threads(1)  # threads: one intra-op thread each, as the actors get
    except ImportError:
        pass
    cases = [c for c in cases if c[0] in args.models]
    results = []
    for model, base, num_rows in cases:
        for kind in ("processes", "threads"):
            for n in args.streams:
                over = dict(base, **{"output.shard_rows": max(1, num_rows // (2 * n)), "resources.num_actors": n,
                                     "resources.cpus_per_actor": args.cpus / n, "resources.torch_threads": 1})
                if kind == "processes":
                    executor: Any = RayExecutor(url, prefix=queue.prefix, name="streams")
                else:
                    executor = ThreadExecutor(url, prefix=queue.prefix)
                worker = Worker(queue, executor, name=f"streams-{os.getpid()}", lease_s=120)
                try:
                    tag = f"{model.split('?')[0]}-{kind}-{n}"
                    run_job(queue, worker, work, tag=f"warm-{tag}", num_rows=2 * n, overrides=over)
                    jobs = [run_job(queue, worker, work, tag=f"{tag}-r{i}", num_rows=num_rows, overrides=over)
                            for i in range(args.stream_repeats)]
                    mem = actor_memory_mb(executor) if kind == "processes" else []
                finally:
                    executor.shutdown()
                rates = sorted(j["output_tokens"] / j["wall_s"] for j in jobs)
                walls = [j["wall_s"] for j in jobs]
                res = {"model": model, "kind": kind, "streams": n, "rows": num_rows, "repeats": len(jobs),
                       "wall_s": round(common.median(walls), 3),
                       "tokens_per_s": round(common.median(rates), 2),
                       "tokens_per_s_min": round(rates[0], 2), "tokens_per_s_max": round(rates[-1], 2),
                       "rows_per_s": round(num_rows / common.median(walls), 3),
                       "memory_mb": mem, "process_rss_mb": _self_rss_mb() if kind == "threads" else None}
                results.append(res)
                log.info("streams %s", res)
    return {"config": {"cases": {m: b for m, b, _ in cases}, "ray_logical_cpus": args.cpus}, "results": results}


def _self_rss_mb() -> float:
    import psutil

    return round(psutil.Process().memory_info().rss / 2**20, 1)


# ---- output
def machine() -> dict:
    """``common.machine()`` (the CPU, cores, load average, Python, torch); no GPU in this benchmark."""
    return dict(common.machine(), gpu=None)


def machine_note(d: dict) -> str:
    """The machine and its load at the start and the end of a part."""
    return (f"{common.machine_line(d['machine'])}, shared with other jobs (load average {d['machine']['load']} at "
            f"start, {d['machine_end']['load']} at the end)")


def overhead_md(d: dict) -> str:
    """The overhead part's Markdown: per pool size, then the components timed on their own."""
    c = d["config"]

    def pct(x: float, nd: int = 2) -> str:
        return f"{100 * x:.{nd}f}%"

    def memory(mem: list[dict]) -> str:
        rss = statistics.mean(m["rss_mb"] for m in mem) if mem else 0
        uss = statistics.mean(m["uss_mb"] for m in mem) if mem else 0
        return f"{rss:.0f} ({uss:.0f})"

    pools = common.md_table(
        ["actors", "rows", "wall s", "rows/s", "ideal rows/s", "row gen ms", "overhead ms/row", "overhead share",
         "in actor", "outside actor", "actor RSS MB (USS)"],
        [[r["num_actors"], r["rows"], r["wall_s"], r["rows_per_s"], r["ideal_rows_per_s"], r["row_gen_ms"],
          r["overhead_ms_per_row"], pct(r["overhead_share"]), pct(r["in_actor_share"]),
          pct(r["outside_actor_share"]), memory(r["actor_memory"])] for r in d["results"]])
    comp, per = d["components_ms"], d["components_per_row"]
    share = per["share_of_row"]
    components = common.md_table(
        ["component", "one call ms", "per row ms", "share of a row's generation"],
        [["Redis telemetry (1 per row) + probes (1 per 50 ms)",
          f"{comp['redis_record_row_ms']} + {comp['redis_probe_ms']}", per["redis_ms"], pct(share["redis_ms"], 3)],
         ["Parquet part file (1 per shard)", comp["parquet_part_ms"], per["parquet_ms"], pct(share["parquet_ms"], 3)],
         ["Ray actor round trip (1 per shard)", comp["ray_roundtrip_ms"], per["ray_ms"], pct(share["ray_ms"], 3)]])
    return "\n".join([
        "# Scheduling overhead (stand-in engine, CPU actors)", "",
        f"Reproduce: `{d['command']}`", "",
        f"Stand-in: `{c['model']}` ({c['ms_per_token']:.1f} ms per token, fixed), max_new_tokens "
        f"{c['max_new_tokens']}, shard_rows {c['shard_rows']}, {c['rows_per_actor']} rows per actor, "
        f"Ray with {c['ray_logical_cpus']} logical CPUs split evenly among the actors. Machine: {machine_note(d)}.",
        "",
        "overhead share = (actors x job wall time - generation time) / generation time; generation time is "
        "the sum of the engine's prefill + decode time over rows. Inside the actor: row parsing, Redis "
        "telemetry, cancel/lease probes. Outside: Ray dispatch, Parquet write, the worker loop, actors idle "
        "at the tail of the job. Target: at most 2%.", "",
        pools, "", "## Components, timed on their own", "", components,
    ])


def streams_md(d: dict) -> str:
    """The streams part's Markdown: one row per (model, kind, streams)."""
    def memory(r: dict) -> str:
        if r["memory_mb"]:
            return (f"{sum(m['rss_mb'] for m in r['memory_mb']):.0f} RSS, "
                    f"{sum(m['uss_mb'] for m in r['memory_mb']):.0f} USS (all actors)")
        return f"{r['process_rss_mb']:.0f} RSS (whole process)"

    table = common.md_table(
        ["model", "kind", "streams", "rows", "wall s", "tokens/s (min..max)", "rows/s", "memory MB"],
        [[r["model"], r["kind"], r["streams"], r["rows"], r["wall_s"],
          f"{r['tokens_per_s']} ({r['tokens_per_s_min']}..{r['tokens_per_s_max']})", r["rows_per_s"], memory(r)]
         for r in d["results"]])
    return "\n".join([
        "# Generation streams on CPU: Ray actor processes vs threads of one process", "",
        f"Reproduce: `{d['command']}`", "",
        f"Machine: {machine_note(d)}; no GPU. Processes: N Ray actors with "
        f"{d['config']['ray_logical_cpus']}/N logical CPUs each (the CPU analogue of fractional-GPU actors). "
        "Threads: N RowRunners on threads of one process (ThreadExecutor), one torch thread each.", "",
        "Each configuration: one warm-up job, then the median of the timed jobs (min..max in brackets).", "",
        table,
    ])


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=common.prog("sched_overhead"), description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["overhead", "streams", "all"], default="all")
    p.add_argument("--actors", default="1,2,4,8", help="pool sizes for the overhead part")
    p.add_argument("--streams", default="1,2,4", help="stream counts for the streams part")
    p.add_argument("--ms-per-step", type=float, default=20.0, help="stand-in cost of one step (ms)")
    p.add_argument("--mat", type=int, default=2, help="stand-in tokens per step")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--shard-rows", type=int, default=8)
    p.add_argument("--rows-per-actor", type=int, default=16)
    p.add_argument("--stream-rows", type=int, default=16, help="rows per job in the streams part")
    p.add_argument("--models", default="tiny-random,stand-in", help="models of the streams part")
    p.add_argument("--stream-repeats", type=int, default=3, help="timed jobs per streams configuration (median)")
    p.add_argument("--cpus", type=float, default=2.0, help="logical CPUs of the local Ray")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--out", default=str(common.OUT))
    args = p.parse_args(argv)
    args.actors = common.int_list(args.actors)
    args.streams = common.int_list(args.streams)
    args.models = args.models.split(",")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("racer_batch").setLevel(logging.WARNING)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    use_standin()  # `stand-in` model names: the test stand-in engine, here and in the workers started here
    command = common.command("sched_overhead", argv)
    prefix = f"rb-sched-{uuid.uuid4().hex[:8]}:"
    queue = JobQueue(connect(args.redis_url), prefix=prefix)
    work = Path(tempfile.mkdtemp(prefix="rb-sched-"))
    init_local_ray(num_cpus=int(args.cpus))
    parts = [("overhead", "sched_overhead", overhead, overhead_md), ("streams", "streams_cpu", streams, streams_md)]
    try:
        for part, name, measure, render in parts:
            if args.part not in (part, "all"):
                continue
            m0 = machine()
            d = measure(queue, args.redis_url, work, args)
            d.update(machine=m0, machine_end=machine(), command=command, written_at=common.stamp())
            md = render(d)
            common.write_results(args.out, name, d, md)
            print(md)
    finally:
        shutdown_local_ray()
        keys = list(queue.r.scan_iter(f"{prefix}*", count=1000))
        if keys:
            queue.r.delete(*keys)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
