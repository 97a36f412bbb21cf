// Weight-only 4-bit linear layers (W4A16) for AVX-512 CPUs: unsigned 4-bit codes q in [0, 15]
// with, per output column and group of 32 inputs, an fp16 scale d and an fp16 offset m, so
// w = d * q + m: the arithmetic of GGUF's Q4_1 blocks (Q4_0 is the case m = -8d).
//
// Batch-1 decode reads every weight once, and at 4.5 + 1 bits a weight (codes, then scale and
// offset) it reads 0.69 of the bytes of the int8 kernel (csrc/linear_int8.cpp) and 0.34 of
// bf16's. The arithmetic is that kernel's: each activation row is quantised to int16 with one
// scale s (max |x| / 32767), and AVX512-VNNI `vpdpwssd` sums 32 code-times-input products into
// 16 exact int32 lanes. The codes arrive as bytes holding two of them: one 256-bit load widened
// to 32 int16 lanes (`vpmovzxbw`) gives the low nibbles of one input pair with an `and`, and the
// high nibbles of the next pair with a shift, so two pairs cost four instructions besides the
// two dot products. Per group, the int32 sums become float32: d * sum(q * xq) + m * sum(xq),
// where sum(xq) is the row's exact integer sum over the group's inputs (computed once per row);
// the row's scale and the bias come last and the sum is rounded once. A row's result does not
// depend on its batch.
//
// Layout: [N/16][K/4][32] bytes (K padded to a multiple of 32 with zero codes): byte j of the
// c-th 32 bytes of a block holds, for column j / 2 and input parity e = j % 2, the code of input
// 4c + e in its low nibble and of input 4c + 2 + e in its high nibble. Scales and offsets are
// fp16 [N/16][K/32][16] each.

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
constexpr int64_t kGroup = 32;                  // inputs per scale and offset
constexpr int64_t kChunkBytes = 32;             // four inputs of a block's 16 columns
constexpr int64_t kGroupChunks = kGroup / 4;    // 8 chunks per group
constexpr int64_t kGroupBytes = kGroupChunks * kChunkBytes;  // a block's codes of one group
constexpr int64_t kPrefetchGroups = 2;         // how far ahead each block's stream is fetched

// Row and block tiles: sums and accumulators (2 x rows x blocks registers) plus the broadcast
// input pairs (2 x rows) stay within the 32 registers.
struct Single {
  static constexpr int kRows = 1, kPanel = 8;
};
struct Small {
  static constexpr int kRows = 2, kPanel = 4;
};
struct Large {
  static constexpr int kRows = 4, kPanel = 2;
};

struct Problem {
  int64_t n, groups;            // output columns; groups of 32 inputs (padded input / 32)
  int64_t x_stride, y_stride;   // int16 inputs between rows of xq; outputs between rows
  int64_t block_bytes;          // bytes of one block's codes (padded input * 8)
};

// Per row and group of 32 inputs, the exact sum of the row's int16 values (as float32: at most
// 32 x 32767, exact): the offsets' share of the products.
void group_sums_of(const int16_t* xq, int64_t xq_stride, int64_t groups, float* group_sums,
                   int64_t first, int64_t last) {
  const __m512i ones = _mm512_set1_epi16(1);
  for (int64_t r = first; r < last; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i v = _mm512_loadu_si512(xq + r * xq_stride + g * kGroup);
      group_sums[r * groups + g] = float(_mm512_reduce_add_epi32(_mm512_madd_epi16(v, ones)));
    }
  }
}

