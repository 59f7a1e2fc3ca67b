"""Verify-forward cost curve: the eager runner, the static runner (per matmul path, optionally in bfloat16)
and a weight-streaming probe, in one interleaved run (issue 12, "Cost curve").

For each T in ``--sizes``, one verify forward over a chain of T tree tokens after ``--context`` cached
tokens, up to the argmax copied back (``engine/capacity.py::measure_cost_curve`` does the same). Rounds go
over every (runner, T) pair in turn, ``--repeats`` times, so that machine drift hits all contenders alike;
the figure is the median per pair. The probe is the time to read every weight once (a ``sum`` over each
parameter), the floor of a memory-bound forward. Writes ``<out>/verify-<stamp>.json`` and ``.md``.

    python -m benchmarks.verify                       # eager vs static matmul paths, float32
    python -m benchmarks.verify --bf16                # also a bfloat16 copy
    python -m benchmarks.verify --paths small_gemm --isas avx512,avx2 --prefill 300 --no-eager  # AVX-512 vs AVX2
    python -m benchmarks.verify --paths small_gemm --stored --no-eager  # a GGUF's weights as stored vs float32

The float32 contenders run on the de-quantised float32 copy (``weights="float32"``); ``--stored`` adds the static
runner on the weights as the GGUF stores them (issue 31; ``static-stored``, per ISA with ``--isas``).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Callable, Optional

import torch

from benchmarks import common
from racer_batch.drafters.base import Draft
from racer_batch.engine.runner import ModelRunner
from racer_batch.engine.static_runner import StaticRunner
from racer_batch.engine.tree import flatten_tree
from racer_batch.models import ModelBundle, load_model

log = logging.getLogger("benchmarks.verify")


@torch.inference_mode()
def weight_probe_ms(model: torch.nn.Module, repeats: int) -> float:
    """Median ms to read every parameter once (tied weights counted once)."""
    params = list({p.data_ptr(): p for p in model.parameters()}.values())
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for p in params:
            p.sum()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times[1:])


class Contender:
    """One runner with a warm KV cache of ``context`` random tokens, timed per tree size."""

    def __init__(self, label: str, runner, *, context: int, sizes: list[int], vocab: int, isa: Optional[str] = None,
                 prefill_tokens: int = 0) -> None:
        self.label, self.runner, self.context, self.isa = label, runner, context, isa
        gen = torch.Generator().manual_seed(0)
        self.cache = runner.new_cache(context + max(sizes))
        runner.prefill(torch.randint(0, vocab, (context,), generator=gen).tolist(), cache=self.cache, topk=0)
        self.trees = {}
        for t in sizes:
            chain = Draft.chain(torch.randint(0, vocab, (t,), generator=gen).tolist())
            self.trees[t] = flatten_tree(chain, committed_len=context, device=runner.device, dtype=runner.dtype)
        self.times: dict[int, list[float]] = {t: [] for t in sizes}
        # a prompt of prefill_tokens tokens, prefilled into a slot of its own with the store's top-8 (RACER's)
        self.prompt = torch.randint(0, vocab, (prefill_tokens,), generator=gen).tolist() if prefill_tokens else []
        self.prefill_cache = runner.new_cache(prefill_tokens + 1) if prefill_tokens else None
        self.prefill_times: list[float] = []

    def _use_isa(self) -> None:
        if self.isa is not None:
            self.runner._ops.set_isa(self.isa)

    @torch.inference_mode()
    def once_prefill(self) -> None:
        if not self.prompt:
            return
        self._use_isa()
        t0 = time.perf_counter()
        self.runner.prefill(self.prompt, cache=self.prefill_cache, topk=8)
        self.prefill_times.append((time.perf_counter() - t0) * 1000.0)

    @torch.inference_mode()
    def once(self, t: int) -> None:
        self._use_isa()
        t0 = time.perf_counter()
        logits = self.runner.verify_tree(self.trees[t], cache=self.cache)
        logits.argmax(-1).cpu()
        self.times[t].append((time.perf_counter() - t0) * 1000.0)
        self.runner.keep_rows(self.cache, committed_len=self.context, nodes=[])

    def medians(self) -> dict[int, float]:
        return {t: statistics.median(v[1:] if len(v) > 2 else v) for t, v in self.times.items()}


class HFStaticContender(Contender):
    """transformers' own static-cache path: a ``StaticCache`` sized up front, explicit positions and a 4D
    additive mask over the whole cache, the stock (uncompiled) forward: the other way issue 12 names. The
    cache's write offset is set back after each timed call, so every call writes the same rows."""

    def __init__(self, label: str, bundle, *, context: int, sizes: list[int], vocab: int) -> None:
        from transformers import StaticCache

        self.label, self.context, self.bundle, self.runner = label, context, bundle, None
        self.max_len = context + max(sizes)
        self.cache = StaticCache(config=bundle.model.config, max_cache_len=self.max_len)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, vocab, (1, context), generator=gen)
        with torch.inference_mode():
            bundle.model(input_ids=prompt, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.inputs = {}
        neg = torch.finfo(torch.float32).min
        for t in sizes:
            ids = torch.randint(0, vocab, (1, t), generator=gen)
            mask = torch.full((1, 1, t, self.max_len), neg)
            mask[0, 0, :, :context] = 0.0
            mask[0, 0, :, context : context + t].masked_fill_(torch.ones(t, t, dtype=torch.bool).tril(), 0.0)
            self.inputs[t] = (ids, mask, torch.arange(context, context + t))
        self.times = {t: [] for t in sizes}
        self.prompt, self.prefill_times, self.isa = [], [], None

    def once_prefill(self) -> None:
        pass

    @torch.inference_mode()
    def once(self, t: int) -> None:
        ids, mask, pos = self.inputs[t]
        t0 = time.perf_counter()
        out = self.bundle.model(input_ids=ids, attention_mask=mask, position_ids=pos.view(1, -1),
                                cache=self.cache, use_cache=True)
        out.logits.argmax(-1)
        self.times[t].append((time.perf_counter() - t0) * 1000.0)
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(self.context)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=common.prog("verify"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=300, help="cached tokens before the tree")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--paths", default="small_gemm,onednn_packed,torch", help="static-runner matmul paths")
    ap.add_argument("--bf16", action="store_true", help="also the static runner on a bfloat16 copy of the model")
    ap.add_argument("--hf-static", action="store_true", help="also transformers' own StaticCache path (uncompiled)")
    ap.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--isas", default="", help="our CPU kernels' instruction sets side by side for the small_gemm "
                    "path, e.g. avx512,avx2 (one static runner each; default: the machine's own only)")
    ap.add_argument("--prefill", type=int, default=0, help="also time a prefill of this many prompt tokens "
                    "(with the per-position top-8 RACER's store needs) per contender and round")
    ap.add_argument("--no-eager", action="store_true", help="leave the eager transformers runner out")
    ap.add_argument("--stored", action="store_true", help="also the static runner on the GGUF's weights as stored")
    ap.add_argument("--out", default=str(common.OUT))
    return ap


