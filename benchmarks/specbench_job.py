"""Run all 480 Spec-Bench questions as one racer-batch job and write a summary under benchmarks/.

    python -m benchmarks.specbench_job                          # RACER (racer-cpu preset), 256 new tokens
    python -m benchmarks.specbench_job --preset ar --tag ar      # the autoregressive baseline
    python -m benchmarks.specbench_job --smoke                   # 8 questions per group (data README rule)

The input Parquet (one row per question; every row uses `turns`, so a two-turn MT-bench question sees the
model's first answer before its second turn) is written to out/specbench/input.parquet. The job runs on an
embedded worker (local Ray + the Redis at REDIS_URL, or a private redis-server). Re-running with the same
settings resumes the job. Outputs: benchmarks/specbench_<tag>.json and .md (``common.write_results``; per
category, a ``Tally`` of its rows: rows, output tokens, steps, MAT, token-weighted tokens/s; MT-bench categories
are also reported together as multi_turn).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks import common
from racer_batch.service.execution.local import ensure_redis, init_local_ray, run_until_done, shutdown_local_ray
from racer_batch.service.execution.queue import JobQueue, resolve_url
from racer_batch.service.job.spec import load_spec
from racer_batch.service.results.output import read_output
from racer_batch.service.results.record import RowRecord
from racer_batch.service.results.tally import Tally
from racer_batch.service.submit import submit_job

ROOT = common.ROOT
QUESTIONS = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUP_ORDER = ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag")


def group_of(category: str) -> str:
    return "multi_turn" if category in MT_BENCH else category


def smoke_subset(records: list[dict]) -> list[dict]:
    """Within each group in file order, with n items, keep positions floor(k*n/8) for k = 0..7."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[group_of(r["category"])].append(r)
    keep = []
    for items in groups.values():
        n = len(items)
        keep += [items[(k * n) // 8] for k in range(8)]
    return sorted(keep, key=lambda r: r["question_id"])


def build_input(questions: Path, out: Path, *, smoke: bool) -> int:
    records = [json.loads(line) for line in questions.read_text(encoding="utf-8").splitlines() if line.strip()]
    if smoke:
        records = smoke_subset(records)
    table = pa.Table.from_pylist(
        [{"id": r["question_id"], "route": r["category"], "turns": list(r["turns"])} for r in records],
        schema=pa.schema([("id", pa.int64()), ("route", pa.string()), ("turns", pa.list_(pa.string()))]),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
    return table.num_rows


def summarise(records: list[RowRecord]) -> dict:
    """{category: figures} over the job's rows, also for multi_turn (the MT-bench categories together) and all:
    a ``Tally`` of the rows (its counters), ``prefill_ms``, ``mat`` and token-weighted ``tokens_per_s`` (output
    tokens / the rows' prefill + decode time)."""
    total, mt_bench = Tally(), Tally()
    prefill_ms: dict[str, float] = defaultdict(float)
    for rec in records:
        total.observe_row(rec)  # routes: one tally per category
        keys = [rec.route, "all"]
        if rec.route in MT_BENCH:
            mt_bench.observe_row(rec, group=group_of(rec.route))
            keys.append(group_of(rec.route))
        for key in keys:
            prefill_ms[key] += rec.prefill_ms or 0.0
    tallies = {**total.routes, **mt_bench.routes, "all": total}
    return {key: {**{k: v for k, v in t.to_dict().items() if k != "routes"}, "prefill_ms": prefill_ms[key],
                  "mat": t.mat, "tokens_per_s": t.output_tokens / (t.gen_ms / 1000.0) if t.gen_ms else None}
            for key, t in tallies.items()}


def render_md(result: dict) -> str:
    """The summary's Markdown: the job, then one table row per category (groups first, then MT-bench's)."""
    cats = result["categories"]
    order = [g for g in GROUP_ORDER if g in cats] + sorted(c for c in cats if c in MT_BENCH) + ["all"]
    body = [[c, cats[c]["rows"], cats[c]["rows"] - cats[c]["ok"], cats[c]["output_tokens"], cats[c]["steps"],
             None if cats[c]["mat"] is None else round(cats[c]["mat"], 2),
             None if cats[c]["tokens_per_s"] is None else round(cats[c]["tokens_per_s"], 1)] for c in order]
    return "\n".join([
        f"# Spec-Bench as one racer-batch job ({result['tag']})", "",
        f"Reproduce: `{result['command']}`", "",
        f"- model `{result['model']}`, method `{result['method']}` (capacity {result['capacity']}), "
        f"greedy, max_new_tokens {result['max_new_tokens']} (reduced for CPU), questions {result['rows']}",
        f"- job `{result['job_id']}`, wall {result['wall_s']:.0f} s, machine: {common.machine_line(result['machine'])}",
        f"- streams per actor: {result.get('streams_per_actor', 1)}, actors: {result.get('num_actors', 'auto')}; "
        f"**job throughput {cats['all']['output_tokens'] / result['wall_s']:.1f} output tokens/s** "
        "(all output tokens / job wall time)",
        "- tokens/s per category is per row: output tokens / (the rows' prefill + decode time), so with several "
        "rows in flight it is a row's own rate, not the job's", "",
        common.md_table(["category", "rows", "errors", "output tokens", "steps", "MAT", "tokens/s"], body),
    ])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog("specbench_job"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=Path, default=QUESTIONS)
    ap.add_argument("--preset", default="racer-cpu", help="preset name (racer-cpu, racer-paper, ar, pld)")
    ap.add_argument("--tag", default=None, help="name of the result files (default: the preset)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-actors", default="auto")
    ap.add_argument("--streams-per-actor", default="1", help="rows one actor decodes at once (int or auto)")
    ap.add_argument("--capacity", default=None, help="decoding.capacity (default: the preset's)")
    ap.add_argument("--shard-rows", type=int, default=None, help="output.shard_rows (default: the job file's 16)")
    ap.add_argument("--smoke", action="store_true", help="8 questions per group (48 rows)")
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--prefix", default="racer-batch:")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    tag = args.tag or (args.preset + ("-smoke" if args.smoke else ""))
    work = ROOT / "out" / "specbench"
    input_path = work / ("input-smoke.parquet" if args.smoke else "input.parquet")
    n = build_input(args.questions, input_path, smoke=args.smoke)
    overrides = {
        "preset": args.preset, "input.path": str(input_path), "output.path": str(work / tag),
        "generation.max_new_tokens": args.max_new_tokens, "model.name": args.model,
        "resources.num_actors": args.num_actors if args.num_actors == "auto" else int(args.num_actors),
        "resources.streams_per_actor": args.streams_per_actor if args.streams_per_actor == "auto"
        else int(args.streams_per_actor),
    }
    if args.shard_rows is not None:
        overrides["output.shard_rows"] = args.shard_rows
    if args.capacity is not None:
        overrides["decoding.capacity"] = args.capacity if args.capacity == "auto" else int(args.capacity)
    spec = load_spec(ROOT / "jobs" / "specbench.yaml", overrides)
    url, private = ensure_redis(resolve_url(args.redis_url, spec.redis_url))
    try:
        queue = JobQueue.from_url(url, prefix=args.prefix)
        sub = submit_job(queue, spec)
        print(f"job {sub.job_id} ({sub.action}): {n} questions -> {spec.output.path}", flush=True)
        init_local_ray()
        t0 = time.monotonic()
        last = [0.0]

        def tick() -> None:
            if time.monotonic() - last[0] >= 30:
                last[0] = time.monotonic()
                st = queue.status(sub.job_id)
                eta = f"{st.eta_s / 60:.0f} min" if st.eta_s is not None else "-"
                print(f"  {st.rows_done}/{st.rows_total} rows, MAT {st.mat or 0:.2f}, "
                      f"{st.tokens_per_s:.1f} tok/s, ETA {eta}", flush=True)

        run = run_until_done(queue, sub.job_id, url=url, prefix=args.prefix, on_tick=tick, tick_s=5.0)
        wall_s = time.monotonic() - t0
    finally:
        shutdown_local_ray()
        if private is not None:
            private.stop()
    records = [RowRecord.from_row(r) for r in read_output(spec.output.path).to_pylist()]
    result = {
        "tag": tag, "job_id": sub.job_id, "state": run.state, "rows": len(records), "model": spec.model.name,
        "method": spec.decoding.method, "capacity": spec.decoding.capacity,
        "max_new_tokens": spec.generation.max_new_tokens, "config_hash": spec.decoding.config_hash(),
        "streams_per_actor": spec.resources.streams_per_actor, "num_actors": spec.resources.num_actors,
        "decoding": spec.decoding.model_dump(mode="json"), "wall_s": wall_s,
        "machine": common.machine(), "written_at": common.stamp(),
        "command": common.command("specbench_job", argv),
        "categories": summarise(records),
    }
    md = render_md(result)
    common.write_results(args.out, f"specbench_{tag}", result, md)
    print(md)
    return 0 if run.state == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
