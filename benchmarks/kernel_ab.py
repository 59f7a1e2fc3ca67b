"""Our CPU kernels at two git revisions, timed in alternating processes (one run, interleaved rounds).

``torch.ops.racer`` can hold one build per process, so the two revisions cannot share a process: each round
runs a child process per revision, ``base`` then ``head`` in one round and ``head`` then ``base`` in the next.
The revision's ``racer_batch`` package is unpacked from ``git archive`` into a temporary folder SRC (or, for
``WORKTREE``, is this checkout); the child, ``python -m benchmarks.kernel_ab --child SRC`` started by
``benchmarks.common.run_child``, has ``PYTHONPATH`` starting with SRC and checks that ``racer_batch`` came from
there; the revision's kernels are built once into the usual cache, keyed by their source. Each child times

- ``attention``: 30 layers of ``racer.attention_seg`` (SmolLM2-135M's heads: 9 query, 3 KV, head_dim 64) for B
  streams of T tree rows each over ``ctx`` cached positions, every layer its own KV (read cold, as in a
  verify forward);
- ``verify`` (unless ``--no-verify``): one whole batched verify forward of the default model
  (``StaticRunner.verify_batch``, chain trees of T nodes over ``ctx`` prefilled random tokens per stream).

Per config the report gives each revision's median over rounds of its best-of-repeats ms and the median of
the per-round ratios head / base (below 1: head faster); a child's time is the fastest of ``--repeats`` calls
after one untimed call. Writes ``<out>/kernel-ab-<stamp>.json`` and ``.md``.

    python -m benchmarks.kernel_ab --base HEAD~1 --head WORKTREE --configs 4x500x3,1x500x4 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks import common

DEFAULT_CONFIGS = "4x500x3,4x800x4,1x500x4,1x800x3"
# SmolLM2-135M's attention: query heads, KV heads, head size, layers
N_Q, N_KV, HEAD_DIM, LAYERS = 9, 3, 64, 30
VOCAB = 49000  # random token ids below this (SmolLM2's vocabulary has 49,152)


# =====================================================================================================
# child side: runs against the revision's racer_batch (PYTHONPATH starts with its folder), which may be older
# than this harness: racer_batch is imported inside the functions, and only what older revisions had
# =====================================================================================================
def parse_configs(text: str) -> list[tuple[int, int, int]]:
    """``"4x500x3,1x800x4"`` -> ``[(4, 500, 3), (1, 800, 4)]`` (B streams, CTX cached positions, T tree rows).

    Raises:
        ValueError: an item that is not BxCTXxT with positive integers, or no item at all.
    """
    out = []
    for item in filter(None, (c.strip() for c in text.split(","))):
        parts = item.split("x")
        if len(parts) != 3 or not all(v.isdigit() and int(v) > 0 for v in parts):
            raise ValueError(f"--configs: {item!r} is not BxCTXxT with positive integers")
        b, ctx, t = (int(v) for v in parts)
        out.append((b, ctx, t))
    if not out:
        raise ValueError("--configs is empty")
    return out


def label(config: tuple[int, int, int]) -> str:
    """``(4, 500, 3)`` -> ``"4x500x3"``."""
    return "x".join(str(v) for v in config)


def best_ms(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, in ms, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def _attention_layers(ops: Any, q: Any, keys: list, vals: list, seg: Any, mask: Any) -> None:
    for k, v in zip(keys, vals):
        ops.attention_seg(q, k, v, seg, mask, 0.125)


def time_attention(ops: Any, configs: list[tuple[int, int, int]], repeats: int, gen: Any) -> dict[str, float]:
    """ms per config of ``LAYERS`` calls of ``ops.attention_seg``, each layer its own random KV (read cold)."""
    import torch

    out = {}
    for b, ctx, t in configs:
        keys = [torch.randn(b, N_KV, ctx + t, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
        vals = [torch.randn(b, N_KV, ctx + t, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
        q = torch.randn(b * t, N_Q, HEAD_DIM, generator=gen)
        seg = torch.tensor([[i, ctx, i * t] for i in range(b)], dtype=torch.long)
        mask = torch.zeros(b * t, ctx + t)
        run = functools.partial(_attention_layers, ops, q, keys, vals, seg, mask)
        out[label((b, ctx, t))] = best_ms(run, repeats)
    return out


def time_verify(configs: list[tuple[int, int, int]], repeats: int, gen: Any) -> dict[str, float]:
    """ms per config of one verify forward of smollm2-135m (``StaticRunner``): B chain trees of T nodes, each
    over CTX prefilled random tokens; ``verify_tree`` at B = 1, ``verify_batch`` above."""
    import torch

    from racer_batch.drafters.base import Draft
    from racer_batch.engine.static_runner import StaticRunner
    from racer_batch.engine.tree import flatten_tree
    from racer_batch.models import load_model

    runner = StaticRunner(load_model("smollm2-135m"), slots=max(b for b, _, _ in configs))
    runner.warmup([4, 16])
    out = {}
    for b, ctx, t in configs:
        caches = []
        for _ in range(b):
            cache = runner.new_cache(ctx + 64)
            runner.prefill(torch.randint(0, VOCAB, (ctx,), generator=gen).tolist(), cache=cache, topk=0)
            caches.append(cache)
        trees = [flatten_tree(Draft.chain(torch.randint(0, VOCAB, (t,), generator=gen).tolist()),
                              committed_len=c.length, device="cpu", dtype=torch.float32) for c in caches]
        if b == 1:
            step = functools.partial(runner.verify_tree, trees[0], cache=caches[0])
        else:
            step = functools.partial(runner.verify_batch, list(zip(trees, caches)))
        out[label((b, ctx, t))] = best_ms(step, repeats)
        for cache in caches:
            runner.release(cache)
    return out


def child_main(src: str, configs: list[tuple[int, int, int]], repeats: int, threads: int, verify: bool) -> int:
    """The child process: times the revision's kernels in ``src``; prints the ``RESULT`` line
    ``common.run_child`` reads (``isa``, ``attention_ms`` and ``verify_ms``: config -> ms).

    Raises:
        SystemExit: ``racer_batch`` was not imported from ``src`` (``common.check_origin``), or this build has
            no CPU kernels.
    """
    common.check_origin(src)
    import torch

    torch.set_num_threads(threads)
    from racer_batch.engine.kernels import cpu_ops

    ops = cpu_ops()
    if ops is None:
        raise SystemExit(f"the CPU kernels of {src} are not available here (cpu_ops() is None)")
    gen = torch.Generator().manual_seed(0)
    out = {"isa": ops.isa(), "attention_ms": time_attention(ops, configs, repeats, gen), "verify_ms": {}}
    if verify:
        out["verify_ms"] = time_verify(configs, repeats, gen)
    common.print_result(out)
    return 0


# =====================================================================================================
# parent side: revisions, rounds, summary, report
# =====================================================================================================
def summarize(rounds: list[dict], configs: list[str]) -> list[dict]:
    """One row per kind (attention, verify) and config: each revision's median over rounds (ms) and the
    median, min and max of the per-round ratios head / base."""
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
    """The report: how it was run, the machine, one table line per kind and config."""
    table = common.md_table(
        ["what", "config", "base ms", "head ms", "head / base (median of rounds)", "min..max"],
        [[r["what"], r["config"], r["base_ms"], r["head_ms"], r["head_over_base"],
          f"{r['ratio_min']}..{r['ratio_max']}"] for r in d["rows"]])
    lines = [f"# Kernels at two revisions, interleaved ({d['stamp']})", "",
             f"Reproduce: `{d['command']}`", "",
             f"Machine: {common.machine_line(d['machine'])}, Python {d['machine']['python']}, torch "
             f"{d['machine']['torch']}; kernels ISA {d['isa']}; {d['rounds']} rounds, each revision in its own "
             f"process per round (order alternated), best of {d['repeats']} repeats in each.", "",
             f"base = `{d['base']}`, head = `{d['head']}`. Config BxCTXxT: B streams of T tree rows over CTX "
             "cached positions (attention: 30 layers of `attention_seg`, cold KV per layer; verify: one batched "
             "verify forward of smollm2-135m).", "", table]
    return "\n".join(lines) + "\n"


def measure(base: str, head: str, configs: list[str], *, rounds: int, repeats: int, threads: int,
            verify: bool) -> tuple[list[dict], str]:
    """Every round's child results (``{"base": ..., "head": ...}`` per round) and the kernels' ISA.

    Raises:
        subprocess.CalledProcessError: a revision could not be unpacked (``common.unpack``).
        RuntimeError: a child failed or printed no result.
    """
    args = ["--configs", ",".join(configs), "--repeats", str(repeats), "--threads", str(threads),
            *([] if verify else ["--no-verify"])]
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        src = {"base": common.unpack(base, Path(tmp) / "base"), "head": common.unpack(head, Path(tmp) / "head")}
        got_rounds, isa = [], ""
        for i in range(rounds):
            order = ("base", "head") if i % 2 == 0 else ("head", "base")
            got = {}
            for name in order:
                got[name] = common.run_child("kernel_ab", ["--child", str(src[name]), *args], src=src[name],
                                             tmp=Path(tmp), what=f"{name}, round {i + 1}")
                isa = got[name]["isa"]
                print(f"round {i + 1} {name}: {got[name]}", flush=True)
            got_rounds.append(got)
    return got_rounds, isa


def main(argv: Optional[list[str]] = None) -> int:
    """The command line (``--help``; ``--child SRC`` is a child process's mode); returns the exit status.

    Raises:
        SystemExit: bad options (status 2), or a child whose ``racer_batch`` came from elsewhere.
        RuntimeError: a child failed (:func:`measure`).
    """
    p = argparse.ArgumentParser(prog=common.prog("kernel_ab"), description=__doc__.split("\n")[0])
    p.add_argument("--base", default=None, help="git revision to compare against (e.g. HEAD~1; required)")
    p.add_argument("--head", default="WORKTREE", help="git revision, or WORKTREE (this checkout; default)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="BxCTXxT, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-verify", action="store_true", help="time attention only (no model load)")
    p.add_argument("--out", default=str(common.OUT))
    p.add_argument("--tag", default="")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        parsed = parse_configs(args.configs)
    except ValueError as exc:
        p.error(str(exc))
    if args.rounds < 1 or args.repeats < 1:
        p.error("--rounds and --repeats must be >= 1")
    if args.child:
        return child_main(args.child, parsed, args.repeats, args.threads, not args.no_verify)
    if args.base is None:
        p.error("the following arguments are required: --base")
    stamp = common.stamp() + (f"-{args.tag}" if args.tag else "")
    configs = [label(c) for c in parsed]
    rounds, isa = measure(args.base, args.head, configs, rounds=args.rounds, repeats=args.repeats,
                          threads=args.threads, verify=not args.no_verify)
    d = {"command": common.command("kernel_ab", argv),
         "stamp": stamp, "machine": common.machine(), "isa": isa, "base": common.describe(args.base),
         "head": common.describe(args.head), "rounds": args.rounds, "repeats": args.repeats, "configs": configs,
         "rows": summarize(rounds, configs), "raw": rounds}
    md = render_md(d)
    jpath, mpath = common.write_results(args.out, f"kernel-ab-{stamp}", d, md)
    print(md)
    print(f"wrote {jpath} and {mpath}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
