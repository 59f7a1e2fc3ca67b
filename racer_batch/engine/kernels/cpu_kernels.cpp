// The verify forward's CPU kernels (float32, AVX2 + FMA), registered as torch.ops.racer (engine/kernels):
// a small-row GEMM, y[M, N] = x[M, K] @ W[N, K]^T (+ bias) (+= into a residual), and the ops between the GEMMs
// of a decoder layer (RMSNorm, rotary embedding with the KV-cache write, tree attention, SiLU * up).
//
// Why: a verify forward multiplies 1-64 rows (the padded draft tree) by every weight of the target model.
// At those row counts MKL and oneDNN sgemm run far below the machine's FLOP rate while streaming the weights
// well below its memory bandwidth (benchmarks/verify.py, benchmarks/README.md), so t(16) costs ~2x t(1)
// although the extra FLOPs would fit in the time the weights take to stream. This kernel streams each weight
// panel from memory once per call and does every row while the panel sits in L1/L2.
//
// Layout: W is packed once into column panels of NR = 16 output features, panel p = W[16p : 16p+16, :]^T as
// [K][16] contiguous floats (zero-padded past N), so one panel is one linear stream. The micro-kernel keeps an
// MR x 16 block of y in 2 * MR AVX2 registers (MR <= 6: 12 accumulators, 2 panel loads, 1 broadcast = 15 of
// the 16 ymm registers), and for each k broadcasts x[r, k] and does 2 * MR FMAs with the panel's 16 values:
// the register-blocked outer-product scheme of Goto and van de Geijn ("Anatomy of high-performance matrix
// multiplication", ACM TOMS 2008) with the B-panel streamed instead of cached, since B is read once per call.
// Threads (torch's own pool, at::parallel_for) split the panels, so no second OpenMP runtime is loaded.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t NR = 16;  // output features per panel (2 ymm)
constexpr int MR_MAX = 6;   // rows per register block
#ifndef RACER_KC
#define RACER_KC 128
#endif
constexpr int64_t KC = RACER_KC;  // k per chunk: a 16 x KC panel chunk (8 KiB) and the rows' x stay in L1

inline void store_row(float* __restrict y, __m256 lo, __m256 hi, int64_t ncols) {
  if (ncols == NR) {
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
  } else {
    alignas(32) float tmp[NR];
    _mm256_store_ps(tmp, lo);
    _mm256_store_ps(tmp + 8, hi);
    std::memcpy(y, tmp, sizeof(float) * ncols);
  }
}

inline void load_row(const float* __restrict y, __m256& lo, __m256& hi, int64_t ncols) {
  if (ncols == NR) {
    lo = _mm256_loadu_ps(y);
    hi = _mm256_loadu_ps(y + 8);
  } else {
    alignas(32) float tmp[NR] = {0};
    std::memcpy(tmp, y, sizeof(float) * ncols);
    lo = _mm256_load_ps(tmp);
    hi = _mm256_load_ps(tmp + 8);
  }
}

// One MR x 16 block of y over one K chunk (added to y when ``accumulate``). The accumulators are named variables, not an array: GCC keeps an array of __m256
// on the stack and stores it back every iteration, which halved the FMA rate (measured).
template <int MR>
void micro_kernel(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
                  float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias,
                  const float* __restrict next, bool accumulate, int pf_mod, int pf_res) {
  static_assert(MR >= 1 && MR <= MR_MAX, "MR out of range");
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
  __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  if (accumulate) {
    load_row(y + 0 * ldy, c00, c01, ncols);
    if constexpr (MR > 1) load_row(y + 1 * ldy, c10, c11, ncols);
    if constexpr (MR > 2) load_row(y + 2 * ldy, c20, c21, ncols);
    if constexpr (MR > 3) load_row(y + 3 * ldy, c30, c31, ncols);
    if constexpr (MR > 4) load_row(y + 4 * ldy, c40, c41, ncols);
    if constexpr (MR > 5) load_row(y + 5 * ldy, c50, c51, ncols);
  }
  const float* w = panel;
  int cnt = pf_res;
  for (int64_t k = 0; k < K; ++k, w += NR) {
    // the 64-byte lines of the chunk to be read next (one per k), shared out among the row blocks: block
    // pf_res of pf_mod prefetches every pf_mod-th line, so the DRAM stream runs evenly under all the blocks'
    // FMAs instead of in one burst under the first block's (measured ~15% faster at 16 rows)
    if (cnt == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * NR), _MM_HINT_T0);
      cnt = pf_mod;
    }
    --cnt;
    const __m256 w0 = _mm256_load_ps(w);
    const __m256 w1 = _mm256_load_ps(w + 8);
    {
      const __m256 b = _mm256_broadcast_ss(x + 0 * ldx + k);
      c00 = _mm256_fmadd_ps(b, w0, c00);
      c01 = _mm256_fmadd_ps(b, w1, c01);
    }
    if constexpr (MR > 1) {
      const __m256 b = _mm256_broadcast_ss(x + 1 * ldx + k);
      c10 = _mm256_fmadd_ps(b, w0, c10);
      c11 = _mm256_fmadd_ps(b, w1, c11);
    }
    if constexpr (MR > 2) {
      const __m256 b = _mm256_broadcast_ss(x + 2 * ldx + k);
      c20 = _mm256_fmadd_ps(b, w0, c20);
      c21 = _mm256_fmadd_ps(b, w1, c21);
    }
    if constexpr (MR > 3) {
      const __m256 b = _mm256_broadcast_ss(x + 3 * ldx + k);
      c30 = _mm256_fmadd_ps(b, w0, c30);
      c31 = _mm256_fmadd_ps(b, w1, c31);
    }
    if constexpr (MR > 4) {
      const __m256 b = _mm256_broadcast_ss(x + 4 * ldx + k);
      c40 = _mm256_fmadd_ps(b, w0, c40);
      c41 = _mm256_fmadd_ps(b, w1, c41);
    }
    if constexpr (MR > 5) {
      const __m256 b = _mm256_broadcast_ss(x + 5 * ldx + k);
      c50 = _mm256_fmadd_ps(b, w0, c50);
      c51 = _mm256_fmadd_ps(b, w1, c51);
    }
  }
  if (bias != nullptr) {
    alignas(32) float bb[NR] = {0};
    std::memcpy(bb, bias, sizeof(float) * ncols);
    const __m256 b0 = _mm256_load_ps(bb), b1 = _mm256_load_ps(bb + 8);
    c00 = _mm256_add_ps(c00, b0), c01 = _mm256_add_ps(c01, b1);
    if constexpr (MR > 1) c10 = _mm256_add_ps(c10, b0), c11 = _mm256_add_ps(c11, b1);
    if constexpr (MR > 2) c20 = _mm256_add_ps(c20, b0), c21 = _mm256_add_ps(c21, b1);
    if constexpr (MR > 3) c30 = _mm256_add_ps(c30, b0), c31 = _mm256_add_ps(c31, b1);
    if constexpr (MR > 4) c40 = _mm256_add_ps(c40, b0), c41 = _mm256_add_ps(c41, b1);
    if constexpr (MR > 5) c50 = _mm256_add_ps(c50, b0), c51 = _mm256_add_ps(c51, b1);
  }
  store_row(y + 0 * ldy, c00, c01, ncols);
  if constexpr (MR > 1) store_row(y + 1 * ldy, c10, c11, ncols);
  if constexpr (MR > 2) store_row(y + 2 * ldy, c20, c21, ncols);
  if constexpr (MR > 3) store_row(y + 3 * ldy, c30, c31, ncols);
  if constexpr (MR > 4) store_row(y + 4 * ldy, c40, c41, ncols);
  if constexpr (MR > 5) store_row(y + 5 * ldy, c50, c51, ncols);
}

using Kernel = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*,
                       const float*, bool, int, int);
constexpr Kernel kKernels[MR_MAX + 1] = {nullptr,          micro_kernel<1>, micro_kernel<2>, micro_kernel<3>,
                                         micro_kernel<4>, micro_kernel<5>, micro_kernel<6>};

// Row blocks for M rows: as even as possible with at most MR_MAX rows each (16 -> 6, 5, 5, not 6, 6, 4).
inline int64_t row_block(int64_t m_left, int64_t blocks_left) { return (m_left + blocks_left - 1) / blocks_left; }

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "racer::pack: weight must be [N, K], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "racer::pack: weight must be float32, got ", weight.scalar_type());
  TORCH_CHECK(weight.device().is_cpu(), "racer::pack: weight must be on the CPU");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + NR - 1) / NR;
  at::Tensor out = at::zeros({panels, K, NR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR, nc = std::min(NR, N - n0);
      float* panel = dst + p * K * NR;
      for (int64_t j = 0; j < nc; ++j) {
        const float* row = src + (n0 + j) * K;
        for (int64_t k = 0; k < K; ++k) panel[k * NR + j] = row[k];
      }
    }
  });
  return out;
}

// ---- the AVX-512 variant of the GEMM (same packed panels, same arithmetic per output element) ----
//
// Where the CPU has AVX-512F (Intel since Skylake-SP, AMD since Zen 4) a 512-bit register holds a whole
// 16-column panel row, and 32 registers allow a 12-row x 32-column block of y (two adjacent panels) in 24
// accumulators, with 2 panel loads and 12 broadcasts for 24 FMAs per k: the register block BLIS uses for
// sgemm on Skylake-X (32 x 12), with the panels streamed as above. Every output element is still one FMA per
// k, in k order, chunk after chunk, added to the bias last: lane for lane the arithmetic of the AVX2 kernel,
// so both paths give bit-identical results (tests/engine/test_kernels.py checks it) and a row's output never
// depends on the other rows of the call. Compiled for AVX-512F through function attributes, chosen at run
// time (``racer::set_isa``, ``RACER_KERNEL_ISA``), so one library serves both kinds of CPU.
constexpr int MR512 = 12;  // rows per register block on the AVX-512 path

#define RACER_AVX512 __attribute__((target("avx512f")))

// One MR x (16 NP) block of y over one K chunk of NP adjacent panels (``panel`` and ``panel + pstride``).
template <int MR, int NP>
RACER_AVX512 void micro_kernel_512(const float* __restrict x, int64_t ldx, const float* __restrict panel,
                                   int64_t pstride, int64_t K, float* __restrict y, int64_t ldy, int64_t ncols,
                                   const float* __restrict bias, const float* __restrict next, bool accumulate,
                                   int pf_mod, int pf_res) {
  static_assert(MR >= 1 && MR <= MR512 && (NP == 1 || NP == 2), "block out of range");
  // columns of y written: the first panel's 16 (or fewer: ncols), the second's ncols - 16
  const __mmask16 m0 = ncols >= NR ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << ncols) - 1u);
  const int64_t n1 = NP == 2 ? std::max<int64_t>(0, std::min(NR, ncols - NR)) : 0;
  const __mmask16 m1 = n1 >= NR ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n1) - 1u);
  __m512 a[MR], c[MR];  // fully unrolled below: GCC keeps them in registers
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    a[r] = accumulate ? _mm512_maskz_loadu_ps(m0, y + r * ldy) : _mm512_setzero_ps();
    if constexpr (NP == 2) c[r] = accumulate ? _mm512_maskz_loadu_ps(m1, y + r * ldy + NR) : _mm512_setzero_ps();
  }
  const float* w = panel;
  const float* w2 = panel + pstride;
  const float* nx2 = next + pstride;
  int cnt = pf_res;
  for (int64_t k = 0; k < K; ++k, w += NR, w2 += NR) {
    if (cnt == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * NR), _MM_HINT_T0);
      if constexpr (NP == 2) _mm_prefetch(reinterpret_cast<const char*>(nx2 + k * NR), _MM_HINT_T0);
      cnt = pf_mod;
    }
    --cnt;
    const __m512 w0 = _mm512_load_ps(w);
    __m512 w1;
    if constexpr (NP == 2) w1 = _mm512_load_ps(w2);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
      a[r] = _mm512_fmadd_ps(b, w0, a[r]);
      if constexpr (NP == 2) c[r] = _mm512_fmadd_ps(b, w1, c[r]);
    }
  }
  if (bias != nullptr) {
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, bias);
    __m512 b1 = _mm512_setzero_ps();
    if constexpr (NP == 2) b1 = _mm512_maskz_loadu_ps(m1, bias + NR);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      a[r] = _mm512_add_ps(a[r], b0);
      if constexpr (NP == 2) c[r] = _mm512_add_ps(c[r], b1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, a[r]);
    if constexpr (NP == 2) _mm512_mask_storeu_ps(y + r * ldy + NR, m1, c[r]);
  }
}

using Kernel512 = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, int64_t,
                          const float*, const float*, bool, int, int);
template <int NP>
constexpr Kernel512 kKernels512[MR512 + 1] = {
    nullptr,                     micro_kernel_512<1, NP>,  micro_kernel_512<2, NP>,  micro_kernel_512<3, NP>,
    micro_kernel_512<4, NP>,     micro_kernel_512<5, NP>,  micro_kernel_512<6, NP>,  micro_kernel_512<7, NP>,
    micro_kernel_512<8, NP>,     micro_kernel_512<9, NP>,  micro_kernel_512<10, NP>, micro_kernel_512<11, NP>,
    micro_kernel_512<12, NP>};

