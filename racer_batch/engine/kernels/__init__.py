"""Our own CPU kernels for the verify forward, built on first use with the machine's C++ compiler and cached.

``cpu_kernels.cpp`` registers ``torch.ops.racer``: ``pack`` / ``linear`` / ``linear_add_`` (a float32 GEMM for
the few rows of a verify forward over weights packed once in 16-column panels; see the file's header for the
scheme), and the small ops around it, each one call instead of 3-10 aten ops: ``rms_norm``, ``rope_kv_``
(rotary embedding of q and k, k and v written into the KV cache), ``attention`` (tree attention of a few
query rows over one slot of the cache) and ``silu_mul``. The shared library is compiled once per (source,
flags, torch, Python) into ``$RACER_KERNEL_CACHE`` (default ``~/.cache/racer-batch/kernels``), so actors and
test processes after the first load it in milliseconds; building takes ~20 s on 2 cores. Where the CPU has
AVX-512F the GEMM (past 6 rows) runs AVX-512 code compiled through function attributes and picked at run time
(``isa()``, ``set_isa``; ``RACER_KERNEL_ISA=avx2`` forces AVX2), bit-identical to the AVX2 code. It is compiled with
``-fopenmp`` against torch's own ``libgomp``, so ``at::parallel_for`` runs on torch's thread pool (without
the flag it silently runs on one thread) and ``torch.set_num_threads`` governs it.

Nothing here is required: :func:`cpu_ops` returns None, with the reason in :func:`unavailable_reason`, where
the CPU lacks AVX2/FMA/F16C, there is no working C++ compiler, or ``RACER_KERNELS=off``; the static runner then
uses oneDNN's prepacked matmul and aten ops (slower, same results up to float rounding).
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from ...native_build import cache_dir, compile_library, library_path  # noqa: F401 - cache_dir re-exported

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("cpu_kernels.cpp")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17", "-fPIC", "-shared", "-DNDEBUG"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return "avx2" in flags and "fma" in flags and "f16c" in flags


def _compile(out: Path) -> None:
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    compile_library(_SRC, out, [*_FLAGS, abi], link=[f"-L{libdir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{libdir}"])


def _library_path() -> Path:
    return library_path(_SRC, _FLAGS, "cpu_kernels")


def cpu_ops():
    """``torch.ops.racer`` loaded, or None when unavailable (the reason logged once, kept for
    :func:`unavailable_reason`). Builds the library on the first call in this machine's cache.

    Ops (float32, CPU; shapes as in ``cpu_kernels.cpp``):
        ``pack(weight [N, K]) -> [ceil(N/16), K, 16]``; ``linear(x [M, K], packed, bias [N] | None, N) ->
        [M, N]``; ``linear_add_(out [M, N], x, packed, bias) -> out`` (adds in place);
        ``rms_norm(x [..., H], weight [H], eps)``; ``rope_kv_(qkv [T, (nq + 2 nkv) d], cos [T, d], sin,
        keys [nkv, L, d], values, start, nq, q_norm | None, k_norm | None, eps) -> q [T, nq, d]``;
        ``attention(q [T, nq, d], keys, values, S, mask [T, >= S] | None, scale) -> [T, nq d]``;
        ``silu_mul(gu [T, 2I]) -> [T, I]``. Bad shapes or dtypes raise RuntimeError naming the op.
    """
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        ops, reason = None, None
        off = os.environ.get("RACER_KERNELS", "on").lower() in ("0", "off", "false", "no")
        if off:
            reason = "RACER_KERNELS=off"
        elif not _cpu_has_avx2_fma():
            reason = "the CPU has no AVX2/FMA/F16C"
        else:
            try:
                path = _library_path()
                if not path.exists():
                    # a warning, so the ~20 s pause is explained at the default log level
                    log.warning("building racer's CPU kernels into %s (once per machine, ~20 s)", path)
                    _compile(path)
                torch.ops.load_library(str(path))
                ops = torch.ops.racer
            except Exception as exc:  # noqa: BLE001 - any build/load failure falls back to oneDNN
                reason = f"{type(exc).__name__}: {exc}"
        if off:
            log.warning("racer CPU kernels turned off (RACER_KERNELS=off); the static runner uses oneDNN and aten ops")
        elif reason is not None:
            log.warning("racer CPU kernels unavailable (%s); the static runner uses oneDNN and aten ops", reason)
        _state["ops"], _state["reason"] = ops, reason
        return ops


def unavailable_reason() -> Optional[str]:
    """Why :func:`cpu_ops` returned None (None when it loaded or was not tried yet)."""
    return _state.get("reason")  # type: ignore[return-value]


def fused_argmax_topk(logits: torch.Tensor, k: int, ops) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(argmax [T], top-k ids [T, k])`` (int64, CPU) of float32 CPU ``logits [T, V]`` in one pass of our
    kernels ``ops`` (``racer::argmax_topk``: the argmax is torch.argmax's, the first maximal index; the top-k
    are torch.topk's ids up to the order of equal values); None where ``ops`` is None, the logits are not
    float32 ``[T, V]`` on the CPU, or k is outside 1..min(64, V) (the caller then uses torch's ops)."""
    if ops is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    if k < 1 or k > min(64, logits.shape[1]):
        return None
    return ops.argmax_topk(logits, k)


