// Weight-only int8 linear layers (W8A16) for AVX-512 CPUs: int8 weights with a float32 scale per
// output column and group of inputs, bf16 or float32 activations.
//
// A decode step reads every weight once, so int8 weights halve the bytes of bf16 ones; the
// kernel must then cost less than the memory time of those bytes. Widening int8 to bf16 or
// float32 takes five instructions per 32 weights, which is slower than memory on two cores.
// Instead the activations stay 16-bit integers: each row is quantised to int16 with one scale
// (max |x| / 32767), and AVX512-VNNI `vpdpwssd` multiplies 32 weights (widened to int16 by one
// `vpmovsxbw`) by a broadcast pair of inputs into 16 exact int32 sums. Two instructions per 32
// weights per row. The activation rounding (at most max |x| / 65534 per value) is finer than
// bf16's rounding of the row's large values; the weight's own quantisation dominates the error.
//
// Layout: the float kernels' blocking (csrc/linear.cpp), one byte per weight,
// [N/16][K/2][16][2] int8 (K padded to even), and the scales as [N/16][groups][16] float32.
// The int32 sums cover at most 128 input pairs (so they cannot overflow: 256 x 127 x 32767 <
// 2^31) and never cross a group; each is converted to float32, multiplied by its group's scale
// and added to the output's sum, in input order. The row's scale and the bias come last and the
// sum is rounded once. As in csrc/linear.cpp, a row's result does not depend on its batch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "int16_rows.h"
#include "linear_args.h"
#include "vec_math.h"

namespace {

using namespace radixserve_cpu;

constexpr int64_t kBlock = 16;
// Tiles: decode batches of one or two rows take 6 blocks at a time (more weight streams in flight
// for the same instructions); larger batches 4 rows by 3 blocks (each widened weight feeds more
// rows). Sums of both fit the 32 registers: 2 x MR x NB + NB weights + 1 input.
struct Small {
  static constexpr int kRows = 2, kPanel = 6;
};
struct Large {
  static constexpr int kRows = 4, kPanel = 3;
};
constexpr int64_t kChunk = 128;  // input pairs per int32 sum
// Each block is a stream of its own, more at once than the hardware prefetcher follows: every
// block's weights 1 KiB ahead are asked for (a batch-1 step streamed 10% faster from memory).
constexpr int64_t kAhead = 1024;

struct Problem {
  int64_t n, groups, group_steps;  // output columns; groups; input pairs per group
  int64_t x_stride, y_stride;      // int16 inputs between rows of xq; outputs between rows
  int64_t block_bytes;             // bytes of one weight block (pairs * 32)
};

template <typename T, int MR, int NB>
void tile(const int16_t* xq, const float* row_scale, const int8_t* w, const float* scales,
          const T* bias, T* y, int64_t col, const Problem& p) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 scale[NB];
    for (int b = 0; b < NB; ++b) scale[b] = _mm512_loadu_ps(scales + (b * p.groups + g) * kBlock);
    const int64_t group_end = (g + 1) * p.group_steps;
    for (int64_t first = g * p.group_steps; first < group_end; first += kChunk) {
      const int64_t last = std::min(first + kChunk, group_end);
      __m512i sum[MR][NB];
      for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NB; ++b) sum[r][b] = _mm512_setzero_si512();
      for (int64_t s = first; s < last; ++s) {
        __m512i wv[NB];
        if (s % 2 == 0) {  // a new cache line of each block's stream every other step
          for (int b = 0; b < NB; ++b) prefetch(w + b * p.block_bytes + s * 2 * kBlock + kAhead);
        }
        for (int b = 0; b < NB; ++b) {
          const int8_t* ws = w + b * p.block_bytes + s * 2 * kBlock;
          wv[b] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws)));
        }
        for (int r = 0; r < MR; ++r) {
          const __m512i pair =
              _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + r * p.x_stride + 2 * s));
          for (int b = 0; b < NB; ++b) sum[r][b] = dot_pairs(sum[r][b], pair, wv[b]);
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NB; ++b)
          acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][b]), scale[b], acc[r][b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t c = col + b * kBlock;
    const __mmask16 m = lanes(p.n - c);
    const __m512 add = bias ? load16(bias + c, m) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const __m512 v = _mm512_fmadd_ps(acc[r][b], _mm512_set1_ps(row_scale[r]), add);
      store16(y + r * p.y_stride + c, round_to<T>(v), m);
    }
  }
}