def build_contenders(args: argparse.Namespace, bundle: ModelBundle, *, sizes: list[int], isas: list[str],
                     error: Callable[[str], None]) -> tuple[list[Contender], dict[str, float]]:
    """The contenders the arguments ask for, each warmed up on ``sizes``, and their set-up seconds (load, pack,
    warm-up / compile). ``error``: the parser's (our kernels missing for ``--isas``)."""
    contenders: list[Contender] = []
    setup_s: dict[str, float] = {}
    vocab = bundle.vocab_size

    def add(label: str, make: Callable[[], object], isa: Optional[str] = None) -> None:
        t0 = time.perf_counter()
        runner = make()
        if isa is not None:
            if getattr(runner, "_ops", None) is None:
                error(f"--isas: our CPU kernels are not available here ({label})")
            runner._ops.set_isa(isa)
        runner.warmup(sizes)
        setup_s[label] = round(time.perf_counter() - t0, 2)
        contenders.append(Contender(label, runner, context=args.context, sizes=sizes, vocab=vocab, isa=isa,
                                    prefill_tokens=args.prefill if isinstance(runner, StaticRunner) else 0))
        log.info("%s ready in %.1f s", label, setup_s[label])

    if not args.no_eager:
        add("eager", lambda: ModelRunner(bundle))
    for path in [p for p in args.paths.split(",") if p]:
        if path == "small_gemm" and isas:
            add(f"static-{path}", lambda: StaticRunner(bundle, matmul="small_gemm"), isa=isas[0])
            for isa in isas[1:]:
                add(f"static-{path}-{isa}", lambda: StaticRunner(bundle, matmul="small_gemm"), isa=isa)
            continue
        add(f"static-{path}", lambda path=path: StaticRunner(bundle, matmul=path))
    if args.hf_static:
        contenders.append(HFStaticContender("hf-staticcache", bundle, context=args.context, sizes=sizes, vocab=vocab))
        setup_s["hf-staticcache"] = 0.0
    if args.bf16:
        b16 = load_model(args.model, dtype="bfloat16")
        add("static-bf16", lambda: StaticRunner(b16))
    if args.stored:
        stored = load_model(args.model, weights="as_stored")
        for i, isa in enumerate(isas or [None]):
            add("static-stored" + (f"-{isa}" if i else ""), lambda: StaticRunner(stored), isa=isa)
        setup_s["stored_weight_bytes"] = stored.stored.nbytes
    return contenders, setup_s


def run_rounds(contenders: list[Contender], model: torch.nn.Module, *, sizes: list[int], repeats: int) -> float:
    """``repeats`` + 1 interleaved rounds (the first an untimed warm-up): per round the weight probe, every
    (T, contender) verify forward, then each contender's prefill. Returns the probe's median ms."""
    probe = []
    for rnd in range(repeats + 1):
        probe.append(weight_probe_ms(model, 1))
        for t in sizes:
            for c in contenders:
                c.once(t)
        for c in contenders:
            c.once_prefill()
        log.info("round %d/%d (the first is an untimed warm-up)", rnd + 1, repeats + 1)
    return statistics.median(probe[1:])


