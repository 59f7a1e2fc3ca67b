"""Does tuning the draft capacity give most of the gain that relaxed acceptance promises? (issue 8, part 6)

The survey of relaxed acceptance (Xia, Ribar and Balanca, 2026; docs/method.md section 6) finds that tuning the
capacity first gives most of the speed gain that relaxing acceptance promises. This module puts that to the
test on our data: RACER at the paper's default capacity (64, the untuned setting), lossless at a sweep of
capacities, and relaxed (top-k and probability-threshold acceptance) at the default and at a tuned capacity,
all in one `racer-batch bench` process on the smoke prompts (interleaved per prompt, HF greedy baseline).

    python -m benchmarks.capacity_vs_relaxed --per-set 8 --max-new-tokens 48 --torch-threads 1

Reading (written into the results): S(x) = speedup of setting x over HF greedy (token-weighted).
- capacity gain  = S(best lossless capacity) / S(lossless @ default)
- relaxed gain   = S(best relaxed setting) / S(lossless @ default)
- share          = (capacity gain - 1) / (relaxed gain - 1): the part of the relaxed gain that capacity tuning
  alone gets while keeping the output exact. share >= 0.5 reproduces the survey's finding; below refutes it.
Beside it, what relaxation costs: exact match against greedy, answer accuracy where the sets have references,
mean length and the repeated 4-gram rate. Writes benchmarks/capacity_vs_relaxed.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from benchmarks import common
from racer_batch import load_model
from racer_batch.bench import run_bench, summarize

DEFAULT_CAPACITY = 64  # the paper's (docs/method.md section 5)


def variants(sweep: list[int], tuned: int, topk: int, threshold: float) -> list[str]:
    out = [f"lossless-c{DEFAULT_CAPACITY}=racer:capacity={DEFAULT_CAPACITY}"]
    out += [f"lossless-c{c}=racer:capacity={c}" for c in sweep if c != DEFAULT_CAPACITY]
    for cap in (DEFAULT_CAPACITY, tuned):
        out.append(f"top{topk}-c{cap}=racer:capacity={cap},acceptance=topk,relaxed_topk={topk}")
        out.append(f"p{threshold:g}-c{cap}=racer:capacity={cap},acceptance=threshold,relaxed_threshold={threshold}")
    return out


def analyse(overall: dict[str, dict]) -> dict:
    """The reading above from the bench's overall rows (label -> row)."""
    def speed(label: str) -> float:
        return float(overall[label]["speedup_vs_hf_greedy"])

    default = f"lossless-c{DEFAULT_CAPACITY}"
    lossless = [lb for lb in overall if lb.startswith("lossless-")]
    relaxed = [lb for lb in overall if lb.startswith(("top", "p")) and not lb.startswith("lossless-")]
    best_lossless = max(lossless, key=speed)
    best_relaxed = max(relaxed, key=speed)
    cap_gain = speed(best_lossless) / speed(default)
    relax_gain = speed(best_relaxed) / speed(default)
    share = (cap_gain - 1) / (relax_gain - 1) if relax_gain > 1 else None
    if share is None:
        verdict = "no relaxed setting beat lossless RACER at the default capacity, so there is no relaxed gain to share"
    elif share >= 0.5:
        verdict = (f"reproduced: tuning capacity alone gives {share:.0%} of the best relaxed setting's gain "
                   "while the output stays exact")
    else:
        verdict = f"refuted on this data: tuning capacity alone gives only {share:.0%} of the best relaxed gain"
    return {"default": default, "best_lossless": best_lossless, "best_relaxed": best_relaxed,
            "capacity_gain": round(cap_gain, 3), "relaxed_gain": round(relax_gain, 3),
            "share": round(share, 3) if share is not None else None, "verdict": verdict}


def render_md(result: dict) -> str:
    """The Markdown of a result: the finding, then every setting's overall row."""
    a, cfg = result["analysis"], result["config"]
    cols = ["mat", "ms_per_token", "speedup_vs_hf_greedy", "exact_match_vs_hf_greedy", "answer_accuracy",
            "mean_tokens", "repeat4"]
    lines = [
        "# Capacity tuning versus relaxed acceptance", "",
        f"Reproduce: `{result['command']}`", "",
        f"Model {cfg['model']} ({cfg['dtype']}, {cfg['device']}, {cfg['torch_threads']} torch threads), "
        f"{cfg['items']} smoke prompts, max_new_tokens {cfg['max_new_tokens']}, greedy. Written "
        f"{result['written_at']}.", "",
        f"Machine: {common.machine_line(result['machine'])}.", "",
        "## Finding", "",
        f"- capacity gain: S({a['best_lossless']}) / S({a['default']}) = **{a['capacity_gain']}x** (output exact)",
        f"- relaxed gain: S({a['best_relaxed']}) / S({a['default']}) = **{a['relaxed_gain']}x**",
        f"- share of the relaxed gain that capacity tuning alone gets: **{a['share']}**",
        f"- verdict: {a['verdict']}", "",
        "## All settings (overall)", "",
        common.md_records(result["overall"], cols, key="setting"), "",
        "Columns: speedup against HF `generate` greedy (token-weighted, prefill included); exact match "
        "counts answered turns identical to greedy; answer accuracy is correct / scored turns (numeric and "
        "short references only, racer_batch/capability.py); repeat4 is the mean repeated 4-gram rate of "
        "the output tokens.", "",
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog("capacity_vs_relaxed"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-set", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--sweep", default="4,8,16,32", help="lossless capacities besides the default 64")
    ap.add_argument("--tuned", type=int, default=16, help="capacity of the relaxed settings besides 64")
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--threshold", type=float, default=0.1)
    ap.add_argument("--torch-threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    sweep = common.int_list(args.sweep)
    names = variants(sweep, args.tuned, args.topk, args.threshold)
    bundle = load_model(args.model)
    res = run_bench(bundle, methods=names, capacity=DEFAULT_CAPACITY, max_new_tokens=args.max_new_tokens,
                    per_set=args.per_set)
    summary = summarize(res)
    result = {"command": common.command("capacity_vs_relaxed", argv),
              "written_at": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": common.machine(),
              "config": summary["config"],
              "method_configs": summary["method_configs"], "overall": summary["overall"], "sets": summary["sets"],
              "analysis": analyse(summary["overall"])}
    md = render_md(result)
    common.write_results(args.out, "capacity_vs_relaxed", result, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
