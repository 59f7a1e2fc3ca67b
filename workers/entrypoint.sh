#!/usr/bin/env bash
# Entry point of the racer-batch GPU worker image.
#
#   worker [ARGS...]     check the GPU, then `racer-batch worker ARGS...` (metrics on $RACER_BATCH_METRICS_PORT)
#   check                print what the worker would run on (torch, CUDA, GPUs, bf16) and exit
#   gpu-bench [ARGS...]  benchmarks/gpu_bench.sh (writes to $OUT or ./benchmarks)
#   anything else        run it as is (KubeRay overrides the command of Ray pods anyway)
#
# Environment: REDIS_URL (required for worker), RACER_BATCH_METRICS_PORT (default 9400),
# RACER_BATCH_REQUIRE_GPU=1 to refuse to start without a CUDA device (exit 3).
set -euo pipefail

gpu_check() {
    python - <<'PY'
import os, sys
import torch
ok = torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, CUDA available: {ok}")
if ok:
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name} {p.total_memory / 2**30:.1f} GiB, bf16: {torch.cuda.is_bf16_supported()}")
elif os.environ.get("RACER_BATCH_REQUIRE_GPU") == "1":
    print("RACER_BATCH_REQUIRE_GPU=1 but no CUDA device is visible (driver, --gpus, nvidia.com/gpu?)", file=sys.stderr)
    sys.exit(3)
PY
}

cmd="${1:-worker}"
case "$cmd" in
    worker)
        shift || true
        if [ -z "${REDIS_URL:-}" ]; then
            echo "REDIS_URL is not set (redis[s]://[user:password@]host:port/db)" >&2
            exit 2
        fi
        gpu_check
        export RACER_BATCH_METRICS_PORT="${RACER_BATCH_METRICS_PORT:-9400}"
        exec racer-batch worker "$@"
        ;;
    check)
        gpu_check
        ;;
    gpu-bench)
        shift
        exec bash /opt/racer-batch/benchmarks/gpu_bench.sh "$@"
        ;;
    *)
        exec "$@"
        ;;
esac