# Row counts at which calibrate_stored_rows times the stored GEMM's two paths. Past the last one the faster path
# at it is kept (the register blocks led at every row count to 256 on a Zen 4; the chunk buffer led from 12 rows
# on an Intel Xeon (family 6 model 207), 1.5x at 64 and more: benchmarks/README.md).
STORED_ROWS_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
UNLIMITED_ROWS = 1 << 40  # set_stored_rows: every row count through the register blocks


def pick_stored_rows(times: dict[int, tuple[float, float]]) -> int:
    """The largest row count the stored GEMM should still run in register blocks, from ``{M: (registers ms,
    buffer ms)}``: the threshold ``t`` (registers at M <= t, the chunk buffer above) that minimises the summed
    ratio of the chosen path's time to the faster one's over the measured M, so one noisy size does not flip
    the choice (on a tie the smaller threshold); :data:`UNLIMITED_ROWS` when the register blocks are chosen at
    the largest measured M.

    Raises:
        ValueError: no times.
    """
    if not times:
        raise ValueError("no stored-GEMM timings to choose from")
    sizes = sorted(times)
    ratio = {m: (r / min(r, b), b / min(r, b)) for m, (r, b) in times.items() if min(r, b) > 0}
    best_t, best_cost = 0, float("inf")
    for t in [0, *sizes]:
        cost = sum(ratio[m][0] if m <= t else ratio[m][1] for m in sizes if m in ratio)
        if cost < best_cost - 1e-9:
            best_t, best_cost = t, cost
    return UNLIMITED_ROWS if best_t == sizes[-1] else best_t


def calibrate_stored_rows(ops, linear, *, rounds: int = 3, reps: int = 5) -> int:
    """Time the stored GEMM's register blocks against its chunk buffer on ``linear`` (a ``FastLinear`` over
    stored weights: the model's own format and shape) at every row count of :data:`STORED_ROWS_GRID`, both
    paths alternately (``rounds`` rounds of ``reps`` calls, the median), set the threshold
    (``ops.set_stored_rows``, :func:`pick_stored_rows`) and return it. Once per process: later calls return the
    first result; ``RACER_STORED_ROWS`` set in the environment wins and nothing is timed. Both paths give the same
    bits (tests/engine/test_stored_kernels.py), so only the speed depends on it; takes ~0.1-0.3 s.
    """
    with _lock:
        if "stored_rows" in _state:
            return int(_state["stored_rows"])  # type: ignore[arg-type]
        env = os.environ.get("RACER_STORED_ROWS")
        if env is not None:
            chosen = max(0, int(env))
            ops.set_stored_rows(chosen)
            _state["stored_rows"] = chosen
            return chosen
        times: dict[int, tuple[float, float]] = {}
        old = ops.set_stored_rows(-1)
        try:
            for m in STORED_ROWS_GRID:
                call = partial(linear.stored_into, torch.empty(m, linear.n), torch.randn(m, linear.stored[0].k),
                               add=False)
                samples: dict[int, list[float]] = {UNLIMITED_ROWS: [], 0: []}
                for _ in range(rounds):
                    for lim in samples:
                        ops.set_stored_rows(lim)
                        samples[lim].append(_median_ms(call, reps))
                times[m] = (statistics.median(samples[UNLIMITED_ROWS]), statistics.median(samples[0]))
        finally:
            ops.set_stored_rows(old)
        chosen = pick_stored_rows(times)
        ops.set_stored_rows(chosen)
        _state["stored_rows"] = chosen
        log.info("stored GEMM: register blocks up to %s rows, the chunk buffer above (ms registers/buffer by rows: "
                 "%s)", "every" if chosen == UNLIMITED_ROWS else chosen,
                 {m: (round(r, 3), round(b, 3)) for m, (r, b) in times.items()})
        return chosen


def _median_ms(fn, reps: int) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` after one warm call."""
    fn()
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        per.append(time.perf_counter() - t0)
    return statistics.median(per) * 1e3
