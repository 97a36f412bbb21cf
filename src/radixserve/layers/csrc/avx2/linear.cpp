// Linear layers for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel Haswell to Comet
// Lake, and the E-cores of hybrid Intel parts), bf16 and float32: the op `csrc/linear.cpp`
// defines for AVX-512 CPUs, on the same blocked weight, `[N/16][K/2][16][2]` (bf16) or
// `[N/16][K][16]` (float32). One block, 16 output columns, is two 8-lane registers here.
//
// A tile is up to 6 input rows by one block: 12 float32 sums, the block's step in two registers
// and one broadcast input fill 15 of the 16 registers. A bf16 step is an input pair: its weights
// widen to four registers (each input's products of 16 columns), so a bf16 tile is up to 5 rows
// and each broadcast input feeds both halves of the block (1.3-1.5x faster at 8-512 rows than 6
// rows that broadcast each input twice; RESULTS.md, session 33). One block is one contiguous
// stream of the weight (the hardware prefetcher follows it, and the first tile asks 1 KiB
// ahead); a prefill's row tiles reuse it from the L2 cache. torch's own GEMMs on such CPUs are
// slow where this kernel is not: on an AMD EPYC (Zen 3), F.linear ran float32 at 9-98 GFLOP/s
// and bf16 at 15-18 GFLOP/s at every batch size (benchmarks/RESULTS.md, session 31).
//
// Each output is the same chain of float32 multiply-adds as in the AVX-512 kernel without
// AVX512-BF16: inputs in ascending order from zero, a bf16 pair's second product before its
// first; then the bias is added and the sum rounded once as c10 rounds. So a row's output is
// the same bits whatever batch it is part of, and the same bits as on an AVX-512 CPU without
// AVX512-BF16. bf16 activations are widened to float32 once per call (exact), so the inner
// loop broadcasts float32 inputs as it does for float32 models.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "../linear_args.h"

namespace {

using namespace radixserve_cpu;

constexpr int64_t kBlock = 16;  // output columns per block: two registers of float32 sums
constexpr int kMaxRows = 6;     // rows per tile: 6 x 2 sums + 2 weights + 1 input in 16 registers
constexpr int kMaxBf16Rows = 5;  // bf16: 5 x 2 sums + 4 weights (a pair's two) + 1 input in 15
constexpr int kPrefetchSteps = 4;  // float32 steps per line of the next block prefetched
constexpr int64_t kAheadBytes = 1024;  // how far ahead a block's first tile asks for its weights

// Output storage: float32 sums (plus the bias, added in float32) to T.
inline void store_out(float* y, const float* sums, const float* bias, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) y[j] = sums[j] + (bias ? bias[j] : 0.0f);
}
inline void store_out(uint16_t* y, const float* sums, const float* bias, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) {
    y[j] = c10::BFloat16(sums[j] + (bias ? bias[j] : 0.0f)).x;  // round to nearest even
  }
}

struct Problem {
  int64_t n, steps;     // output columns; input steps (K, or K / 2 bf16 pairs; padded)
  int64_t x_stride;     // floats between input rows (the float32 copy for bf16)
  int64_t block_elems;  // weight elements of one block (K x 16, padded)
  int64_t y_stride;     // elements between output rows
};

// step(s) for s in [0, steps) of one block `w`, whose steps are one 64-byte line each (16
// float32 columns, or 16 bf16 pairs), with the prefetches its tile asks for: given `next`, one
// line from there into L2 every kPrefetchSteps steps; if `ahead` (a block's first tile, which
// streams it from memory), each step's line kAheadBytes ahead. The prefetches sit in loops of
// their own with no test inside: a test in the step loop made g++ keep the sums in memory (2x
// slower); tiles that prefetch nothing keep the plain loop (prefetching lines already in L2
// cost them 10% at 256-512 rows).
template <typename Step>
inline void walk(const Step& step, int64_t steps, const void* w, const char* next, bool ahead) {
  int64_t s = 0;
  if (next) {
    const char* line = next;
    for (; s + kPrefetchSteps <= steps; s += kPrefetchSteps, line += 64) {
      _mm_prefetch(line, _MM_HINT_T1);
#pragma GCC unroll 4
      for (int u = 0; u < kPrefetchSteps; ++u) step(s + u);
    }
  } else if (ahead) {
    for (; s < steps; ++s) {
      _mm_prefetch(static_cast<const char*>(w) + s * 64 + kAheadBytes, _MM_HINT_T0);
      step(s);
    }
  }
  for (; s < steps; ++s) step(s);
}

