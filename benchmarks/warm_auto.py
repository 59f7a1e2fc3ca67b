"""A job's saved draft state and ``decoding.method: auto`` on a Spec-Bench job (issue 30).

One fixed sample of Spec-Bench questions (``--per-group`` questions of each of its six groups, the first in
question order; every row uses its ``turns``; a row's route is its group) runs as one racer-batch job per
contender, on a local Ray with ``--num-actors`` actors, ``--streams-per-actor`` rows per forward and
``--shard-rows``-row shards, one job after the other in the order given (``--order``), each into its own output
folder:

- ``racer-cold``: RACER with ``resources.warm_draft_state: false`` (each actor keeps its own state across its
  shards, as before the saved state existed);
- ``racer-warm``: RACER with the saved draft state (the default);
- ``pld`` and ``ar``: the other lossless methods, fixed;
- ``auto``: ``decoding.method: auto`` over racer, pld and ar (with the saved state);
- ``racer-row`` (only when ``--order`` names it): RACER with a draft state per row (``decoding.scope:
  request``), so nothing is learned across rows: racer-cold's MAT over it is what the job's other rows add to
  a row's drafts at all, the room a saved state has to raise MAT.

With ``--rounds N`` every contender runs N times, the order reversed in every other round (round 1 in
``--order``, round 2 the other way round, ...), so that a drift of the machine's speed during the run falls on
every contender alike; the figures below then pool the rounds (sums of tokens and actor time) and each round's
own ratio is shown beside them.

Reported:

- **warm state**: the mean over shards of each shard's MAT (output tokens / target forwards), over every shard
  that ``racer-warm`` started from a saved state (``warm_commits`` > 0: every shard after each actor's first),
  against the same shards of ``racer-cold``; tokens per second of those shards beside it (their output tokens
  over their elapsed time);
- **method auto**: per route, the tokens per actor-second (output tokens / the rows' actor time: their share of
  the forwards they were in) of ``auto`` against the best of the fixed methods, measured the same way, and the
  route's choice with its evidence (the manifest's ``method_auto``);
- **method auto's own machinery**, where ``auto-ar`` (method auto with ar its only candidate) and ``ar`` both ran:
  per route and over all rows, auto-ar's tokens per actor-second against fixed ar's (``machinery``);
- **lossless**: every row's text in every contender against ``racer-cold``'s.

Writes ``<out>/warm-auto-<stamp>.json`` and ``.md``. Needs the Redis at ``--redis-url`` (else a private
redis-server) and starts its own local Ray.

    python -m benchmarks.warm_auto --per-group 27 --max-new-tokens 128      # 162 questions, ~1 h on 2 cores
    python -m benchmarks.warm_auto --per-group 27 --rounds 2                # each contender twice, interleaved
    python -m benchmarks.warm_auto --per-group 2 --max-new-tokens 16 --shard-rows 4 --out /tmp/wa   # a check
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks import common
from benchmarks.specbench_job import QUESTIONS, group_of
from racer_batch.report.drafting import method_choice
from racer_batch.service.execution.local import ensure_redis, init_local_ray, run_until_done, shutdown_local_ray
from racer_batch.service.execution.queue import JobQueue, resolve_url
from racer_batch.service.job.spec import load_spec
from racer_batch.service.results.method_auto import figures, pool
from racer_batch.service.results.output import read_manifest, read_output
from racer_batch.service.submit import submit_job

CONTENDERS: dict[str, dict[str, Any]] = {
    "racer-cold": {"decoding.method": "racer", "resources.warm_draft_state": False},
    "racer-warm": {"decoding.method": "racer"},
    "pld": {"decoding.method": "pld"},
    "ar": {"decoding.method": "ar"},
    "auto": {"decoding.method": "auto"},
    # not in the default order: RACER with a draft state per row (decoding.scope request, nothing learned from the
    # job's other rows), the ceiling check of the warm state (what learning across rows adds at all)
    "racer-row": {"decoding.method": "racer", "decoding.scope": "request", "resources.warm_draft_state": False},
    # not in the default order: method auto with ar as its only candidate, against fixed ar (what auto's own
    # machinery changes in a row's measured tokens per actor-second, apart from the candidates sharing forwards)
    "auto-ar": {"decoding.method": "auto", "decoding.auto_methods": ["ar"]},
}
DEFAULT_ORDER = ("racer-cold", "racer-warm", "pld", "ar", "auto")
FIXED = ("racer-warm", "pld", "ar")  # auto is compared with the best of these per route


def sample_rows(questions: Path, per_group: int) -> list[dict]:
    """The first ``per_group`` questions of each group in question order, as job rows
    ``{"id", "route" (= group), "turns"}`` (also ``benchmarks.cross_row``'s sample).

    Raises:
        ValueError: ``per_group`` < 1.
    """
    if per_group < 1:
        raise ValueError(f"--per-group must be >= 1, got {per_group}")
    records = [json.loads(line) for line in questions.read_text(encoding="utf-8").splitlines() if line.strip()]
    taken: dict[str, int] = {}
    rows = []
    for r in sorted(records, key=lambda r: r["question_id"]):
        g = group_of(r["category"])
        if taken.get(g, 0) < per_group:
            taken[g] = taken.get(g, 0) + 1
            rows.append({"id": int(r["question_id"]), "route": g, "turns": list(r["turns"])})
    return rows


def build_input(questions: Path, out: Path, per_group: int) -> list[dict]:
    """:func:`sample_rows`, written as Parquet to ``out``; returns the rows.

    Raises:
        ValueError: ``per_group`` < 1.
    """
    rows = sample_rows(questions, per_group)
    schema = pa.schema([("id", pa.int64()), ("route", pa.string()), ("turns", pa.list_(pa.string()))])
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out)
    return rows


def run_job(queue: JobQueue, url: str, prefix: str, overrides: dict) -> dict:
    """One contender's job, run to its end on the local Ray: its rows, manifest and wall seconds."""
    spec = load_spec(None, overrides)
    sub = submit_job(queue, spec)
    t0 = time.monotonic()
    run = run_until_done(queue, sub.job_id, url=url, prefix=prefix, executor_kind="ray")
    wall_s = time.monotonic() - t0
    if run.state != "done":
        raise RuntimeError(f"job {sub.job_id} ended {run.state}")
    return {"job_id": sub.job_id, "wall_s": wall_s, "rows": read_output(spec.output.path).to_pylist(),
            "manifest": read_manifest(spec.output.path) or {}}


# ---- analysis -------------------------------------------------------------------------------------------------
def _shard_figures(job: dict) -> dict[int, dict]:
    """``{shard: {"mat", "tokens", "steps", "elapsed_s", "warm_commits"}}`` from the manifest's summaries."""
    out = {}
    for key, m in (job["manifest"].get("shards") or {}).items():
        steps = m.get("steps") or 0
        out[int(key)] = {"mat": m["output_tokens"] / steps if steps else None, "tokens": m["output_tokens"],
                         "steps": steps, "elapsed_s": m.get("elapsed_s"), "warm_commits": m.get("warm_commits", 0)}
    return out


def warm_against_cold(warm: dict, cold: dict) -> dict:
    """Mean per-shard MAT (and tokens/s) over the shards ``warm`` started from a saved state, in both runs."""
    w, c = _shard_figures(warm), _shard_figures(cold)
    shards = sorted(s for s, f in w.items() if f["warm_commits"] > 0 and s in c)

    def mean(fig: dict, key: str) -> Optional[float]:
        vals = [fig[s][key] for s in shards if fig[s][key] is not None]
        return sum(vals) / len(vals) if vals else None

    def rate(fig: dict) -> Optional[float]:
        el = sum(fig[s]["elapsed_s"] or 0.0 for s in shards)
        return sum(fig[s]["tokens"] for s in shards) / el if el else None

    out = {"shards": shards, "first_shards": sorted(s for s, f in w.items() if f["warm_commits"] == 0),
           "warm_mean_mat": mean(w, "mat"), "cold_mean_mat": mean(c, "mat"),
           "warm_tokens_per_s": rate(w), "cold_tokens_per_s": rate(c)}
    out["mat_ratio"] = common.ratio(out["warm_mean_mat"], out["cold_mean_mat"])
    out["tokens_per_s_ratio"] = common.ratio(out["warm_tokens_per_s"], out["cold_tokens_per_s"])
    return out


def cross_row(job_scope: dict, row_scope: dict) -> dict:
    """MAT (output tokens / target forwards over all rows) of RACER with the job's state against a state per
    row, and the same over the shards after the first two (where a job state has learned from earlier shards)."""
    def mat(job: dict, shards: Optional[set] = None) -> Optional[float]:
        rows = [r for r in job["rows"] if r["status"] == "ok" and (shards is None or r["shard"] in shards)]
        steps = sum(r["steps"] or 0 for r in rows)
        return sum(r["output_tokens"] or 0 for r in rows) / steps if steps else None

    later = {r["shard"] for r in job_scope["rows"] if r["shard"] >= 2}
    out = {"job_mat": mat(job_scope), "row_mat": mat(row_scope), "job_mat_later": mat(job_scope, later),
           "row_mat_later": mat(row_scope, later)}
    out["ratio"] = common.ratio(out["job_mat"], out["row_mat"])
    out["ratio_later"] = common.ratio(out["job_mat_later"], out["row_mat_later"])
    return out


def mean_of_rounds(per_round: list[dict]) -> dict:
    """``warm_against_cold`` over several rounds: each figure the mean of the rounds', the ratios of those means
    ({} without rounds)."""
    if not per_round:
        return {}
    out = dict(per_round[0])
    for key in ("warm_mean_mat", "cold_mean_mat", "warm_tokens_per_s", "cold_tokens_per_s"):
        vals = [r[key] for r in per_round if r[key] is not None]
        out[key] = sum(vals) / len(vals) if vals else None
    out["mat_ratio"] = common.ratio(out["warm_mean_mat"], out["cold_mean_mat"])
    out["tokens_per_s_ratio"] = common.ratio(out["warm_tokens_per_s"], out["cold_tokens_per_s"])
    out["rounds"] = len(per_round)
    return out


def per_route(job: dict) -> dict[str, dict]:
    """``{route: figures}`` of a job's ok rows (rows, tokens, steps, actor ms, MAT, tokens per actor-second)."""
    acc: dict[str, list] = {}
    for r in job["rows"]:
        if r["status"] != "ok":
            continue
        a = acc.setdefault(r["route"], [0, 0, 0, 0.0])
        busy = r["device_ms"] if r["device_ms"] is not None else (r["prefill_ms"] or 0.0) + (r["decode_ms"] or 0.0)
        a[0], a[1], a[2], a[3] = a[0] + 1, a[1] + (r["output_tokens"] or 0), a[2] + (r["steps"] or 0), a[3] + busy
    return {route: figures(*a) for route, a in sorted(acc.items())}


def auto_against_fixed(jobs: dict[str, dict]) -> dict[str, dict]:
    """Per route: auto's tokens per actor-second, the best fixed method's, their ratio, and auto's choice."""
    routes = {name: per_route(jobs[name]) for name in (*FIXED, "auto") if name in jobs}
    choice = method_choice(jobs["auto"]["rows"], jobs["auto"]["manifest"]) if "auto" in jobs else {}
    out = {}
    for route, auto in routes.get("auto", {}).items():
        fixed = {n: routes[n][route]["tokens_per_s"] for n in FIXED if n in routes and route in routes[n]}
        best = max(fixed, key=fixed.get) if fixed else None
        out[route] = {"auto_tokens_per_s": auto["tokens_per_s"], "fixed_tokens_per_s": fixed, "best_fixed": best,
                      "ratio_to_best": common.ratio(auto["tokens_per_s"], fixed.get(best)),
                      "choice": (choice.get(route) or {}).get("choice"),
                      "evidence": (choice.get(route) or {}).get("candidates", {})}
    return out


def machinery(jobs: dict[str, dict]) -> dict[str, dict]:
    """Per route and over all rows: ``auto-ar``'s tokens per actor-second (method auto with ar its only candidate)
    against fixed ``ar``'s and their ratio, where both ran: what auto's own machinery (the chooser, its evidence,
    the measured step cost) changes in a row's measured rate, with no other candidate sharing its forwards."""
    if "auto-ar" not in jobs or "ar" not in jobs:
        return {}
    got = {name: per_route(jobs[name]) for name in ("auto-ar", "ar")}
    got = {name: {**routes, "all": figures(*(sum(f[k] for f in routes.values()) for k in
                                            ("rows", "tokens", "steps", "busy_ms")))}
           for name, routes in got.items()}
    return {route: {"auto_ar": a["tokens_per_s"], "ar": got["ar"][route]["tokens_per_s"],
                    "ratio": common.ratio(a["tokens_per_s"], got["ar"][route]["tokens_per_s"])}
            for route, a in got["auto-ar"].items() if route in got["ar"]}


def pooled(runs: list[dict]) -> dict:
    """One contender's runs (rounds) as one job: every round's rows, the manifests' ``method_auto`` pooled
    (``results.method_auto.pool``), the wall seconds summed."""
    manifest = dict(runs[0]["manifest"])
    if any(r["manifest"].get("method_auto") for r in runs):
        manifest["method_auto"] = pool(r["manifest"].get("method_auto") for r in runs)
    return {"job_id": ",".join(r["job_id"] for r in runs), "wall_s": sum(r["wall_s"] for r in runs),
            "rows": [row for r in runs for row in r["rows"]], "manifest": manifest}


def round_order(order: list[str], rnd: int) -> list[str]:
    """The contenders' order in round ``rnd`` (0-based): as given in even rounds, reversed in odd ones."""
    return list(order) if rnd % 2 == 0 else list(reversed(order))


def lossless(jobs: dict[str, dict], reference: str = "racer-cold") -> dict[str, int]:
    """Per contender, the rows whose text differs from ``reference``'s (0 everywhere: lossless)."""
    ref = {r["id"]: (r["text"], r["status"]) for r in jobs[reference]["rows"]}
    return {name: sum(ref.get(r["id"]) != (r["text"], r["status"]) for r in job["rows"]) +
            abs(len(job["rows"]) - len(ref)) for name, job in jobs.items()}


# ---- report ---------------------------------------------------------------------------------------------------
def render_md(d: dict) -> str:
    w = d["warm"]
    lines = [f"# Saved draft state and method auto on Spec-Bench ({d['stamp']})", "",
             f"Reproduce: `{d['command']}`", "",
             f"Machine: {common.machine_line(d['machine'])}; load at the end {d['machine'].get('load')}.", "",
             f"Settings: {d['rows']} questions ({d['per_group']} per group, the first in question order; route = "
             f"group), {d['settings']['max_new_tokens']} new tokens, greedy, {d['settings']['num_actors']} actors, "
             f"{d['settings']['streams_per_actor']} rows per forward, {d['settings']['shard_rows']}-row shards; "
             f"jobs run one after the other in this order: {', '.join(d['order'])}"
             + (f", {d.get('rounds', 1)} rounds, the order reversed in every other round; figures pool the rounds "
                "(tokens and actor time summed; the warm/cold means averaged over the rounds)"
                if d.get("rounds", 1) > 1 else "") + ".", "",
             "## Lossless", "", common.md_table(["contender", "rows differing from racer-cold"],
                                                [[k, v] for k, v in d["lossless"].items()]), "",
             "## Saved draft state: shards after each actor's first, warm against cold", ""]
    if w:
        lines += [common.md_table(["round", "shards", "racer-cold mean MAT", "racer-warm mean MAT", "MAT warm / cold",
                                   "cold tokens/s", "warm tokens/s", "tokens/s warm / cold"],
                                  [[label, len(x["shards"]), _r(x["cold_mean_mat"]), _r(x["warm_mean_mat"]),
                                    x["mat_ratio"], _r(x["cold_tokens_per_s"], 1), _r(x["warm_tokens_per_s"], 1),
                                    x["tokens_per_s_ratio"]]
                                   for label, x in _with_rounds(w, d.get("warm_rounds") or [])]), "",
                  f"Shards started cold in racer-warm (each actor's first): {w['first_shards']}; compared: "
                  f"{w['shards']}.", ""]
    else:
        lines += ["(racer-warm did not run.)", ""]
    if d.get("cross_row"):
        c = d["cross_row"]
        lines += ["What learning across rows adds at all: RACER's MAT with the job's draft state (racer-cold) over "
                  "RACER with a state per row (racer-row, `decoding.scope: request`):", "",
                  common.md_table(["rows", "job-state MAT", "per-row MAT", "job / per-row"],
                                  [["all", _r(c["job_mat"]), _r(c["row_mat"]), c["ratio"]],
                                   ["shards 2 and later", _r(c["job_mat_later"]), _r(c["row_mat_later"]),
                                    c["ratio_later"]]]), ""]
    lines += ["## Method auto against the best fixed method, per route", ""]
    per_round = d.get("auto_rounds") or []
    body = [[route, a["choice"], _r(a["auto_tokens_per_s"], 1), a["best_fixed"],
             _r(a["fixed_tokens_per_s"].get(a["best_fixed"]), 1), a["ratio_to_best"],
             " / ".join(str((r.get(route) or {}).get("ratio_to_best")) for r in per_round) if len(per_round) > 1
             else "", ", ".join(f"{m} {_r(t, 1)}" for m, t in a["fixed_tokens_per_s"].items())]
            for route, a in d["auto"].items()]
    lines += [common.md_table(["route", "auto's choice", "auto tokens/actor-s", "best fixed", "its tokens/actor-s",
                               "auto / best", "auto / best per round", "fixed methods"], body), "",
              "Evidence of auto per route (its own rows: rows, MAT, tokens per actor-second per candidate):", "",
              common.md_table(["route", "method", "rows", "MAT", "tokens/actor-s"],
                              [[route, m, f["rows"], f["mat"], f["tokens_per_s"]]
                               for route, a in d["auto"].items() for m, f in a["evidence"].items()]), "",
              *_machinery_md(d),
              "## Jobs", "", common.md_table(["contender", "job", "wall s", "output tokens", "tokens/s (wall)"],
                                             [[n, j["job_id"], _r(j["wall_s"], 1), j["tokens"],
                                               _r(j["tokens"] / j["wall_s"], 1)] for n, j in d["jobs"].items()])]
    return "\n".join(lines) + "\n"


def _machinery_md(d: dict) -> list[str]:
    """The section of ``machinery`` (auto-ar against ar), where both ran."""
    m = d.get("machinery") or {}
    if not m:
        return []
    rounds = d.get("machinery_rounds") or []
    body = [[route, _r(x["auto_ar"], 1), _r(x["ar"], 1), x["ratio"],
             " / ".join(str((r.get(route) or {}).get("ratio")) for r in rounds) if len(rounds) > 1 else ""]
            for route, x in m.items()]
    return ["## Method auto's own machinery: auto with ar its only candidate against fixed ar", "",
            common.md_table(["route", "auto-ar tokens/actor-s", "ar tokens/actor-s", "auto-ar / ar",
                             "auto-ar / ar per round"], body), ""]


def _with_rounds(pooled_fig: dict, per_round: list[dict]) -> list[tuple[str, dict]]:
    """``[(label, figures)]``: each round's, then the pooled one (only the pooled one with a single round)."""
    if len(per_round) <= 1:
        return [("all", pooled_fig)]
    return [(str(i + 1), x) for i, x in enumerate(per_round)] + [("mean", pooled_fig)]


def _r(x: Optional[float], nd: int = 3) -> Optional[float]:
    return None if x is None else round(x, nd)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog("warm_auto"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-group", type=int, default=27, help="questions per Spec-Bench group (6 groups)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-actors", type=int, default=2)
    ap.add_argument("--streams-per-actor", type=int, default=4)
    ap.add_argument("--shard-rows", type=int, default=40)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--capacity", default="4", help="decoding.capacity of every contender (an integer or auto; "
                    "auto's tuner makes a shard's MAT depend on timing, so the default is fixed)")
    ap.add_argument("--order", default=",".join(DEFAULT_ORDER), help="contenders, in the order their jobs run")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every contender, the order reversed in every "
                    "other round; the figures pool the rounds")
    ap.add_argument("--questions", type=Path, default=QUESTIONS)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--prefix", default="racer-batch-bench:")
    ap.add_argument("--work", type=Path, default=common.ROOT / "out" / "warm_auto", help="inputs and job outputs")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    order = [c.strip() for c in args.order.split(",") if c.strip()]
    if not order or any(c not in CONTENDERS for c in order) or "racer-cold" not in order:
        ap.error(f"--order: contenders from {list(CONTENDERS)}, racer-cold among them")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    stamp = common.stamp()
    rows = build_input(args.questions, args.work / f"input-{stamp}.parquet", args.per_group)
    base = {"input.path": str(args.work / f"input-{stamp}.parquet"), "model.name": args.model,
            "generation.max_new_tokens": args.max_new_tokens, "output.shard_rows": args.shard_rows,
            "resources.num_actors": args.num_actors, "resources.streams_per_actor": args.streams_per_actor,
            "resources.torch_threads": 1,
            "decoding.capacity": args.capacity if args.capacity == "auto" else int(args.capacity)}
    url, private = ensure_redis(resolve_url(args.redis_url, None))
    runs: dict[str, list[dict]] = {name: [] for name in order}
    try:
        queue = JobQueue.from_url(url, prefix=args.prefix)
        init_local_ray()
        for rnd in range(args.rounds):
            for name in round_order(order, rnd):
                out_dir = args.work / f"{stamp}-{name}" / f"round{rnd + 1}"
                job = run_job(queue, url, args.prefix, {**base, **CONTENDERS[name], "output.path": str(out_dir)})
                runs[name].append(job)
                print(f"round {rnd + 1} {name}: {job['wall_s']:.0f} s", flush=True)
    finally:
        shutdown_local_ray()
        if private is not None:
            private.stop()
    jobs = {name: pooled(r) for name, r in runs.items() if r}
    rounds = [{name: r[i] for name, r in runs.items() if len(r) > i} for i in range(args.rounds)]
    d = {"stamp": stamp, "command": common.command("warm_auto", argv), "machine": common.machine(),
         "per_group": args.per_group, "rows": len(rows), "order": order, "rounds": args.rounds,
         "settings": {"max_new_tokens": args.max_new_tokens, "num_actors": args.num_actors,
                      "streams_per_actor": args.streams_per_actor, "shard_rows": args.shard_rows, "model": args.model,
                      "capacity": args.capacity},
         "lossless": {name: sum(lossless({**rnd, "racer-cold": rounds[0]["racer-cold"]}).get(name, 0) for rnd in rounds)
                      for name in order},
         "warm_rounds": [warm_against_cold(rnd["racer-warm"], rnd["racer-cold"]) for rnd in rounds
                         if "racer-warm" in rnd and "racer-cold" in rnd],
         "auto": auto_against_fixed(jobs) if "auto" in jobs else {},
         "cross_row": cross_row(jobs["racer-cold"], jobs["racer-row"]) if "racer-row" in jobs else {},
         "auto_rounds": [auto_against_fixed(rnd) for rnd in rounds if "auto" in rnd],
         "machinery": machinery(jobs), "machinery_rounds": [machinery(rnd) for rnd in rounds],
         "jobs": {f"{n} (round {i + 1})": {"job_id": j["job_id"], "wall_s": j["wall_s"],
                                           "tokens": sum(r["output_tokens"] or 0 for r in j["rows"])}
                  for n, r in runs.items() for i, j in enumerate(r)}}
    d["warm"] = mean_of_rounds(d["warm_rounds"])
    md = render_md(d)
    common.write_results(args.out, f"warm-auto-{stamp}", d, md)
    print(md)
    return 0 if not any(d["lossless"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