// Where the weight chunks come from: ``F32Panels`` reads the float32 panels in place; ``StoredPanels`` (below,
// the GGUF block formats) expands each chunk into a per-thread L1 buffer first. Both hand the micro-kernels the
// same [kc][16] floats, so every output element sees the same FMA chain either way.
struct F32Panels {
  const float* wp;
  int64_t K;
  // chunk [kc][16] of panel p from k = c0 (and, when ``two``, panel p + 1's at + pstride()); ``after``: what is
  // read after it, for the prefetch
  const float* chunk(int64_t p, int64_t c0, int64_t /*kc*/, bool /*two*/) const { return wp + p * K * NR + c0 * NR; }
  int64_t pstride() const { return K * NR; }
  const float* next(int64_t p, int64_t c0, int64_t step, bool more) const {
    const float* ch = wp + p * K * NR + c0 * NR;
    return c0 + KC < K ? ch + KC * NR : (more ? wp + (p + step) * K * NR : ch);
  }
};

// gemm (below) on the AVX-512 kernels: threads split pairs of panels (an odd last panel goes alone).
template <class Src>
RACER_AVX512 void gemm512_t(const float* xp, int64_t ldx, int64_t M, int64_t K, const Src& src, int64_t panels,
                            int64_t N, const float* b, float* yp, int64_t ldy, bool add_into) {
  const int64_t blocks = (M + MR512 - 1) / MR512;
  const int64_t pairs = (panels + 1) / 2;
  const int64_t pstride = src.pstride();
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * 2 * NR * M));
  at::parallel_for(0, pairs, grain, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t p = 2 * q;
      const int64_t n0 = p * NR, nc = std::min(2 * NR, N - n0);
      const bool two = p + 1 < panels;
      for (int64_t c0 = 0; c0 < K; c0 += KC) {
        const int64_t kc = std::min(KC, K - c0);
        const float* chunk = src.chunk(p, c0, kc, two);
        // read after this chunk: the pair's next chunk, or the next pair's first (a prefetch past the last
        // panel is only a hint: it cannot fault), prefetched by the row blocks in turn (below)
        const float* next = src.next(p, c0, 2, q + 1 < q1);
        const bool last = c0 + KC >= K;
        int64_t m0 = 0;
        for (int64_t left = blocks; left > 0; --left) {
          const int64_t mr = row_block(M - m0, left);
          const Kernel512 kern = two ? kKernels512<2>[mr] : kKernels512<1>[mr];
          kern(xp + m0 * ldx + c0, ldx, chunk, two ? pstride : 0, kc, yp + m0 * ldy + n0, ldy, nc,
               (last && b != nullptr) ? b + n0 : nullptr, next, c0 > 0 || add_into, static_cast<int>(blocks),
               static_cast<int>(blocks - left));
          m0 += mr;
        }
      }
    }
  });
}

bool cpu_has_avx512f() { return __builtin_cpu_supports("avx512f"); }

// Whether the GEMM runs its AVX-512 blocks: where the CPU has AVX-512F, unless RACER_KERNEL_ISA=avx2.
bool& wide_isa() {
  static bool wide = [] {
    const char* env = std::getenv("RACER_KERNEL_ISA");
    return cpu_has_avx512f() && !(env != nullptr && std::string(env) == "avx2");
  }();
  return wide;
}

std::string get_isa() { return wide_isa() ? "avx512" : "avx2"; }

// Switch the GEMM's instruction set ("avx2" or "avx512"); returns the previous one. Benchmarks and tests.
std::string set_isa(const std::string& isa) {
  TORCH_CHECK(isa == "avx2" || isa == "avx512", "racer::set_isa: 'avx2' or 'avx512', got '", isa, "'");
  TORCH_CHECK(isa == "avx2" || cpu_has_avx512f(), "racer::set_isa: this CPU has no AVX-512F");
  std::string old = get_isa();
  wide_isa() = isa == "avx512";
  return old;
}

constexpr int64_t X_BLOCK_BYTES = 512 * 1024;  // gemm_t's row ranges on the AVX-512 path (below)

// y[M, N] (row stride ldy) = x[M, K] @ W^T + bias, or y += that when add_into (a residual added in place).
template <class Src>
void gemm_t(const float* xp, int64_t ldx, int64_t M, int64_t K, const Src& src, int64_t panels, int64_t N,
            const float* b, float* yp, int64_t ldy, bool add_into) {
  // up to 6 rows the weights' stream sets the pace and the AVX2 blocks are measured faster (lane for lane the
  // same arithmetic, so a call's rows give the same bits either way); past that the 12-row blocks win
  if (M > MR_MAX && wide_isa()) {
    // many rows (a prompt chunk) go in row ranges whose x fits X_BLOCK_BYTES, so a range's x stays in L2 while
    // every panel passes over it: 512 rows of SmolLM2's shapes ran at 0.86x MKL's rate in one range, 0.91x in
    // ranges (Intel Xeon family 6 model 207). Each output element's FMA chain is the same either way.
    const int64_t ranges = std::max<int64_t>(1, (M * K * 4 + X_BLOCK_BYTES - 1) / X_BLOCK_BYTES);
    const int64_t rows = (M + ranges - 1) / ranges;
    for (int64_t m0 = 0; m0 < M; m0 += rows)
      gemm512_t(xp + m0 * ldx, ldx, std::min(rows, M - m0), K, src, panels, N, b, yp + m0 * ldy, ldy, add_into);
    return;
  }
  const int64_t blocks = (M + MR_MAX - 1) / MR_MAX;
  // at least ~64K multiply-adds per task, as aten's own grain sizes do: a tiny model's matmuls stay on the
  // calling thread instead of waking the pool for microseconds of work
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * NR * M));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR, nc = std::min(NR, N - n0);
      for (int64_t c0 = 0; c0 < K; c0 += KC) {
        const int64_t kc = std::min(KC, K - c0);
        const float* chunk = src.chunk(p, c0, kc, false);
        // what is read after this chunk: the panel's next chunk, or the next panel's first, prefetched by
        // the row blocks in turn while they work on this one (already in L1)
        const float* next = src.next(p, c0, 1, p + 1 < p1);
        const bool last = c0 + KC >= K;
        int64_t m0 = 0;
        for (int64_t left = blocks; left > 0; --left) {
          const int64_t mr = row_block(M - m0, left);
          kKernels[mr](xp + m0 * ldx + c0, ldx, chunk, kc, yp + m0 * ldy + n0, ldy, nc,
                       (last && b != nullptr) ? b + n0 : nullptr, next, c0 > 0 || add_into,
                       static_cast<int>(blocks), static_cast<int>(blocks - left));
          m0 += mr;
        }
      }
    }
  });
}

void gemm(const float* xp, int64_t ldx, int64_t M, int64_t K, const float* wp, int64_t panels, int64_t N,
          const float* b, float* yp, int64_t ldy, bool add_into) {
  gemm_t(xp, ldx, M, K, F32Panels{wp, K}, panels, N, b, yp, ldy, add_into);
}

const float* check_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                          int64_t N, at::Tensor& bias_c) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "racer::linear: x must be [M, K] with unit column stride, got ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "racer::linear: float32 only");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "racer::linear: CPU tensors only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR, "racer::linear: packed must be [panels, K, 16]");
  TORCH_CHECK(x.size(1) == packed.size(1), "racer::linear: x has K=", x.size(1), ", weight K=", packed.size(1));
  TORCH_CHECK(N > 0 && N <= packed.size(0) * NR && N > (packed.size(0) - 1) * NR,
              "racer::linear: N=", N, " does not match ", packed.size(0), " panels");
  TORCH_CHECK(packed.is_contiguous(), "racer::linear: packed weight must be contiguous");
  TORCH_CHECK(reinterpret_cast<std::uintptr_t>(packed.data_ptr()) % 32 == 0,
              "racer::linear: packed weight must be 32-byte aligned");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat, "racer::linear: bias must be float32 [N]");
    bias_c = bias->contiguous();
    return bias_c.data_ptr<float>();
  }
  return nullptr;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N) {
  at::Tensor bias_c;
  const at::Tensor xc = x.dim() == 2 && x.stride(1) != 1 ? x.contiguous() : x;
  const float* b = check_linear(xc, packed, bias, N, bias_c);
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M > 0) {
    gemm(xc.data_ptr<float>(), xc.stride(0), M, xc.size(1), packed.data_ptr<float>(), packed.size(0), N, b,
         y.data_ptr<float>(), N, false);
  }
  return y;
}

// out[M, N] = x @ W^T + bias (add_into: +=) into a preallocated out; ``op`` names the caller in errors.
at::Tensor linear_out(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, bool add_into, const char* op) {
  at::Tensor bias_c;
  const at::Tensor xc = x.dim() == 2 && x.stride(1) != 1 ? x.contiguous() : x;
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.scalar_type() == at::kFloat,
              op, ": out must be float32 [M, N] with unit column stride");
  const int64_t N = out.size(1);
  const float* b = check_linear(xc, packed, bias, N, bias_c);
  TORCH_CHECK(out.size(0) == xc.size(0), op, ": out has ", out.size(0), " rows, x ", xc.size(0));
  if (xc.size(0) > 0) {
    gemm(xc.data_ptr<float>(), xc.stride(0), xc.size(0), xc.size(1), packed.data_ptr<float>(), packed.size(0), N,
         b, out.data_ptr<float>(), out.stride(0), add_into);
  }
  return out;
}

// out += x @ W^T + bias, in place (the residual stream of a decoder layer).
at::Tensor linear_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias) {
  return linear_out(out, x, packed, bias, true, "racer::linear_add_");
}

// out = x @ W^T + bias into a preallocated out (a reused logits buffer: no multi-MB allocation per verify
// step, which glibc would map and unmap each time).
at::Tensor linear_into_(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                        const c10::optional<at::Tensor>& bias) {
  return linear_out(out, x, packed, bias, false, "racer::linear_into_");
}

// ---- the GEMM over weights as a GGUF file stores them (issue 31) ----
//
// A GGUF weight is kept in its own blocks; only their bit layout is rearranged once at load (Python:
// weights/stored.py), into groups of 32 k x 16 output features (one panel), so that a panel's chunk is one linear
// stream, like the float32 panels. Each group holds the block's numbers and what multiplies them:
//   STORED_F16 (F16):        [32 k][16] halves                                   1024 bytes
//   STORED_I8  (Q8_0, Q6_K): scale fp32 [2][16] (k 0-15, 16-31), q int8 [32 k][16]  640 bytes
//   STORED_U4H (Q4_1):       a fp16 [16], c fp16 [16], q 4-bit [16 pairs of k][16]  320 bytes
//   STORED_U4F (Q4_K):       a fp32 [16], c fp32 [16], q 4-bit [16 pairs][16]       384 bytes
// (a pair's byte for a row holds k = 2i in its low nibble, k = 2i + 1 in its high one). A chunk is expanded
// into a per-thread L1 buffer with the operations GGUF's reference de-quantiser (gguf-py, which transformers
// uses) applies: F16 a conversion; Q8_0 d * q (exact); Q6_K (d * scale) * q, d * scale exact in float32, then
// one rounding; Q4_1 d * q + m and Q4_K (d * sc) * q - dmin * m, whose products are exact (at most 21 bits), so
// one rounding of the sum: an FMA gives that same number. The buffer then goes through the float32 GEMM's own
// micro-kernels (gemm_t above), so every output element is the float32 path's FMA chain over the very numbers
// the float32 copy holds: the results are bit-identical (tests/engine/test_stored_kernels.py).
constexpr int64_t STORED_F16 = 1, STORED_I8 = 2, STORED_U4H = 3, STORED_U4F = 4;
constexpr int64_t GROUP_K = 32;

int64_t stored_group_bytes(int64_t fmt) {
  switch (fmt) {
    case STORED_F16: return GROUP_K * NR * 2;
    case STORED_I8: return 2 * NR * 4 + GROUP_K * NR;
    case STORED_U4H: return 2 * NR * 2 + GROUP_K * NR / 2;
    case STORED_U4F: return 2 * NR * 4 + GROUP_K * NR / 2;
    default: TORCH_CHECK(false, "racer: unknown stored weight format ", fmt);
  }
  return 0;
}

inline __m256 half8(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }

// One group (32 k x 16 features) of format ``fmt`` as floats, out [32][16].
void expand_group(int64_t fmt, const uint8_t* g, float* __restrict out) {
  if (fmt == STORED_F16) {
    for (int64_t k = 0; k < GROUP_K; ++k) {
      _mm256_store_ps(out + k * NR, half8(g + k * 32));
      _mm256_store_ps(out + k * NR + 8, half8(g + k * 32 + 16));
    }
  } else if (fmt == STORED_I8) {
    const float* sc = reinterpret_cast<const float*>(g);
    const uint8_t* q = g + 2 * NR * 4;
    for (int64_t k = 0; k < GROUP_K; ++k) {
      const float* s = sc + (k / 16) * NR;
      const __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * NR))));
      const __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * NR + 8))));
      _mm256_store_ps(out + k * NR, _mm256_mul_ps(_mm256_loadu_ps(s), v0));
      _mm256_store_ps(out + k * NR + 8, _mm256_mul_ps(_mm256_loadu_ps(s + 8), v1));
    }
  } else {
    __m256 a0, a1, c0, c1;
    const uint8_t* q;
    if (fmt == STORED_U4H) {
      a0 = half8(g), a1 = half8(g + 16), c0 = half8(g + 32), c1 = half8(g + 48);
      q = g + 64;
    } else {
      const float* f = reinterpret_cast<const float*>(g);
      a0 = _mm256_loadu_ps(f), a1 = _mm256_loadu_ps(f + 8), c0 = _mm256_loadu_ps(f + 16), c1 = _mm256_loadu_ps(f + 24);
      q = g + 128;
    }
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int64_t i = 0; i < GROUP_K / 2; ++i) {
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i * NR)));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i * NR + 8)));
      float* even = out + (2 * i) * NR;
      float* odd = even + NR;
      _mm256_store_ps(even, _mm256_fmadd_ps(a0, _mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), c0));
      _mm256_store_ps(even + 8, _mm256_fmadd_ps(a1, _mm256_cvtepi32_ps(_mm256_and_si256(b1, low)), c1));
      _mm256_store_ps(odd, _mm256_fmadd_ps(a0, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), c0));
      _mm256_store_ps(odd + 8, _mm256_fmadd_ps(a1, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), c1));
    }
  }
}

