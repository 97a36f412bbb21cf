// What the int8 linear kernels share (csrc/linear_int8.cpp for AVX-512 CPUs,
// csrc/avx2/linear_int8.cpp for AVX2 ones): the op's checks and messages, its output and the
// activations' int16 copy, the threads, and the walk over row tiles and panels of blocks. A
// build defines a kernel type K with its tile shapes (`K::Small` for batches of up to
// `Small::kRows` rows, `K::Large` above: `kRows` rows by `kPanel` blocks), its
// `K::tile<T, MR, NB>` (MR rows by NB blocks) and its `K::quantize_rows<T>`.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "linear_args.h"

namespace radixserve_cpu::int8 {

constexpr int64_t kBlock = 16;
// Input pairs per int32 sum: at most 256 x 127 x 32767 < 2^31, so a sum cannot overflow.
constexpr int64_t kChunk = 128;

struct Problem {
  int64_t n, groups, group_steps;  // output columns; groups; input pairs per group
  int64_t x_stride, y_stride;      // int16 inputs between rows of xq; outputs between rows
  int64_t block_bytes;             // bytes of one weight block (pairs * 32)
};

template <typename K, typename T, typename Tiles, int NB>
void row_tiles(const int16_t* xq, const float* row_scale, int64_t m, const int8_t* w,
               const float* scales, const T* bias, T* y, int64_t col, const Problem& p) {
  int64_t r = 0;
  constexpr int kMaxRows = Tiles::kRows;
  for (; r + kMaxRows <= m; r += kMaxRows) {
    K::template tile<T, kMaxRows, NB>(xq + r * p.x_stride, row_scale + r, w, scales, bias,
                                      y + r * p.y_stride, col, p);
  }
  const int16_t* xr = xq + r * p.x_stride;
  const float* sr = row_scale + r;
  T* yr = y + r * p.y_stride;
  switch (m - r) {
    case 1: K::template tile<T, 1, NB>(xr, sr, w, scales, bias, yr, col, p); break;
    case 2: K::template tile<T, 2, NB>(xr, sr, w, scales, bias, yr, col, p); break;
    case 3: K::template tile<T, 3, NB>(xr, sr, w, scales, bias, yr, col, p); break;
    default: break;
  }
}

// The last `count` (< Tiles::kPanel) blocks of a thread's range.
template <typename K, typename T, typename Tiles, int NB>
void tail_blocks(int64_t count, const int16_t* xq, const float* row_scale, int64_t m,
                 const int8_t* w, const float* scales, const T* bias, T* y, int64_t col,
                 const Problem& p) {
  if constexpr (NB < Tiles::kPanel) {
    if (count == NB) {
      row_tiles<K, T, Tiles, NB>(xq, row_scale, m, w, scales, bias, y, col, p);
    } else {
      tail_blocks<K, T, Tiles, NB + 1>(count, xq, row_scale, m, w, scales, bias, y, col, p);
    }
  }
}

template <typename K, typename T, typename Tiles>
void panels(const int16_t* xq, const float* row_scale, int64_t m, const int8_t* w,
            const float* scales, const T* bias, T* y, int64_t first, int64_t last,
            const Problem& p) {
  const int64_t scale_block = p.groups * kBlock;
  int64_t b = first;
  constexpr int kPanel = Tiles::kPanel;
  for (; b + kPanel <= last; b += kPanel) {
    row_tiles<K, T, Tiles, kPanel>(xq, row_scale, m, w + b * p.block_bytes,
                                   scales + b * scale_block, bias, y, b * kBlock, p);
  }
  tail_blocks<K, T, Tiles, 1>(last - b, xq, row_scale, m, w + b * p.block_bytes,
                              scales + b * scale_block, bias, y, b * kBlock, p);
}

// x: [M, K] bf16 or float32 (rows contiguous, K at most the weight's padded input size);
// weight: int8 [N/16, K/2, 16, 2]; scales: float32 [N/16, groups, 16]; bias: [n] of x's dtype or
// None. Returns [M, n] in x's dtype.
template <typename K>
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
      K::quantize_rows(xp, x.stride(0), k, xqp, 2 * pairs, rsp, first, last);
    });
    const auto split = [&](auto tiles) {
      using Tiles = decltype(tiles);
      const int64_t panel = Tiles::kPanel, total = (blocks + panel - 1) / panel;
      at::parallel_for(0, total, grain, [&](int64_t first, int64_t last) {
        panels<K, T, Tiles>(xqp, rsp, m, wp, sp, bp, yp, first * panel,
                            std::min(last * panel, blocks), p);
      });
    };
    if (m <= K::Small::kRows) {
      split(typename K::Small{});
    } else {
      split(typename K::Large{});
    }
  });
  return y;
}

}  // namespace radixserve_cpu::int8
