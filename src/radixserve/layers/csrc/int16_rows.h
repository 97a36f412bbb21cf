// What the weight-only integer kernels (csrc/linear_int8.cpp, csrc/linear_int4.cpp) share: the
// activations quantised to int16, one scale per row, and the exact int16 pair products they
// sum with.
//
// An int16 row keeps about 15 bits of each value relative to the row's largest (the rounding is
// at most max |x| / 65534), finer than bf16's 8 for the row's large values, so the weights'
// own quantisation dominates the error; and AVX512-VNNI's `vpdpwssd` then sums 32 products of
// 16-bit integers exactly per instruction, where a float kernel would widen every weight.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "vec_math.h"

namespace radixserve_cpu {

constexpr float kInt16Max = 32767.0f;

// The weight streams of these kernels are more than the hardware prefetcher follows at once:
// they ask for the bytes they will read next themselves.
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// sum + a.even * b.even + a.odd * b.odd per int32 lane of int16 pairs: AVX512-VNNI's
// `vpdpwssd`, or the same exact sum from `vpmaddwd` and an add on CPUs without VNNI
inline __m512i dot_pairs(__m512i sum, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(sum, a, b);
#else
  return _mm512_add_epi32(sum, _mm512_madd_epi16(a, b));
#endif
}

// Rows [first, last) of x (bf16 or float32, k values each) -> int16 rows of xq_stride values
// (the padding past k becomes 0) and one scale per row: x ≈ xq * scale.
template <typename T>
void quantize_rows(const T* x, int64_t x_stride, int64_t k, int16_t* xq, int64_t xq_stride,
                   float* row_scale, int64_t first, int64_t last) {
  for (int64_t r = first; r < last; ++r) {
    const T* xr = x + r * x_stride;
    __m512 top = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += kLanes) {
      top = _mm512_max_ps(top, _mm512_abs_ps(load16(xr + i, lanes(k - i))));
    }
    const float max = _mm512_reduce_max_ps(top);
    const float scale = max > 0 ? max / kInt16Max : 1.0f;
    const __m512 inv = _mm512_set1_ps(max > 0 ? kInt16Max / max : 0.0f);
    int16_t* qr = xq + r * xq_stride;
    for (int64_t i = 0; i < xq_stride; i += kLanes) {
      const __m512 v = load16(xr + i, lanes(std::min(k, i + kLanes) - std::min(k, i)));
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));  // to nearest, ties to even
      _mm256_mask_storeu_epi16(qr + i, lanes(xq_stride - i), _mm512_cvtsepi32_epi16(q));
    }
    row_scale[r] = scale;
  }
}

}  // namespace radixserve_cpu