// One weight element (row j of its panel, k within its group) by the same operations, for the embedding rows.
inline float stored_element(int64_t fmt, const uint8_t* g, int64_t j, int64_t k) {
  if (fmt == STORED_F16) {
    uint16_t h;
    std::memcpy(&h, g + (k * NR + j) * 2, 2);
    return _cvtsh_ss(h);
  }
  if (fmt == STORED_I8) {
    float s;
    std::memcpy(&s, g + ((k / 16) * NR + j) * 4, 4);
    return s * static_cast<float>(static_cast<int8_t>(g[2 * NR * 4 + k * NR + j]));
  }
  float a, c;
  int64_t qoff;
  if (fmt == STORED_U4H) {
    uint16_t ha, hc;
    std::memcpy(&ha, g + j * 2, 2);
    std::memcpy(&hc, g + 32 + j * 2, 2);
    a = _cvtsh_ss(ha), c = _cvtsh_ss(hc), qoff = 64;
  } else {
    std::memcpy(&a, g + j * 4, 4);
    std::memcpy(&c, g + 64 + j * 4, 4);
    qoff = 128;
  }
  const uint8_t byte = g[qoff + (k / 2) * NR + j];
  return std::fma(a, static_cast<float>((k & 1) ? (byte >> 4) : (byte & 0x0F)), c);
}

// The chunk source of gemm_t for a stored weight [panels, K / 32 groups, group bytes].
struct StoredPanels {
  const uint8_t* wp;
  int64_t K, fmt, gbytes;
  static float* buffer() {
    alignas(64) static thread_local float buf[2 * KC * NR];
    return buf;
  }
  void expand(int64_t p, int64_t c0, int64_t kc, float* out) const {
    const uint8_t* g = wp + (p * (K / GROUP_K) + c0 / GROUP_K) * gbytes;
    for (int64_t k = 0; k < kc; k += GROUP_K, g += gbytes) expand_group(fmt, g, out + k * NR);
  }
  const float* chunk(int64_t p, int64_t c0, int64_t kc, bool two) const {
    float* buf = buffer();
    expand(p, c0, kc, buf);
    if (two) expand(p + 1, c0, kc, buf + KC * NR);
    return buf;
  }
  int64_t pstride() const { return KC * NR; }
  const float* next(int64_t, int64_t, int64_t, bool) const { return buffer(); }  // in L1 already
};

// ---- a few rows over a stored weight, expanded in registers ----
// At M <= ROWS_MAX the chunk-buffer path above pays a store and a reload per weight for too few rows to share
// them, and one panel's FMA chains (16 outputs per row, one FMA per k) wait 4 cycles per k on the FMA latency.
// Here each k's 16 weights of a panel are expanded into registers by the same operations as expand_group and
// used at once by every row, and NP panels run side by side so their chains overlap. Every output element still
// gets one FMA per k, in k order, from the same start (0, or y when add_into), with the bias added after the
// last: the float32 kernel's chain, so the bits are the same.
constexpr int ROWS_MAX = 4;           // rows of one register block (AVX2)
constexpr int ROWS_MAX_512 = 8;       // ... (AVX-512)
constexpr int64_t ROW_PF_GROUPS = 2;  // groups ahead that each panel's stream is prefetched

inline void prefetch_group(const uint8_t* g, int64_t i, int64_t gbytes) {
  if (i * 64 < gbytes) _mm_prefetch(reinterpret_cast<const char*>(g + ROW_PF_GROUPS * gbytes + i * 64), _MM_HINT_T0);
}

// Panels side by side per register block of MR rows: AVX2 has 16 registers (2 accumulators per row and panel,
// 4 scale registers per panel), AVX-512 32 (1 and 2).
#ifndef RACER_RP8
#define RACER_RP8 1
#endif
constexpr int row_panels(bool wide, int mr) {
  return wide ? (mr <= 4 ? 4 : RACER_RP8) : (mr == 1 ? 2 : 1);
}

// y[0:MR, 16 p0 : 16 (p0 + NP)] over panels p0.. of a stored weight (``w``: panel p0's first group).
template <int64_t FMT, int NP, int MR>
void stored_rows_kernel(const float* __restrict x, int64_t ldx, const uint8_t* __restrict w, int64_t pstride,
                        int64_t G, int64_t gbytes, float* __restrict y, int64_t ldy, int64_t ncols,
                        const float* __restrict bias, bool add_into) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      const int64_t nc = std::max<int64_t>(0, std::min(NR, ncols - j * NR));
      if (add_into && nc > 0) load_row(y + r * ldy + j * NR, acc[r][j][0], acc[r][j][1], nc);
      else acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
    }
  }
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int64_t gi = 0; gi < G; ++gi) {
    const float* xg = x + gi * GROUP_K;
    const uint8_t* g[NP];
    __m256 a[NP][2], c[NP][2];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      g[j] = w + j * pstride + gi * gbytes;
      if constexpr (FMT == STORED_U4H) {
        a[j][0] = half8(g[j]), a[j][1] = half8(g[j] + 16), c[j][0] = half8(g[j] + 32), c[j][1] = half8(g[j] + 48);
      } else if constexpr (FMT == STORED_U4F) {
        const float* f = reinterpret_cast<const float*>(g[j]);
        a[j][0] = _mm256_loadu_ps(f), a[j][1] = _mm256_loadu_ps(f + 8);
        c[j][0] = _mm256_loadu_ps(f + 16), c[j][1] = _mm256_loadu_ps(f + 24);
      }
    }
    for (int64_t i = 0; i < GROUP_K / 2; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) {
        prefetch_group(g[j], i, gbytes);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256 we, wo;
          if constexpr (FMT == STORED_F16) {
            we = half8(g[j] + (2 * i) * 32 + h * 16);
            wo = half8(g[j] + (2 * i + 1) * 32 + h * 16);
          } else if constexpr (FMT == STORED_I8) {
            const __m256 s = _mm256_loadu_ps(reinterpret_cast<const float*>(g[j]) + (i / 8) * NR + h * 8);
            const uint8_t* q = g[j] + 2 * NR * 4 + h * 8;
            we = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (2 * i) * NR)))));
            wo = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (2 * i + 1) * NR)))));
          } else {
            const uint8_t* q = g[j] + (FMT == STORED_U4H ? 64 : 128) + h * 8;
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i * NR)));
            we = _mm256_fmadd_ps(a[j][h], _mm256_cvtepi32_ps(_mm256_and_si256(b, low)), c[j][h]);
            wo = _mm256_fmadd_ps(a[j][h], _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), c[j][h]);
          }
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) {
            acc[r][j][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(xg + r * ldx + 2 * i), we, acc[r][j][h]);
            acc[r][j][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(xg + r * ldx + 2 * i + 1), wo, acc[r][j][h]);
          }
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) {
    const int64_t nc = std::max<int64_t>(0, std::min(NR, ncols - j * NR));
    if (nc == 0) continue;
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    if (bias != nullptr) {
      alignas(32) float bb[NR] = {0};
      std::memcpy(bb, bias + j * NR, sizeof(float) * nc);
      b0 = _mm256_load_ps(bb), b1 = _mm256_load_ps(bb + 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      if (bias != nullptr) acc[r][j][0] = _mm256_add_ps(acc[r][j][0], b0), acc[r][j][1] = _mm256_add_ps(acc[r][j][1], b1);
      store_row(y + r * ldy + j * NR, acc[r][j][0], acc[r][j][1], nc);
    }
  }
}

// The same on AVX-512: one zmm per panel's 16 features, by the same lane-wise operations.
template <int64_t FMT, int NP, int MR>
RACER_AVX512 void stored_rows_kernel_512(const float* __restrict x, int64_t ldx, const uint8_t* __restrict w,
                                         int64_t pstride, int64_t G, int64_t gbytes, float* __restrict y, int64_t ldy,
                                         int64_t ncols, const float* __restrict bias, bool add_into) {
  __m512 acc[MR][NP];
  __mmask16 mk[NP];
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) {
    const int64_t nc = std::max<int64_t>(0, std::min(NR, ncols - j * NR));
    mk[j] = nc >= NR ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << nc) - 1u);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      acc[r][j] = add_into ? _mm512_maskz_loadu_ps(mk[j], y + r * ldy + j * NR) : _mm512_setzero_ps();
  }
  const __m512i low = _mm512_set1_epi32(0x0F);
  for (int64_t gi = 0; gi < G; ++gi) {
    const float* xg = x + gi * GROUP_K;
    const uint8_t* g[NP];
    __m512 a[NP], c[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      g[j] = w + j * pstride + gi * gbytes;
      if constexpr (FMT == STORED_U4H) {
        a[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g[j])));
        c[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g[j] + 32)));
      } else if constexpr (FMT == STORED_U4F) {
        a[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(g[j]));
        c[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(g[j]) + 16);
      }
    }
    for (int64_t i = 0; i < GROUP_K / 2; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) {
        prefetch_group(g[j], i, gbytes);
        __m512 we, wo;
        if constexpr (FMT == STORED_F16) {
          we = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g[j] + (2 * i) * 32)));
          wo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g[j] + (2 * i + 1) * 32)));
        } else if constexpr (FMT == STORED_I8) {
          const __m512 s = _mm512_loadu_ps(reinterpret_cast<const float*>(g[j]) + (i / 8) * NR);
          const uint8_t* q = g[j] + 2 * NR * 4;
          we = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (2 * i) * NR)))));
          wo = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (2 * i + 1) * NR)))));
        } else {
          const uint8_t* q = g[j] + (FMT == STORED_U4H ? 64 : 128);
          const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * NR)));
          we = _mm512_fmadd_ps(a[j], _mm512_cvtepi32_ps(_mm512_and_si512(b, low)), c[j]);
          wo = _mm512_fmadd_ps(a[j], _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), c[j]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r * ldx + 2 * i]), we, acc[r][j]);
          acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r * ldx + 2 * i + 1]), wo, acc[r][j]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) {
    if (mk[j] == 0) continue;
    const __m512 bj = bias != nullptr ? _mm512_maskz_loadu_ps(mk[j], bias + j * NR) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      if (bias != nullptr) acc[r][j] = _mm512_add_ps(acc[r][j], bj);
      _mm512_mask_storeu_ps(y + r * ldy + j * NR, mk[j], acc[r][j]);
    }
  }
}

using RowsKernel = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*, int64_t, int64_t,
                            const float*, bool);

// The kernel for MR rows and np <= row_panels(wide, MR) panels.
template <int64_t FMT, int MR>
RowsKernel rows_kernel(bool wide, int np) {
  if constexpr (MR > ROWS_MAX) {  // AVX-512 only (stored_rows_gemm)
    if constexpr (row_panels(true, MR) == 2) {
      if (np >= 2) return stored_rows_kernel_512<FMT, 2, MR>;
    }
    return stored_rows_kernel_512<FMT, 1, MR>;
  } else {
    if (wide) {
      if constexpr (row_panels(true, MR) == 4) {
        if (np == 4) return stored_rows_kernel_512<FMT, 4, MR>;
        if (np == 3) return stored_rows_kernel_512<FMT, 3, MR>;
      }
      return np >= 2 ? stored_rows_kernel_512<FMT, 2, MR> : stored_rows_kernel_512<FMT, 1, MR>;
    }
    if constexpr (row_panels(false, MR) == 2) {
      if (np == 2) return stored_rows_kernel<FMT, 2, MR>;
    }
    return stored_rows_kernel<FMT, 1, MR>;
  }
}

template <int64_t FMT>
RowsKernel rows_kernel(bool wide, int mr, int np) {
  switch (mr) {
    case 1: return rows_kernel<FMT, 1>(wide, np);
    case 2: return rows_kernel<FMT, 2>(wide, np);
    case 3: return rows_kernel<FMT, 3>(wide, np);
    case 4: return rows_kernel<FMT, 4>(wide, np);
    case 5: return rows_kernel<FMT, 5>(wide, np);
    case 6: return rows_kernel<FMT, 6>(wide, np);
    case 7: return rows_kernel<FMT, 7>(wide, np);
    default: return rows_kernel<FMT, 8>(wide, np);
  }
}

RowsKernel rows_kernel(int64_t fmt, bool wide, int mr, int np) {
  switch (fmt) {
    case STORED_F16: return rows_kernel<STORED_F16>(wide, mr, np);
    case STORED_I8: return rows_kernel<STORED_I8>(wide, mr, np);
    case STORED_U4H: return rows_kernel<STORED_U4H>(wide, mr, np);
    default: return rows_kernel<STORED_U4F>(wide, mr, np);
  }
}

