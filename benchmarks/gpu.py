"""GPU cost model for RACER (docs/method.md section 8): t(T)/t(1) per verify runner, the engine's per-step CPU
overhead, and the speedup projected from the MAT measured on CPU with the real model; then the batched
engine at GPU batch sizes: the B x N verify grid and host µs per stream-step beside device ms per forward.

    python -m benchmarks.gpu                  # on a CUDA machine (bash benchmarks/gpu_bench.sh adds environment.txt)
    python -m benchmarks.gpu --tiny           # the CPU smoke run, in seconds

Prepared for a CUDA machine with no network: the target is a Llama with the shape of an 8B model (Llama 3
8B: hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336, vocabulary 128256) and random bfloat16
weights built from its config on the GPU, so nothing is downloaded. Steps, run in the order 1, 5, 2, 6, 3
(4 is arithmetic on their results):

1. t(T): median ms of one verify forward over T tree tokens after ``--context`` cached tokens, for T in
   ``--capacities``, for three verify runners measured **interleaved** (every repeat visits every (T,
   runner) pair once, the runner order rotating per repeat; one untimed round first), each synchronised by
   copying the argmax back: ``eager`` (the stock transformers forward, ``ModelRunner``), ``static`` (our
   decoder over a static KV cache; ``StaticRunner(compile=False)``) and ``cuda-graph`` (on CUDA: the same
   with one CUDA graph per (streams, tree) bucket, captured by ``warmup``). The static runners pad
   to the buckets the engine's would have for these capacities (the defaults, plus the power of two
   ``add_bucket`` adds above them). The warm-up (weight packing, graph capture or compilation) is timed per
   runner.
2. Per-step CPU overhead: the engine decodes (``ar`` and ``racer``) on the runner it picks by default on
   this device (cuda-graph on CUDA, static on the CPU), and ``ar`` on every other runner; for each step the
   time outside the forward = step time - t(padded tree size) from that runner's curve (the prefill step is
   left out). Drafting (propose + flatten) and update (top-k copy + drafter update) are reported on their own.
3. Greedy equality in the model's dtype: AR reference vs RACER on the default runner, same prompt, compared
   by common prefix with the target's logit gap where they part (``racer_batch.engine.numerics``).
4. Projection, on the default runner's curve and overheads: speedup(T) ~= MAT * (t(1) + o_ar) / (t(T) +
   o_racer), with MAT from the newest ``benchmarks/bench-*.json`` (method racer, real model on CPU) or
   ``--mat``; and, per T, the MAT needed to break even. MAT depends on the capacity: only the row at the
   benchmark's capacity is a projection, the others show the cost side.

5. Batched verify grid (issues 14, 27): one ``runner.verify_flat`` call (the engine's one forward: a
   ``tree.FlatTrees`` of every stream's tree) over B streams' random draft trees of N nodes each, every stream
   on its own KV-cache slot holding its own cached context (stream i: ``--context`` minus 8 (i mod 8) tokens,
   so neighbouring slots differ), for B in ``--batch-streams`` (default 1, 8, 32, 64; tiny 1, 2, 4) and N in
   ``--batch-nodes`` (default 1, 4, 16; tiny 1, 4), the (B, N) pairs interleaved like step 1 (one untimed
   round first), on the default runner with its slots reserved for the largest B before the warm-up (so the
   CUDA graphs of every (B_pad, N_pad) bucket are captured once). Reported: device ms per forward (wall time
   up to every row's argmax copied to the host), tokens per forward (B x N), the throughput ratio to B=1 at
   the same N (``B x t(1, N) / t(B, N)``), and which path ran, as the runner's ``last_batch_path`` says
   (``segments``: our CPU kernels, one forward over all rows; ``padded`` / ``padded-graph``: the ``[B_pad,
   N_pad]`` static step, on CUDA one graph per bucket; one stream goes the same way as several).
6. Engine decode at B streams (issue 27): for B in ``--engine-streams`` (default: step 5's B) and the methods
   ``ar`` and ``racer`` at each of ``--engine-capacities`` (default 4, 16), a fresh ``Engine(bundle,
   DecodingConfig(method, capacity), streams=B)`` on the default runner greedy-decodes ``2 B + 4`` synthetic
   prompts (token-id lists of about ``--context`` tokens, each a random 24-token motif repeated, so the
   retrieval drafter has material; the id tokenizer gives them no meaning) for ``--engine-tokens`` new tokens
   each (default 32; tiny 16) through one ``StreamBatch`` with continuous batching: B streams in flight, a
   finished one replaced by the next prompt. One untimed warm-up first (B short streams). From
   ``BatchStats``: **host µs per stream-step** = (wall - verify_ms - prefill_ms) / stream-steps (``streams``;
   on CUDA the prefill is synchronised, so its device time is not counted as host time), **device ms per
   forward** = verify_ms / steps (the batched ``verify_flat`` including the argmax / top-k), host ms per
   batched step, MAT, tokens/s, and the host split per part (``step.HOST_PARTS`` from ``stats.host_ms``, plus
   ``other``: stream set-up, prefill-side host work and the ``StreamBatch`` plumbing) in µs per stream-step.

``--tiny`` runs the same steps on a tiny Llama on the CPU (float32) in seconds, with the eager and static
runners only: the smoke test the suite runs. A runner that fails (construction, warm-up, a timed forward, a
decode) is dropped and its error recorded under ``errors`` (exit status 4 after the results are written), so
one failure does not cost the other measurements; a failing step-6 configuration likewise. Results:
``<out>/gpu_bench-<tag>.json`` and ``.md`` (``common.write_results``; a few KB: fits any upload limit), the
machine as ``common.machine()`` plus the device's name, CUDA version and peak GPU memory.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import glob
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks import common
from racer_batch.drafters.base import Draft
from racer_batch.engine import Engine
from racer_batch.engine.batch import BatchStats, StreamBatch
from racer_batch.engine.numerics import compare_greedy
from racer_batch.engine.reference import generate_reference
from racer_batch.engine.runner import ModelRunner
from racer_batch.engine.static_runner import DEFAULT_BUCKETS, StaticRunner, describe_unsupported, pick_bucket
from racer_batch.engine.step import HOST_PARTS
from racer_batch.engine.tree import FlatTrees, flatten_tree
from racer_batch.models import ModelBundle
from racer_batch.values import DecodingConfig, GenerationParams

log = logging.getLogger("benchmarks.gpu")

LLAMA_8B_SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
DEFAULT_CAPACITIES = "1,2,4,8,16,24,32,48,64,96,128"
# the batched grid (step 5) and the engine's B (step 6): the GPU batch sizes, and a small CPU one for --tiny
GPU_BATCH_STREAMS, GPU_BATCH_NODES = "1,8,32,64", "1,4,16"
TINY_BATCH_STREAMS, TINY_BATCH_NODES = "1,2,4", "1,4"
ENGINE_CAPACITIES = "4,16"
WARM_TOKENS, WARM_PROMPT = 4, 64  # new tokens and prompt tokens per stream of step 6's untimed warm-up


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


def forward_ms(curve: dict[int, float], t: int, buckets: Optional[tuple[int, ...]]) -> float:
    """Forward ms of a tree of ``t`` nodes: the curve at the padded size on a static runner (its cost is a step
    function of T), linear between measured sizes on the eager one."""
    return interp(curve, pick_bucket(t, buckets) if buckets else t)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def release_memory(device: str) -> None:
    """Drop what finished runners held (KV caches, CUDA graph pools) before the next ones allocate."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- the runners ----
