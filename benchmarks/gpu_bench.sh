#!/usr/bin/env bash
# The GPU cost-model benchmark (python -m benchmarks.gpu) for a CUDA machine with no network, on an 8B-shaped
# random bf16 Llama: t(T) of the verify forward for the eager, static and cuda-graph runners (interleaved),
# their warm-up (capture) seconds, the engine's per-step overhead per runner, greedy equality, the projected
# speedup on the default runner, and the batched engine at GPU batch sizes (issue 27):
#   - the B x N verify grid: one runner.verify_flat over B streams x N tree nodes, B in 1,8,32,64 and N in
#     1,4,16 (--batch-streams / --batch-nodes), device ms per forward, throughput vs B=1 and the path that ran
#     (padded-graph: one CUDA graph per (B_pad, N_pad) bucket);
#   - the engine at B streams in flight: for each B of the grid (--engine-streams), ar and racer at capacity 4
#     and 16 (--engine-capacities), Engine(..., streams=B) greedy-decodes 2B+4 synthetic token-id prompts of
#     ~512 tokens for 32 new tokens each (--engine-tokens) through one StreamBatch with continuous batching;
#     host µs per stream-step ((wall - verify - prefill ms) / stream-steps) beside device ms per forward
#     (verify ms / steps), and the host split per part (µs per stream-step).
#
#   bash benchmarks/gpu_bench.sh              # 8B-shaped random bf16 Llama on cuda:0 (~17 GB weights, ~35-40 GB
#                                             # peak with 64 KV slots); expected ~4-6 min on an H200 (model
#                                             # build + steps 1-4 ~3 min, the B x N grid ~0.5 min, the engine
#                                             # at B = 1..64 ~1.5-2 min), well inside 8 min
#   bash benchmarks/gpu_bench.sh --tiny       # tiny Llama on the CPU, eager + static runners, B in 1,2,4 and
#                                             # N in 1,4: checks the script anywhere, in seconds
#   bash benchmarks/gpu_bench.sh --mat 2.4    # project with this MAT instead of the newest benchmarks/bench-*.json
#   bash benchmarks/gpu_bench.sh --repeats 5  # fewer timed rounds per (T, runner) and (B, N) (default 10)
#   bash benchmarks/gpu_bench.sh --engine-streams 1,8 --engine-tokens 16   # a shorter engine step
#
# Exit status: 0; 3 without CUDA and without --tiny; 4 when a runner or an engine-step configuration failed
# (the others' results are still written, the failure is under "errors" in the JSON).
#
# Needs python with torch (a CUDA build for the real run), transformers, numpy and pydantic; nothing is
# downloaded (weights are random, built from the config). Runs `python -m benchmarks.gpu` from the repository
# root (the folder above this one) with $PYTHON when set, else .venv/bin/python when present, else python3.
# Results go to $OUT when set (the folder a remote runner brings back), else benchmarks/; they are a few KB
# (JSON + Markdown + environment.txt), well under a 64 MiB upload limit.
set -euo pipefail

cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false

if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"
elif [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=python3
fi
out="${OUT:-benchmarks}"
mkdir -p "$out"

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -srm)"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
    else
        echo "nvidia-smi: not found"
    fi
    "$py" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "transformers", transformers.__version__)'
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt"

exec "$py" -m benchmarks.gpu --out "$out" "$@"