// The defaults below hold until the runner measures this CPU (kernels.calibrate_stored_rows, once per process, sets
// the override): an Intel Xeon (family 6 model 207) ran the chunk buffer faster from 12 rows, 1.5x at 64.
// Up to how many rows a call takes stored_rows_gemm rather than the chunk buffer, measured on a Zen 4 with
// benchmarks/stored_gemm.py (SmolLM2's weight shapes, both paths interleaved; benchmarks/stored-gemm-*.md): on
// AVX-512 the register blocks of up to 8 rows ran ahead at every row count tried, 1 to 256 (2.3x at 1 row, 1.9x
// at 8, 1.2x at 32, 1.05x at 256), so every call takes them; on AVX2 the blocks of up to 4 rows led up to 8 rows
// (1.3-1.6x, level at 4-6) and trailed from 12 (0.94x, 0.56x at 256). RACER_STORED_ROWS or racer::set_stored_rows
// overrides it (A/B and debugging; 0 sends every call through the buffer).
constexpr int64_t STORED_ROWS_AVX2 = 8, STORED_ROWS_AVX512 = std::numeric_limits<int64_t>::max();
int64_t& stored_rows_override() {
  static int64_t v = [] {
    const char* e = std::getenv("RACER_STORED_ROWS");
    return e != nullptr ? std::max<int64_t>(0, std::atoi(e)) : int64_t{-1};
  }();
  return v;
}
int64_t stored_rows_max() {
  const int64_t v = stored_rows_override();
  return v >= 0 ? v : (wide_isa() ? STORED_ROWS_AVX512 : STORED_ROWS_AVX2);
}
// Set the override (-1: the per-ISA default above); returns the previous one.
int64_t set_stored_rows(int64_t rows) {
  TORCH_CHECK(rows >= -1, "racer::set_stored_rows: -1 (default) or a row count >= 0, got ", rows);
  const int64_t old = stored_rows_override();
  stored_rows_override() = rows;
  return old;
}

// y[M, N] = x[M, K] @ W^T + bias (or y += that) over a stored weight [panels, G, gbytes], M <= stored_rows_max():
// threads split blocks of panels; each block's rows go in register blocks of at most ROWS_MAX (its bytes stay in L1
// from the first row block to the next).
void stored_rows_gemm(const float* x, int64_t ldx, int64_t M, const uint8_t* wp, int64_t fmt, int64_t gbytes,
                      int64_t K, int64_t panels, int64_t N, const float* b, float* y, int64_t ldy, bool add_into) {
  const bool wide = wide_isa();
  const int64_t rows_max = wide ? ROWS_MAX_512 : ROWS_MAX;
  const int64_t rblocks = (M + rows_max - 1) / rows_max;
  const int np = row_panels(wide, static_cast<int>(row_block(M, rblocks)));  // the first row block is the largest
  const int64_t G = K / GROUP_K, pstride = G * gbytes;
  const int64_t blocks = (panels + np - 1) / np;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * NR * np * M));
  at::parallel_for(0, blocks, grain, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t p = q * np, n = std::min<int64_t>(np, panels - p);
      const int64_t n0 = p * NR;
      int64_t m0 = 0;
      for (int64_t left = rblocks; left > 0; --left) {
        const int64_t mr = row_block(M - m0, left);
        rows_kernel(fmt, wide, static_cast<int>(mr), static_cast<int>(n))(
            x + m0 * ldx, ldx, wp + p * pstride, pstride, G, gbytes, y + m0 * ldy + n0, ldy, N - n0,
            b != nullptr ? b + n0 : nullptr, add_into);
        m0 += mr;
      }
    }
  });
}

const uint8_t* check_stored(const at::Tensor& x, const at::Tensor& packed, int64_t fmt, int64_t N, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              op, ": x must be a float32 CPU [M, K] with unit column stride, got ", x.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() && packed.device().is_cpu(),
              op, ": packed must be a contiguous uint8 [panels, K / 32, group bytes]");
  TORCH_CHECK(packed.size(2) == stored_group_bytes(fmt), op, ": format ", fmt, " has ", stored_group_bytes(fmt),
              "-byte groups, packed has ", packed.size(2));
  TORCH_CHECK(x.size(1) == packed.size(1) * GROUP_K, op, ": x has K=", x.size(1), ", weight K=", packed.size(1) * GROUP_K);
  TORCH_CHECK(N > 0 && N <= packed.size(0) * NR && N > (packed.size(0) - 1) * NR,
              op, ": N=", N, " does not match ", packed.size(0), " panels");
  return packed.data_ptr<uint8_t>();
}

const float* stored_bias(const c10::optional<at::Tensor>& bias, int64_t N, at::Tensor& bias_c, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat, op, ": bias must be float32 [N]");
  bias_c = bias->contiguous();
  return bias_c.data_ptr<float>();
}

at::Tensor stored_out(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, int64_t fmt,
                      const c10::optional<at::Tensor>& bias, bool add_into, const char* op) {
  const at::Tensor xc = x.dim() == 2 && x.stride(1) != 1 ? x.contiguous() : x;
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.scalar_type() == at::kFloat,
              op, ": out must be float32 [M, N] with unit column stride");
  const int64_t N = out.size(1);
  const uint8_t* wp = check_stored(xc, packed, fmt, N, op);
  TORCH_CHECK(out.size(0) == xc.size(0), op, ": out has ", out.size(0), " rows, x ", xc.size(0));
  at::Tensor bias_c;
  const float* b = stored_bias(bias, N, bias_c, op);
  const int64_t K = xc.size(1);
  if (xc.size(0) > 0 && xc.size(0) <= stored_rows_max()) {
    stored_rows_gemm(xc.data_ptr<float>(), xc.stride(0), xc.size(0), wp, fmt, packed.size(2), K, packed.size(0), N, b,
                     out.data_ptr<float>(), out.stride(0), add_into);
  } else if (xc.size(0) > 0) {
    gemm_t(xc.data_ptr<float>(), xc.stride(0), xc.size(0), K, StoredPanels{wp, K, fmt, packed.size(2)},
           packed.size(0), N, b, out.data_ptr<float>(), out.stride(0), add_into);
  }
  return out;
}

// y[M, N] = x @ W^T + bias over a stored weight.
at::Tensor stored_linear(const at::Tensor& x, const at::Tensor& packed, int64_t fmt, const c10::optional<at::Tensor>& bias,
                         int64_t N) {
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  return stored_out(y, x, packed, fmt, bias, false, "racer::stored_linear");
}

// out += x @ W^T + bias in place (the residual), or out = that into a preallocated out (``into``).
at::Tensor stored_linear_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, int64_t fmt,
                              const c10::optional<at::Tensor>& bias) {
  return stored_out(out, x, packed, fmt, bias, true, "racer::stored_linear_add_");
}

at::Tensor stored_linear_into_(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, int64_t fmt,
                               const c10::optional<at::Tensor>& bias) {
  return stored_out(out, x, packed, fmt, bias, false, "racer::stored_linear_into_");
}

// Rows ``ids [R]`` of a stored weight [N, K] as float32 [R, K] (the embedding lookup of a stored table).
at::Tensor stored_rows(const at::Tensor& packed, int64_t fmt, int64_t N, const at::Tensor& ids) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
              "racer::stored_rows: packed must be a contiguous uint8 [panels, K / 32, group bytes]");
  TORCH_CHECK(packed.size(2) == stored_group_bytes(fmt), "racer::stored_rows: group bytes do not match format ", fmt);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "racer::stored_rows: ids must be int64 [R]");
  const at::Tensor idc = ids.contiguous();
  const int64_t R = idc.size(0), G = packed.size(1), K = G * GROUP_K, gb = packed.size(2);
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < N, "racer::stored_rows: id ", id[r], " out of range [0, ", N, ")");
  at::Tensor out = at::empty({R, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t p = id[r] / NR, j = id[r] % NR;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* grp = wp + (p * G + g) * gb;
      for (int64_t k = 0; k < GROUP_K; ++k) o[r * K + g * GROUP_K + k] = stored_element(fmt, grp, j, k);
    }
  }
  return out;
}

// ---- the small ops around the GEMMs: one call each instead of 3-10 aten ops ----

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by the degree-6 polynomial of Cephes' expf
// (S. Moshier, Cephes Math Library; relative error ~1e-7, like libm's expf), 2^n put into the exponent bits.
// Below -87.3 (e^x under the smallest normal float: masked scores, which are ~ -3.4e38) the result is exactly 0.
// exp256's (and exp512's) constants: the clamp, log2(e), ln 2 in two parts (Cody-Waite) and Cephes' polynomial
constexpr float EXP_HI = 88.3762626647949f, EXP_LO = -87.3365478515625f, EXP_LOG2E = 1.44269504088896341f;
constexpr float EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline __m256 exp256(__m256 x) {
  const __m256 hi = _mm256_set1_ps(EXP_HI), lo = _mm256_set1_ps(EXP_LO);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_P[0]);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[1]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[2]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[3]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[4]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[5]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// the same for a scalar tail, through the vector path so the tail rounds like the rest
inline float exp1(float x) {
  alignas(32) float v[8];
  _mm256_store_ps(v, exp256(_mm256_set1_ps(x)));
  return v[0];
}

inline float sum_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = hsum(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// y = x / sqrt(mean(x^2) + eps) * w over the last dimension of a float32 row (the Llama family's RMSNorm,
// computed in float32 as transformers' LlamaRMSNorm does).
inline void rms_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * inv) * w[i];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "racer::rms_norm: float32 only");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t n = wc.numel();
  TORCH_CHECK(xc.numel() % n == 0 && xc.size(-1) == n, "racer::rms_norm: last dim of x ", xc.sizes(), " != ", n);
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = xc.numel() / n;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(xp + r * n, wp, yp + r * n, n, static_cast<float>(eps));
  });
  return y;
}

// Rotary embedding (halves layout, transformers' rotate_half): out = x * cos + rotate_half(x) * sin.
inline void rope_row(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    out[i] = a * cos[i] - b * sin[i];
    out[i + h] = b * cos[i + h] + a * sin[i + h];
  }
}

// One row of the fused projection src [(nq + 2 nkv) d]: its q heads rotated into q_out [nq, d], its k heads
// rotated into krow + g * ks0 and its v heads copied to vrow + g * vs0 (g the KV head). Optional q/k RMSNorm.
inline void rope_kv_row(const float* src, const float* ct, const float* st, float* q_out, float* krow, int64_t ks0,
                        float* vrow, int64_t vs0, int64_t nq, int64_t nkv, int64_t d, const float* qn,
                        const float* kn, float* tmp, double eps) {
  for (int64_t h = 0; h < nq + nkv; ++h) {
    const float* in = src + h * d;
    if (qn != nullptr) {
      rms_row(in, h < nq ? qn : kn, tmp, d, static_cast<float>(eps));
      in = tmp;
    }
    float* out = h < nq ? q_out + h * d : krow + (h - nq) * ks0;
    rope_row(in, ct, st, out, d);
  }
  for (int64_t g = 0; g < nkv; ++g) std::memcpy(vrow + g * vs0, src + (nq + nkv + g) * d, sizeof(float) * d);
}

// From the fused projection qkv [T, (nq + 2 nkv) d]: q [T, nq, d] rotated (returned), k rotated and v written
// into the layer's cache rows keys/values [nkv, max_len, d] at positions start .. start + T. Optional per-head
// RMSNorm of q and k before the rotation (Qwen3's q_norm / k_norm, weights [d]). cos, sin: [T, d].
at::Tensor rope_kv_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor keys,
                    at::Tensor values, int64_t start, int64_t nq, const c10::optional<at::Tensor>& q_norm,
                    const c10::optional<at::Tensor>& k_norm, double eps) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat,
              "racer::rope_kv_: float32 only");
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && keys.stride(2) == 1 && values.stride(2) == 1,
              "racer::rope_kv_: keys/values must be [nkv, max_len, d] with unit last stride");
  const int64_t nkv = keys.size(0), maxlen = keys.size(1), d = keys.size(2);
  const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  const int64_t T = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == (nq + 2 * nkv) * d, "racer::rope_kv_: qkv ", x.sizes(),
              " is not [T, (nq + 2 nkv) d]");
  TORCH_CHECK(c.size(0) == T && c.size(-1) == d && s.sizes() == c.sizes(), "racer::rope_kv_: cos/sin must be [T, d]");
  TORCH_CHECK(start >= 0 && start + T <= maxlen, "racer::rope_kv_: rows ", start, "..", start + T, " past ", maxlen);
  const bool norm = q_norm.has_value() && q_norm->defined();
  at::Tensor qn, kn;
  if (norm) {
    TORCH_CHECK(k_norm.has_value() && k_norm->defined(), "racer::rope_kv_: q_norm without k_norm");
    qn = q_norm->contiguous();
    kn = k_norm->contiguous();
  }
  at::Tensor q = at::empty({T, nq, d}, x.options());
  const float* xp = x.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  const int64_t row = (nq + 2 * nkv) * d;
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), vs0 = values.stride(0), vs1 = values.stride(1);
  at::Tensor tmp_t = at::empty({d}, x.options());  // normed head (q/k norm), reused for every head
  float* tmp = tmp_t.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    rope_kv_row(xp + t * row, c.data_ptr<float>() + t * d, s.data_ptr<float>() + t * d, qp + t * nq * d,
                kp + (start + t) * ks1, ks0, vp + (start + t) * vs1, vs0, nq, nkv, d,
                norm ? qn.data_ptr<float>() : nullptr, norm ? kn.data_ptr<float>() : nullptr, tmp, eps);
  }
  return q;
}

