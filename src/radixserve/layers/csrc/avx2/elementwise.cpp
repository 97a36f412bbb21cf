// The elementwise ops (RMSNorm alone or after the residual add, SwiGLU, rotary, greedy argmax)
// for CPUs with AVX2 and FMA: csrc/elementwise.cpp's row functions with 8-lane registers, the
// same operations in the same order, so the same bits (its comment says how they match torch's),
// but for the norms' double sums of squares, added in another order (exact to far below the
// float32 rounding that follows).
// The ops' checks and threading are csrc/elementwise_ops.h, shared with the AVX-512 build.

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "../elementwise_ops.h"
#include "vec_math.h"

namespace radixserve_cpu {
namespace {

using namespace avx2;

// Sum of squares of a row, in double (see csrc/elementwise.cpp).
struct SumOfSquares {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();

  void add(__m256 v) {
    const __m256 sq = _mm256_mul_ps(v, v);
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1)));
  }

  float inv_rms(int64_t n, float eps) const {
    alignas(32) double parts[4];
    _mm256_store_pd(parts, _mm256_add_pd(lo, hi));
    const float sum = static_cast<float>((parts[0] + parts[2]) + (parts[1] + parts[3]));
    return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  }
};

// out = T(w * T(x * scale)) over one row.
template <typename T>
void scale_row(const T* x, const T* w, T* out, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m256 h = round_to<T>(_mm256_mul_ps(load8(x + i, n - i), s));
    store8(out + i, round_to<T>(_mm256_mul_ps(load8(w + i, n - i), h)), n - i);
  }
}

// Lanes [0, left) equal to `target` (or NaN, when `nan`), as a bit mask.
int hits(__m256 v, __m256 target, bool nan, int64_t left) {
  const __m256 eq = nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ);
  const int in_row = left >= kLanes ? 0xFF : (1 << left) - 1;
  return _mm256_movemask_ps(eq) & in_row;
}

}  // namespace

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t n, float eps, int64_t first,
                   int64_t last) {
  for (int64_t row = first; row < last; ++row) {
    const T* xr = x + row * n;
    SumOfSquares sumsq;
    for (int64_t i = 0; i < n; i += kLanes) sumsq.add(load8(xr + i, n - i));
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
      // the norm reads the sum as stored (rounded), as the unfused add then norm do
      const __m256 sum = round_to<T>(_mm256_add_ps(load8(xr + i, n - i), load8(rr + i, n - i)));
      store8(rr + i, sum, n - i);
      sumsq.add(sum);
    }
    scale_row(rr, w, xr, n, sumsq.inv_rms(n, eps));
  }
}

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t d, int64_t first, int64_t last) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t row = first; row < last; ++row) {
    const T* gate = x + row * 2 * d;
    const T* up = gate + d;
    for (int64_t i = 0; i < d; i += kLanes) {
      const __m256 g = load8(gate + i, d - i);
      const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
      const __m256 silu = round_to<T>(_mm256_div_ps(g, _mm256_add_ps(one, e)));
      store8(out + row * d + i, round_to<T>(_mm256_mul_ps(silu, load8(up + i, d - i))), d - i);
    }
  }
}

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
        const int64_t left = half - i;
        const __m256 x1 = load8(xr + i, left), x2 = load8(xr + half + i, left);
        // first half: x1 cos1 + x2 (-sin); second half: x2 cos2 + x1 sin
        const __m256 lo = _mm256_add_ps(round_to<T>(_mm256_mul_ps(x1, load8(c + i, left))),
                                        round_to<T>(_mm256_mul_ps(x2, load8(s + i, left))));
        const __m256 hi =
            _mm256_add_ps(round_to<T>(_mm256_mul_ps(x2, load8(c + half + i, left))),
                          round_to<T>(_mm256_mul_ps(x1, load8(s + half + i, left))));
        store8(yr + i, round_to<T>(lo), left);
        store8(yr + half + i, round_to<T>(hi), left);
      }
    }
  }
}

// Two passes, as csrc/elementwise.cpp's: the maximum (and whether there is a NaN), then the
// first lane equal to it. A row's tail lanes load as zero, so the maximum takes only the lanes
// in the row (a blend with -inf).
template <typename T>
int64_t argmax_row(const T* x, int64_t vocab) {
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  __m256 top = neg_inf;
  bool nan = false;
  for (int64_t i = 0; i < vocab; i += kLanes) {
    const int64_t left = vocab - i;
    __m256 v = load8(x + i, left);
    if (left < kLanes) v = _mm256_blendv_ps(neg_inf, v, _mm256_castsi256_ps(lane_mask(left)));
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0;
    top = _mm256_max_ps(v, top);  // a NaN lane keeps top (the NaN pass below finds it)
  }
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, top);
  float best = lanes[0];
  for (int j = 1; j < kLanes; ++j) best = std::max(best, lanes[j]);
  const __m256 best_v = _mm256_set1_ps(best);
  for (int64_t i = 0; i < vocab; i += kLanes) {
    // with a NaN in the row, the first NaN; else the first lane equal to the maximum
    const int hit = hits(load8(x + i, vocab - i), best_v, nan, vocab - i);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // a row of -inf: its first entry, as torch
}

}  // namespace radixserve_cpu

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) { radixserve_cpu::define_elementwise_ops(m); }
