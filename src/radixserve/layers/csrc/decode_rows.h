// How the decode attention passes (decode_attention.cpp, decode_narrow.h) reach a task's keys
// and values in the paged pool: the rows a request's slots point at, read a block at a time
// with the rows ahead prefetched, and the four-key reductions of the score passes.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kv_quant.h"
#include "vec_math.h"

namespace radixserve_cpu {

constexpr int64_t kKeyBlock = 64;  // keys per block: a block's rows stay in L1 across the passes

// Rows prefetched ahead: slots are scattered (a page's rows are together, the pages anywhere)
// and each pass reads one head's line of each row, which the hardware prefetcher does not
// follow. 64 rows cover the memory's latency at two threads: 8 (the old figure) left a 30-layer
// int8 step 1.5x slower when the pool was out of cache (32 rows: 1.4x faster than 8, 64: 1.5x).
constexpr int64_t kAhead = 64;

template <typename T>
inline void prefetch_row(const T* row, int64_t head_dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < head_dim * static_cast<int64_t>(sizeof(T)); off += 64) {
    _mm_prefetch(p + off, _MM_HINT_T0);
  }
}

// Where one task's keys and values are: row t of its request at base + slots[t] * kv_row; in a
// quantized pool (S int8 or fp8) its scale at scale_base[slots[t] * scale_row] (scale_row 0: one
// scale for the layer).
template <typename S>
struct Rows {
  const S* k;
  const S* v;
  const int64_t* slots;
  int64_t kv_row;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t scale_row = 0;
};

// The row kAhead after row t of a task's keys or values (`base`: rows.k or rows.v), and its
// scale in a quantized pool, asked for ahead.
template <typename S>
inline void prefetch_ahead(const S* base, const float* scales, const Rows<S>& rows, int64_t t,
                           int64_t len, int64_t head_dim) {
  if (t + kAhead < len) {
    prefetch_row(base + rows.slots[t + kAhead] * rows.kv_row, head_dim);
    if constexpr (kQuantizedKV<S>) {
      if (rows.scale_row != 0) {  // 0: one scale for every row (fp8's per-layer scale)
        _mm_prefetch(
            reinterpret_cast<const char*>(scales + rows.slots[t + kAhead] * rows.scale_row),
            _MM_HINT_T0);
      }
    }
  }
}

// Row t of a task's keys or values into R float32 registers, as stored (a quantized pool's
// codes, not yet times their scale); the row kAhead further on is prefetched.
template <typename S, int64_t R>
inline void load_row(const S* base, const float* scales, const Rows<S>& rows, int64_t t,
                     int64_t len, int64_t head_dim, __m512* out) {
  prefetch_ahead(base, scales, rows, t, len, head_dim);
  const S* row = base + rows.slots[t] * rows.kv_row;
  if constexpr (kFp8KV<S> && R % 2 == 0) {
    for (int64_t r = 0; r < R; r += 2) load_kv32(row + r * kLanes, out + r);
  } else {
    for (int64_t r = 0; r < R; ++r) out[r] = load_kv16(row + r * kLanes);
  }
}

// The scale row t's codes are multiplied by (1 for an unquantized pool).
template <typename S>
inline float row_scale(const float* scales, const Rows<S>& rows, int64_t t) {
  if constexpr (kQuantizedKV<S>) {
    return scales[rows.slots[t] * rows.scale_row] * kScaleFactor<S>;
  } else {
    return 1.0f;
  }
}

// The sums of four 16-lane vectors, [sum a, sum b, sum c, sum d], in ten instructions where
// four horizontal sums take about 32: pairs of lanes are added across the vectors first, so
// every shuffle serves four keys. Each result depends on its own vector only (lanes never mix
// between vectors), so a key's score is the same bits whatever its neighbours.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit lane: (a0+a2) (b0+b2) (a1+a3) (b1+b3), and the same of c and d
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: the lane's sum of a, b, c and d
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd));
  const __m512 quads = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  // the four 128-bit lanes added
  const __m256 half = _mm256_add_ps(
      _mm512_castps512_ps256(quads),
      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(quads), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// The scores of keys [t, t + n) (n <= 4: the last keys of a block) from sum4's lanes.
inline void store_scores4(__m128 sums, int64_t n, float* dst) {
  if (n == 4) {
    _mm_storeu_ps(dst, sums);
  } else {
    alignas(16) float tail[4];
    _mm_store_ps(tail, sums);
    std::copy_n(tail, n, dst);
  }
}

// The loop both score passes share (decode_attention.cpp's float32 one, decode_narrow.h's over
// integer and bf16 lanes): keys [t0, t1) four at a time. `dots(t, dot)` sets dot[g] to a register
// whose lanes sum to head g's product with key t and returns the key row's scale; four keys' sums
// are reduced together (sum4), times their rows' scales (kScaled) and then head g's `factor[g]`
// (kFactor), and stored as scores[g * len + t].
template <int64_t G, bool kScaled, bool kFactor, typename Dots>
inline void four_keys_at_a_time(int64_t t0, int64_t t1, int64_t len, const float* factor,
                                float* scores, Dots&& dots) {
  for (int64_t t = t0; t < t1; t += 4) {
    const int64_t n = std::min<int64_t>(4, t1 - t);
    __m512 dot[4][G];
    alignas(16) float row_s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t j = 0; j < 4; ++j) {
      if (j < n) {
        row_s[j] = dots(t + j, dot[j]);
      } else {
        for (int64_t g = 0; g < G; ++g) dot[j][g] = _mm512_setzero_ps();
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      __m128 sums = sum4(dot[0][g], dot[1][g], dot[2][g], dot[3][g]);
      if constexpr (kScaled) sums = _mm_mul_ps(sums, _mm_load_ps(row_s));
      if constexpr (kFactor) sums = _mm_mul_ps(sums, _mm_set1_ps(factor[g]));
      store_scores4(sums, n, scores + g * len + t);
    }
  }
}

}  // namespace radixserve_cpu
