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
#include "linear_int8_op.h"
#include "vec_math.h"

namespace {

using namespace radixserve_cpu;

using int8::kBlock;
using int8::kChunk;
using int8::Problem;

// Tiles: decode batches of one or two rows take 6 blocks at a time (more weight streams in flight
// for the same instructions); larger batches 4 rows by 3 blocks (each widened weight feeds more
// rows). Sums of both fit the 32 registers: 2 x MR x NB + NB weights + 1 input.
struct Small {
  static constexpr int kRows = 2, kPanel = 6;
};
struct Large {
  static constexpr int kRows = 4, kPanel = 3;
};
// Each block is a stream of its own, more at once than the hardware prefetcher follows: every
// block's weights 1 KiB ahead are asked for (a batch-1 step streamed 10% faster from memory).
constexpr int64_t kAhead = 1024;

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
    radixserve_cpu::quantize_rows(args...);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("linear_int8(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int n) -> Tensor");
  m.impl("linear_int8", c10::DispatchKey::CPU, &radixserve_cpu::int8::linear_int8<Kernel>);
}
