// Batch-1 bf16 linear layer (GEMV) for CPUs with AVX512-BF16, streaming the weight at memory speed.
//
// Decoding one request reads every weight once per token, so its speed is the speed at which the
// weights stream from memory. The weight is stored blocked as [N/16][K/2][16][2]: one 64-byte
// load holds input pair (k, k+1) of 16 output rows, `vdpbf16ps` multiplies it by the broadcast
// input pair and adds into 16 float32 sums, and each thread reads its blocks front to back. No
// horizontal sums, no reordering at run time. Products and sums are float32 (bf16 x bf16 is exact
// in float32); the output is rounded to bf16 once, after the bias.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kRows = 16;     // output rows per block: one register of float32 sums
constexpr int64_t kAhead = 1024;  // bytes of the block prefetched ahead of the loads

__m512 load_bias(const c10::BFloat16* bias) {
  // bf16 -> float32 is a 16-bit shift of each value
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

void gemv_blocks(const uint32_t* x_pairs, const uint16_t* weight, const c10::BFloat16* bias,
                 uint16_t* out, int64_t pairs, int64_t first, int64_t last) {
  for (int64_t b = first; b < last; ++b) {
    const uint16_t* block = weight + b * pairs * 2 * kRows;
    const char* ahead = reinterpret_cast<const char*>(block) + kAhead;
    // Four independent sums hide the latency of vdpbf16ps.
    __m512 acc[4] = {bias ? load_bias(bias + b * kRows) : _mm512_setzero_ps(),
                     _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t p = 0;
    for (; p + 4 <= pairs; p += 4) {
      _mm_prefetch(ahead + p * 64, _MM_HINT_T0);
      _mm_prefetch(ahead + p * 64 + 128, _MM_HINT_T0);
      for (int i = 0; i < 4; ++i) {
        __m512i w = _mm512_loadu_si512(block + (p + i) * 2 * kRows);
        __m512i x = _mm512_set1_epi32(static_cast<int32_t>(x_pairs[p + i]));
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)x, (__m512bh)w);
      }
    }
    for (; p < pairs; ++p) {
      __m512i w = _mm512_loadu_si512(block + p * 2 * kRows);
      __m512i x = _mm512_set1_epi32(static_cast<int32_t>(x_pairs[p]));
      acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)x, (__m512bh)w);
    }
    __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    // round to nearest even, as c10::BFloat16 does
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kRows),
                        (__m256i)_mm512_cvtneps_pbh(sum));
  }
}

// x: [1, K] bf16 contiguous; weight: blocked [N/16, K/2, 16, 2] bf16; bias: [N] bf16 or None.
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "gemv_bf16 takes bfloat16 inputs");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "x must be [1, K], contiguous");
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == kRows && weight.size(3) == 2 &&
                  weight.is_contiguous(),
              "weight must be blocked [N/16, K/2, 16, 2]");
  TORCH_CHECK(weight.size(1) * 2 == x.size(1), "x has ", x.size(1), " features, the weight ",
              weight.size(1) * 2);
  const int64_t blocks = weight.size(0), pairs = weight.size(1), n = blocks * kRows;
  const c10::BFloat16* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n &&
                    bias->is_contiguous(),
                "bias must be [N] bfloat16, contiguous");
    bias_ptr = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor out = at::empty({1, n}, x.options());
  const auto* x_pairs = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* y = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, blocks, 4, [&](int64_t first, int64_t last) {
    gemv_blocks(x_pairs, w, bias_ptr, y, pairs, first, last);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu, m) {
  m.def("gemv_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("gemv_bf16", c10::DispatchKey::CPU, &gemv_bf16);
}
