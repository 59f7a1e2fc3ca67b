"""The reduced-precision path on the CPU: greedy comparison by common prefix (numerics helper), the engine
in bfloat16, and benchmarks/gpu.py in its tiny CPU mode. No GPU is needed (none is available here)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu
from racer_batch.engine import Engine
from racer_batch.engine.kernels import cpu_ops
from racer_batch.engine.numerics import Divergence, compare_greedy, first_divergence
from racer_batch.engine.reference import generate_reference
from racer_batch.values import DecodingConfig, GenerationParams


def test_first_divergence_on_token_lists():
    assert first_divergence([5, 7, 9, 2], [5, 7, 4]) == Divergence(2, 4, 3, 9, 4)
    assert first_divergence([1, 2, 3], [1, 2, 3]).identical
    d = first_divergence([1, 2], [1, 2, 3])
    assert (d.common_prefix, d.token_a, d.token_b, d.identical) == (2, None, 3, False)
    assert first_divergence([], [4]).token_b == 4
    assert "diverge after 2 of 4/3 tokens: 9 vs 4" in first_divergence([5, 7, 9, 2], [5, 7, 4]).describe()


def test_tie_tolerance_by_dtype():
    assert Divergence(3, 5, 5, 1, 2, logit_gap=0.2, dtype="bfloat16").is_tie
    assert not Divergence(3, 5, 5, 1, 2, logit_gap=0.2, dtype="float16").is_tie
    assert Divergence(3, 5, 5, 1, 2).is_tie is None


def _bf16(bundle):
    bundle.model.to(torch.bfloat16)
    bundle.dtype = "bfloat16"
    return bundle


@pytest.mark.parametrize("method", ["racer", "pld"])
def test_engine_in_bfloat16_matches_reference_up_to_ties(tiny, method):
    bundle = _bf16(tiny)
    prompt = "abcabcabd abcabc " * 3
    params = GenerationParams(max_new_tokens=48)
    engine = Engine(bundle, DecodingConfig(method=method, capacity=16))
    assert engine.runner.dtype == torch.bfloat16
    res = engine.generate(prompt, params)
    ref = generate_reference(bundle, prompt, params)
    div = compare_greedy(bundle, engine.encode(prompt), ref.token_ids, res.token_ids)
    # Equal, or parted at a near-tie of the target's top two logits (rounding), never at a clear winner.
    assert div.identical or div.is_tie, div.describe()


def test_compare_greedy_measures_the_gap_where_outputs_part(tiny):
    prompt_ids = [3, 4, 5, 6]
    ref = generate_reference(tiny, prompt_ids, GenerationParams(max_new_tokens=6)).token_ids
    other = ref[:3] + [(ref[3] + 1) % 60 + 3]  # force a different 4th token
    div = compare_greedy(tiny, prompt_ids, ref, other)
    assert div.common_prefix == 3 and div.dtype == "float32"
    assert div.logit_gap > 0, "the reference's own greedy token must have the larger logit"


def test_gpu_bench_tiny_mode_runs_on_cpu(tmp_path):
    bench = tmp_path / "bench-20260101-000000.json"
    bench.write_text(json.dumps({"config": {"capacity": 16}, "overall": {"racer": {"mat": 2.5}}}))
    rc = gpu.main(["--tiny", "--capacities", "1,4,16", "--max-new-tokens", "16", "--repeats", "2",
                         "--batch-streams", "1,2,4", "--batch-nodes", "1,8", "--engine-streams", "1,2",
                         "--engine-tokens", "8",
                         "--bench-glob", str(tmp_path / "bench-*.json"), "--out", str(tmp_path / "out")])
    assert rc == 0
    d = json.loads((tmp_path / "out" / "gpu_bench-tiny-cpu.json").read_text())
    assert set(d["cost_curve_ms"]) == {"1", "4", "16"}
    # eager and static on the CPU (CUDA graphs only on CUDA), timed over the same sizes; the default
    # runner's curve is the one the projection uses
    assert d["default_runner"] == "static" and not d["errors"]
    assert set(d["cost_curves_ms"]) == {"eager", "static"}
    assert all(set(c) == {"1", "4", "16"} for c in d["cost_curves_ms"].values())
    assert d["cost_curve_ms"] == d["cost_curves_ms"]["static"]
    assert all(d["t_ratio"][n]["1"] == 1.0 for n in ("eager", "static"))
    assert set(d["warmup_s"]) == {"eager", "static"} and d["warmup_s"]["eager"] == 0.0
    assert all(v >= 0 for v in d["warmup_s"].values())
    assert not d["runners"]["static"]["compiled"]
    assert d["mat"]["value"] == 2.5 and d["mat"]["bench_capacity"] == 16
    row16 = next(r for r in d["projection"] if r["T"] == 16)
    assert row16["at_bench_capacity"] and row16["projected_speedup"] == pytest.approx(
        2.5 / row16["break_even_mat"], rel=0.01)
    # 16 new tokens: the prefill's and 15 decoding steps (the prefill record is not a step)
    assert d["overhead"]["ar"]["steps"] == 15 and d["overhead"]["racer"]["steps"] >= 1
    assert d["overhead"]["ar"]["runner"] == d["overhead"]["racer"]["runner"] == "static"
    by = d["overhead_by_runner"]
    assert set(by) == {"eager", "static"} and set(by["static"]) == {"ar", "racer"} and set(by["eager"]) == {"ar"}
    assert by["static"]["ar"] == d["overhead"]["ar"] and by["eager"]["ar"]["runner"] == "eager"
    assert all(o["ar"]["steps"] == 15 for o in by.values())
    assert d["greedy_equality"]["identical"] or d["greedy_equality"]["is_tie"]
    # batched verify: every (B, N) timed on the default runner, B=1 the baseline of each N
    bv = d["batch_verify"]
    assert bv["runner"] == "static"
    assert [(r["streams"], r["nodes"]) for r in bv["rows"]] == [(b, n) for b in (1, 2, 4) for n in (1, 8)]
    for r in bv["rows"]:
        assert r["ms"] > 0 and r["tokens_per_forward"] == r["streams"] * r["nodes"]
        assert r["throughput_vs_b1"] == pytest.approx(r["streams"] / r["ms_vs_b1"], rel=0.01)
        # the runner's own word: every B (one stream too) in one forward: our CPU kernels' segments, else the
        # padded [B, N] step
        assert r["path"] == ("segments" if cpu_ops() is not None else "padded")
    # the engine at B streams in flight: ar and racer at capacity 4 and 16 for each B, host µs per stream-step
    # beside device ms per forward, and the host split per part
    eb = d["engine_batch"]
    assert eb["runner"] == "static" and d["config"]["engine_streams"] == [1, 2]
    assert [(r["streams"], r["label"]) for r in eb["rows"]] == [
        (b, m) for b in (1, 2) for m in ("ar", "racer-c4", "racer-c16")]
    for r in eb["rows"]:
        for key in ("host_us_per_stream_step", "device_ms_per_forward", "host_ms_per_step", "wall_ms", "verify_ms",
                    "prefill_ms", "tokens_per_s", "mat"):
            assert isinstance(r[key], (int, float)) and r[key] > 0, (key, r)
        assert r["prompts"] == 2 * r["streams"] + 4 and r["output_tokens"] == 8 * r["prompts"]
        assert r["stream_steps"] >= r["steps"] > 0 and r["prefills"] == r["prompts"]
        assert r["streams_per_step"] <= r["streams"] and not r["fallbacks"]
        assert set(r["host_us_split"]) == {*gpu.HOST_PARTS, "other"} == set(eb["parts"])
        assert all(isinstance(v, (int, float)) for v in r["host_us_split"].values())
        assert sum(r["host_us_split"][p] for p in gpu.HOST_PARTS) > 0
        assert sum(r["host_us_split"].values()) == pytest.approx(r["host_us_per_stream_step"], abs=0.1)
    ar1 = next(r for r in eb["rows"] if r["streams"] == 1 and r["label"] == "ar")
    assert ar1["steps"] == ar1["stream_steps"] == 7 * ar1["prompts"] and ar1["mat"] == 1.0  # 1 token a step
    assert max(r["streams_per_step"] for r in eb["rows"] if r["streams"] == 2) > 1  # two streams per forward
    md = (tmp_path / "out" / "gpu_bench-tiny-cpu.md").read_text()
    assert "## Batched verify: B streams x N tree nodes in one call (static)" in md
    assert "## Engine decode at B streams in flight (static)" in md and "| 2 | racer-c16 |" in md
    assert "| B | method | " + " | ".join([*gpu.HOST_PARTS, "other"]) + " |" in md
    assert "say nothing about a GPU" in md
    assert "| T | eager ms | static ms |" in md and "Per-step overhead outside the forward" in md


def test_gpu_bench_refuses_the_full_run_without_cuda(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert gpu.main(["--out", str(tmp_path)]) == 3
    assert "no CUDA device" in capsys.readouterr().err