inline __m512 load_fp16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename T, int MR, int NB>
void tile(const int16_t* xq, const float* row_scale, const float* group_sums, const uint8_t* w,
          const uint16_t* scales, const uint16_t* offsets, const T* bias, T* y, int64_t col,
          const Problem& p) {
  const __m512i low = _mm512_set1_epi16(0x0F);
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512i sum[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) sum[r][b] = _mm512_setzero_si512();
    // One stream of codes, scales and offsets per block: more than the hardware prefetcher
    // follows at once, so each block's next-but-one group is asked for now (a batch-1 step
    // streamed 18% faster from memory; prefetching past a block's end is harmless).
    for (int b = 0; b < NB; ++b) {
      const uint8_t* ahead = w + b * p.block_bytes + (g + kPrefetchGroups) * kGroupBytes;
      for (int line = 0; line < kGroupBytes; line += 64) prefetch(ahead + line);
      const int64_t at = (b * p.groups + g + kPrefetchGroups) * kBlock;
      prefetch(scales + at);
      prefetch(offsets + at);
    }
    for (int64_t c = g * kGroupChunks; c < (g + 1) * kGroupChunks; ++c) {
      __m512i first[MR], second[MR];  // input pairs 2c and 2c + 1 of each row
      for (int r = 0; r < MR; ++r) {
        const int16_t* xr = xq + r * p.x_stride + 4 * c;
        first[r] = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr));
        second[r] = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 2));
      }
      for (int b = 0; b < NB; ++b) {
        const uint8_t* wc = w + b * p.block_bytes + c * kChunkBytes;
        const __m512i codes =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc)));
        const __m512i lo = _mm512_and_si512(codes, low);
        for (int r = 0; r < MR; ++r) sum[r][b] = dot_pairs(sum[r][b], first[r], lo);
        const __m512i hi = _mm512_srli_epi16(codes, 4);
        for (int r = 0; r < MR; ++r) sum[r][b] = dot_pairs(sum[r][b], second[r], hi);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const int64_t at = (b * p.groups + g) * kBlock;
      const __m512 d = load_fp16(scales + at), m = load_fp16(offsets + at);
      for (int r = 0; r < MR; ++r) {
        acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][b]), d, acc[r][b]);
        acc[r][b] = _mm512_fmadd_ps(m, _mm512_set1_ps(group_sums[r * p.groups + g]), acc[r][b]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t c = col + b * kBlock;
    const __mmask16 mk = lanes(p.n - c);
    const __m512 add = bias ? load16(bias + c, mk) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const __m512 v = _mm512_fmadd_ps(acc[r][b], _mm512_set1_ps(row_scale[r]), add);
      store16(y + r * p.y_stride + c, round_to<T>(v), mk);
    }
  }
}

struct Rows {
  const int16_t* xq;
  const float* row_scale;
  const float* group_sums;
  int64_t m;
};

template <typename T, typename Tiles, int NB>
void row_tiles(const Rows& rows, const uint8_t* w, const uint16_t* scales,
               const uint16_t* offsets, const T* bias, T* y, int64_t col, const Problem& p) {
  constexpr int kMaxRows = Tiles::kRows;
  int64_t r = 0;
  for (; r + kMaxRows <= rows.m; r += kMaxRows) {
    tile<T, kMaxRows, NB>(rows.xq + r * p.x_stride, rows.row_scale + r,
                          rows.group_sums + r * p.groups, w, scales, offsets, bias,
                          y + r * p.y_stride, col, p);
  }
  const int16_t* xr = rows.xq + r * p.x_stride;
  const float* sr = rows.row_scale + r;
  const float* gr = rows.group_sums + r * p.groups;
  T* yr = y + r * p.y_stride;
  switch (rows.m - r) {
    case 1: tile<T, 1, NB>(xr, sr, gr, w, scales, offsets, bias, yr, col, p); break;
    case 2: tile<T, 2, NB>(xr, sr, gr, w, scales, offsets, bias, yr, col, p); break;
    case 3: tile<T, 3, NB>(xr, sr, gr, w, scales, offsets, bias, yr, col, p); break;
    default: break;
  }
}

