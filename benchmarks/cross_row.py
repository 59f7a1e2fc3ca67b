"""What a job's rows teach each other's drafts: RACER's MAT under four draft-state scopes (issue 30).

Issue 30 asks a saved draft state to raise the mean MAT of every shard after each actor's first by >= 1.15x over
the same shards run cold. A saved state can only add what *other* rows taught the automaton and the copy-logit
store, so this module measures that room directly, without the service's timing: one engine (batch size 1, the
rows one after another in question order, each row's ``turns`` answered in turn as the service answers them),
greedy, so every scope gives the same text and only the steps differ. The rows are cut into ``--shard-rows``-row
shards; with ``--actors`` actors shard ``i`` goes to actor ``i % actors``. Scopes (each a whole run):

- ``row``: a fresh state per row: nothing is learned across rows (``decoding.scope: request``);
- ``shard``: a fresh state per shard: every shard starts empty (what the issue's text calls today's behaviour);
- ``actor``: one state per actor, kept across its shards (the service's cold run, ``warm_draft_state: false``);
- ``job``: one state over every row in order: every actor's rows at once, as if each commit's saved state were
  merged into every actor before its next row: an upper bound on what a saved state can add over ``actor``.

MAT is counted as the service counts it (output tokens over target forwards, the prefill one forward), over the
shards after each actor's first (shard index >= ``--actors``), pooled (sums of tokens and steps) and per route.
Every (capacity, max_nodes) pair of ``--capacities`` x ``--max-nodes`` runs every scope, each in its own child
process (``--jobs`` at a time, ``torch`` threads split between them).

Writes ``<out>/cross-row-<stamp>.json`` and ``.md``.

    python -m benchmarks.cross_row --per-group 27                                 # 162 questions
    python -m benchmarks.cross_row --per-group 2 --max-new-tokens 16 --shard-rows 2 --capacities 4 --out /tmp/cr
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks import common
from benchmarks.specbench_job import QUESTIONS
from benchmarks.warm_auto import sample_rows

SCOPES = ("row", "shard", "actor", "job")


def state_key(scope: str, index: int, shard_rows: int, actors: int) -> int:
    """Which draft state row ``index`` runs on under ``scope`` (a new key starts an empty state).

    >>> [state_key("shard", i, 2, 2) for i in range(5)], [state_key("actor", i, 2, 2) for i in range(5)]
    ([0, 0, 1, 1, 2], [0, 0, 1, 1, 0])
    """
    if scope == "row":
        return index
    if scope == "shard":
        return index // shard_rows
    if scope == "actor":
        return (index // shard_rows) % actors
    if scope == "job":
        return 0
    raise ValueError(f"unknown scope {scope!r}; one of {SCOPES}")


def run_scope(args: argparse.Namespace) -> dict:
    """One scope at one (capacity, max_nodes): every row's tokens, steps and text (a child's work)."""
    import torch

    from racer_batch import DecodingConfig, Engine, GenerationParams, load_model

    torch.set_num_threads(args.threads)
    rows = sample_rows(args.questions, args.per_group)
    engine = Engine(load_model(args.model), DecodingConfig(method="racer", capacity=args.capacity,
                                                           max_nodes=args.max_nodes, scope="job"))
    params = GenerationParams(max_new_tokens=args.max_new_tokens)
    states: dict[int, Any] = {}
    out = []
    t0 = time.perf_counter()
    for i, row in enumerate(rows):
        key = state_key(args.scope, i, args.shard_rows, args.actors)
        if key not in states:
            states[key] = engine.new_state()
        chat: list[dict] = []
        tokens = steps = 0
        texts = []
        for turn in row["turns"]:
            chat.append({"role": "user", "content": turn})
            res = engine.generate(chat, params, state=states[key])
            tokens += res.stats.emitted_tokens
            steps += res.stats.steps
            texts.append(res.text)
            chat.append({"role": "assistant", "content": res.text})
        out.append({"id": row["id"], "route": row["route"], "shard": i // args.shard_rows, "tokens": tokens,
                    "steps": steps, "text": texts})
    return {"scope": args.scope, "capacity": args.capacity, "max_nodes": args.max_nodes,
            "wall_s": round(time.perf_counter() - t0, 1), "rows": out}


def slim(run: dict) -> dict:
    """A run as the results file keeps it: each row's text replaced by its SHA-256 (the texts are what the
    lossless check compares, already counted by :func:`analyse`; kept whole they would be ~100 KB a run)."""
    return {**run, "rows": [{**r, "text": hashlib.sha256(json.dumps(r["text"]).encode()).hexdigest()[:16]}
                            for r in run["rows"]]}


def _mat(rows: list[dict]) -> Optional[float]:
    steps = sum(r["steps"] for r in rows)
    return sum(r["tokens"] for r in rows) / steps if steps else None


def analyse(runs: list[dict], actors: int) -> list[dict]:
    """Per (capacity, max_nodes): each scope's MAT over the shards after each actor's first, pooled and per
    route, the ratios against ``actor`` (the service's cold run) and ``row``, and the rows whose text differs
    from the ``row`` scope's."""
    out = []
    for cap, nodes in sorted({(r["capacity"], r["max_nodes"]) for r in runs}):
        by = {r["scope"]: r for r in runs if (r["capacity"], r["max_nodes"]) == (cap, nodes)}
        late = {s: [x for x in r["rows"] if x["shard"] >= actors] for s, r in by.items()}
        routes = sorted({x["route"] for rs in late.values() for x in rs})
        fig: dict[str, Any] = {"capacity": cap, "max_nodes": nodes, "scopes": {}}
        for s, rs in late.items():
            fig["scopes"][s] = {
                "mat": _mat(rs), "mat_all_rows": _mat(by[s]["rows"]), "wall_s": by[s]["wall_s"],
                "routes": {g: _mat([x for x in rs if x["route"] == g]) for g in routes},
                "rows_differing_from_row_scope": (sum(a["text"] != b["text"] for a, b in
                                                      zip(by[s]["rows"], by["row"]["rows"])) if "row" in by else None),
            }
        sc = fig["scopes"]
        for s in sc:
            for base in ("actor", "row", "shard"):
                if base in sc:
                    sc[s][f"over_{base}"] = common.ratio(sc[s]["mat"], sc[base]["mat"])
        out.append(fig)
    return out


def render(data: dict) -> str:
    a = data["args"]
    lines = [f"# Cross-row learning: RACER's MAT by draft-state scope ({data['stamp']})", "",
             common.machine_line(data["machine"]), "",
             f"{data['rows']} Spec-Bench questions (the first {a['per_group']} of each group), "
             f"{a['max_new_tokens']} new tokens per turn, greedy, batch size 1, {a['shard_rows']}-row shards over "
             f"{a['actors']} actors; MAT over the shards after each actor's first (shard >= {a['actors']}). "
             f"`{data['command']}`", ""]
    head = ["capacity", "max_nodes"] + [f"{s} MAT" for s in SCOPES] + ["job / actor", "job / shard", "job / row",
                                                                       "actor / row"]
    body = []
    for f in data["figures"]:
        sc = f["scopes"]
        mats = [round(sc[s]["mat"], 3) if s in sc and sc[s]["mat"] else "" for s in SCOPES]
        body.append([f["capacity"], f["max_nodes"], *mats, sc.get("job", {}).get("over_actor"),
                     sc.get("job", {}).get("over_shard"), sc.get("job", {}).get("over_row"),
                     sc.get("actor", {}).get("over_row")])
    lines += [common.md_table(head, body), ""]
    for f in data["figures"]:
        sc = f["scopes"]
        if "job" not in sc or "actor" not in sc:
            continue
        routes = sorted(sc["job"]["routes"])
        lines += [f"Per route, capacity {f['capacity']}, max_nodes {f['max_nodes']} (MAT job / actor, job / row):",
                  "", common.md_table(["route", "job / actor", "job / row"], [
                      [g, common.ratio(sc["job"]["routes"][g], sc["actor"]["routes"].get(g)),
                       common.ratio(sc["job"]["routes"][g], sc.get("row", {}).get("routes", {}).get(g))]
                      for g in routes]), ""]
    diff = {f"{f['capacity']}/{f['max_nodes']}/{s}": v["rows_differing_from_row_scope"]
            for f in data["figures"] for s, v in f["scopes"].items()}
    lines += [f"Lossless: rows whose text differs from the `row` scope's: {diff}", ""]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog("cross_row"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-group", type=int, default=27, help="questions per Spec-Bench group (6 groups)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--shard-rows", type=int, default=40)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--capacities", type=common.int_list, default=[4, 16], help="decoding.capacity values, e.g. 4,16")
    ap.add_argument("--max-nodes", type=common.int_list, default=[10_000], help="automaton node budgets")
    ap.add_argument("--scopes", default=",".join(SCOPES))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--jobs", type=int, default=2, help="child processes at a time")
    ap.add_argument("--questions", type=Path, default=QUESTIONS)
    ap.add_argument("--out", type=Path, default=common.OUT)
    # a child's own arguments
    ap.add_argument("--scope", help=argparse.SUPPRESS)
    ap.add_argument("--capacity", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    scopes = [s for s in args.scopes.split(",") if s]
    if not scopes or any(s not in SCOPES for s in scopes):
        ap.error(f"--scopes: some of {list(SCOPES)}")
    if min(args.shard_rows, args.actors, args.jobs, args.max_new_tokens) < 1:
        ap.error("--shard-rows, --actors, --jobs and --max-new-tokens must be >= 1")
    if args.scope:  # a child: one scope at one capacity and node budget
        args.max_nodes = args.max_nodes[0]
        args.result.write_text(json.dumps(run_scope(args)))
        return 0
    rows = len(sample_rows(args.questions, args.per_group))
    threads = max(1, (os.cpu_count() or 2) // args.jobs)
    tasks = [(c, n, s) for c in args.capacities for n in args.max_nodes for s in scopes]
    tmp = args.out / f".cross-row-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    pending, running, runs = list(tasks), [], []
    while pending or running:
        while pending and len(running) < args.jobs:
            c, n, s = pending.pop(0)
            res = tmp / f"{c}-{n}-{s}.json"
            cmd = [sys.executable, "-m", "benchmarks.cross_row", "--scope", s, "--capacity", str(c), "--max-nodes",
                   str(n), "--threads", str(threads), "--result", str(res), "--per-group", str(args.per_group),
                   "--max-new-tokens", str(args.max_new_tokens), "--shard-rows", str(args.shard_rows), "--actors",
                   str(args.actors), "--model", args.model, "--questions", str(args.questions)]
            running.append((subprocess.Popen(cmd, cwd=common.ROOT), res, (c, n, s)))
        time.sleep(1.0)
        for item in list(running):
            proc, res, what = item
            if proc.poll() is None:
                continue
            running.remove(item)
            if proc.returncode != 0:
                raise RuntimeError(f"child {what} exited {proc.returncode}")
            runs.append(json.loads(res.read_text()))
            res.unlink()
            print(f"done {what}: MAT {_mat(runs[-1]['rows']):.3f}, {runs[-1]['wall_s']} s", flush=True)
    tmp.rmdir()
    stamp = common.stamp()
    data = {"stamp": stamp, "machine": common.machine(), "command": common.command("cross_row", argv),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("scope", "capacity", "threads", "result")},
            "rows": rows, "figures": analyse(runs, args.actors), "runs": [slim(r) for r in runs]}
    md = render(data)
    paths = common.write_results(args.out, f"cross-row-{stamp}", data, md)
    print(md)
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