// rope_kv_ for several streams' rows at once: qkv [R, (nq + 2 nkv) d], cos/sin [R, d]; keys/values
// [slots, nkv, max_len, d] (one layer of the cache, every slot); seg [B, 3] int64 per stream: slot, start
// (its rows' KV goes to positions start ..), first row (ascending; stream b's rows end where b + 1's begin).
at::Tensor rope_kv_seg_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor keys,
                        at::Tensor values, const at::Tensor& seg, int64_t nq, const c10::optional<at::Tensor>& q_norm,
                        const c10::optional<at::Tensor>& k_norm, double eps) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat,
              "racer::rope_kv_seg_: float32 only");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.stride(3) == 1 && values.stride(3) == 1,
              "racer::rope_kv_seg_: keys/values must be [slots, nkv, max_len, d] with unit last stride");
  TORCH_CHECK(seg.scalar_type() == at::kLong && seg.dim() == 2 && seg.size(1) == 3, "racer::rope_kv_seg_: seg [B, 3] int64");
  const int64_t slots = keys.size(0), nkv = keys.size(1), maxlen = keys.size(2), d = keys.size(3);
  const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous(), sg = seg.contiguous();
  const int64_t R = x.size(0), B = sg.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == (nq + 2 * nkv) * d, "racer::rope_kv_seg_: qkv ", x.sizes(),
              " is not [R, (nq + 2 nkv) d]");
  TORCH_CHECK(c.size(0) == R && c.size(-1) == d && s.sizes() == c.sizes(), "racer::rope_kv_seg_: cos/sin must be [R, d]");
  const int64_t* sp = sg.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r0 = sp[3 * b + 2], r1 = b + 1 < B ? sp[3 * b + 5] : R;
    TORCH_CHECK(sp[3 * b] >= 0 && sp[3 * b] < slots && sp[3 * b + 1] >= 0 && r0 >= 0 && r0 <= r1 && r1 <= R &&
                sp[3 * b + 1] + (r1 - r0) <= maxlen, "racer::rope_kv_seg_: bad segment ", b);
  }
  const bool norm = q_norm.has_value() && q_norm->defined();
  at::Tensor qn, kn;
  if (norm) {
    TORCH_CHECK(k_norm.has_value() && k_norm->defined(), "racer::rope_kv_seg_: q_norm without k_norm");
    qn = q_norm->contiguous();
    kn = k_norm->contiguous();
  }
  at::Tensor q = at::empty({R, nq, d}, x.options());
  const float* xp = x.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t row = (nq + 2 * nkv) * d;
  const int64_t kss = keys.stride(0), ks0 = keys.stride(1), ks1 = keys.stride(2);
  const int64_t vss = values.stride(0), vs0 = values.stride(1), vs1 = values.stride(2);
  at::Tensor tmp_t = at::empty({d}, x.options());
  float* tmp = tmp_t.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t slot = sp[3 * b], start = sp[3 * b + 1], r0 = sp[3 * b + 2], r1 = b + 1 < B ? sp[3 * b + 5] : R;
    float* kp = keys.data_ptr<float>() + slot * kss;
    float* vp = values.data_ptr<float>() + slot * vss;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t at_pos = start + (r - r0);
      rope_kv_row(xp + r * row, c.data_ptr<float>() + r * d, s.data_ptr<float>() + r * d, qp + r * nq * d,
                  kp + at_pos * ks1, ks0, vp + at_pos * vs1, vs0, nq, nkv, d,
                  norm ? qn.data_ptr<float>() : nullptr, norm ? kn.data_ptr<float>() : nullptr, tmp, eps);
    }
  }
  return q;
}

// Softmax of one row of scores in place (max-shifted); returns 1 / the sum.
inline float softmax_row(float* p, int64_t S) {
  // the maximum 8 lanes at a time (a scalar loop is one dependent compare per score: ~4 cycles each, as long as
  // a row's whole QK over 64 dims); max is exact, so the shift, and every result, is the scalar loop's
  __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t s8 = 0;
  for (; s8 + 8 <= S; s8 += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(p + s8));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  float mx = lanes[0];
  for (int i = 1; i < 8; ++i) mx = std::max(mx, lanes[i]);
  for (; s8 < S; ++s8) mx = std::max(mx, p[s8]);
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 dv = _mm256_setzero_ps();
  int64_t s = 0;
  for (; s + 8 <= S; s += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + s), mv));
    _mm256_storeu_ps(p + s, e);
    dv = _mm256_add_ps(dv, e);
  }
  float denom = hsum(dv);
  for (; s < S; ++s) {
    p[s] = exp1(p[s] - mx);
    denom += p[s];
  }
  return 1.f / denom;
}

// Attention of NR <= 4 query rows that share one KV head (head_dim d % 16 == 0): scores of NR rows x 2 keys
// per pass (2 accumulators a row; each key chunk loaded once for the rows), then P V with NR rows x 16 columns
// (2 accumulators a row; each value chunk loaded once for the rows). A row's instructions are the same
// whatever NR is (the reductions are laid out for 4 rows; absent rows' accumulators stay zero and are never
// stored), so its result is bit-identical in a block of 1, 2, 3 or 4 rows: blocks need not be padded to 4
// (3 heads x 3 tree nodes = 9 rows go as 3 + 3 + 3, not 4 + 4 + 4 with three rows of padding).
// p: scratch [4, S].
constexpr int64_t ATT_PF_KEYS = 48;  // how far ahead the key and value rows are prefetched (the first block over
                                     // a KV head reads it from DRAM; measured 5-15% faster at 500-1000 cached)
template <int NR>
void attend_rows(const float* const* qr, const float* const* mr, float* const* orow, const float* kh, int64_t ks1,
                 const float* vh, int64_t vs1, int64_t S, int64_t d, float sc, float* p) {
  static_assert(NR >= 1 && NR <= 4, "attend_rows: 1 to 4 rows");
  const float* q0 = qr[0];
  const float* q1 = NR > 1 ? qr[1] : q0;
  const float* q2 = NR > 2 ? qr[2] : q0;
  const float* q3 = NR > 3 ? qr[3] : q0;
  float* p0 = p;
  float* p1 = p + S;
  float* p2 = p + 2 * S;
  float* p3 = p + 3 * S;
  int64_t s = 0;
  for (; s + 2 <= S; s += 2) {
    const float* k0 = kh + s * ks1;
    const float* k1 = k0 + ks1;
    if (s + ATT_PF_KEYS + 2 <= S) {
      const char* f = reinterpret_cast<const char*>(k0 + ATT_PF_KEYS * ks1);
      for (int64_t i = 0; i < d; i += 16) {
        _mm_prefetch(f + 4 * i, _MM_HINT_T0);
        _mm_prefetch(f + 4 * (i + ks1), _MM_HINT_T0);
      }
    }
    __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps();
    __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps(), a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 x0 = _mm256_loadu_ps(k0 + i), x1 = _mm256_loadu_ps(k1 + i);
      __m256 qv = _mm256_loadu_ps(q0 + i);
      a00 = _mm256_fmadd_ps(qv, x0, a00);
      a01 = _mm256_fmadd_ps(qv, x1, a01);
      if constexpr (NR > 1) {
        qv = _mm256_loadu_ps(q1 + i);
        a10 = _mm256_fmadd_ps(qv, x0, a10);
        a11 = _mm256_fmadd_ps(qv, x1, a11);
      }
      if constexpr (NR > 2) {
        qv = _mm256_loadu_ps(q2 + i);
        a20 = _mm256_fmadd_ps(qv, x0, a20);
        a21 = _mm256_fmadd_ps(qv, x1, a21);
      }
      if constexpr (NR > 3) {
        qv = _mm256_loadu_ps(q3 + i);
        a30 = _mm256_fmadd_ps(qv, x0, a30);
        a31 = _mm256_fmadd_ps(qv, x1, a31);
      }
    }
    // hadd(hadd(A, B), hadd(C, D)) with its two 128-bit halves added is [sum A, sum B, sum C, sum D]
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a00, a01), _mm256_hadd_ps(a10, a11));
    alignas(16) float r[8];
    _mm_store_ps(r, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h0), _mm256_extractf128_ps(h0, 1)), _mm_set1_ps(sc)));
    p0[s] = r[0], p0[s + 1] = r[1];
    if constexpr (NR > 1) p1[s] = r[2], p1[s + 1] = r[3];
    if constexpr (NR > 2) {
      const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a20, a21), _mm256_hadd_ps(a30, a31));
      _mm_store_ps(r + 4, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h1), _mm256_extractf128_ps(h1, 1)), _mm_set1_ps(sc)));
      p2[s] = r[4], p2[s + 1] = r[5];
      if constexpr (NR > 3) p3[s] = r[6], p3[s + 1] = r[7];
    }
  }
  const float* qs[4] = {q0, q1, q2, q3};
  float* ps[4] = {p0, p1, p2, p3};
  for (; s < S; ++s) {
    const float* kr = kh + s * ks1;
    for (int j = 0; j < NR; ++j) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qs[j] + i), _mm256_loadu_ps(kr + i), a);
      ps[j][s] = hsum(a) * sc;
    }
  }
  float inv[4];
  for (int j = 0; j < NR; ++j) {
    if (mr[j] != nullptr) {
      int64_t u = 0;
      for (; u + 8 <= S; u += 8) _mm256_storeu_ps(ps[j] + u, _mm256_add_ps(_mm256_loadu_ps(ps[j] + u), _mm256_loadu_ps(mr[j] + u)));
      for (; u < S; ++u) ps[j][u] += mr[j][u];
    }
    inv[j] = softmax_row(ps[j], S);
  }
  for (int64_t i = 0; i < d; i += 16) {
    __m256 o00 = _mm256_setzero_ps(), o01 = _mm256_setzero_ps(), o10 = _mm256_setzero_ps(), o11 = _mm256_setzero_ps();
    __m256 o20 = _mm256_setzero_ps(), o21 = _mm256_setzero_ps(), o30 = _mm256_setzero_ps(), o31 = _mm256_setzero_ps();
    for (int64_t u = 0; u < S; ++u) {
      const float* vr = vh + u * vs1 + i;
      if (i == 0 && u + ATT_PF_KEYS < S) {  // the first column block reads the value rows cold: the whole row ahead
        const char* f = reinterpret_cast<const char*>(vr + ATT_PF_KEYS * vs1);
        for (int64_t c = 0; c < d; c += 16) _mm_prefetch(f + 4 * c, _MM_HINT_T0);
      }
      const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
      __m256 b = _mm256_broadcast_ss(p0 + u);
      o00 = _mm256_fmadd_ps(b, v0, o00);
      o01 = _mm256_fmadd_ps(b, v1, o01);
      if constexpr (NR > 1) {
        b = _mm256_broadcast_ss(p1 + u);
        o10 = _mm256_fmadd_ps(b, v0, o10);
        o11 = _mm256_fmadd_ps(b, v1, o11);
      }
      if constexpr (NR > 2) {
        b = _mm256_broadcast_ss(p2 + u);
        o20 = _mm256_fmadd_ps(b, v0, o20);
        o21 = _mm256_fmadd_ps(b, v1, o21);
      }
      if constexpr (NR > 3) {
        b = _mm256_broadcast_ss(p3 + u);
        o30 = _mm256_fmadd_ps(b, v0, o30);
        o31 = _mm256_fmadd_ps(b, v1, o31);
      }
    }
    const __m256 outs[8] = {o00, o01, o10, o11, o20, o21, o30, o31};
    for (int j = 0; j < NR; ++j) {
      const __m256 iv = _mm256_set1_ps(inv[j]);
      _mm256_storeu_ps(orow[j] + i, _mm256_mul_ps(outs[2 * j], iv));
      _mm256_storeu_ps(orow[j] + i + 8, _mm256_mul_ps(outs[2 * j + 1], iv));
    }
  }
}

// attend_rows<nr> for 1 <= nr <= 4 rows.
void attend4(int nr, const float* const* qr, const float* const* mr, float* const* orow, const float* kh,
             int64_t ks1, const float* vh, int64_t vs1, int64_t S, int64_t d, float sc, float* p) {
  switch (nr) {
    case 1: attend_rows<1>(qr, mr, orow, kh, ks1, vh, vs1, S, d, sc, p); break;
    case 2: attend_rows<2>(qr, mr, orow, kh, ks1, vh, vs1, S, d, sc, p); break;
    case 3: attend_rows<3>(qr, mr, orow, kh, ks1, vh, vs1, S, d, sc, p); break;
    default: attend_rows<4>(qr, mr, orow, kh, ks1, vh, vs1, S, d, sc, p); break;
  }
}

// Blocks of at most 4 of a KV head's `rows` query rows, as even as possible (9 -> 3, 3, 3; 10 -> 4, 3, 3):
// there are row_blocks4(rows) blocks, block k starts at row_start4(rows, k).
inline int64_t row_blocks4(int64_t rows) { return (rows + 3) / 4; }

