// Vectorised float32 math shared by radixserve's AVX-512 kernels.
#pragma once

#include <immintrin.h>

#include <initializer_list>

namespace radixserve_cpu {

// e^x within about one float32 ulp: x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor series to
// r^7 (truncation error under 0.05 ulp), then scaled by 2^n, which also gives inf and 0 (and the
// denormals between) at the ends of the range.
inline __m512 exp_ps(__m512 x) {
  // Out here float32 has overflowed or underflowed anyway; clamping keeps inf out of the
  // reduction below. The operand order lets NaN through.
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 in two parts: x - n * the first is exact, so r keeps the bits that x - n ln2 cancels.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(p, n);
}

}  // namespace radixserve_cpu
