"""RACER on a GGUF's weights as stored against llama.cpp on the same file (issue 31, "Benchmark").

One interleaved run, prompt by prompt, over a fixed mixed sample of Spec-Bench (one item per category), HumanEval
and MGSM-ZH at 256 new tokens, greedy:

* ``hf_greedy``: transformers' ``generate`` on the float32 model (the baseline every row is compared with);
* ``racer`` and ``ar``: our engine on the weights as the GGUF stores them (``weights="as_stored"``, the CPU
  default), capacity auto; ``racer-c4``, ``racer-c16``: racer at fixed capacities (``--fixed``), to check that
  the capacity tuner still chooses well on the cheaper weights;
* ``racer_f32``: the same racer on the de-quantised float32 copy (the path before issue 31);
* ``llamacpp``: llama.cpp plain greedy on the same ``.gguf`` (llama-cpp-python in its own venv, compiled here
  by ``benchmarks/llamacpp_venv.sh``; ``benchmarks/llamacpp.py``);
* ``llamacpp_lookup``: llama.cpp with its prompt-lookup drafting (10 tokens).

Every contender gets the same prompt token ids (the model's chat template, no system prompt) and the same
threads. llama.cpp's outputs are its own kernels' greedy tokens: its ``exact_match_vs_hf_greedy`` counts how
often they agree with the float32 model's (near-ties differ; its lookup mode verifies in batches whose logits
differ slightly from its one-token ones). Writes ``<out>/vs-llamacpp-<stamp>.json`` and ``.md``.

    python -m benchmarks.vs_llamacpp                      # ~10 min on a 2-core machine (+5 min first build)
    python -m benchmarks.vs_llamacpp --counts spec_bench/rag=1 --max-new 64   # a quick look
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.llamacpp import DEFAULT_VENV, LlamaCppWorker, ensure_venv

log = logging.getLogger("benchmarks.vs_llamacpp")

DEFAULT_COUNTS = "spec_bench=1,human_eval=3,mgsm_zh=3"


def parse_counts(text: str) -> dict[str, int]:
    """``"spec_bench=1,human_eval=3"`` -> ``{"spec_bench": 1, "human_eval": 3}``.

    Raises:
        ValueError: an entry without ``=`` or a count that is not an integer.
    """
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = part.partition("=")
        if not sep:
            raise ValueError(f"--counts entry {part!r}: expected set=count")
        out[key.strip()] = int(val)
    return out


def llama_runner(worker: LlamaCppWorker, max_new: int, *, lookup: bool, eos: list[int]):
    """A ``run_bench`` extra runner over the llama.cpp worker: (new ids, the end token appended where it stopped
    on one; wall ms, prefill included; no RowStats)."""

    def run(ids: list[int]):
        r = worker.request(ids, max_new, lookup=lookup, eos=eos)
        new = [int(t) for t in r["ids"]] + ([int(r["stop"])] if r.get("stop") is not None else [])
        return new, float(r["ms"]), None

    return run


def ratio_lines(summary: dict) -> list[str]:
    """Markdown lines with the tokens/s of every row and racer's ratio to each llama.cpp row."""
    rows = summary["overall"]
    tps = {m: 1000.0 / r["ms_per_token"] for m, r in rows.items() if r.get("ms_per_token")}
    lines = ["| contender | tokens/s | exact vs HF greedy |", "|---|---|---|"]
    lines += [f"| {m} | {v:.1f} | {rows[m]['exact_match_vs_hf_greedy']} |" for m, v in tps.items()]
    lines.append("")
    for other in ("llamacpp", "llamacpp_lookup", "ar", "racer_f32", *(m for m in tps if m.startswith("racer-c"))):
        if "racer" in tps and other in tps:
            lines.append(f"- racer / {other}: **{tps['racer'] / tps[other]:.2f}x**")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a built-in GGUF model or a .gguf file")
    ap.add_argument("--counts", default=DEFAULT_COUNTS, help="prompts per set (benchdata.sample_prompts)")
    ap.add_argument("--max-new", type=int, default=256, help="new tokens per turn (default 256)")
    ap.add_argument("--capacity", default="auto", help="racer's capacity: auto or a number")
    ap.add_argument("--threads", type=int, default=2, help="threads of every contender")
    ap.add_argument("--venv", default=DEFAULT_VENV, help="llama-cpp-python's venv (built when missing)")
    ap.add_argument("--no-f32", action="store_true", help="leave the float32 racer row out")
    ap.add_argument("--fixed", default="4,16", help="racer rows at these fixed capacities beside auto (the "
                    "capacity tuner's check; '' for none)")
    ap.add_argument("--out", default=str(common.OUT), help="results folder (default: the repository's benchmarks/)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from racer_batch import bench, models
    from racer_batch.benchdata import sample_prompts
    from racer_batch.engine import Engine

    torch.set_num_threads(args.threads)
    capacity = args.capacity if args.capacity == "auto" else int(args.capacity)
    gguf = models.gguf_source(args.model)
    if gguf is None:
        ap.error(f"--model {args.model!r} has no GGUF file for llama.cpp to read")
    python = ensure_venv(args.venv)
    bundle = models.load_model(args.model, weights="as_stored")
    items = sample_prompts(parse_counts(args.counts))
    extra: dict = {}
    if not args.no_f32:
        f32 = models.load_model(args.model, weights="float32")
        cfg = bench.decoding_config(bench.parse_method("racer"), capacity=capacity)
        eng = Engine(f32, cfg)
        extra["racer_f32"] = (bench._engine_runner(eng, args.max_new), cfg.model_dump(mode="json"), eng.runner.kind)
    command = common.command("vs_llamacpp", argv)
    stamp = common.stamp()
    # the model's own context, as our engine's
    with LlamaCppWorker(python, str(gguf), threads=args.threads, ctx=bundle.context_length) as worker:
        version, system_info = worker.version()
        base = {"engine": "llama.cpp", "llama_cpp_python": version, "gguf": gguf.name, "threads": args.threads}
        extra["llamacpp"] = (llama_runner(worker, args.max_new, lookup=False, eos=bundle.eos_ids),
                             dict(base, method="greedy"), "llama.cpp")
        extra["llamacpp_lookup"] = (llama_runner(worker, args.max_new, lookup=True, eos=bundle.eos_ids),
                                    dict(base, method="prompt_lookup", num_pred_tokens=10), "llama.cpp")
        machine = common.machine_line()
        preamble = [f"RACER on the GGUF's weights as stored ({gguf.name}) vs llama.cpp on the same file. Machine: "
                    f"{machine}; {args.threads} threads each. `racer`, `racer-c*` and `ar` run on the weights as "
                    "stored, `racer_f32` on the de-quantised float32 copy, `hf_greedy` on transformers' float32 "
                    "model.", "",
                    f"llama-cpp-python {version}; system info: `{system_info.strip()}`", ""]

        def partial(res) -> None:
            summary = bench.summarize(res)
            bench.write_results(summary, Path(args.out), command=command, stamp=stamp, name="vs-llamacpp",
                                preamble=preamble + ["(partial: items still running)", ""])

        fixed = [f"racer-c{c}=racer:capacity={c}" for c in filter(None, args.fixed.split(","))]
        res = bench.run_bench(bundle, methods=["racer", *fixed, "ar"], capacity=capacity, max_new_tokens=args.max_new,
                              items=items, extra=extra, on_item=partial)
    summary = bench.summarize(res)
    summary["llamacpp"] = {"version": version, "system_info": system_info, "gguf": str(gguf)}
    summary["weights"] = {"racer": "as_stored", "ar": "as_stored", "racer_f32": "float32", "hf_greedy": "float32"}
    jpath, mpath = bench.write_results(summary, Path(args.out), command=command, stamp=stamp, name="vs-llamacpp",
                                       preamble=preamble + ratio_lines(summary))
    print("\n".join(ratio_lines(summary)))
    print(f"wrote {jpath} and {mpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