// Blocks [first, last) of the weight, kPanel at a time, then the rest in one narrower panel.
template <typename T, typename Tiles, int NB = Tiles::kPanel>
void blocks_from(const Rows& rows, const uint8_t* w, const uint16_t* scales,
                 const uint16_t* offsets, const T* bias, T* y, int64_t first, int64_t last,
                 const Problem& p) {
  const int64_t scale_block = p.groups * kBlock;
  int64_t b = first;
  for (; b + NB <= last; b += NB) {
    row_tiles<T, Tiles, NB>(rows, w + b * p.block_bytes, scales + b * scale_block,
                            offsets + b * scale_block, bias, y, b * kBlock, p);
  }
  if constexpr (NB > 1) {
    if (b < last) blocks_from<T, Tiles, NB - 1>(rows, w, scales, offsets, bias, y, b, last, p);
  }
}

// x: [M, K] bf16 or float32 (rows contiguous, K at most the weight's padded input size);
// codes: uint8 [N/16, K/4, 32]; scales, offsets: fp16 (as int16) [N/16, K/32, 16]; bias: [n] of
// x's dtype or None. Returns [M, n] in x's dtype.
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                       int64_t n) {
  check_activations("linear_int4", x);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 &&
                  codes.size(2) == kChunkBytes && codes.size(1) % kGroupChunks == 0 &&
                  codes.is_contiguous(),
              "linear_int4: the codes must be uint8 [N/16, K/4, 32] with K a multiple of 32");
  const int64_t blocks = codes.size(0), padded_k = 4 * codes.size(1), k = x.size(1);
  const int64_t groups = padded_k / kGroup;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && k <= padded_k && k > padded_k - kGroup,
              "linear_int4: x must be [M, K] with contiguous rows and K within the weight's ",
              padded_k, " inputs, got ", x.sizes());
  for (const at::Tensor* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 3 && t->size(0) == blocks &&
                    t->size(1) == groups && t->size(2) == kBlock && t->is_contiguous(),
                "linear_int4: scales and offsets must be fp16 [N/16, K/32, 16]");
  }
  TORCH_CHECK(n > (blocks - 1) * kBlock && n <= blocks * kBlock, "linear_int4: n = ", n,
              " does not fit the weight's ", blocks, " blocks");
  const void* bias_data = checked_bias("linear_int4", x, bias, n);
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  at::Tensor xq = at::empty({m, padded_k}, x.options().dtype(at::kShort));
  at::Tensor row_scale = at::empty({m}, x.options().dtype(at::kFloat));
  at::Tensor group_sums = at::empty({m, groups}, x.options().dtype(at::kFloat));
  const Problem p{n, groups, padded_k, n, codes.stride(0)};
  const auto* wp = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const auto* op = reinterpret_cast<const uint16_t*>(offsets.data_ptr());
  const Rows rows{xq.data_ptr<int16_t>(), row_scale.data_ptr<float>(),
                  group_sums.data_ptr<float>(), m};
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, m * p.block_bytes));
  with_element_type(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    const T* bp = static_cast<const T*>(bias_data);
    T* yp = reinterpret_cast<T*>(y.data_ptr());
    at::parallel_for(0, m, 16, [&](int64_t first, int64_t last) {
      quantize_rows(xp, x.stride(0), k, xq.data_ptr<int16_t>(), padded_k,
                    row_scale.data_ptr<float>(), first, last);
      group_sums_of(xq.data_ptr<int16_t>(), padded_k, groups, group_sums.data_ptr<float>(),
                    first, last);
    });
    const auto split = [&](auto tiles) {
      using Tiles = decltype(tiles);
      // Threads split the blocks evenly; each runs its share a panel at a time.
      at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
        blocks_from<T, Tiles>(rows, wp, sp, op, bp, yp, first, last, p);
      });
    };
    if (m == 1) {
      split(Single{});
    } else if (m <= Small::kRows) {
      split(Small{});
    } else {
      split(Large{});
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("linear_int4(Tensor x, Tensor codes, Tensor scales, Tensor offsets, Tensor? bias, "
        "int n) -> Tensor");
  m.impl("linear_int4", c10::DispatchKey::CPU, &linear_int4);
}