inline int64_t row_start4(int64_t rows, int64_t k) {
  const int64_t blocks = row_blocks4(rows), base = rows / blocks, extra = rows % blocks;
  return k * base + std::min(k, extra);
}

// ---- tree attention on AVX-512: the same arithmetic as attend4, lane for lane, at half the instructions ----
//
// attend4 above scores two keys per pass against 4 rows in 256-bit registers and reduces every dot product
// with horizontal adds, so a verify forward whose streams each hold a few hundred cached positions spends a
// quarter of its time in attention (4 streams x 4 nodes, 400 cached positions: 5.9 of 22 ms, measured). Here
// a tile of 16 keys is transposed once into 16-key columns (kt[i] = component i of the 16 keys), so the scores
// of 16 keys are 16 lanes of one register: per row, 8 accumulators A_j take the products of the components
// i = j, j + 8, j + 16, ... in order, exactly the lane-j chains of attend4's 256-bit accumulators, and
// ((A0 + A1) + (A2 + A3)) + ((A4 + A5) + (A6 + A7)) is the order its two horizontal adds and the final
// 128-bit add sum them in. An odd last key is scored by attend4's own single-key code. The softmax is the
// shared softmax_row and P V keeps each output element's FMA chain over the positions in order (4 registers
// = 64 columns per row, 6 rows per pass), so every score, probability and output is bit-identical to the
// AVX2 kernel (tests/engine/test_kernels.py) and a row's result never depends on the other rows of its
// call. Used where the GEMM runs its AVX-512 blocks (``wide_isa``) and head_dim is a multiple of 16 up to 256.
constexpr int64_t WIDE_MAX_D = 256;
constexpr int WIDE_MAX_ROWS = 12;  // rows of one KV head per task (its scores: WIDE_MAX_ROWS x S scratch)

// kt[c * 16 + l] = k[l][c0 + c] for the 16 columns [c0, c0 + 16) of nk <= 16 key rows (missing rows zero).
RACER_AVX512 inline void transpose_tile(const float* kh, int64_t ks1, int nk, int64_t c0, float* kt) {
  __m512 r[16], t[16];
#pragma GCC unroll 16
  for (int l = 0; l < 16; ++l) r[l] = l < nk ? _mm512_loadu_ps(kh + l * ks1 + c0) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // per 128-bit lane k: u[4i + c] holds rows 4i..4i+3 of column 4k + c
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
  }
  // column 4k + c gathers lane k of r[c], r[4 + c], r[8 + c], r[12 + c] into lanes 0..3
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512 p0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), p1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
    const __m512 q0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44), q1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_store_ps(kt + (0 + c) * 16, _mm512_shuffle_f32x4(p0, q0, 0x88));
    _mm512_store_ps(kt + (4 + c) * 16, _mm512_shuffle_f32x4(p0, q0, 0xDD));
    _mm512_store_ps(kt + (8 + c) * 16, _mm512_shuffle_f32x4(p1, q1, 0x88));
    _mm512_store_ps(kt + (12 + c) * 16, _mm512_shuffle_f32x4(p1, q1, 0xDD));
  }
}

// Scores of G rows against one transposed tile of 16 keys: out[g][l] = dot(q[g], key l) * sc (lanes of m).
template <int G>
RACER_AVX512 void qk_tile(const float* const* q, const float* kt, int64_t d, float sc, float* const* out, __mmask16 m) {
  __m512 acc[G][8];
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[g][j] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < d; i += 8) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512 kv = _mm512_load_ps(kt + (i + j) * 16);
#pragma GCC unroll 3
      for (int g = 0; g < G; ++g) acc[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(q[g][i + j]), kv, acc[g][j]);
    }
  }
  const __m512 s = _mm512_set1_ps(sc);
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g) {
    const __m512 lo = _mm512_add_ps(_mm512_add_ps(acc[g][0], acc[g][1]), _mm512_add_ps(acc[g][2], acc[g][3]));
    const __m512 hi = _mm512_add_ps(_mm512_add_ps(acc[g][4], acc[g][5]), _mm512_add_ps(acc[g][6], acc[g][7]));
    _mm512_mask_storeu_ps(out[g], m, _mm512_mul_ps(_mm512_add_ps(lo, hi), s));
  }
}

// o[g][c0 : c0 + 16 CB] = sum over positions u (in order) of p[g][u] * v[u][c0 : ...], times inv[g].
template <int G, int CB>
RACER_AVX512 void pv_block(const float* const* p, const float* vh, int64_t vs1, int64_t S, int64_t c0,
                           const float* inv, float* const* orow) {
  __m512 o[G][CB];
#pragma GCC unroll 6
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int c = 0; c < CB; ++c) o[g][c] = _mm512_setzero_ps();
  }
  for (int64_t u = 0; u < S; ++u) {
    const float* vr = vh + u * vs1 + c0;
    if (u + 16 < S) {  // the value row 16 positions on (see attend_wide)
#pragma GCC unroll 4
      for (int c = 0; c < CB; ++c) _mm_prefetch(reinterpret_cast<const char*>(vr + 16 * vs1 + 16 * c), _MM_HINT_T0);
    }
    __m512 v[CB];
#pragma GCC unroll 4
    for (int c = 0; c < CB; ++c) v[c] = _mm512_loadu_ps(vr + 16 * c);
#pragma GCC unroll 6
    for (int g = 0; g < G; ++g) {
      const __m512 b = _mm512_set1_ps(p[g][u]);
#pragma GCC unroll 4
      for (int c = 0; c < CB; ++c) o[g][c] = _mm512_fmadd_ps(b, v[c], o[g][c]);
    }
  }
#pragma GCC unroll 6
  for (int g = 0; g < G; ++g) {
    const __m512 iv = _mm512_set1_ps(inv[g]);
#pragma GCC unroll 4
    for (int c = 0; c < CB; ++c) _mm512_storeu_ps(orow[g] + c0 + 16 * c, _mm512_mul_ps(o[g][c], iv));
  }
}

template <int G>
RACER_AVX512 void pv_rows(const float* const* p, const float* vh, int64_t vs1, int64_t S, int64_t d,
                          const float* inv, float* const* orow) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    switch (std::min<int64_t>(4, (d - c0) / 16)) {
      case 4: pv_block<G, 4>(p, vh, vs1, S, c0, inv, orow); break;
      case 3: pv_block<G, 3>(p, vh, vs1, S, c0, inv, orow); break;
      case 2: pv_block<G, 2>(p, vh, vs1, S, c0, inv, orow); break;
      default: pv_block<G, 1>(p, vh, vs1, S, c0, inv, orow); break;
    }
  }
}

// exp256's operations on 16 lanes: each lane's result is exp256's bits for that lane (the same roundings in the
// same order; tests/engine/test_kernels.py holds the wide attention to the AVX2 kernel bit for bit).
RACER_AVX512 inline __m512 exp512(__m512 x) {
  const __m512 hi = _mm512_set1_ps(EXP_HI), lo = _mm512_set1_ps(EXP_LO);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_P[0]);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[1]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[2]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[3]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[4]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[5]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(e));
}

// softmax_row on AVX-512 with the same bits: the maximum is exact in any order, the exponentials are exp256's per
// lane, and the denominator is still summed into 8 lanes in position order (a 16-lane block's low half, then its
// high half, as two 8-wide steps of softmax_row would) before the same horizontal sum and scalar tail.
RACER_AVX512 inline float softmax_row_512(float* p, int64_t S) {
  __m512 m16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t s = 0;
  for (; s + 16 <= S; s += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(p + s));
  float mx = _mm512_reduce_max_ps(m16);
  for (; s < S; ++s) mx = std::max(mx, p[s]);
  const __m512 mv = _mm512_set1_ps(mx);
  __m256 dv = _mm256_setzero_ps();
  s = 0;
  for (; s + 16 <= S; s += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(p + s), mv));
    _mm512_storeu_ps(p + s, e);
    dv = _mm256_add_ps(dv, _mm512_castps512_ps256(e));
    dv = _mm256_add_ps(dv, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  if (s + 8 <= S) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + s), _mm512_castps512_ps256(mv)));
    _mm256_storeu_ps(p + s, e);
    dv = _mm256_add_ps(dv, e);
    s += 8;
  }
  float denom = hsum(dv);
  for (; s < S; ++s) {
    p[s] = exp1(p[s] - mx);
    denom += p[s];
  }
  return 1.f / denom;
}

// Attention of nr <= WIDE_MAX_ROWS query rows that share one KV head (d % 16 == 0, d <= WIDE_MAX_D) over
// positions [0, S): the rows' masks mr (nullptr: none), outputs orow. p: scratch [WIDE_MAX_ROWS, S].
// seen (nullptr: every row sees all S): row j sees positions [0, seen[j]) only (a causal prefill chunk).
RACER_AVX512 void attend_wide(int nr, const float* const* qr, const float* const* mr, float* const* orow,
                              const float* kh, int64_t ks1, const float* vh, int64_t vs1, int64_t S, int64_t d,
                              float sc, float* p, const int64_t* seen = nullptr) {
  alignas(64) float kt[WIDE_MAX_D * 16];
  float* pr[WIDE_MAX_ROWS];
  for (int j = 0; j < nr; ++j) pr[j] = p + j * S;
  const int64_t paired = S - (S & 1);  // attend4 scores keys in pairs; an odd last key alone
  for (int64_t s0 = 0; s0 < paired; s0 += 16) {
    const int nk = static_cast<int>(std::min<int64_t>(16, paired - s0));
    // the keys two tiles on: this task's KV comes from DRAM (a forward's weights evict it from L3), and the
    // hardware prefetcher starts late on each new head's rows
    for (int64_t l = 0; l < 16 && s0 + 32 + l < S; ++l)
      for (int64_t c0 = 0; c0 < d; c0 += 16) _mm_prefetch(reinterpret_cast<const char*>(kh + (s0 + 32 + l) * ks1 + c0), _MM_HINT_T0);
    for (int64_t c0 = 0; c0 < d; c0 += 16) transpose_tile(kh + s0 * ks1, ks1, nk, c0, kt + c0 * 16);
    const __mmask16 m = nk == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << nk) - 1u);
    float* out[3];
    for (int j = 0; j < nr; j += 3) {
      const int g = std::min(3, nr - j);
      for (int i = 0; i < g; ++i) out[i] = pr[j + i] + s0;
      if (g == 3) qk_tile<3>(qr + j, kt, d, sc, out, m);
      else if (g == 2) qk_tile<2>(qr + j, kt, d, sc, out, m);
      else qk_tile<1>(qr + j, kt, d, sc, out, m);
    }
  }
  if (S & 1) {  // attend4's single-key tail, the same code
    const float* kr = kh + (S - 1) * ks1;
    for (int j = 0; j < nr; ++j) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qr[j] + i), _mm256_loadu_ps(kr + i), a);
      pr[j][S - 1] = hsum(a) * sc;
    }
  }
  float inv[WIDE_MAX_ROWS];
  for (int j = 0; j < nr; ++j) {
    if (mr[j] != nullptr) {
      int64_t u = 0;
      for (; u + 16 <= S; u += 16)
        _mm512_storeu_ps(pr[j] + u, _mm512_add_ps(_mm512_loadu_ps(pr[j] + u), _mm512_loadu_ps(mr[j] + u)));
      for (; u < S; ++u) pr[j][u] += mr[j][u];
    }
    if (seen != nullptr) std::fill(pr[j] + seen[j], pr[j] + S, -std::numeric_limits<float>::infinity());  // e^-inf = 0
    inv[j] = softmax_row_512(pr[j], S);
  }
  for (int j = 0; j < nr; j += 6) {
    const int g = std::min(6, nr - j);
    switch (g) {
      case 6: pv_rows<6>(pr + j, vh, vs1, S, d, inv + j, orow + j); break;
      case 5: pv_rows<5>(pr + j, vh, vs1, S, d, inv + j, orow + j); break;
      case 4: pv_rows<4>(pr + j, vh, vs1, S, d, inv + j, orow + j); break;
      case 3: pv_rows<3>(pr + j, vh, vs1, S, d, inv + j, orow + j); break;
      case 2: pv_rows<2>(pr + j, vh, vs1, S, d, inv + j, orow + j); break;
      default: pv_rows<1>(pr + j, vh, vs1, S, d, inv + j, orow + j); break;
    }
  }
}

// One stream of a wide attention call: its KV slot's keys/values (head 0), S positions, T rows from row0,
// its mask rows (nullptr: none) with row stride ms.
struct WideStream {
  const float* keys;
  const float* vals;
  int64_t S, T, row0;
  const float* mask;
  int64_t ms;
  int64_t causal = -1;  // >= 0: a prefill chunk at that start, row t seeing [0, causal + t] (mask unused)
};

