"""The stored GEMM's two paths side by side per row count (issue 31): weights expanded in registers
(``stored_rows_gemm``) against each 128-k chunk expanded into an L1 buffer for the float32 micro-kernels, on the
weight shapes of a GGUF model (default SmolLM2-135M: q/k/v, o, gate/up, down and the tied Q8_0 output layer).

For each instruction set, shape and row count M, the two paths are timed alternately (``--rounds`` rounds of
``--reps`` calls each, median per round), so machine drift hits both alike; both give the same bits
(tests/engine/test_stored_kernels.py). The verdict per M (registers / buffer, time summed over the shapes as a
forward weights them: each shape once) is what ``STORED_ROWS_AVX2`` / ``STORED_ROWS_AVX512`` in cpu_kernels.cpp
were set from. Writes ``<out>/stored-gemm-<stamp>.json`` and ``.md``.

    python -m benchmarks.stored_gemm
    python -m benchmarks.stored_gemm --rows 1,4,8,16 --isas avx2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial

import torch

from benchmarks import common

BIG = 1 << 30  # set_stored_rows: every row count through the registers


def time_call(fn, reps: int) -> float:
    """Median ms of ``reps`` calls of ``fn`` (after one warm call)."""
    fn()
    return common.median_ms(fn, reps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a GGUF model whose weight shapes are timed")
    ap.add_argument("--rows", default="1,2,4,6,8,12,16,24,32,64,256", help="row counts M (comma list)")
    ap.add_argument("--isas", default="", help="comma list (default: every one this CPU runs)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per (shape, M)")
    ap.add_argument("--reps", type=int, default=9, help="calls per round (median taken)")
    ap.add_argument("--out", default=str(common.OUT), help="results folder (default: the repository's benchmarks/)")
    args = ap.parse_args(argv)

    from racer_batch.engine.kernels import cpu_ops
    from racer_batch.models import load_model

    ops = cpu_ops()
    if ops is None:
        sys.exit("our CPU kernels are unavailable here: nothing to measure")
    bundle = load_model(args.model, weights="as_stored")
    shapes: dict[tuple, tuple[str, object]] = {}
    for name, w in bundle.stored.weights.items():
        shapes.setdefault((tuple(w.packed.shape), w.fmt), (name, w))
    isas = [s for s in args.isas.split(",") if s] or (
        ["avx512", "avx2"] if "avx512f" in open("/proc/cpuinfo").read().split() else ["avx2"])
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for isa in isas:
        old_isa = ops.set_isa(isa)
        for m in rows:
            per_path = {"registers": 0.0, "buffer": 0.0}
            for (_shape, fmt), (name, w) in shapes.items():
                n, k = w.packed.shape[0] * 16, w.packed.shape[1] * 32
                x = torch.randn(m, k)
                out = torch.empty(m, n)
                med = {"registers": [], "buffer": []}
                for _ in range(args.rounds):
                    for path, lim in (("registers", BIG), ("buffer", 0)):
                        old = ops.set_stored_rows(lim)
                        med[path].append(time_call(partial(ops.stored_linear_into_, out, x, w.packed, fmt, None),
                                                   args.reps))
                        ops.set_stored_rows(old)
                row = {"isa": isa, "rows": m, "weight": name, "fmt": int(fmt), "n": n, "k": k}
                for path in med:
                    ms = statistics.median(med[path])
                    row[f"{path}_ms"] = round(ms, 4)
                    row[f"{path}_gmacs"] = round(m * n * k / ms / 1e6, 1)
                    per_path[path] += ms
                results.append(row)
            results.append({"isa": isa, "rows": m, "weight": "(all shapes)",
                            "registers_ms": round(per_path["registers"], 4), "buffer_ms": round(per_path["buffer"], 4),
                            "buffer_over_registers": round(per_path["buffer"] / per_path["registers"], 3)})
            print(json.dumps(results[-1]))
        ops.set_isa(old_isa)
    stamp = common.stamp()
    command = common.command("stored_gemm", argv)
    machine = common.machine()
    lines = [f"# Stored GEMM: registers vs chunk buffer {stamp}", "", f"Reproduce: `{command}`", "",
             f"Machine: {common.machine_line(machine)}; {torch.get_num_threads()} threads; model {args.model}; "
             f"medians of {args.rounds} alternating rounds of {args.reps} calls.", "",
             "Summed over the model's weight shapes (each once); > 1 in the last column: the registers are faster.",
             "", "| ISA | rows | registers ms | buffer ms | buffer / registers |", "|---|---|---|---|---|"]
    lines += [f"| {r['isa']} | {r['rows']} | {r['registers_ms']} | {r['buffer_ms']} | {r['buffer_over_registers']} |"
              for r in results if r["weight"] == "(all shapes)"]
    lines += ["", "Per shape:", "", "| ISA | rows | weight | N x K | fmt | registers GMAC/s | buffer GMAC/s |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['isa']} | {r['rows']} | {r['weight']} | {r['n']} x {r['k']} | {r['fmt']} | "
              f"{r['registers_gmacs']} | {r['buffer_gmacs']} |" for r in results if r["weight"] != "(all shapes)"]
    _, mpath = common.write_results(args.out, f"stored-gemm-{stamp}",
                                    {"command": command, "machine": machine, "results": results}, "\n".join(lines))
    print(f"wrote {mpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