def curve_rows(contenders: list[Contender], probe_ms: float) -> list[dict]:
    """One row per contender: ms and ms / t(1) per T, t(1) over the probe, t(16) / t(1), the ISA forced and
    the median prefill ms (None without ``--prefill``)."""
    rows = []
    for c in contenders:
        curve = c.medians()
        rows.append({"runner": c.label, "ms": {str(t): round(v, 2) for t, v in curve.items()},
                     "ratio": {str(t): round(v / curve[1], 3) for t, v in curve.items()},
                     "t1_over_probe": round(curve[1] / probe_ms, 3),
                     "t16_over_t1": round(curve[16] / curve[1], 3) if 16 in curve else None,
                     "isa": c.isa,
                     "prefill_ms": (round(statistics.median(c.prefill_times[1:] or c.prefill_times), 1)
                                    if c.prefill_times else None)})
    return rows


def render_md(summary: dict, stamp: str) -> str:
    """The Markdown of a result: the cost curve per runner (ms and ratios to t(1)), the probe, the prefills,
    set-up seconds and prepacked bytes."""
    sizes, rows = summary["sizes"], summary["rows"]
    head = ["runner", *(f"t({t}) ms" for t in sizes), "t(1)/probe", *(f"t({t})/t(1)" for t in sizes if t > 1)]
    body = [[r["runner"], *(f"{r['ms'][str(t)]:.1f}" for t in sizes), f"{r['t1_over_probe']:.2f}",
             *(f"{r['ratio'][str(t)]:.2f}" for t in sizes if t > 1)] for r in rows]
    lines = [f"# Verify cost curve {stamp}", "", f"Reproduce: `{summary['command']}`", "",
             f"Model {summary['model']} ({summary['weight_bytes'] / 1e6:.0f} MB of weights), "
             f"{summary['context_tokens']} cached tokens, machine: {common.machine_line(summary['machine'])}, "
             f"{summary['torch_threads']} torch threads, torch {summary['machine']['torch']}; medians of "
             f"{summary['repeats']} interleaved rounds.", "",
             f"Weight-streaming probe (read every float32 weight once): **{summary['probe_ms']:.1f} ms**."
             + (f" Weights as stored: {summary['stored_weight_bytes'] / 1e6:.0f} MB."
                if summary.get("stored_weight_bytes") else ""), "",
             common.md_table(head, body)]
    if summary["prefill_tokens"]:
        lines += ["", f"Prefill of {summary['prefill_tokens']} prompt tokens with the per-position top-8 (median ms): "
                  + ", ".join(f"{r['runner']} {r['prefill_ms']}" for r in rows if r["prefill_ms"] is not None)]
    lines += ["", "Set-up seconds (load, pack, warm-up / compile): "
              + ", ".join(f"{k} {v}" for k, v in summary["setup_s"].items()), "",
              "Extra bytes of prepacked weights: "
              + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in summary["packed_bytes"].items()),
              "", f"Static KV cache: {summary['kv_bytes_per_token']} bytes per position per stream.", ""]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    sizes = sorted(set(common.int_list(args.sizes)))
    isas = [x for x in args.isas.split(",") if x]
    if any(x not in ("avx2", "avx512") for x in isas):
        ap.error(f"--isas takes avx2 and/or avx512, got {args.isas!r}")
    bundle = load_model(args.model, dtype="float32", weights="float32")
    contenders, setup_s = build_contenders(args, bundle, sizes=sizes, isas=isas, error=ap.error)
    stored_bytes = setup_s.pop("stored_weight_bytes", None)
    probe_ms = run_rounds(contenders, bundle.model, sizes=sizes, repeats=args.repeats)
    static = [c.runner for c in contenders if isinstance(c.runner, StaticRunner)]
    summary = {
        "command": common.command("verify", argv),
        "written_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": bundle.name, "context_tokens": args.context, "repeats": args.repeats, "sizes": sizes,
        "prefill_tokens": args.prefill, "machine": common.machine(), "torch_threads": torch.get_num_threads(),
        "weight_bytes": sum(p.numel() * p.element_size()
                            for p in {p.data_ptr(): p for p in bundle.model.parameters()}.values()),
        "stored_weight_bytes": stored_bytes,
        "probe_ms": round(probe_ms, 2), "setup_s": setup_s, "rows": curve_rows(contenders, probe_ms),
        "kv_bytes_per_token": static[0].kv_bytes_per_token if static else None,
        "packed_bytes": {c.label: c.runner.packed_bytes for c in contenders if isinstance(c.runner, StaticRunner)},
    }
    stamp = common.stamp()
    md = render_md(summary, stamp)
    common.write_results(args.out, f"verify-{stamp}", summary, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
