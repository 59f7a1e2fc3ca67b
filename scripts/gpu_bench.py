"""GPU cost model for RACER (RACER.md section 8): t(T)/t(1), the engine's per-step CPU overhead, and the
speedup projected from the MAT measured on CPU with the real model.

Prepared for a CUDA machine with no network: the target is a Llama with the shape of an 8B model (Llama 3
8B: hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336, vocabulary 128256) and random bfloat16
weights built from its config on the GPU, so nothing is downloaded. Steps:

1. t(T): median ms of one verify forward over T tree tokens after ``--context`` cached tokens, for T in
   ``--capacities`` (the engine's own ``measure_cost_curve``, synchronised by copying the argmax back).
2. Per-step CPU overhead: the engine decodes (``ar`` and ``racer``) on the same model; for each step the
   time outside the forward = step time - t(tree size). Drafting (propose + flatten) and update
   (top-k copy + drafter update) are reported on their own.
3. Greedy equality in the model's dtype: AR reference vs RACER on the same prompt, compared by common prefix
   with the target's logit gap where they part (``racer_batch.engine.numerics``).
4. Projection: speedup(T) ~= MAT * (t(1) + o_ar) / (t(T) + o_racer), with MAT from the newest
   ``benchmarks/bench-*.json`` (method racer, real model on CPU) or ``--mat``; and, per T, the MAT needed to
   break even. MAT depends on the capacity: only the row at the benchmark's capacity is a projection,
   the others show the cost side.

``--tiny`` runs the same steps on a tiny Llama on the CPU (float32) in seconds: the smoke test the suite
runs. Results: ``<out>/gpu_bench-<tag>.json`` and ``.md`` (a few KB: fits any upload limit).
"""

from __future__ import annotations

import argparse
import bisect
import glob
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from racer_batch.engine import Engine  # noqa: E402
from racer_batch.engine.capacity import measure_cost_curve  # noqa: E402
from racer_batch.engine.numerics import compare_greedy  # noqa: E402
from racer_batch.engine.reference import generate_reference  # noqa: E402
from racer_batch.engine.runner import ModelRunner  # noqa: E402
from racer_batch.models import ModelBundle  # noqa: E402
from racer_batch.types import DecodingConfig, GenerationParams  # noqa: E402

log = logging.getLogger("gpu_bench")

LLAMA_8B_SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
DEFAULT_CAPACITIES = "1,2,4,8,16,24,32,48,64,96,128"


class IdTokenizer:
    """Token ids as text ("17 4 99"): enough for the stop rules; the random model has no vocabulary."""

    eos_token_id = None
    all_special_tokens: list[str] = []
    chat_template = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __len__(self) -> int:
        return self.vocab_size


