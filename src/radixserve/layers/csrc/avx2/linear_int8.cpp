// Weight-only int8 linear layers (W8A16) for CPUs with AVX2 and FMA but no AVX-512: the op
// `csrc/linear_int8.cpp` defines for AVX-512 CPUs, on the same layout (int8 [N/16][K/2][16][2],
// float32 scales [N/16][groups][16]) and with the same sums, bit for bit.
//
// As there, each activation row is quantised to int16 with one scale (max |x| / 32767), and a
// step multiplies a broadcast pair of inputs by a pair of int8 weights per column (widened to
// int16) into exact int32 sums: `vpmaddwd` and an add (AVX-VNNI's `vpdpwssd` where the CPU has
// it, the same sums). A block's 16 columns are two registers of 8. The int32 sums cover at most
// 128 input pairs and never cross a group; each is converted to float32, multiplied by its
// group's scale and added to the output's sum in input order; the row's scale and the bias come
// last and the sum is rounded once. So a row's result does not depend on its batch, and is the
// AVX-512 kernel's.
//
// Without a kernel, int8 weights on such CPUs were dequantised whole on every call and sent
// to torch's bf16 GEMM, which runs at 13-20 GFLOP/s there (benchmarks/RESULTS.md, session 33).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#include "../linear_int8_op.h"
#include "vec_math.h"

namespace {

using namespace radixserve_cpu;
using radixserve_cpu::avx2::load8;
using radixserve_cpu::avx2::round_to;
using radixserve_cpu::avx2::store8;

using int8::kBlock;
using int8::kChunk;
using int8::Problem;

constexpr int64_t kAhead = 1024;  // how far ahead each block's weights are asked for
constexpr float kInt16Max = 32767.0f;

// Tiles of MR rows by NB blocks keep 2 x MR x NB int32 sums, 2 x NB widened weights and one
// input pair in the 16 registers: decode batches of one or two rows take two blocks at a time
// (13 registers), larger ones four rows of one block (11: each widened weight feeds 4 rows).
// The float32 sums are touched once per 128 steps and may live in memory. Measured against
// 2 x 1 and 1 x 3 tiles at 1-2 rows (within 5%, or 1 x 3 up to 15% slower) and 2 x 2 and 3 x 1
// from 8 rows up (up to 30% slower at 128 rows) on a Zen 3 (RESULTS.md, session 33).
struct Small {
  static constexpr int kRows = 2, kPanel = 2;
};
struct Large {
  static constexpr int kRows = 4, kPanel = 1;
};

// sum + a.even * b.even + a.odd * b.odd per int32 lane of int16 pairs
inline __m256i dot_pairs(__m256i sum, __m256i a, __m256i b) {
#ifdef __AVXVNNI__
  return _mm256_dpwssd_avx_epi32(sum, a, b);
#else
  return _mm256_add_epi32(sum, _mm256_madd_epi16(a, b));
#endif
}

// Rows [first, last) of x (k values each) -> int16 rows of xq_stride values (0 past k) and one
// scale per row, x ~ xq * scale: csrc/int16_rows.h's quantize_rows, 8 lanes at a time.
template <typename T>
void quantize_rows(const T* x, int64_t x_stride, int64_t k, int16_t* xq, int64_t xq_stride,
                   float* row_scale, int64_t first, int64_t last) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t r = first; r < last; ++r) {
    const T* xr = x + r * x_stride;
    __m256 top = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
      top = _mm256_max_ps(top, _mm256_and_ps(load8(xr + i, k - i), magnitude));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    const float max = *std::max_element(lanes, lanes + 8);
    const float scale = max > 0 ? max / kInt16Max : 1.0f;
    const __m256 inv = _mm256_set1_ps(max > 0 ? kInt16Max / max : 0.0f);
    int16_t* qr = xq + r * xq_stride;
    for (int64_t i = 0; i < xq_stride; i += 8) {
      const __m256 v = load8(xr + i, std::max<int64_t>(0, k - i));
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v, inv));  // to nearest, ties to even
      // saturated to int16, packed per 128-bit lane, then the two lanes' halves side by side
      const __m128i packed =
          _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packs_epi32(q, q), 0b1000));
      if (xq_stride - i >= 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i), packed);
      } else {
        int16_t buf[8];
        _mm_storeu_si128(reinterpret_cast<__m128i*>(buf), packed);
        std::memcpy(qr + i, buf, (xq_stride - i) * sizeof(int16_t));
      }
    }
    row_scale[r] = scale;
  }
}