// The tasks of a wide call: (stream, KV head, chunk of that head's rep * T rows, h-major), chunks of at most
// WIDE_MAX_ROWS rows, split finer (down to 3 rows) while there are fewer tasks than twice the threads, so a
// lone stream's three KV heads still keep both threads busy.
void attention_wide(const std::vector<WideStream>& streams, const float* qp, float* op, int64_t nq, int64_t nkv,
                    int64_t d, int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1, float sc, int64_t smax,
                    const at::TensorOptions& opts) {
  const int64_t rep = nq / nkv;
  const int64_t want = 2 * static_cast<int64_t>(at::get_num_threads());
  int64_t chunk = WIDE_MAX_ROWS;
  auto count = [&](int64_t c) {
    int64_t n = 0;
    for (const auto& s : streams) n += nkv * ((rep * s.T + c - 1) / c);
    return n;
  };
  while (chunk > 3 && count(chunk) < want) chunk = std::max<int64_t>(3, chunk / 2);
  std::vector<int64_t> task_s, task_g, task_r;
  for (int64_t b = 0; b < static_cast<int64_t>(streams.size()); ++b) {
    const int64_t rows = rep * streams[b].T;
    for (int64_t g = 0; g < nkv; ++g) {
      for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        task_s.push_back(b);
        task_g.push_back(g);
        task_r.push_back(r0);
      }
    }
  }
  at::Tensor scratch = at::empty({at::get_num_threads(), WIDE_MAX_ROWS * smax}, opts);  // see `attention`
  const int64_t ntasks = static_cast<int64_t>(task_s.size());
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, 2 * chunk * smax * d));
  at::parallel_for(0, ntasks, grain, [&](int64_t a0, int64_t a1) {
    float* p = scratch.data_ptr<float>() + at::get_thread_num() * WIDE_MAX_ROWS * smax;
    for (int64_t a = a0; a < a1; ++a) {
      const WideStream& st = streams[task_s[a]];
      const int64_t g = task_g[a], r0 = task_r[a], T = st.T;
      const int nr = static_cast<int>(std::min<int64_t>(chunk, rep * T - r0));
      const float* qr[WIDE_MAX_ROWS];
      const float* mr[WIDE_MAX_ROWS];
      float* orow[WIDE_MAX_ROWS];
      for (int j = 0; j < nr; ++j) {
        const int64_t h = g * rep + (r0 + j) / T, t = (r0 + j) % T;
        qr[j] = qp + ((st.row0 + t) * nq + h) * d;
        mr[j] = st.mask == nullptr ? nullptr : st.mask + t * st.ms;
        orow[j] = op + (st.row0 + t) * nq * d + h * d;
      }
      if (st.causal < 0) {
        attend_wide(nr, qr, mr, orow, st.keys + g * ks0, ks1, st.vals + g * vs0, vs1, st.S, d, sc, p);
        continue;
      }
      int64_t seen[WIDE_MAX_ROWS], span = 0;  // keys past the task's last visible one are not scored at all
      for (int j = 0; j < nr; ++j) {
        seen[j] = st.causal + (r0 + j) % T + 1;
        span = std::max(span, seen[j]);
      }
      attend_wide(nr, qr, mr, orow, st.keys + g * ks0, ks1, st.vals + g * vs0, vs1, span, d, sc, p, seen);
    }
  });
}

bool use_wide_attention(int64_t d) { return wide_isa() && d % 16 == 0 && d <= WIDE_MAX_D; }

// Attention of T query rows q [T, nq, d] over keys/values [nkv, >= S, d] (a slot of the cache; positions
// [0, S) are read) with the additive mask [T, S] (or none: all visible). Query head h reads KV head h / (nq/nkv),
// as transformers' repeat_kv lays them out. Returns [T, nq * d], the o_proj input. Exact softmax (max-shifted),
// one (head, row) per task; the keys and values of a head stay in L2 across its rows.
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t S,
                     const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat, "racer::attention: float32 only");
  const at::Tensor qc = q.contiguous();
  TORCH_CHECK(qc.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(), "racer::attention: bad shapes");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1, "racer::attention: keys/values need unit last stride");
  const int64_t T = qc.size(0), nq = qc.size(1), d = qc.size(2), nkv = keys.size(0);
  TORCH_CHECK(keys.size(2) == d && nq % nkv == 0 && S > 0 && S <= keys.size(1), "racer::attention: q ", qc.sizes(),
              " vs keys ", keys.sizes(), " S=", S);
  at::Tensor m;
  const float* mp = nullptr;
  int64_t ms = 0;
  if (mask.has_value() && mask->defined()) {
    m = *mask;
    TORCH_CHECK(m.dim() == 2 && m.size(0) == T && m.size(1) >= S && m.stride(1) == 1 && m.scalar_type() == at::kFloat,
                "racer::attention: mask must be float32 [T, >= S] with unit last stride");
    mp = m.data_ptr<float>();
    ms = m.stride(0);
  }
  const int64_t rep = nq / nkv;
  at::Tensor out = at::empty({T, nq * d}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), vs0 = values.stride(0), vs1 = values.stride(1);
  const float sc = static_cast<float>(scale);
  const bool vec = d % 8 == 0;
  if (use_wide_attention(d)) {
    attention_wide({WideStream{kp, vp, S, T, 0, mp, ms}}, qp, op, nq, nkv, d, ks0, ks1, vs0, vs1, sc, S, qc.options());
    return out;
  }
  if (d % 16 == 0) {  // blocks of up to 4 rows of one KV head (row_start4): its rows are (head h in the group, node t), h-major
    const int64_t rows = rep * T, blocks = row_blocks4(rows);
    // scratch for the scores, one [4, S] block per thread, allocated here on the calling thread: a heap
    // allocation inside the parallel region lands in each worker thread's own malloc arena, whose size then
    // drifts with S from call to call (seen as tens of MB of RSS jitter in the soak test)
    at::Tensor scratch = at::empty({at::get_num_threads(), 4 * S}, qc.options());
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, 8 * S * d));  // ~64K FMAs a task
    at::parallel_for(0, nkv * blocks, grain, [&](int64_t a0, int64_t a1) {
      float* p = scratch.data_ptr<float>() + at::get_thread_num() * 4 * S;
      for (int64_t a = a0; a < a1; ++a) {
        const int64_t g = a / blocks, k = a % blocks, r0 = row_start4(rows, k);
        const int nr = static_cast<int>(row_start4(rows, k + 1) - r0);
        const float* qr[4];
        const float* mr[4];
        float* orow[4];
        for (int j = 0; j < nr; ++j) {
          const int64_t h = g * rep + (r0 + j) / T, t = (r0 + j) % T;
          qr[j] = qp + (t * nq + h) * d;
          mr[j] = mp == nullptr ? nullptr : mp + t * ms;
          orow[j] = op + t * nq * d + h * d;
        }
        attend4(nr, qr, mr, orow, kp + g * ks0, ks1, vp + g * vs0, vs1, S, d, sc, p);
      }
    });
    return out;
  }
  // any other head_dim: one (head, row) per task, ordered head-major so one thread's rows share a KV head
  const int64_t tasks = nq * T;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, S * d / 8));
  at::Tensor scratch = at::empty({at::get_num_threads(), S + d}, qc.options());  // see the blocked path
  at::parallel_for(0, tasks, grain, [&](int64_t a0, int64_t a1) {
    float* p = scratch.data_ptr<float>() + at::get_thread_num() * (S + d);
    float* acc = p + S;
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t h = a / T, t = a % T, g = h / rep;
      const float* qr = qp + (t * nq + h) * d;
      const float* kh = kp + g * ks0;
      const float* vh = vp + g * vs0;
      float mx = -std::numeric_limits<float>::infinity();
      int64_t s = 0;
      if (vec) {  // four keys at a time: four independent FMA chains, then one reduction for the four dots
        for (; s + 4 <= S; s += 4) {
          const float* k0 = kh + s * ks1;
          __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
          for (int64_t i = 0; i < d; i += 8) {
            const __m256 qv = _mm256_loadu_ps(qr + i);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + ks1 + i), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * ks1 + i), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * ks1 + i), a3);
          }
          const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
          __m128 dots = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  // [d0 d1 d2 d3]
          dots = _mm_mul_ps(dots, _mm_set1_ps(sc));
          if (mp != nullptr) dots = _mm_add_ps(dots, _mm_loadu_ps(mp + t * ms + s));
          _mm_storeu_ps(p + s, dots);
          for (int j = 0; j < 4; ++j) mx = std::max(mx, p[s + j]);
        }
      }
      for (; s < S; ++s) {
        const float* kr = kh + s * ks1;
        float dot = 0.f;
        for (int64_t i = 0; i < d; ++i) dot += qr[i] * kr[i];
        float sv = dot * sc;
        if (mp != nullptr) sv += mp[t * ms + s];
        p[s] = sv;
        mx = std::max(mx, sv);
      }
      float denom = 0.f;
      {
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 dv = _mm256_setzero_ps();
        int64_t s = 0;
        for (; s + 8 <= S; s += 8) {
          const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + s), mv));
          _mm256_storeu_ps(p + s, e);
          dv = _mm256_add_ps(dv, e);
        }
        denom = hsum(dv);
        for (; s < S; ++s) {
          p[s] = exp1(p[s] - mx);
          denom += p[s];
        }
      }
      std::fill(acc, acc + d, 0.f);
      if (vec) {  // 8 output columns at a time, four keys' products in independent chains
        for (int64_t i = 0; i < d; i += 8) {
          __m256 o0 = _mm256_setzero_ps(), o1 = _mm256_setzero_ps(), o2 = _mm256_setzero_ps(), o3 = _mm256_setzero_ps();
          int64_t s2 = 0;
          for (; s2 + 4 <= S; s2 += 4) {
            const float* v0 = vh + s2 * vs1 + i;
            o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + s2), _mm256_loadu_ps(v0), o0);
            o1 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + s2 + 1), _mm256_loadu_ps(v0 + vs1), o1);
            o2 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + s2 + 2), _mm256_loadu_ps(v0 + 2 * vs1), o2);
            o3 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + s2 + 3), _mm256_loadu_ps(v0 + 3 * vs1), o3);
          }
          for (; s2 < S; ++s2) {
            o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + s2), _mm256_loadu_ps(vh + s2 * vs1 + i), o0);
          }
          _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_add_ps(o0, o1), _mm256_add_ps(o2, o3)));
        }
      } else {
        for (int64_t s2 = 0; s2 < S; ++s2) {
          const float w = p[s2];
          const float* vr = vh + s2 * vs1;
          for (int64_t i = 0; i < d; ++i) acc[i] += w * vr[i];
        }
      }
      const float inv = 1.f / denom;
      float* orow = op + t * nq * d + h * d;
      for (int64_t i = 0; i < d; ++i) orow[i] = acc[i] * inv;
    }
  });
  return out;
}

// Causal attention of a prefill chunk: q [T, nq, d] at positions [start, start + T), keys/values [nkv, >= start
// + T, d]; row t sees positions [0, start + t]. Returns [T, nq * d]. On the AVX-512 kernels only (rows in
// chunks of 12 consecutive positions of one head, each scoring keys up to its chunk's last visible one); the
// runner uses SDPA where this is unavailable (``racer::has_causal``).
at::Tensor attention_causal(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                            double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "racer::attention_causal: float32 only");
  const at::Tensor qc = q.contiguous();
  TORCH_CHECK(qc.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes() && keys.stride(2) == 1 &&
              values.stride(2) == 1, "racer::attention_causal: q [T, nq, d], keys/values [nkv, >= S, d]");
  const int64_t T = qc.size(0), nq = qc.size(1), d = qc.size(2), nkv = keys.size(0);
  TORCH_CHECK(keys.size(2) == d && nq % nkv == 0 && start >= 0 && T > 0 && start + T <= keys.size(1),
              "racer::attention_causal: q ", qc.sizes(), " vs keys ", keys.sizes(), " start=", start);
  TORCH_CHECK(use_wide_attention(d), "racer::attention_causal: needs the AVX-512 kernels and head_dim % 16 == 0 <= 256");
  at::Tensor out = at::empty({T, nq * d}, qc.options());
  WideStream st{keys.data_ptr<float>(), values.data_ptr<float>(), start + T, T, 0, nullptr, 0, start};
  attention_wide({st}, qc.data_ptr<float>(), out.data_ptr<float>(), nq, nkv, d, keys.stride(0), keys.stride(1),
                 values.stride(0), values.stride(1), static_cast<float>(scale), start + T, qc.options());
  return out;
}

bool has_causal(int64_t d) { return use_wide_attention(d); }

