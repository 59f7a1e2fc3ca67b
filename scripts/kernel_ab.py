"""Our CPU kernels at two git revisions, timed in alternating processes (one run, interleaved rounds).

``torch.ops.racer`` can hold one build per process, so the two revisions cannot share a process: each round
runs a child process per revision (the revision's ``racer_batch`` package unpacked from ``git archive`` into a
temporary folder, its kernels built once into the usual cache, keyed by their source), ``base`` then ``head``
in one round and ``head`` then ``base`` in the next, and each child times

- ``attention``: 30 layers of ``racer.attention_seg`` (SmolLM2-135M's heads: 9 query, 3 KV, head_dim 64) for B
  streams of T tree rows each over ``ctx`` cached positions, every layer its own KV (read cold, as in a
  verify forward);
- ``verify`` (unless ``--no-verify``): one whole batched verify forward of the default model
  (``StaticRunner.verify_batch``, chain trees of T nodes over ``ctx`` prefilled random tokens per stream).

Per config the report gives each revision's median over rounds of its best-of-repeats ms and the median of
the per-round ratios head / base (below 1: head faster). Writes ``<out>/kernel-ab-<stamp>.json`` and ``.md``.

    python scripts/kernel_ab.py --base HEAD~1 --head WORKTREE --configs 4x500x3,1x500x4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(int(sys.argv[4]))
from racer_batch.engine.kernels import cpu_ops
configs = [tuple(int(v) for v in c.split("x")) for c in sys.argv[2].split(",")]
repeats, verify = int(sys.argv[3]), sys.argv[5] == "1"
ops = cpu_ops()
out = {"isa": ops.isa(), "attention_ms": {}, "verify_ms": {}}
g = torch.Generator().manual_seed(0)
nq, nkv, d, layers = 9, 3, 64, 30
def best(f):
    f()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3
for b, ctx, t in configs:
    keys = [torch.randn(b, nkv, ctx + t, d, generator=g) for _ in range(layers)]
    vals = [torch.randn(b, nkv, ctx + t, d, generator=g) for _ in range(layers)]
    q = torch.randn(b * t, nq, d, generator=g)
    seg = torch.tensor([[i, ctx, i * t] for i in range(b)], dtype=torch.long)
    mask = torch.zeros(b * t, ctx + t)
    def att():
        for li in range(layers):
            ops.attention_seg(q, keys[li], vals[li], seg, mask, 0.125)
    out["attention_ms"][f"{b}x{ctx}x{t}"] = best(att)
if verify:
    from racer_batch.drafters.base import Draft
    from racer_batch.engine.static_runner import StaticRunner
    from racer_batch.engine.tree import flatten_tree
    from racer_batch.models import load_model
    bundle = load_model("smollm2-135m")
    runner = StaticRunner(bundle, slots=max(b for b, _, _ in configs))
    runner.warmup([4, 16])
    for b, ctx, t in configs:
        caches = []
        for _ in range(b):
            c = runner.new_cache(ctx + 64)
            runner.prefill(torch.randint(0, 49000, (ctx,), generator=g).tolist(), cache=c, topk=0)
            caches.append(c)
        trees = [flatten_tree(Draft.chain(torch.randint(0, 49000, (t,), generator=g).tolist()),
                              committed_len=c.length, device="cpu", dtype=torch.float32) for c in caches]
        items = list(zip(trees, caches))
        step = ((lambda: runner.verify_tree(trees[0], cache=caches[0])) if b == 1
                else (lambda: runner.verify_batch(items)))
        out["verify_ms"][f"{b}x{ctx}x{t}"] = best(step)
        for c in caches:
            runner.release(c)
print("RESULT " + json.dumps(out))
'''


def unpack(rev: str, dest: Path) -> Path:
    """The ``racer_batch`` package of ``rev`` (``WORKTREE``: this checkout as it is) under ``dest``."""
    if rev == "WORKTREE":
        return ROOT
    dest.mkdir(parents=True, exist_ok=True)
    tar = dest / "src.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(tar), rev, "racer_batch"], check=True)
    with tarfile.open(tar) as tf:
        tf.extractall(dest, filter="data")
    return dest


def describe(rev: str) -> str:
    """``rev`` with the commit it named when the run was made (the worktree: HEAD's, and whether it was dirty)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, check=False).stdout.strip()
    if rev == "WORKTREE":
        dirty = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
        return f"WORKTREE (at {git('rev-parse', '--short', 'HEAD')}{dirty})"
    return f"{rev} ({git('rev-parse', '--short', rev)})"


def run_child(src: Path, configs: str, repeats: int, threads: int, verify: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(src), configs, str(repeats), str(threads),
                           "1" if verify else "0"], capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"child for {src} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def summarize(rounds: list[dict], configs: list[str]) -> list[dict]:
    rows = []
    for kind in ("attention_ms", "verify_ms"):
        for c in configs:
            base = [r["base"][kind][c] for r in rounds if c in r["base"][kind]]
            head = [r["head"][kind][c] for r in rounds if c in r["head"][kind]]
            if not base:
                continue
            ratios = [h / b for h, b in zip(head, base)]
            rows.append({"what": kind[:-3], "config": c, "base_ms": round(statistics.median(base), 2),
                         "head_ms": round(statistics.median(head), 2),
                         "head_over_base": round(statistics.median(ratios), 3),
                         "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)})
    return rows


def render_md(d: dict) -> str:
    lines = [f"# Kernels at two revisions, interleaved ({d['stamp']})", "",
             f"Reproduce: `{d['command']}`", "",
             f"Machine: {d['machine']}; kernels ISA {d['isa']}; {d['rounds']} rounds, each revision in its own "
             f"process per round (order alternated), best of {d['repeats']} repeats in each.", "",
             f"base = `{d['base']}`, head = `{d['head']}`. Config BxCTXxT: B streams of T tree rows over CTX "
             "cached positions (attention: 30 layers of `attention_seg`, cold KV per layer; verify: one batched "
             "verify forward of smollm2-135m).", "",
             "| what | config | base ms | head ms | head / base (median of rounds) | min..max |",
             "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['what']} | {r['config']} | {r['base_ms']} | {r['head_ms']} | {r['head_over_base']} | "
                     f"{r['ratio_min']}..{r['ratio_max']} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="git revision to compare against (e.g. HEAD~1)")
    p.add_argument("--head", default="WORKTREE", help="git revision, or WORKTREE (this checkout; default)")
    p.add_argument("--configs", default="4x500x3,4x800x4,1x500x4,1x800x3", help="BxCTXxT, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-verify", action="store_true", help="time attention only (no model load)")
    p.add_argument("--out", default=str(ROOT / "benchmarks"))
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        parts = c.split("x")
        if len(parts) != 3 or not all(v.isdigit() and int(v) > 0 for v in parts):
            p.error(f"--configs: {c!r} is not BxCTXxT with positive integers")
    if args.rounds < 1 or args.repeats < 1:
        p.error("--rounds and --repeats must be >= 1")
    stamp = time.strftime("%Y%m%d-%H%M%S") + (f"-{args.tag}" if args.tag else "")
    from racer_batch.bench import cpu_name
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        src = {"base": unpack(args.base, Path(tmp) / "base"), "head": unpack(args.head, Path(tmp) / "head")}
        rounds, isa = [], ""
        for i in range(args.rounds):
            order = ("base", "head") if i % 2 == 0 else ("head", "base")
            got = {}
            for name in order:
                got[name] = run_child(src[name], ",".join(configs), args.repeats, args.threads, not args.no_verify)
                isa = got[name]["isa"]
                print(f"round {i + 1} {name}: {got[name]}", flush=True)
            rounds.append(got)
    d = {"command": "python scripts/kernel_ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
         "stamp": stamp, "machine": f"{cpu_name()} ({os.cpu_count()} cores), {platform.python_version()}",
         "isa": isa, "base": describe(args.base), "head": describe(args.head), "rounds": args.rounds,
         "repeats": args.repeats, "configs": configs, "rows": summarize(rounds, configs), "raw": rounds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kernel-ab-{stamp}.json").write_text(json.dumps(d, indent=1))
    (out / f"kernel-ab-{stamp}.md").write_text(render_md(d))
    print(render_md(d))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
