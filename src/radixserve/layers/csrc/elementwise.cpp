// Fused RMSNorm (alone or after the residual add), SwiGLU activation and rotary embedding for
// AVX512 CPUs, in bf16 and float32, and the greedy argmax of bf16 or float32 logits.
//
// A decode step has a few rows, so torch spends its time starting kernels, not computing: RMSNorm
// is eight of them (cast, square, mean, + eps, rsqrt, scale, cast back, * weight), the residual
// add one more, silu(gate) * up two and the rotary embedding four, each a dispatch and often an
// OpenMP region. Here each is one pass over a row (two for the norms: sum of squares, then
// scale), in float32, rounding to the storage dtype where transformers' modules do (a no-op in
// float32):
//
//   rms_norm:      out = T(w * T(x * rsqrt(mean(x^2) + eps)))
//   add + norm:    residual = T(x + residual); x = rms_norm(residual)
//   silu_and_mul:  out = T(T(silu(gate)) * up)
//   rotary:        out = T(T(x * cos) + T(rotate_half(x) * sin))  (sin carries the sign)
//
// So results equal torch's bit for bit, except for the rare value that lands on the other side of
// a rounding because torch's sum of squares (in another order) or its exp differs in the last
// bit. The build turns off floating-point contraction, so a product and a sum are rounded
// separately, as torch's separate kernels round them. The ops' checks and threading are
// elementwise_ops.h's, shared with the AVX2 build (avx2/elementwise.cpp).

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "elementwise_ops.h"
#include "vec_math.h"

namespace radixserve_cpu {
namespace {

// Sum of squares of a row, in double: the square of a bf16 value is exact in float32 (8-bit
// significands), and the double sum is the exact sum rounded once. A float32 sum strays by ulps
// over a long row, enough to move the row's scale and flip dozens of its bf16 roundings at once.
struct SumOfSquares {
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();

  void add(__m512 v) {
    __m512 sq = _mm512_mul_ps(v, v);
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(sq)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(
                               _mm512_extractf64x4_pd(_mm512_castps_pd(sq), 1))));
  }

  // 1 / sqrt(mean + eps) over `n` values, in float32 as torch: the mean divides the sum, and
  // rsqrt is 1 / sqrt.
  float inv_rms(int64_t n, float eps) const {
    float sum = static_cast<float>(_mm512_reduce_add_pd(_mm512_add_pd(lo, hi)));
    return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  }
};

// out = T(w * T(x * scale)) over one row.
template <typename T>
void scale_row(const T* x, const T* w, T* out, int64_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += kLanes) {
    __mmask16 m = lanes(n - i);
    __m512 h = round_to<T>(_mm512_mul_ps(load16(x + i, m), s));
    store16(out + i, round_to<T>(_mm512_mul_ps(load16(w + i, m), h)), m);
  }
}

}  // namespace

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t n, float eps, int64_t first,
                   int64_t last) {
  for (int64_t row = first; row < last; ++row) {
    const T* xr = x + row * n;
    SumOfSquares sumsq;
    for (int64_t i = 0; i < n; i += kLanes) sumsq.add(load16(xr + i, lanes(n - i)));
    scale_row(xr, w, out + row * n, n, sumsq.inv_rms(n, eps));
  }
}

template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* w, int64_t n, float eps, int64_t first,
                       int64_t last) {
  for (int64_t row = first; row < last; ++row) {
    T* xr = x + row * n;
    T* rr = residual + row * n;
    SumOfSquares sumsq;
    for (int64_t i = 0; i < n; i += kLanes) {
      __mmask16 m = lanes(n - i);
      // The norm reads the sum as stored (rounded), as the unfused add then norm do.
      __m512 sum = round_to<T>(_mm512_add_ps(load16(xr + i, m), load16(rr + i, m)));
      store16(rr + i, sum, m);
      sumsq.add(sum);
    }
    scale_row(rr, w, xr, n, sumsq.inv_rms(n, eps));
  }
}

// Row layout [gate (d) | up (d)] -> [d]; silu(g) = g / (1 + e^-g), as torch computes it.
template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t d, int64_t first, int64_t last) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t row = first; row < last; ++row) {
    const T* gate = x + row * 2 * d;
    const T* up = gate + d;
    for (int64_t i = 0; i < d; i += kLanes) {
      __mmask16 m = lanes(d - i);
      __m512 g = load16(gate + i, m);
      __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
      __m512 silu = round_to<T>(_mm512_div_ps(g, _mm512_add_ps(one, e)));
      store16(out + row * d + i, round_to<T>(_mm512_mul_ps(silu, load16(up + i, m))), m);
    }
  }
}

// x: [tokens] rows of `heads` contiguous heads, `x_stride` elements apart; cos, sin: [tokens,
// head_dim]; out: [tokens, heads, head_dim] contiguous.
template <typename T>
void rotary_rows(const T* xs, int64_t x_stride, const T* cs, const T* ss, T* ys, int64_t heads,
                 int64_t dim, int64_t first, int64_t last) {
  const int64_t half = dim / 2;
  for (int64_t t = first; t < last; ++t) {
    const T* c = cs + t * dim;
    const T* s = ss + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = xs + t * x_stride + h * dim;
      T* yr = ys + (t * heads + h) * dim;
      for (int64_t i = 0; i < half; i += kLanes) {
        __mmask16 m = lanes(half - i);
        __m512 x1 = load16(xr + i, m), x2 = load16(xr + half + i, m);
        // first half: x1 cos1 + x2 (-sin); second half: x2 cos2 + x1 sin
        __m512 lo = _mm512_add_ps(round_to<T>(_mm512_mul_ps(x1, load16(c + i, m))),
                                  round_to<T>(_mm512_mul_ps(x2, load16(s + i, m))));
        __m512 hi = _mm512_add_ps(round_to<T>(_mm512_mul_ps(x2, load16(c + half + i, m))),
                                  round_to<T>(_mm512_mul_ps(x1, load16(s + half + i, m))));
        store16(yr + i, round_to<T>(lo), m);
        store16(yr + half + i, round_to<T>(hi), m);
      }
    }
  }
}

// One row: one vectorised pass finds the maximum (and whether there is a NaN), a second the
// first lane equal to it, usually early in the row.
template <typename T>
int64_t argmax_row(const T* x, int64_t vocab) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < vocab; i += kLanes) {
    __mmask16 m = lanes(vocab - i);
    __m512 v = load16(x + i, m);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    top = _mm512_mask_max_ps(top, m, top, v);
  }
  const __m512 best_v = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  for (int64_t i = 0; i < vocab; i += kLanes) {
    __mmask16 m = lanes(vocab - i);
    __m512 v = load16(x + i, m);
    // with a NaN in the row, the first NaN; else the first lane equal to the maximum
    __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q)
                        : _mm512_mask_cmp_ps_mask(m, v, best_v, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // a row of -inf: its first entry, as torch
}

}  // namespace radixserve_cpu

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) { radixserve_cpu::define_elementwise_ops(m); }