// Tree attention of several streams' rows at once: q [R, nq, d] (the streams' rows one after another),
// keys/values [slots, nkv, max_len, d] (one layer of the cache, every slot), seg [B, 3] int64 per stream: slot,
// start (its committed length), first row; stream b's rows read positions [0, start + T_b) of its own slot with
// its rows of the additive mask [R, >= start + T_b]. Returns [R, nq * d]. Each row's arithmetic is that of
// `attention` over its stream alone (same blocks of up to 4 rows of one KV head), so batch-mates change nothing.
at::Tensor attention_seg(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& seg,
                         const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && mask.scalar_type() == at::kFloat,
              "racer::attention_seg: float32 only");
  const at::Tensor qc = q.contiguous(), sg = seg.contiguous();
  TORCH_CHECK(qc.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes() && keys.stride(3) == 1 &&
              values.stride(3) == 1, "racer::attention_seg: q [R, nq, d], keys/values [slots, nkv, max_len, d]");
  TORCH_CHECK(sg.scalar_type() == at::kLong && sg.dim() == 2 && sg.size(1) == 3, "racer::attention_seg: seg [B, 3] int64");
  const int64_t R = qc.size(0), nq = qc.size(1), d = qc.size(2);
  const int64_t slots = keys.size(0), nkv = keys.size(1), maxlen = keys.size(2), B = sg.size(0);
  TORCH_CHECK(keys.size(3) == d && nq % nkv == 0, "racer::attention_seg: q ", qc.sizes(), " vs keys ", keys.sizes());
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == R && mask.stride(1) == 1, "racer::attention_seg: mask [R, S] unit stride");
  const int64_t* sp = sg.data_ptr<int64_t>();
  int64_t smax = 1;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r0 = sp[3 * b + 2], r1 = b + 1 < B ? sp[3 * b + 5] : R, S = sp[3 * b + 1] + (r1 - r0);
    TORCH_CHECK(sp[3 * b] >= 0 && sp[3 * b] < slots && r0 >= 0 && r0 < r1 && r1 <= R && S <= maxlen &&
                S <= mask.size(1), "racer::attention_seg: bad segment ", b);
    smax = std::max(smax, S);
  }
  at::Tensor out = at::empty({R, nq * d}, qc.options());
  const int64_t rep = nq / nkv;
  if (d % 16 != 0) {  // other head sizes: the one-stream op per stream
    for (int64_t b = 0; b < B; ++b) {
      const int64_t r0 = sp[3 * b + 2], r1 = b + 1 < B ? sp[3 * b + 5] : R, S = sp[3 * b + 1] + (r1 - r0);
      out.slice(0, r0, r1).copy_(attention(qc.slice(0, r0, r1), keys.select(0, sp[3 * b]), values.select(0, sp[3 * b]),
                                           S, mask.slice(0, r0, r1), scale));
    }
    return out;
  }
  if (use_wide_attention(d)) {
    std::vector<WideStream> streams;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t r0 = sp[3 * b + 2], r1 = b + 1 < B ? sp[3 * b + 5] : R, slot = sp[3 * b];
      streams.push_back(WideStream{keys.data_ptr<float>() + slot * keys.stride(0),
                                   values.data_ptr<float>() + slot * values.stride(0), sp[3 * b + 1] + (r1 - r0),
                                   r1 - r0, r0, mask.data_ptr<float>() + r0 * mask.stride(0), mask.stride(0)});
    }
    attention_wide(streams, qc.data_ptr<float>(), out.data_ptr<float>(), nq, nkv, d, keys.stride(1), keys.stride(2), values.stride(1),
                   values.stride(2), static_cast<float>(scale), smax, qc.options());
    return out;
  }
  // tasks: (stream, KV head, block k of its rep * T_b rows: row_start4), as `attention` orders them per stream
  std::vector<int64_t> task_seg, task_g, task_k;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t T = (b + 1 < B ? sp[3 * b + 5] : R) - sp[3 * b + 2], blocks = row_blocks4(rep * T);
    for (int64_t g = 0; g < nkv; ++g) {
      for (int64_t k = 0; k < blocks; ++k) {
        task_seg.push_back(b);
        task_g.push_back(g);
        task_k.push_back(k);
      }
    }
  }
  const float* qp = qc.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const float* mp = mask.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ms = mask.stride(0);
  const int64_t kss = keys.stride(0), ks0 = keys.stride(1), ks1 = keys.stride(2);
  const int64_t vss = values.stride(0), vs0 = values.stride(1), vs1 = values.stride(2);
  const float sc = static_cast<float>(scale);
  at::Tensor scratch = at::empty({at::get_num_threads(), 4 * smax}, qc.options());  // see `attention`
  const int64_t ntasks = static_cast<int64_t>(task_seg.size());
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, 8 * smax * d));
  at::parallel_for(0, ntasks, grain, [&](int64_t a0, int64_t a1) {
    float* p = scratch.data_ptr<float>() + at::get_thread_num() * 4 * smax;
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t b = task_seg[a], g = task_g[a], k = task_k[a];
      const int64_t row0 = sp[3 * b + 2], T = (b + 1 < B ? sp[3 * b + 5] : R) - row0, S = sp[3 * b + 1] + T;
      const int64_t slot = sp[3 * b], rows = rep * T, r0 = row_start4(rows, k);
      const int nr = static_cast<int>(row_start4(rows, k + 1) - r0);
      const float* qr[4];
      const float* mr[4];
      float* orow[4];
      for (int j = 0; j < nr; ++j) {
        const int64_t h = g * rep + (r0 + j) / T, t = row0 + (r0 + j) % T;
        qr[j] = qp + (t * nq + h) * d;
        mr[j] = mp + t * ms;
        orow[j] = op + t * nq * d + h * d;
      }
      attend4(nr, qr, mr, orow, kp + slot * kss + g * ks0, ks1, vp + slot * vss + g * vs0, vs1, S, d, sc, p);
    }
  });
  return out;
}

// silu(gate) * up for gu [T, 2I] = [gate | up]; returns [T, I].
// keep_rows_: the accepted path's KV rows moved down in place, for every stream of a step in one call.
// kv [L, 2, S, H, P, D] (any dtype, contiguous); move r copies position src[r] to dst[r] of slot slot[r] in every
// layer, key/value and head, in the order given. A stream's moves come in ascending dst with src[r] >= dst[r],
// so a source is never an earlier move's destination: the same rows as a gather of every source then a scatter.
at::Tensor keep_rows_(at::Tensor kv, const at::Tensor& slot, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(kv.dim() == 6 && kv.is_contiguous(), "racer::keep_rows_: kv must be a contiguous [L, 2, S, H, P, D]");
  for (const at::Tensor* t : {&slot, &src, &dst})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous() && t->numel() == slot.numel(),
                "racer::keep_rows_: slot, src and dst must be contiguous int64 [M] of one length");
  const int64_t L2 = kv.size(0) * 2, S = kv.size(2), H = kv.size(3), P = kv.size(4);
  const int64_t row = kv.size(5) * int64_t(kv.element_size()), M = slot.numel();
  const int64_t* sl = slot.data_ptr<int64_t>();
  const int64_t* sp = src.data_ptr<int64_t>();
  const int64_t* dp = dst.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r)
    TORCH_CHECK(sl[r] >= 0 && sl[r] < S && sp[r] >= 0 && sp[r] < P && dp[r] >= 0 && dp[r] < P,
                "racer::keep_rows_: slot or position out of range");
  char* base = static_cast<char*>(kv.data_ptr());
  for (int64_t r = 0; r < M; ++r)
    for (int64_t lc = 0; lc < L2; ++lc)
      for (int64_t h = 0; h < H; ++h) {
        char* plane = base + (((lc * S + sl[r]) * H + h) * P) * row;
        std::memmove(plane + dp[r] * row, plane + sp[r] * row, size_t(row));
      }
  return kv;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.scalar_type() == at::kFloat && gu.dim() == 2 && gu.size(1) % 2 == 0, "racer::silu_mul: float32 [T, 2I]");
  const at::Tensor x = gu.contiguous();
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor y = at::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, I)), [&](int64_t t0, int64_t t1) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = xp + t * 2 * I;
      const float* u = g + I;
      float* o = yp + t * I;
      int64_t j = 0;
      for (; j + 8 <= I; j += 8) {  // g / (1 + e^-g) * u
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 den = _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv)));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + j)));
      }
      for (; j < I; ++j) o[j] = (g[j] / (1.f + exp1(-g[j]))) * u[j];
    }
  });
  return y;
}


// Row counts up to ``largest`` after which a GEMM's cost steps up (one more pass of register blocks over each
// L1 chunk): multiples of 6 on AVX2; on AVX-512, 6 (the last AVX2 call), then multiples of 12.
std::vector<int64_t> row_steps(int64_t largest) {
  std::vector<int64_t> out;
  const bool wide = wide_isa();
  for (int64_t r = MR_MAX; r <= largest; r += (wide && r >= MR512) ? MR512 : MR_MAX) out.push_back(r);
  return out;
}

// ---- the greedy step's argmax and the store's top-k of a verify's logits, in one pass ----
//
// A greedy RACER step needs, per tree node, the argmax of its logits (acceptance) and the top-k ids (the
// copy-logit store): torch.argmax and torch.topk read the [T, V] logits twice and cost ~0.27 ms per stream
// step on SmolLM2 (V = 49152), ~3% of a forward with four streams. Here each row is read once: 8 values at a
// time are compared with the current k-th best and the rare winner is inserted into a sorted list of k. A
// value enters ahead of another only when strictly greater, so among equal values the lower index comes
// first and list[0] is the first maximal index, which is torch.argmax's rule ("the first maximal value").
// (The order of equal values within the top-k may differ from torch.topk's, which leaves it unspecified.)
// x enters the sorted list at slot ``last`` or above (the entry at ``last``, if any, drops out).
inline void topk_insert(float* val, int64_t* idx, int64_t last, float x, int64_t i) {
  int64_t p = last;
  while (p > 0 && x > val[p - 1]) {
    val[p] = val[p - 1];
    idx[p] = idx[p - 1];
    --p;
  }
  val[p] = x;
  idx[p] = i;
}

std::tuple<at::Tensor, at::Tensor> argmax_topk(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "racer::argmax_topk: logits must be float32 [T, V] on the CPU, got ", logits.sizes());
  const at::Tensor x = logits.contiguous();
  const int64_t T = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V && k <= 64, "racer::argmax_topk: need 1 <= k <= min(V, 64), got k=", k, " V=", V);
  at::Tensor am = at::empty({T}, x.options().dtype(at::kLong));
  at::Tensor top = at::empty({T, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* ap = am.data_ptr<int64_t>();
  int64_t* tp = top.data_ptr<int64_t>();
  at::parallel_for(0, T, 4, [&](int64_t r0, int64_t r1) {
    float val[64];
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * V;
      int64_t* idx = tp + r * k;
      int64_t i = 0;
      for (; i < k; ++i) topk_insert(val, idx, i, row[i], i);  // the first k values (k <= V), same rule
      __m256 thr = _mm256_set1_ps(val[k - 1]);
      for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        int m = _mm256_movemask_ps(_mm256_cmp_ps(v, thr, _CMP_GT_OQ));
        if (m == 0) continue;
        while (m != 0) {
          const int j = __builtin_ctz(static_cast<unsigned>(m));
          m &= m - 1;
          if (row[i + j] > val[k - 1]) topk_insert(val, idx, k - 1, row[i + j], i + j);
        }
        thr = _mm256_set1_ps(val[k - 1]);
      }
      for (; i < V; ++i)
        if (row[i] > val[k - 1]) topk_insert(val, idx, k - 1, row[i], i);
      ap[r] = idx[0];
    }
  });
  return std::make_tuple(am, top);
}
}  // namespace

TORCH_LIBRARY(racer, m) {
  // row counts after which the GEMM's cost steps up (a catch-all kernel)
  m.def("row_steps(int largest) -> int[]", row_steps);
  // the GEMM's instruction set: "avx512" or "avx2"; set_isa switches it and returns the previous one
  m.def("isa() -> str", get_isa);
  m.def("has_causal(int head_dim) -> bool", has_causal);
  m.def("set_isa(str isa) -> str", set_isa);
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
  m.def("linear_add_(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> Tensor(a!)");
  m.def("linear_into_(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> Tensor(a!)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_kv_(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, int start, int nq, "
        "Tensor? q_norm, Tensor? k_norm, float eps) -> Tensor");
  m.def("attention(Tensor q, Tensor keys, Tensor values, int S, Tensor? mask, float scale) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("rope_kv_seg_(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, Tensor seg, int nq, "
        "Tensor? q_norm, Tensor? k_norm, float eps) -> Tensor");
  m.def("attention_seg(Tensor q, Tensor keys, Tensor values, Tensor seg, Tensor mask, float scale) -> Tensor");
  m.def("argmax_topk(Tensor logits, int k) -> (Tensor, Tensor)");
  m.def("keep_rows_(Tensor(a!) kv, Tensor slot, Tensor src, Tensor dst) -> Tensor(a!)");
  m.def("attention_causal(Tensor q, Tensor keys, Tensor values, int start, float scale) -> Tensor");
  // the GEMM and the embedding rows over a weight kept in its GGUF blocks (STORED_* formats)
  m.def("stored_group_bytes(int fmt) -> int", stored_group_bytes);
  // up to how many rows the stored GEMM expands in registers (-1: the ISA's default); returns the previous setting
  m.def("set_stored_rows(int rows) -> int", set_stored_rows);
  m.def("stored_linear(Tensor x, Tensor packed, int fmt, Tensor? bias, int N) -> Tensor");
  m.def("stored_linear_add_(Tensor(a!) out, Tensor x, Tensor packed, int fmt, Tensor? bias) -> Tensor(a!)");
  m.def("stored_linear_into_(Tensor(a!) out, Tensor x, Tensor packed, int fmt, Tensor? bias) -> Tensor(a!)");
  m.def("stored_rows(Tensor packed, int fmt, int N, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(racer, CPU, m) {
  m.impl("pack", pack);
  m.impl("linear", linear);
  m.impl("linear_add_", linear_add_);
  m.impl("linear_into_", linear_into_);
  m.impl("rms_norm", rms_norm);
  m.impl("rope_kv_", rope_kv_);
  m.impl("attention", attention);
  m.impl("silu_mul", silu_mul);
  m.impl("rope_kv_seg_", rope_kv_seg_);
  m.impl("attention_seg", attention_seg);
  m.impl("argmax_topk", argmax_topk);
  m.impl("keep_rows_", keep_rows_);
  m.impl("attention_causal", attention_causal);
  m.impl("stored_linear", stored_linear);
  m.impl("stored_linear_add_", stored_linear_add_);
  m.impl("stored_linear_into_", stored_linear_into_);
  m.impl("stored_rows", stored_rows);
}