def build_model(shape: dict, *, device: str, dtype: torch.dtype, seed: int = 0) -> ModelBundle:
    """A Llama with random weights, created directly on ``device`` in ``dtype`` (no download, no checkpoint)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(bos_token_id=None, eos_token_id=None, pad_token_id=None, **shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if next(model.parameters()).device.type != torch.device(device).type:
        model = model.to(device)  # a transformers version that ignores the device context
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)  # sharper output distribution: clearer greedy winners
    model.eval()
    return ModelBundle(model=model, tokenizer=IdTokenizer(shape["vocab_size"]), name="llama-random", eos_ids=[],
                       context_length=shape["max_position_embeddings"], device=device,
                       dtype=str(dtype).removeprefix("torch."))


def interp(curve: dict[int, float], t: int) -> float:
    """t(T) ms for any T, linear between measured capacities (clamped at the ends)."""
    xs = sorted(curve)
    if t <= xs[0]:
        return curve[xs[0]]
    if t >= xs[-1]:
        return curve[xs[-1]]
    i = bisect.bisect_left(xs, t)
    if xs[i] == t:
        return curve[t]
    x0, x1 = xs[i - 1], xs[i]
    return curve[x0] + (curve[x1] - curve[x0]) * (t - x0) / (x1 - x0)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_overhead(bundle: ModelBundle, curve: dict[int, float], *, method: str, capacity: int, prompt: list[int],
                  max_new_tokens: int) -> tuple[dict, Any]:
    """Decode once (after one warm-up) and split each step into forward time t(T) and everything else."""
    engine = Engine(bundle, DecodingConfig(method=method, capacity=capacity) if method != "ar" else
                    DecodingConfig(method="ar"))
    params = GenerationParams(max_new_tokens=max_new_tokens)
    engine.generate(prompt, params)  # warm-up: allocator, kernels, drafter code paths
    sync(bundle.device)
    res = engine.generate(prompt, params, keep_steps=True)
    recs = res.stats.step_records
    assert recs, f"{method}: no decoding steps recorded"
    total = [r.draft_ms + r.verify_ms + r.update_ms for r in recs]
    fwd = [interp(curve, r.tree_size) for r in recs]
    over = [t - f for t, f in zip(total, fwd)]
    out = {
        "method": method, "capacity": capacity if method != "ar" else 1, "steps": len(recs),
        "mean_tree_tokens": round(statistics.mean(r.tree_size for r in recs), 2),
        "mat": round(res.stats.mat, 3),
        "step_ms": round(statistics.mean(total), 3),
        "forward_ms_from_curve": round(statistics.mean(fwd), 3),
        "overhead_ms": round(statistics.mean(over), 3),
        "overhead_ms_median": round(statistics.median(over), 3),
        "draft_ms": round(statistics.mean(r.draft_ms for r in recs), 3),
        "update_ms": round(statistics.mean(r.update_ms for r in recs), 3),
    }
    return out, res


def find_mat(bench_glob: str) -> tuple[Optional[float], Optional[int], Optional[str]]:
    """(MAT of method racer, its capacity, file) from the newest benchmark JSON, or Nones."""
    for path in sorted(glob.glob(bench_glob), key=os.path.getmtime, reverse=True):
        try:
            d = json.loads(Path(path).read_text())
            mat = d["overall"]["racer"]["mat"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        cap = d.get("config", {}).get("capacity")
        return float(mat), (int(cap) if isinstance(cap, (int, float)) else None), path
    return None, None, None


def project(curve: dict[int, float], *, mat: Optional[float], o_ar: float, o_racer: float,
            bench_capacity: Optional[int]) -> list[dict]:
    base = curve[1] + o_ar
    rows = []
    for t in sorted(curve):
        cost = curve[t] + o_racer
        rows.append({"T": t, "t_ratio": round(curve[t] / curve[1], 3), "break_even_mat": round(cost / base, 3),
                     "projected_speedup": round(mat * base / cost, 3) if mat else None,
                     "at_bench_capacity": t == bench_capacity})
    return rows


def write_md(d: dict, path: Path) -> None:
    m, c = d["machine"], d["config"]
    lines = [f"# GPU cost model ({d['tag']})", "", f"Reproduce: `{d['command']}`", "",
             f"Device: {m['device_name']} ({m['device']}), torch {m['torch']}, CUDA {m['cuda']}; model: random "
             f"{c['shape_name']} Llama in {c['dtype']}, context {c['context_tokens']} cached tokens.", ""]
    if d["tag"].startswith("tiny"):
        lines += ["**Tiny CPU smoke run: these numbers test the script, they say nothing about a GPU.**", ""]
    lines += ["## Forward cost and projection", "",
              f"MAT: {d['mat']['value']} ({d['mat']['source']}). speedup ~= MAT * (t(1) + o_ar) / (t(T) + o_racer), "
              f"o_ar = {d['overhead']['ar']['overhead_ms']} ms, o_racer = {d['overhead']['racer']['overhead_ms']} ms "
              "(per step, outside the forward).", "",
              "| T | t(T) ms | t(T)/t(1) | MAT to break even | projected speedup |", "|---|---|---|---|---|"]
    for r in d["projection"]:
        mark = " (bench capacity)" if r["at_bench_capacity"] else ""
        lines.append(f"| {r['T']}{mark} | {d['cost_curve_ms'][str(r['T'])]} | {r['t_ratio']} | {r['break_even_mat']} | "
                     f"{'' if r['projected_speedup'] is None else r['projected_speedup']} |")
    lines += ["", "## Per-step CPU overhead of the engine", "",
              "| method | capacity | steps | mean tree tokens | step ms | forward ms (curve) | overhead ms | draft ms | update ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for o in d["overhead"].values():
        lines.append(f"| {o['method']} | {o['capacity']} | {o['steps']} | {o['mean_tree_tokens']} | {o['step_ms']} | "
                     f"{o['forward_ms_from_curve']} | {o['overhead_ms']} | {o['draft_ms']} | {o['update_ms']} |")
    g = d["greedy_equality"]
    lines += ["", "## Greedy equality in the model's dtype", "", f"AR reference vs RACER: {g['describe']}", ""]
    path.write_text("\n".join(lines))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny Llama on the CPU in float32 (smoke test)")
    p.add_argument("--device", default=None, help="default: cuda when available (required without --tiny)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 with --tiny")
    p.add_argument("--capacities", default=DEFAULT_CAPACITIES)
    p.add_argument("--context", type=int, default=None, help="cached tokens before the tree (default 512; tiny 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed forwards per T (default 10; tiny 3)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens per overhead run (default 128; tiny 32)")
    p.add_argument("--racer-capacity", type=int, default=None,
                   help="capacity of the racer overhead run (default: the bench file's, else 64; tiny 16)")
    p.add_argument("--mat", type=float, default=None, help="MAT to project with (default: newest bench-*.json)")
    p.add_argument("--bench-glob", default=str(ROOT / "benchmarks" / "bench-*.json"))
    p.add_argument("--out", default=str(ROOT / "benchmarks"))
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not device.startswith("cuda"):
        torch.set_num_threads(1)  # spinning OpenMP threads collapse on a shared CPU (docs/service.md)
    if not args.tiny and not device.startswith("cuda"):
        print("no CUDA device: the 8B-shaped run needs a GPU (about 17 GB of memory); use --tiny for the CPU "
              "smoke run", file=sys.stderr)
        return 3
    dtype_name = args.dtype or ("float32" if args.tiny and not device.startswith("cuda") else "bfloat16")
    dtype = getattr(torch, dtype_name)
    shape = TINY_SHAPE if args.tiny else LLAMA_8B_SHAPE
    context = args.context or (64 if args.tiny else 512)
    repeats = args.repeats or (3 if args.tiny else 10)
    max_new = args.max_new_tokens or (32 if args.tiny else 128)
    caps = [int(x) for x in args.capacities.split(",")]
    mat, bench_cap, bench_file = find_mat(args.bench_glob)
    if args.mat is not None:
        mat, source = args.mat, "--mat"
    elif mat is not None:
        source = f"{os.path.relpath(bench_file, ROOT)}, method racer, capacity {bench_cap}"
    else:
        source = "none: pass --mat or put a bench-*.json in benchmarks/"
    racer_cap = args.racer_capacity or (16 if args.tiny else (bench_cap or 64))

    t0 = time.perf_counter()
    bundle = build_model(shape, device=device, dtype=dtype)
    build_s = time.perf_counter() - t0
    log.info("built %s model on %s in %.1f s", "tiny" if args.tiny else "8B-shaped", device, build_s)
    runner = ModelRunner(bundle)
    curve = measure_cost_curve(runner, caps, context_tokens=context, repeats=repeats)
    log.info("t(T) ms: %s", {t: round(ms, 2) for t, ms in curve.items()})

    # A prompt that repeats itself, so the retrieval drafter has something to propose.
    gen = torch.Generator().manual_seed(1)
    motif = torch.randint(3, shape["vocab_size"], (24,), generator=gen).tolist()
    prompt = (motif * (context // len(motif) + 1))[:context]
    o_ar, _ = step_overhead(bundle, curve, method="ar", capacity=1, prompt=prompt, max_new_tokens=max_new)
    o_racer, racer_res = step_overhead(bundle, curve, method="racer", capacity=racer_cap, prompt=prompt,
                                       max_new_tokens=max_new)
    ref = generate_reference(bundle, prompt, GenerationParams(max_new_tokens=max_new))
    div = compare_greedy(bundle, prompt, ref.token_ids, racer_res.token_ids)

    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        dev_name, mem = props.name, round(torch.cuda.max_memory_allocated(torch.device(device)) / 2**30, 2)
    else:
        dev_name, mem = platform.processor() or platform.machine(), None
    tag = args.tag or ("tiny-" + device.split(":")[0] if args.tiny else dev_name.replace(" ", "-").lower())
    d = {
        "tag": tag,
        "command": "python scripts/gpu_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "written_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"device": device, "device_name": dev_name, "torch": torch.__version__, "cuda": torch.version.cuda,
                    "peak_gpu_memory_gib": mem, "python": platform.python_version()},
        "config": {"shape_name": "tiny" if args.tiny else "llama-8b", "shape": shape, "dtype": dtype_name,
                   "context_tokens": context, "repeats": repeats, "max_new_tokens": max_new,
                   "racer_capacity": racer_cap, "build_s": round(build_s, 1)},
        "cost_curve_ms": {str(t): round(ms, 3) for t, ms in sorted(curve.items())},
        "overhead": {"ar": o_ar, "racer": o_racer},
        "greedy_equality": {"identical": div.identical, "common_prefix": div.common_prefix, "len_ref": div.len_a,
                            "len_racer": div.len_b, "logit_gap": div.logit_gap, "is_tie": div.is_tie,
                            "describe": div.describe()},
        "mat": {"value": mat, "source": source, "bench_capacity": bench_cap},
        "projection": project(curve, mat=mat, o_ar=o_ar["overhead_ms"], o_racer=o_racer["overhead_ms"],
                              bench_capacity=bench_cap),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out / f"gpu_bench-{tag}.json", out / f"gpu_bench-{tag}.md"
    jpath.write_text(json.dumps(d, indent=2))
    write_md(d, mpath)
    print(mpath.read_text())
    print(f"wrote {jpath} and {mpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