def runner_specs(device: str) -> dict[str, dict[str, str]]:
    """{runner name: DecodingConfig runner/compile settings} measured on ``device``."""
    specs = {"eager": {"runner": "eager", "compile": "off"}, "static": {"runner": "static", "compile": "off"}}
    if device.startswith("cuda"):
        specs["cuda-graph"] = {"runner": "static", "compile": "on"}
    return specs


def default_runner_name(bundle: ModelBundle) -> str:
    """The runner ``DecodingConfig(runner='auto', compile='auto')`` gives on this device (make_runner)."""
    if describe_unsupported(bundle.model) is not None:
        return "eager"
    return "cuda-graph" if str(bundle.device).startswith("cuda") else "static"


def bench_buckets(capacities: list[int]) -> tuple[int, ...]:
    """The buckets the engine's static runner ends up with for these capacities: its defaults plus, for a
    capacity above them, the one power of two ``StaticRunner.add_bucket`` adds. Known before the runner is
    built, so its KV cache can be sized once (``build_runner``)."""
    top = max(capacities)
    if top <= DEFAULT_BUCKETS[-1]:
        return tuple(DEFAULT_BUCKETS)
    return (*DEFAULT_BUCKETS, 1 << (int(top) - 1).bit_length())


def build_runner(bundle: ModelBundle, spec: dict[str, str], *, buckets: tuple[int, ...], max_len: int) -> Any:
    """``max_len``: KV positions per slot from the start, so ``new_cache`` never grows the buffers (which would
    drop the graphs captured by ``warmup``)."""
    if spec["runner"] == "eager":
        return ModelRunner(bundle)
    return StaticRunner(bundle, compile=spec["compile"] == "on", buckets=buckets, max_len=max_len)


def warm_runner(runner: Any, capacities: list[int], device: str) -> tuple[float, dict[str, float]]:
    """(wall seconds of ``runner.warmup(capacities)`` including the device work, {bucket: s} it reports)."""
    sync(device)
    t0 = time.perf_counter()
    per_bucket = runner.warmup(capacities)
    sync(device)
    return time.perf_counter() - t0, {str(b): round(s, 4) for b, s in sorted(per_bucket.items())}


@torch.inference_mode()
def measure_interleaved(runners: dict[str, Any], capacities: list[int], *, bundle: ModelBundle, context_tokens: int,
                        repeats: int, errors: dict[str, str]) -> dict[str, dict[int, float]]:
    """Median ms of one verify forward over T tree tokens (a chain) after ``context_tokens`` cached ones, up to
    and including the argmax copied back to the CPU, for every runner, interleaved: each of the ``repeats``
    rounds (after one untimed round) visits every (T, runner) pair once, the runner order rotating per round,
    so drifts (clocks, temperature, other load) fall on all runners alike. A runner that raises is dropped
    (``errors``). Returns {runner: {T: ms}} for T in ``capacities`` and T = 1."""
    device = str(bundle.device)
    vocab = bundle.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (context_tokens,), generator=gen).tolist()
    sizes = sorted(set([1, *capacities]))
    any_runner = next(iter(runners.values()))
    trees = {}
    for t in sizes:
        chain = Draft.chain(torch.randint(0, vocab, (t,), generator=gen).tolist())
        trees[t] = flatten_tree(chain, committed_len=context_tokens, device=any_runner.device, dtype=any_runner.dtype)
    live = dict(runners)
    caches: dict[str, Any] = {}

    def drop(name: str, exc: BaseException) -> None:
        log.exception("runner %s failed; dropped from the curves", name)
        errors[name] = f"cost curve: {type(exc).__name__}: {exc}"
        live.pop(name, None)
        cache = caches.pop(name, None)
        if cache is not None:
            runners[name].release(cache)

    for name, runner in list(live.items()):
        try:
            caches[name] = runner.new_cache(context_tokens + sizes[-1])
            runner.prefill(prompt, cache=caches[name], topk=0)
        except Exception as exc:  # noqa: BLE001 - recorded, the other runners go on
            drop(name, exc)
    times: dict[str, dict[int, list[float]]] = {name: {t: [] for t in sizes} for name in live}
    for rnd in range(repeats + 1):
        for t in sizes:
            names = list(live)
            for name in names[rnd % len(names):] + names[: rnd % len(names)] if names else []:
                runner, cache = live[name], caches[name]
                try:
                    sync(device)
                    t0 = time.perf_counter()
                    logits = runner.verify_tree(trees[t], cache=cache)
                    logits.argmax(-1).cpu()
                    ms = (time.perf_counter() - t0) * 1000.0
                    runner.keep_rows(cache, committed_len=context_tokens, nodes=[])
                except Exception as exc:  # noqa: BLE001
                    drop(name, exc)
                    continue
                if rnd:
                    times[name][t].append(ms)
    for name, cache in caches.items():
        runners[name].release(cache)
    return {name: {t: statistics.median(times[name][t]) for t in sizes} for name in live}


# ---- batched verify: B streams x N tree nodes in one verify_flat call ----
def random_tree(gen: torch.Generator, size: int, vocab: int) -> Draft:
    """A draft tree of ``size`` nodes with random tokens and random parents (node 0 the root)."""
    toks = torch.randint(0, vocab, (size,), generator=gen).tolist()
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    return Draft(toks, parents, [0] * size)