template <typename T, typename Tiles, int NB>
void row_tiles(const int16_t* xq, const float* row_scale, int64_t m, const int8_t* w,
               const float* scales, const T* bias, T* y, int64_t col, const Problem& p) {
  int64_t r = 0;
  constexpr int kMaxRows = Tiles::kRows;
  for (; r + kMaxRows <= m; r += kMaxRows) {
    tile<T, kMaxRows, NB>(xq + r * p.x_stride, row_scale + r, w, scales, bias,
                          y + r * p.y_stride, col, p);
  }
  const int16_t* xr = xq + r * p.x_stride;
  const float* sr = row_scale + r;
  T* yr = y + r * p.y_stride;
  switch (m - r) {
    case 1: tile<T, 1, NB>(xr, sr, w, scales, bias, yr, col, p); break;
    case 2: tile<T, 2, NB>(xr, sr, w, scales, bias, yr, col, p); break;
    case 3: tile<T, 3, NB>(xr, sr, w, scales, bias, yr, col, p); break;
    default: break;
  }
}

// The last `count` (< Tiles::kPanel) blocks of a thread's range.
template <typename T, typename Tiles, int NB>
void tail_blocks(int64_t count, const int16_t* xq, const float* row_scale, int64_t m,
                 const int8_t* w, const float* scales, const T* bias, T* y, int64_t col,
                 const Problem& p) {
  if constexpr (NB < Tiles::kPanel) {
    if (count == NB) {
      row_tiles<T, Tiles, NB>(xq, row_scale, m, w, scales, bias, y, col, p);
    } else {
      tail_blocks<T, Tiles, NB + 1>(count, xq, row_scale, m, w, scales, bias, y, col, p);
    }
  }
}

template <typename T, typename Tiles>
void panels(const int16_t* xq, const float* row_scale, int64_t m, const int8_t* w,
            const float* scales, const T* bias, T* y, int64_t first, int64_t last,
            const Problem& p) {
  const int64_t scale_block = p.groups * kBlock;
  int64_t b = first;
  constexpr int kPanel = Tiles::kPanel;
  for (; b + kPanel <= last; b += kPanel) {
    row_tiles<T, Tiles, kPanel>(xq, row_scale, m, w + b * p.block_bytes,
                                scales + b * scale_block, bias, y, b * kBlock, p);
  }
  tail_blocks<T, Tiles, 1>(last - b, xq, row_scale, m, w + b * p.block_bytes,
                           scales + b * scale_block, bias, y, b * kBlock, p);
}

// x: [M, K] bf16 or float32 (rows contiguous, K at most the weight's padded input size);
// weight: int8 [N/16, K/2, 16, 2]; scales: float32 [N/16, groups, 16]; bias: [n] of x's dtype or
// None. Returns [M, n] in x's dtype.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  check_activations("linear_int8", x);
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 4 && weight.size(2) == kBlock &&
                  weight.size(3) == 2 && weight.is_contiguous(),
              "linear_int8: the weight must be int8 blocked [N/16, K/2, 16, 2]");
  const int64_t blocks = weight.size(0), pairs = weight.size(1), k = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (k + 1) / 2 == pairs,
              "linear_int8: x must be [M, K] with contiguous rows and K = ", 2 * pairs,
              " (or one less), got ", x.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 &&
                  scales.size(0) == blocks && scales.size(2) == kBlock &&
                  scales.is_contiguous() && scales.size(1) >= 1 && pairs % scales.size(1) == 0,
              "linear_int8: scales must be float32 [N/16, groups, 16] with the groups dividing "
              "the input, got ", scales.sizes());
  TORCH_CHECK(n > (blocks - 1) * kBlock && n <= blocks * kBlock, "linear_int8: n = ", n,
              " does not fit the weight's ", blocks, " blocks");
  const void* bias_data = checked_bias("linear_int8", x, bias, n);
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const int64_t groups = scales.size(1);
  at::Tensor xq = at::empty({m, 2 * pairs}, x.options().dtype(at::kShort));
  at::Tensor row_scale = at::empty({m}, x.options().dtype(at::kFloat));
  const Problem p{n, groups, pairs / groups, 2 * pairs, n, weight.stride(0)};
  const auto* wp = weight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  int16_t* xqp = xq.data_ptr<int16_t>();
  float* rsp = row_scale.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, m * p.block_bytes));
  with_element_type(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    const T* bp = static_cast<const T*>(bias_data);
    T* yp = reinterpret_cast<T*>(y.data_ptr());
    at::parallel_for(0, m, 16, [&](int64_t first, int64_t last) {
      quantize_rows(xp, x.stride(0), k, xqp, 2 * pairs, rsp, first, last);
    });
    const auto split = [&](auto tiles) {
      using Tiles = decltype(tiles);
      const int64_t panel = Tiles::kPanel, total = (blocks + panel - 1) / panel;
      at::parallel_for(0, total, grain, [&](int64_t first, int64_t last) {
        panels<T, Tiles>(xqp, rsp, m, wp, sp, bp, yp, first * panel,
                         std::min(last * panel, blocks), p);
      });
    };
    if (m <= Small::kRows) {
      split(Small{});
    } else {
      split(Large{});
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("linear_int8(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int n) -> Tensor");
  m.impl("linear_int8", c10::DispatchKey::CPU, &linear_int8);
}