// Rows [0, MR) of x (float32) times one block w, into y at column `col` (a partial last block
// stores `n - col` columns). T is the weight's and the output's element type (uint16_t holds
// bf16: a step is an input pair, (k, k+1) side by side per column; float: one input). `bias`
// is float32 (widened once per call) or null. `next` and `ahead`: the prefetches of `walk`
// (blocks says which tiles ask for which).
template <typename T, int MR>
void tile(const float* x, const T* w, const float* bias, T* y, int64_t col, const Problem& p,
          const char* next, bool ahead) {
  __m256 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const int64_t steps = p.steps, stride = p.x_stride;
  if constexpr (std::is_same_v<T, float>) {
    const auto step = [&](int64_t s) {
      const __m256 w0 = _mm256_loadu_ps(w + s * kBlock);
      const __m256 w1 = _mm256_loadu_ps(w + s * kBlock + 8);
      for (int r = 0; r < MR; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * stride + s);
        lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
        hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
      }
    };
    walk(step, steps, w, next, ahead);
  } else {
    const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    const auto step = [&](int64_t s) {
      const float* xs = x + 2 * s;
      // the first eight columns' pairs, then the last eight's, each as the products of input
      // k+1 (odd) and of input k (even)
      const __m256i pairs0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + s * 32));
      const __m256i pairs1 =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + s * 32 + 16));
      const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(pairs0, high));
      const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(pairs1, high));
      const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(pairs0, 16));
      const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(pairs1, 16));
      for (int r = 0; r < MR; ++r) {
        const __m256 x1 = _mm256_broadcast_ss(xs + r * stride + 1);
        lo[r] = _mm256_fmadd_ps(x1, odd0, lo[r]);
        hi[r] = _mm256_fmadd_ps(x1, odd1, hi[r]);
        const __m256 x0 = _mm256_broadcast_ss(xs + r * stride);
        lo[r] = _mm256_fmadd_ps(x0, even0, lo[r]);
        hi[r] = _mm256_fmadd_ps(x0, even1, hi[r]);
      }
    };
    walk(step, steps, w, next, ahead);
  }
  // sums to memory with constant indices first: a loop of calls indexing the registers would
  // make g++ keep them in memory, stored at every step of the loop above
  alignas(32) float sums[MR][kBlock];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm256_store_ps(sums[r], lo[r]);
    _mm256_store_ps(sums[r] + 8, hi[r]);
  }
  const int64_t cols = std::min<int64_t>(kBlock, p.n - col);
  for (int r = 0; r < MR; ++r) {
    store_out(y + r * p.y_stride + col, sums[r], bias ? bias + col : nullptr, cols);
  }
}

// Blocks [first, last) for all m rows: each block's row tiles in turn, the rows split into
// tiles of near-equal height (32 float32 rows: 6, 6, 5, 5, 5, 5; bf16: 5, 5, 5, 5, 4, 4, 4),
// since a tile of one or two rows has too few independent sums to keep both FMA units busy.
// The first tile streams the block from memory, the others read it from L2; in float32, the
// second to fifth tiles prefetch the next block into L2, a quarter of its lines each, so that
// the next first tile does not wait on memory: 5-35% faster at 16-32 rows on the Zen 3 guest
// (RESULTS.md, session 32). The first tile also asks for its lines 1 KiB ahead, which the
// hardware prefetcher alone does not keep up with when few rows leave the loop waiting on
// memory: bf16 8-36% faster at 1-2 rows, fp32 up to 22% at 2-16 rows, the same at 32-512
// (session 33); the later tiles, reading from L2, do not (it cost bf16 2-4% at 512 rows).
template <typename T>
void blocks(const float* x, int64_t m, const T* w, const float* bias, T* y, int64_t first,
            int64_t last, const Problem& p) {
  constexpr int max_rows = std::is_same_v<T, float> ? kMaxRows : kMaxBf16Rows;
  const int64_t tiles = (m + max_rows - 1) / max_rows;
  // a float32 block is one 64-byte line per step; a tile prefetches a line every few steps
  const int64_t per_tile = p.steps / kPrefetchSteps;
  for (int64_t b = first; b < last; ++b) {
    const auto* wb = w + b * p.block_elems;
    const int64_t col = b * kBlock;
    for (int64_t t = 0, r = 0; t < tiles; ++t) {
      const int64_t rows = m / tiles + (t < m % tiles ? 1 : 0);
      const float* xr = x + r * p.x_stride;
      T* yr = y + r * p.y_stride;
      const char* next = std::is_same_v<T, float> && b + 1 < last && t > 0 &&
                                 (t - 1) * per_tile < p.steps
                             ? reinterpret_cast<const char*>(wb + p.block_elems) +
                                   (t - 1) * per_tile * 64
                             : nullptr;
      switch (rows) {
        case 1: tile<T, 1>(xr, wb, bias, yr, col, p, next, t == 0); break;
        case 2: tile<T, 2>(xr, wb, bias, yr, col, p, next, t == 0); break;
        case 3: tile<T, 3>(xr, wb, bias, yr, col, p, next, t == 0); break;
        case 4: tile<T, 4>(xr, wb, bias, yr, col, p, next, t == 0); break;
        case 5: tile<T, 5>(xr, wb, bias, yr, col, p, next, t == 0); break;
        default: tile<T, max_rows>(xr, wb, bias, yr, col, p, next, t == 0); break;
      }
      r += rows;
    }
  }
}

// T: the element type of x, the weight and y (one dtype, checked)
template <typename T>
void run(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
         at::Tensor& y, int64_t n) {
  // float32 inputs and bias: a bf16 call widens them once (exact), the loop then broadcasts
  // float32 values for both weight types; float32 rows are read where they are (a row-strided
  // view of a wider activation included)
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat).contiguous();
  const at::Tensor bf = bias.has_value() && bias->defined() ? bias->to(at::kFloat) : at::Tensor();
  const int64_t m = x.size(0), nblocks = w.size(0);
  const Problem p{n, w.size(1), xf.stride(0), w.stride(0), n};
  const float* xp = xf.data_ptr<float>();
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  // Threads split the output columns, whole blocks each; a small layer stays on one thread.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, m * p.block_elems));
  at::parallel_for(0, nblocks, grain, [&](int64_t first, int64_t last) {
    blocks(xp, m, wp, bp, yp, first, last, p);
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, int64_t n) {
  check_blocked_linear("linear", x, weight, n, kBlock);
  checked_bias("linear", x, bias, n);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  with_element_type(x, [&](auto element) { run<decltype(element)>(x, weight, bias, y, n); });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, int n) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, &linear);
}