def batch_path(runner: Any, streams: int) -> str:
    """Which way ``verify_flat`` verified ``streams`` trees: the runner's own ``last_batch_path`` when it
    keeps one, else a guess for a runner that does not say: ``single`` (one stream), ``segments`` (our CPU
    kernels: one forward over every stream's rows) or ``per-stream`` (one forward per stream)."""
    path = getattr(runner, "last_batch_path", None)
    if path:
        return str(path)
    if streams == 1:
        return "single"
    on_kernels = getattr(runner, "_ops", None) is not None and not getattr(runner, "compile_requested", False)
    return "segments" if on_kernels else "per-stream"


def fill_slots(runner: Any, gen: torch.Generator, *, streams: int, context_tokens: int, extra: int,
               vocab: int) -> tuple[list, list[int]]:
    """``streams`` KV-cache slots, slot i prefilled with ``context_tokens - 8 (i mod 8)`` random tokens (room
    for ``extra`` tree rows more); returns (caches, committed lengths)."""
    caches, lens = [], []
    try:
        for i in range(streams):
            n = max(1, context_tokens - 8 * (i % 8))
            cache = runner.new_cache(n + extra)
            caches.append(cache)
            runner.prefill(torch.randint(0, vocab, (n,), generator=gen).tolist(), cache=cache, topk=0)
            lens.append(n)
    except BaseException:
        for cache in caches:
            runner.release(cache)
        raise
    return caches, lens


def time_flat(runner: Any, flats: dict[tuple[int, int], FlatTrees], *, lens: list[int], repeats: int,
              device: str) -> tuple[dict[tuple[int, int], list[float]], dict[tuple[int, int], str]]:
    """ms of ``runner.verify_flat`` per (B, N), up to every row's argmax copied back: ``repeats`` timed rounds
    after one untimed one, the pairs' order rotating per round. Each stream's slot is cut back to its
    committed length after every forward (outside the timing). Returns (times, path per pair)."""
    pairs = list(flats)
    times: dict[tuple[int, int], list[float]] = {p: [] for p in pairs}
    paths: dict[tuple[int, int], str] = {}
    for rnd in range(repeats + 1):
        k = rnd % len(pairs)
        for pair in pairs[k:] + pairs[:k]:
            flat = flats[pair]
            sync(device)
            t0 = time.perf_counter()
            runner.verify_flat(flat).argmax(-1).cpu()
            ms = (time.perf_counter() - t0) * 1000.0
            paths[pair] = batch_path(runner, pair[0])
            for i, cache in enumerate(flat.caches):
                runner.keep_rows(cache, committed_len=lens[i], nodes=[])
            if rnd:
                times[pair].append(ms)
    return times, paths


@torch.inference_mode()
def measure_batch(runner: Any, *, bundle: ModelBundle, streams: list[int], nodes: list[int], context_tokens: int,
                  repeats: int) -> list[dict]:
    """Median ms of one ``runner.verify_flat`` over B streams' random trees of N nodes each (every stream on
    its own slot: ``fill_slots``), up to every row's argmax copied back, for every (B, N); pairs interleaved
    over ``repeats`` rounds (``time_flat``). Rows: B, N, ms, tokens per forward, tokens/ms, ratio to B=1,
    path."""
    vocab = bundle.vocab_size
    gen = torch.Generator().manual_seed(2)
    caches, lens = fill_slots(runner, gen, streams=max(streams), context_tokens=context_tokens, extra=max(nodes),
                              vocab=vocab)
    try:
        trees = {(i, t): flatten_tree(random_tree(gen, t, vocab), committed_len=lens[i], device=runner.device,
                                      dtype=runner.dtype) for i in range(max(streams)) for t in nodes}
        flats = {(b, t): FlatTrees.of([(trees[(i, t)], caches[i]) for i in range(b)], starts=lens[:b])
                 for b in streams for t in nodes}
        times, paths = time_flat(runner, flats, lens=lens, repeats=repeats, device=str(bundle.device))
    finally:
        for cache in caches:
            runner.release(cache)
    med = {p: statistics.median(v) for p, v in times.items()}
    rows = []
    for b, t in flats:
        ms = med[(b, t)]
        base = med.get((1, t))
        rows.append({"streams": b, "nodes": t, "ms": round(ms, 3), "tokens_per_forward": b * t,
                     "tokens_per_ms": round(b * t / ms, 3),
                     "throughput_vs_b1": common.ratio(b * base, ms) if base else None,
                     "ms_vs_b1": common.ratio(ms, base), "path": paths[(b, t)]})
    return rows


# ---- the engine's per-step overhead ----
def step_overhead(bundle: ModelBundle, curve: dict[int, float], *, method: str, capacity: int, prompt: list[int],
                  max_new_tokens: int, runner_name: str, spec: dict[str, str]) -> tuple[dict, Any]:
    """Decode once (after one warm-up) on the runner ``spec`` and split each step into forward time t(T), read
    from ``curve`` (that runner's), and everything else. The prefill record (step 0) is left out."""
    cfg = dict(runner=spec["runner"], compile=spec["compile"])
    engine = Engine(bundle, DecodingConfig(method=method, capacity=capacity, **cfg) if method != "ar" else
                    DecodingConfig(method="ar", **cfg))
    buckets = getattr(engine.runner, "buckets", None)
    params = GenerationParams(max_new_tokens=max_new_tokens)
    engine.generate(prompt, params)  # warm-up: allocator, kernels, graphs of the grown cache, drafter code paths
    sync(bundle.device)
    res = engine.generate(prompt, params, keep_steps=True)
    recs = res.stats.step_records[1:]  # [0] is the prefill (tree_size 1, no step times)
    assert recs, f"{method} on {runner_name}: no decoding steps recorded"
    total = [r.draft_ms + r.verify_ms + r.update_ms for r in recs]
    fwd = [forward_ms(curve, r.tree_size, buckets) for r in recs]
    over = [t - f for t, f in zip(total, fwd)]
    out = {
        "method": method, "runner": runner_name, "capacity": capacity if method != "ar" else 1, "steps": len(recs),
        "mean_tree_tokens": round(statistics.mean(r.tree_size for r in recs), 2),
        "mat": round(res.stats.mat, 3),
        "step_ms": round(statistics.mean(total), 3),
        "forward_ms_from_curve": round(statistics.mean(fwd), 3),
        "overhead_ms": round(statistics.mean(over), 3),
        "overhead_ms_median": round(statistics.median(over), 3),
        "draft_ms": round(statistics.mean(r.draft_ms for r in recs), 3),
        "verify_ms": round(statistics.mean(r.verify_ms for r in recs), 3),
        "update_ms": round(statistics.mean(r.update_ms for r in recs), 3),
        "engine_warmup_s": round(engine.warmup_s, 3),
    }
    del engine
    release_memory(str(bundle.device))
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