template <typename T, int MR, int NB>
void tile(const int16_t* xq, const float* row_scale, const int8_t* w, const float* scales,
          const T* bias, T* y, int64_t col, const Problem& p) {
  __m256 acc[MR][NB][2];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t group_end = (g + 1) * p.group_steps;
    for (int64_t first = g * p.group_steps; first < group_end; first += kChunk) {
      const int64_t last = std::min(first + kChunk, group_end);
      __m256i sum[MR][NB][2];
      for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NB; ++b) sum[r][b][0] = sum[r][b][1] = _mm256_setzero_si256();
      // a step is 32 bytes of each block: columns 0-7's pairs, then 8-15's
      const auto step = [&](int64_t s) {
        __m256i wv[NB][2];
        for (int b = 0; b < NB; ++b) {
          const int8_t* ws = w + b * p.block_bytes + s * 2 * kBlock;
          wv[b][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws)));
          wv[b][1] =
              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws + 16)));
        }
        for (int r = 0; r < MR; ++r) {
          const __m256i pair =
              _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + r * p.x_stride + 2 * s));
          for (int b = 0; b < NB; ++b) {
            sum[r][b][0] = dot_pairs(sum[r][b][0], pair, wv[b][0]);
            sum[r][b][1] = dot_pairs(sum[r][b][1], pair, wv[b][1]);
          }
        }
      };
      // two steps per cache line of each block: one prefetch per line, outside any test in
      // the step (a test there can make g++ keep the sums in memory)
      int64_t s = first;
      for (; s + 2 <= last; s += 2) {
        for (int b = 0; b < NB; ++b) {
          _mm_prefetch(reinterpret_cast<const char*>(w + b * p.block_bytes + s * 2 * kBlock) +
                           kAhead,
                       _MM_HINT_T0);
        }
        step(s);
        step(s + 1);
      }
      if (s < last) step(s);
      for (int b = 0; b < NB; ++b) {
        const float* sc = scales + (b * p.groups + g) * kBlock;
        const __m256 scale0 = _mm256_loadu_ps(sc), scale1 = _mm256_loadu_ps(sc + 8);
        for (int r = 0; r < MR; ++r) {
          acc[r][b][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][b][0]), scale0, acc[r][b][0]);
          acc[r][b][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][b][1]), scale1, acc[r][b][1]);
        }
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t c = col + b * kBlock, left = p.n - c;
    const __m256 add0 = bias ? load8(bias + c, left) : _mm256_setzero_ps();
    const __m256 add1 = bias && left > 8 ? load8(bias + c + 8, left - 8) : _mm256_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const __m256 scale = _mm256_set1_ps(row_scale[r]);
      T* yr = y + r * p.y_stride + c;
      store8(yr, round_to<T>(_mm256_fmadd_ps(acc[r][b][0], scale, add0)), left);
      if (left > 8) {
        store8(yr + 8, round_to<T>(_mm256_fmadd_ps(acc[r][b][1], scale, add1)), left - 8);
      }
    }
  }
}

// What csrc/linear_int8_op.h walks the rows and blocks with.
struct Kernel {
  using Small = ::Small;
  using Large = ::Large;
  template <typename T, int MR, int NB, typename... Args>
  static void tile(const Args&... args) {
    ::tile<T, MR, NB>(args...);
  }
  template <typename... Args>
  static void quantize_rows(const Args&... args) {
    ::quantize_rows(args...);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("linear_int8(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int n) -> Tensor");
  m.impl("linear_int8", c10::DispatchKey::CPU, &radixserve_cpu::int8::linear_int8<Kernel>);
}