# ---- the engine at B streams in flight: host µs per stream-step beside device ms per forward ----
def engine_prompts(count: int, length: int, vocab: int, *, seed: int = 3) -> list[list[int]]:
    """``count`` synthetic prompts as token-id lists (no tokenizer semantics): prompt i a random 24-token motif
    repeated to ``length - 8 (i mod 8)`` tokens, so the retrieval drafter has material and the rows differ."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        motif = torch.randint(3, vocab, (24,), generator=gen).tolist()
        n = max(8, length - 8 * (i % 8))
        out.append((motif * (n // len(motif) + 1))[:n])
    return out


def sync_prefill(runner: Any, device: str) -> None:
    """On CUDA ``prefill`` returns before its device work ends, and the first token's argmax would then wait
    for it in the stream, as host time: wrap it (on the instance) to synchronise, so the prefill's device time
    lands in ``BatchStats.prefill_ms``."""
    if not device.startswith("cuda"):
        return
    inner = runner.prefill

    def prefill(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        torch.cuda.synchronize()
        return out

    runner.prefill = prefill


def run_stream_batch(engine: Engine, prompts: list[list[int]], params: GenerationParams, *, streams: int,
                     device: str) -> tuple[float, BatchStats, list]:
    """Decode every prompt through one ``StreamBatch`` with continuous batching: ``streams`` in flight, a
    finished stream replaced by the next prompt. Returns (wall ms, the batch's stats, the results); a stream
    that fails raises."""
    batch = StreamBatch()
    results: list = []
    sync(device)
    t0 = time.perf_counter()
    nxt = min(streams, len(prompts))
    for i in range(nxt):
        batch.add(i, engine.stream(prompts[i], params))
    try:
        while len(results) < len(prompts):
            for fin in batch.step():
                if fin.error is not None:
                    raise fin.error
                results.append(fin.result)
                if nxt < len(prompts):
                    batch.add(nxt, engine.stream(prompts[nxt], params))
                    nxt += 1
    finally:
        batch.close()
    sync(device)
    return (time.perf_counter() - t0) * 1000.0, batch.stats, results


def engine_row(st: BatchStats, wall_ms: float, results: list, *, streams: int, method: str, capacity: int,
               tokens: int) -> dict:
    """Step 6's figures of one run from its ``BatchStats``: host µs per stream-step, device ms per forward and
    the host split per part (µs per stream-step)."""
    steps, ss = max(st.steps, 1), max(st.streams, 1)
    host_ms = wall_ms - st.verify_ms - st.prefill_ms
    named = sum(st.host_ms.get(p, 0.0) for p in HOST_PARTS)
    split = {p: round(st.host_ms.get(p, 0.0) * 1000.0 / ss, 2) for p in HOST_PARTS}
    split["other"] = round((host_ms - named) * 1000.0 / ss, 2)
    out_tokens = sum(r.output_tokens for r in results)
    return {
        "streams": streams, "method": method, "capacity": capacity, "prompts": len(results),
        "max_new_tokens": tokens, "output_tokens": out_tokens, "steps": st.steps, "stream_steps": st.streams,
        "prefills": st.prefills, "streams_per_step": round(st.streams / steps, 2),
        "rows_per_forward": round(st.rows / steps, 2),
        "mat": round(out_tokens / max(st.streams + st.prefills, 1), 3),
        "wall_ms": round(wall_ms, 2), "verify_ms": round(st.verify_ms, 2), "prefill_ms": round(st.prefill_ms, 2),
        "host_ms": round(host_ms, 2),
        "host_us_per_stream_step": round(host_ms * 1000.0 / ss, 2),
        "host_ms_per_step": round(host_ms / steps, 3),
        "device_ms_per_forward": round(st.verify_ms / steps, 3),
        "prefill_ms_per_prefill": round(st.prefill_ms / max(st.prefills, 1), 3),
        "host_share": round(host_ms / wall_ms, 3) if wall_ms > 0 else None,
        "tokens_per_s": round(out_tokens / (wall_ms / 1000.0), 1) if wall_ms > 0 else None,
        "host_us_split": split, "fallbacks": st.fallbacks,
    }


def engine_methods(capacities: list[int]) -> list[tuple[str, str, int]]:
    """(label, method, capacity) of step 6: ar, then racer at each capacity."""
    return [("ar", "ar", 1)] + [(f"racer-c{c}", "racer", c) for c in capacities]


def engine_run(bundle: ModelBundle, spec: dict[str, str], *, method: str, capacity: int, streams: int,
               prompts: list[list[int]], tokens: int) -> dict:
    """One step-6 configuration: a fresh engine for ``streams`` streams on the runner ``spec``, an untimed
    warm-up (``streams`` streams: the first ``WARM_PROMPT`` tokens of a prompt, ``WARM_TOKENS`` new tokens),
    then every prompt through a ``StreamBatch``."""
    device = str(bundle.device)
    kw = dict(runner=spec["runner"], compile=spec["compile"])
    cfg = (DecodingConfig(method="ar", **kw) if method == "ar"
           else DecodingConfig(method=method, capacity=capacity, **kw))
    engine = Engine(bundle, cfg, streams=streams)
    try:
        sync_prefill(engine.runner, device)
        warm = [p[:WARM_PROMPT] for p in prompts[:streams]]  # short prompts: the decode paths warm, cheaply
        run_stream_batch(engine, warm, GenerationParams(max_new_tokens=WARM_TOKENS), streams=streams, device=device)
        wall_ms, st, results = run_stream_batch(engine, prompts, GenerationParams(max_new_tokens=tokens),
                                                streams=streams, device=device)
        row = engine_row(st, wall_ms, results, streams=streams, method=method, capacity=capacity, tokens=tokens)
        row["engine_warmup_s"] = round(engine.warmup_s, 3)
        return row
    finally:
        del engine
        release_memory(device)


def engine_batches(bundle: ModelBundle, spec: dict[str, str], *, runner_name: str, streams: list[int],
                   capacities: list[int], tokens: int, context_tokens: int, errors: dict[str, str]) -> dict:
    """Step 6 over every B in ``streams`` and every method (``engine_methods``); a configuration that fails is
    recorded in ``errors`` and the others go on."""
    rows = []
    for b in streams:
        prompts = engine_prompts(2 * b + 4, context_tokens, bundle.vocab_size)
        for label, method, cap in engine_methods(capacities):
            try:
                row = engine_run(bundle, spec, method=method, capacity=cap, streams=b, prompts=prompts, tokens=tokens)
            except Exception as exc:
                log.exception("engine batch B=%d %s failed", b, label)
                errors[f"engine batch B={b} {label}"] = f"{type(exc).__name__}: {exc}"
                continue
            row["label"] = label
            rows.append(row)
            log.info("engine B=%d %s: host %.1f µs/stream-step, device %.2f ms/forward (%d steps, %.1f streams/step, "
                     "MAT %.2f)", b, label, row["host_us_per_stream_step"], row["device_ms_per_forward"],
                     row["steps"], row["streams_per_step"], row["mat"])
    return {"runner": runner_name, "tokens": tokens, "prompts": "2 B + 4", "parts": [*HOST_PARTS, "other"],
            "rows": rows}


def md_curves(d: dict) -> list[str]:
    """The header and the per-runner verify cost table."""
    m, c = d["machine"], d["config"]
    default = d["default_runner"]
    names = list(d["cost_curves_ms"])
    lines = [f"# GPU cost model ({d['tag']})", "", f"Reproduce: `{d['command']}`", "",
             f"Device: {m['device_name']} ({m['device']}), torch {m['torch']}, CUDA {m['cuda']}; host: "
             f"{common.machine_line(m)}; model: random {c['shape_name']} Llama in {c['dtype']}, context "
             f"{c['context_tokens']} cached tokens.", ""]
    if d["tag"].startswith("tiny"):
        lines += ["**Tiny CPU smoke run: these numbers test the script, they say nothing about a GPU.**", ""]

    def cell(n: str, t: str) -> Optional[str]:
        ms, r = d["cost_curves_ms"][n].get(t), d["t_ratio"][n].get(t)
        return None if ms is None else f"{ms} ({r:.2f}x)"

    lines += ["## Verify forward cost per runner", "",
              f"t(T) ms, median of {c['repeats']} interleaved repeats (t(T)/t(1) in brackets). Static runners pad "
              f"T to the buckets {tuple(c['static_buckets'])}. Default runner on this device (the engine's "
              f"`runner: auto, compile: auto`): **{default}**.", "",
              common.md_table(["T", *(f"{n} ms" for n in names)],
                              [[t, *(cell(n, t) for n in names)] for t in d["cost_curve_ms"]])]
    warm = ", ".join(f"{n} {d['warmup_s'][n]} s" for n in names)
    lines += ["", f"Warm-up per runner (weight packing; graph capture or compilation of every bucket up to "
                  f"{max(int(t) for t in d['cost_curve_ms'])}): {warm}.", ""]
    return lines


def md_projection(d: dict) -> list[str]:
    """The overhead summary line and the projection table."""
    default = d["default_runner"]
    per = [f"{n} {o['ar']['overhead_ms']} ms of a {o['ar']['step_ms']} ms step"
           for n, o in d["overhead_by_runner"].items() if "ar" in o]
    lines = [f"Per-step overhead outside the forward (ar, one token per step): {'; '.join(per)}. "
             f"RACER on {default}: {d['overhead']['racer']['overhead_ms']} ms of a "
             f"{d['overhead']['racer']['step_ms']} ms step (mean tree {d['overhead']['racer']['mean_tree_tokens']} "
             "tokens).", ""]
    body = [[f"{r['T']}{' (bench capacity)' if r['at_bench_capacity'] else ''}", d["cost_curve_ms"][str(r["T"])],
             r["t_ratio"], r["break_even_mat"], r["projected_speedup"]] for r in d["projection"]]
    lines += [f"## Projection on the default runner ({default})", "",
              f"MAT: {d['mat']['value']} ({d['mat']['source']}). speedup ~= MAT * (t(1) + o_ar) / (t(T) + o_racer), "
              f"o_ar = {d['overhead']['ar']['overhead_ms']} ms, o_racer = {d['overhead']['racer']['overhead_ms']} ms "
              "(per step, outside the forward).", "",
              common.md_table(["T", "t(T) ms", "t(T)/t(1)", "MAT to break even", "projected speedup"], body)]
    return lines


OVERHEAD_COLUMNS = {"runner": "runner", "method": "method", "capacity": "capacity", "steps": "steps",
                    "mean_tree_tokens": "mean tree tokens", "step_ms": "step ms",
                    "forward_ms_from_curve": "forward ms (curve)", "overhead_ms": "overhead ms", "draft_ms": "draft ms",
                    "verify_ms": "verify ms", "update_ms": "update ms"}


def md_overhead(d: dict) -> list[str]:
    """The per-step overhead table: every (runner, method) decoded in step 2."""
    rows = (o for per_runner in d["overhead_by_runner"].values() for o in per_runner.values())
    return ["", "## Per-step CPU overhead of the engine", "",
            common.md_table(list(OVERHEAD_COLUMNS.values()), [[o[k] for k in OVERHEAD_COLUMNS] for o in rows])]


BATCH_VERIFY_COLUMNS = {"streams": "B", "nodes": "N", "ms": "device ms per forward",
                        "tokens_per_forward": "tokens per forward", "tokens_per_ms": "tokens per ms",
                        "throughput_vs_b1": "throughput x B=1", "ms_vs_b1": "ms x B=1", "path": "path"}


def md_batch_verify(d: dict) -> list[str]:
    """Step 5's B x N table (nothing when the step did not run)."""
    bv, c = d.get("batch_verify"), d["config"]
    if not bv or not bv.get("rows"):
        return []
    return ["", f"## Batched verify: B streams x N tree nodes in one call ({bv['runner']})", "",
            f"`runner.verify_flat` over B streams' random trees of N nodes (one `FlatTrees`), each stream on its "
            f"own KV-cache slot with ~{c['context_tokens']} cached tokens; device ms per forward: wall time up to "
            f"every row's argmax on the host, median of {c['repeats']} interleaved repeats. x B=1: tokens per ms "
            "over B=1's at the same N (B x t(1, N) / t(B, N)); path: how the runner verified the batch "
            "(`runner.last_batch_path`: `segments` our CPU kernels, `padded` / `padded-graph` the static "
            "[B_pad, N_pad] step; `per-stream`: one forward per stream).", "",
            common.md_table(list(BATCH_VERIFY_COLUMNS.values()),
                            [[r[k] for k in BATCH_VERIFY_COLUMNS] for r in bv["rows"]])]


def md_engine_batch(d: dict) -> list[str]:
    """Step 6's table and its host split per part (nothing when the step did not run)."""
    eb, c = d.get("engine_batch"), d["config"]
    if not eb or not eb.get("rows"):
        return []
    head = ["B", "method", "steps", "streams/step", "rows/fwd", "MAT", "tokens/s", "host µs/ss", "host ms/step",
            "device ms/fwd", "prefill ms", "host share"]
    body = [[r["streams"], r["label"], r["steps"], r["streams_per_step"], r["rows_per_forward"], r["mat"],
             r["tokens_per_s"], f"**{r['host_us_per_stream_step']}**", r["host_ms_per_step"],
             f"**{r['device_ms_per_forward']}**", r["prefill_ms_per_prefill"], r["host_share"]] for r in eb["rows"]]
    parts = eb["parts"]
    return ["", f"## Engine decode at B streams in flight ({eb['runner']})", "",
            f"`Engine(..., streams=B)`, greedy, {eb['prompts']} synthetic token-id prompts of ~{c['context_tokens']} "
            f"tokens, {eb['tokens']} new tokens each, through one `StreamBatch` with continuous batching (B in "
            "flight). host µs/ss = (wall - verify_ms - prefill_ms) / stream-steps; device ms/fwd = verify_ms / steps "
            "(the batched `verify_flat` incl. the argmax / top-k); host ms/step: host time per batched step, beside "
            "it; MAT: output tokens per row forward (prefill counted).", "",
            common.md_table(head, body),
            "", "Host split, µs per stream-step (`BatchStats.host_ms`; other: stream set-up, prefill-side host "
                "work, StreamBatch plumbing):", "",
            common.md_table(["B", "method", *parts],
                            [[r["streams"], r["label"], *(r["host_us_split"][p] for p in parts)] for r in eb["rows"]])]


def render_md(d: dict) -> str:
    """The results' Markdown: the cost curves, projection, overheads, steps 5 and 6, greedy equality, errors."""
    g = d["greedy_equality"]
    lines = md_curves(d) + md_projection(d) + md_overhead(d) + md_batch_verify(d) + md_engine_batch(d)
    lines += ["", f"## Greedy equality in the model's dtype ({d['default_runner']})", "",
              f"AR reference vs RACER: {g['describe']}", ""]
    if d["errors"]:
        lines += ["## Errors", ""] + [f"- {k}: {v}" for k, v in d["errors"].items()] + [""]
    return "\n".join(lines)


# ---- the run: settings, the steps, the results ----
@dataclass
class Settings:
    """What one run measures (``parse_args`` resolved for the device: ``settings``)."""

    tiny: bool
    device: str
    dtype_name: str
    shape: dict
    context: int
    repeats: int
    max_new: int
    caps: list[int]
    racer_cap: int
    mat: Optional[float]
    bench_cap: Optional[int]
    mat_source: str
    batch_streams: list[int]
    batch_nodes: list[int]
    engine_streams: list[int]
    engine_caps: list[int]
    engine_tokens: int


@dataclass
class Curves:
    """Step 1's outcome: the runners' specs and the curves of those that were timed."""

    specs: dict[str, dict[str, str]]
    preferred: str
    buckets: tuple[int, ...]
    max_len: int
    curves: dict[str, dict[int, float]] = field(default_factory=dict)
    warmup_s: dict[str, float] = field(default_factory=dict)
    warmup_buckets: dict[str, dict[str, float]] = field(default_factory=dict)
    described: dict[str, dict] = field(default_factory=dict)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=common.prog("gpu"), description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny Llama on the CPU in float32 (smoke test)")
    p.add_argument("--device", default=None, help="default: cuda when available (required without --tiny)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 with --tiny")
    p.add_argument("--capacities", default=DEFAULT_CAPACITIES)
    p.add_argument("--context", type=int, default=None, help="cached tokens before the tree (default 512; tiny 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per (T, runner) (default 10; tiny 3)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens per overhead run (default 128; tiny 32)")
    p.add_argument("--racer-capacity", type=int, default=None,
                   help="capacity of the racer overhead run (default: the bench file's, else 64; tiny 16)")
    p.add_argument("--batch-streams", default=None,
                   help=f"B of the batched-verify grid (default {GPU_BATCH_STREAMS}; tiny {TINY_BATCH_STREAMS})")
    p.add_argument("--batch-nodes", default=None,
                   help=f"N of the batched-verify grid (default {GPU_BATCH_NODES}; tiny {TINY_BATCH_NODES})")
    p.add_argument("--engine-streams", default=None, help="B of the engine step (default: --batch-streams)")
    p.add_argument("--engine-capacities", default=ENGINE_CAPACITIES, help="racer capacities of the engine step")
    p.add_argument("--engine-tokens", type=int, default=None, help="new tokens per prompt in the engine step "
                                                                   "(default 32; tiny 16)")
    p.add_argument("--mat", type=float, default=None, help="MAT to project with (default: newest bench-*.json)")
    p.add_argument("--bench-glob", default=str(common.OUT / "bench-*.json"))
    p.add_argument("--out", default=str(common.OUT))
    p.add_argument("--tag", default=None)
    return p.parse_args(argv)


def resolve_mat(args: argparse.Namespace) -> tuple[Optional[float], Optional[int], str]:
    """(MAT to project with, the bench file's capacity, where the MAT came from)."""
    mat, bench_cap, bench_file = find_mat(args.bench_glob)
    if args.mat is not None:
        return args.mat, bench_cap, "--mat"
    if mat is not None:
        return mat, bench_cap, f"{os.path.relpath(bench_file, common.ROOT)}, method racer, capacity {bench_cap}"
    return None, bench_cap, "none: pass --mat or put a bench-*.json in benchmarks/"


def grids(args: argparse.Namespace) -> dict[str, list[int]]:
    """Steps 5 and 6: the B and N of the verify grid, the engine's B and racer capacities (each list sorted,
    duplicates dropped: '8,1,4' -> [1, 4, 8])."""
    tiny = args.tiny

    def ints(text: str) -> list[int]:
        return sorted(set(common.int_list(text)))

    streams = ints(args.batch_streams or (TINY_BATCH_STREAMS if tiny else GPU_BATCH_STREAMS))
    return {"batch_streams": streams,
            "batch_nodes": ints(args.batch_nodes or (TINY_BATCH_NODES if tiny else GPU_BATCH_NODES)),
            "engine_streams": ints(args.engine_streams) if args.engine_streams else streams,
            "engine_caps": ints(args.engine_capacities)}


def settings(args: argparse.Namespace, device: str) -> Settings:
    tiny = args.tiny
    mat, bench_cap, source = resolve_mat(args)
    return Settings(
        tiny=tiny, device=device,
        dtype_name=args.dtype or ("float32" if tiny and not device.startswith("cuda") else "bfloat16"),
        shape=TINY_SHAPE if tiny else LLAMA_8B_SHAPE, context=args.context or (64 if tiny else 512),
        repeats=args.repeats or (3 if tiny else 10), max_new=args.max_new_tokens or (32 if tiny else 128),
        caps=common.int_list(args.capacities),
        racer_cap=args.racer_capacity or (16 if tiny else (bench_cap or 64)),
        mat=mat, bench_cap=bench_cap, mat_source=source, engine_tokens=args.engine_tokens or (16 if tiny else 32),
        **grids(args))


def cost_curves(bundle: ModelBundle, s: Settings, errors: dict[str, str]) -> Curves:
    """Step 1: build and warm every runner, then t(T) of all of them interleaved; the runners are freed."""
    buckets = bench_buckets([1, *s.caps])
    # new_cache(context + max T) reserves one largest bucket more
    cv = Curves(specs=runner_specs(s.device), preferred=default_runner_name(bundle), buckets=buckets,
                max_len=s.context + max(s.caps) + buckets[-1])
    runners: dict[str, Any] = {}
    for name, spec in cv.specs.items():
        try:
            runner = build_runner(bundle, spec, buckets=buckets, max_len=cv.max_len)
            secs, per_bucket = warm_runner(runner, s.caps, s.device)
        except Exception as exc:
            log.exception("runner %s failed to build or warm up; dropped", name)
            errors[name] = f"build/warm-up: {type(exc).__name__}: {exc}"
            continue
        runners[name], cv.warmup_s[name], cv.warmup_buckets[name] = runner, round(secs, 3), per_bucket
        cv.described[name] = {"class": type(runner).__name__, **spec, "matmul": getattr(runner, "matmul", None),
                              "compiled": bool(getattr(runner, "compiled", False))}
        log.info("runner %s ready (warm-up %.2f s)", name, secs)
    runner = None  # only `runners` holds them now: freed after the curves
    if runners:
        cv.curves = measure_interleaved(runners, s.caps, bundle=bundle, context_tokens=s.context, repeats=s.repeats,
                                        errors=errors)
    for name, curve in cv.curves.items():
        log.info("t(T) ms %s: %s", name, {t: round(ms, 2) for t, ms in curve.items()})
    runners.clear()
    release_memory(s.device)
    return cv


def batched_verify(bundle: ModelBundle, s: Settings, cv: Curves, errors: dict[str, str]) -> dict:
    """Step 5 on the preferred runner (the next one where it fails): the B x N ``verify_flat`` grid."""
    for name in dict.fromkeys([cv.preferred, "static", *cv.specs]):
        if name not in cv.curves:
            continue
        runner = None
        try:
            runner = build_runner(bundle, cv.specs[name], buckets=cv.buckets,
                                  max_len=s.context + max(s.batch_nodes) + cv.buckets[-1])
            if hasattr(runner, "reserve_slots"):
                runner.reserve_slots(max(s.batch_streams))  # before the warm-up: more slots drop captured graphs
            warm_runner(runner, s.batch_nodes, s.device)
            rows = measure_batch(runner, bundle=bundle, streams=s.batch_streams, nodes=s.batch_nodes,
                                 context_tokens=s.context, repeats=s.repeats)
        except Exception as exc:
            log.exception("batched verify on runner %s failed", name)
            errors[f"{name} batch verify"] = f"{type(exc).__name__}: {exc}"
            continue
        finally:
            runner = None
            release_memory(s.device)
        for r in rows:
            log.info("verify_flat B=%d N=%d: %.2f ms (x%.2f throughput vs B=1, %s)", r["streams"], r["nodes"],
                     r["ms"], r["throughput_vs_b1"] or 0.0, r["path"])
        return {"runner": name, "rows": rows}
    return {"runner": None, "rows": []}


def overheads(bundle: ModelBundle, s: Settings, cv: Curves, prompt: list[int],
              errors: dict[str, str]) -> tuple[Optional[str], dict[str, dict[str, dict]], Any]:
    """Step 2: ar and racer on the default runner (falling back when it fails), ar on the others. Returns
    (the runner that decoded, {runner: {method: overhead}}, the racer result for step 3)."""
    by_runner: dict[str, dict[str, dict]] = {}
    default, racer_res = None, None
    run = dict(prompt=prompt, max_new_tokens=s.max_new)
    for name in dict.fromkeys([cv.preferred, "static", "eager", *cv.curves]):
        if name not in cv.curves:
            continue
        try:
            o_ar, _ = step_overhead(bundle, cv.curves[name], method="ar", capacity=1, runner_name=name,
                                    spec=cv.specs[name], **run)
            o_racer, racer_res = step_overhead(bundle, cv.curves[name], method="racer", capacity=s.racer_cap,
                                               runner_name=name, spec=cv.specs[name], **run)
        except Exception as exc:
            log.exception("decoding on runner %s failed", name)
            errors[f"{name} decode"] = f"{type(exc).__name__}: {exc}"
            release_memory(s.device)
            continue
        default = name
        by_runner[name] = {"ar": o_ar, "racer": o_racer}
        break
    if default is None:
        return None, by_runner, None
    for name in cv.curves:
        if name in by_runner or f"{name} decode" in errors:
            continue
        try:
            o, _ = step_overhead(bundle, cv.curves[name], method="ar", capacity=1, runner_name=name,
                                 spec=cv.specs[name], **run)
        except Exception as exc:
            log.exception("ar on runner %s failed", name)
            errors[f"{name} decode"] = f"{type(exc).__name__}: {exc}"
            release_memory(s.device)
            continue
        by_runner[name] = {"ar": o}
    return default, {n: by_runner[n] for n in cv.curves if n in by_runner}, racer_res


def machine(device: str) -> dict:
    """``common.machine()`` (the host: CPU, cores, load, Python, torch) and the device that ran: its name (on
    the CPU the CPU's), the CUDA version and the peak GPU memory allocated (None on the CPU)."""
    host = common.machine()
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        name, mem = props.name, round(torch.cuda.max_memory_allocated(torch.device(device)) / 2**30, 2)
    else:
        name, mem = host["cpu"], None
    return {**host, "device": device, "device_name": name, "cuda": torch.version.cuda, "peak_gpu_memory_gib": mem}


def results(s: Settings, cv: Curves, *, tag: str, command: str, mach: dict, build_s: float, default: str,
            by_runner: dict, div: Any, batch_verify: dict, engine_batch: dict, errors: dict[str, str]) -> dict:
    curve = cv.curves[default]
    o_ar, o_racer = by_runner[default]["ar"], by_runner[default]["racer"]
    return {
        "tag": tag, "command": command, "written_at": common.stamp(), "machine": mach,
        "config": {"shape_name": "tiny" if s.tiny else "llama-8b", "shape": s.shape, "dtype": s.dtype_name,
                   "context_tokens": s.context, "repeats": s.repeats, "max_new_tokens": s.max_new,
                   "racer_capacity": s.racer_cap, "build_s": round(build_s, 1), "static_buckets": list(cv.buckets),
                   "static_max_len": cv.max_len, "engine_buckets": list(DEFAULT_BUCKETS),
                   "batch_streams": s.batch_streams, "batch_nodes": s.batch_nodes,
                   "engine_streams": s.engine_streams, "engine_capacities": s.engine_caps,
                   "engine_tokens": s.engine_tokens},
        "runners": cv.described,
        "default_runner": default,
        # the default runner's curve: what the projection uses
        "cost_curve_ms": {str(t): round(ms, 3) for t, ms in sorted(curve.items())},
        "cost_curves_ms": {n: {str(t): round(ms, 3) for t, ms in sorted(c.items())} for n, c in cv.curves.items()},
        "t_ratio": {n: {str(t): round(ms / c[1], 3) for t, ms in sorted(c.items())} for n, c in cv.curves.items()},
        "warmup_s": {n: cv.warmup_s[n] for n in cv.curves},
        "warmup_s_per_bucket": {n: cv.warmup_buckets[n] for n in cv.curves},
        # per-step overhead on the default runner (ar, racer); overhead_by_runner adds ar on every runner
        "overhead": {"ar": o_ar, "racer": o_racer},
        "overhead_by_runner": by_runner,
        "greedy_equality": {"runner": default, "identical": div.identical, "common_prefix": div.common_prefix,
                            "len_ref": div.len_a, "len_racer": div.len_b, "logit_gap": div.logit_gap,
                            "is_tie": div.is_tie, "describe": div.describe()},
        "mat": {"value": s.mat, "source": s.mat_source, "bench_capacity": s.bench_cap},
        "projection": project(curve, mat=s.mat, o_ar=o_ar["overhead_ms"], o_racer=o_racer["overhead_ms"],
                              bench_capacity=s.bench_cap),
        "batch_verify": batch_verify,
        "engine_batch": engine_batch,
        "errors": errors,
    }


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not device.startswith("cuda"):
        torch.set_num_threads(1)  # spinning OpenMP threads collapse on a shared CPU (docs/service.md)
    if not args.tiny and not device.startswith("cuda"):
        print("no CUDA device: the 8B-shaped run needs a GPU (about 17 GB of memory); use --tiny for the CPU "
              "smoke run", file=sys.stderr)
        return 3
    s = settings(args, device)
    t0 = time.perf_counter()
    bundle = build_model(s.shape, device=device, dtype=getattr(torch, s.dtype_name))
    build_s = time.perf_counter() - t0
    log.info("built %s model on %s in %.1f s", "tiny" if s.tiny else "8B-shaped", device, build_s)
    errors: dict[str, str] = {}

    cv = cost_curves(bundle, s, errors)  # 1. t(T) per runner, interleaved
    if not cv.curves:
        print(f"no runner could be timed: {errors}", file=sys.stderr)
        return 4
    batch_verify = batched_verify(bundle, s, cv, errors)  # 5, while nothing else holds memory
    gen = torch.Generator().manual_seed(1)
    motif = torch.randint(3, s.shape["vocab_size"], (24,), generator=gen).tolist()
    prompt = (motif * (s.context // len(motif) + 1))[:s.context]  # repeats itself: the retrieval drafter has material
    default, by_runner, racer_res = overheads(bundle, s, cv, prompt, errors)  # 2.
    if default is None:
        print(f"no runner could decode: {errors}", file=sys.stderr)
        return 4
    if default != cv.preferred:
        errors["default runner"] = f"{cv.preferred} unavailable: projection, greedy check and engine step on {default}"
    engine_batch = engine_batches(bundle, cv.specs[default], runner_name=default, streams=s.engine_streams,  # 6.
                                  capacities=s.engine_caps, tokens=s.engine_tokens, context_tokens=s.context,
                                  errors=errors)
    # 3. Greedy equality: AR reference (the transformers forward) vs RACER on the default runner.
    ref = generate_reference(bundle, prompt, GenerationParams(max_new_tokens=s.max_new))
    div = compare_greedy(bundle, prompt, ref.token_ids, racer_res.token_ids)

    mach = machine(device)
    tag = args.tag or ("tiny-" + device.split(":")[0] if s.tiny else mach["device_name"].replace(" ", "-").lower())
    command = common.command("gpu", argv)
    d = results(s, cv, tag=tag, command=command, mach=mach, build_s=build_s, default=default, by_runner=by_runner,
                div=div, batch_verify=batch_verify, engine_batch=engine_batch, errors=errors)
    md = render_md(d)
    jpath, mpath = common.write_results(args.out, f"gpu_bench-{tag}", d, md)
    print(md)
    print(f"wrote {jpath} and {mpath}")
    if errors:
        print(f"some runners failed (see 'errors' in {jpath}): {errors}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
