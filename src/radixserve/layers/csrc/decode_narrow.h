// The score passes of decode_attention_quant for a bf16 model (bf16_query) over int8 or fp8
// keys, head_dim a multiple of 32: dot-product instructions on 32 narrow lanes where the float32
// pass (decode_attention.cpp) widens every code to float32 and takes one FMA per 16 products.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "decode_rows.h"
#include "int16_rows.h"
#include "kv_quant.h"
#include "vec_math.h"

namespace radixserve_cpu {

// The narrow score passes for a bf16 model's queries (bf16_query), head_dim a multiple of 32,
// four keys per reduction (score_pass4_narrow); where the float32 pass took a conversion chain
// per 16 codes and one FMA per 16 products and head, a key row's 32 codes are widened once and
// each head takes one dot-product instruction per 32 of them:
// - int8 keys (Int16Keys): each query head is quantised to int16 once per task (a scale of
//   max |q| / 32767, 2^7 times finer than the bf16 it came from), the codes widened to int16 and
//   multiplied with AVX512-VNNI `vpdpwssd` into exact int32 sums;
// - fp8 keys (Bf16Keys): the codes moved into bf16's bit positions (load_fp8_bf16) and
//   multiplied with AVX512-BF16 dot products against the bf16 query, whose products are exact in
//   float32 (so the scores differ from the float32 pass's in the order of the sums, and fp8's
//   smallest codes, read as zero: see kv_quant.h); the query times kBf16QueryFactor.
// R2 registers of 32 lanes per head; `head_factor[g]` multiplies head g's sums (with the row's
// scale): the int16 query's scale, or the softmax scale over the bf16 lanes' factors.
struct Int16Keys {
  using Code = int8_t;
  using Acc = __m512i;
  static Acc zero() { return _mm512_setzero_si512(); }
  static __m512i load(const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Acc dot(Acc acc, __m512i q, __m512i k) { return dot_pairs(acc, q, k); }
  static __m512 sums(Acc acc) { return _mm512_cvtepi32_ps(acc); }
};

template <typename S>
struct Bf16Keys {
  using Code = S;
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static __m512i load(const S* p) { return load_fp8_bf16(p); }
  static Acc dot(Acc acc, __m512i q, __m512i k) { return dot_bf16_pairs(acc, q, k); }
  static __m512 sums(Acc acc) { return acc; }
};

constexpr bool fits_four_keys_narrow(int64_t regs2, int64_t heads) {
  return 4 * heads + heads * regs2 + regs2 <= 32;
}

// What the bf16 query is multiplied by (exactly: a power of two) so that its products with the
// codes' bf16 lanes (values times 2^-120 or 2^-112) and their sums stay far above float32's
// smallest normal (2^-126): sums that fell under it became denormals, whose every add takes a
// microcode assist.
constexpr float kBf16QueryFactor = 0x1p96f;

template <typename K, int64_t R2, int64_t G>
void score_pass4_narrow(const __m512i* query, const float* head_factor,
                        const Rows<typename K::Code>& rows, int64_t t0, int64_t t1, int64_t len,
                        int64_t head_dim, float* scores) {
  __m512i q[G][R2];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < R2; ++r) q[g][r] = query[g * R2 + r];
  four_keys_at_a_time<G, true, true>(
      t0, t1, len, head_factor, scores,
      [&](int64_t t, __m512* dot) __attribute__((always_inline)) {
        prefetch_ahead(rows.k, rows.k_scale, rows, t, len, head_dim);
        const int64_t slot = rows.slots[t];
        const typename K::Code* row = rows.k + slot * rows.kv_row;
        __m512i key[R2];
        for (int64_t r = 0; r < R2; ++r) key[r] = K::load(row + 32 * r);
        for (int64_t g = 0; g < G; ++g) {
          typename K::Acc sum = K::dot(K::zero(), q[g][0], key[0]);
          for (int64_t r = 1; r < R2; ++r) sum = K::dot(sum, q[g][r], key[r]);
          dot[g] = K::sums(sum);
        }
        return rows.k_scale[slot * rows.scale_row];  // the lanes are the codes' values
      });
}

// Two float32 registers holding bf16 values -> one register of their 32 bf16 lanes, in order
// (truncation: exact for bf16 values; AVX-512F only).
inline __m512i pack_bf16_values(__m512 lo, __m512 hi) {
  const __m256i l = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo), 16));
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(hi), 16));
  return _mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1);
}

// Query head g's R float32 registers -> R / 2 registers of 32 int16 lanes (element order kept)
// and its scale.
template <int64_t R>
void quantize_query(const __m512* query, __m512i* out, float* out_scale) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t r = 0; r < R; ++r) top = _mm512_max_ps(top, _mm512_abs_ps(query[r]));
  const float max = _mm512_reduce_max_ps(top);
  *out_scale = max > 0 ? max / kInt16Max : 1.0f;
  const __m512 inv = _mm512_set1_ps(max > 0 ? kInt16Max / max : 0.0f);
  for (int64_t r = 0; r + 1 < R; r += 2) {
    const __m256i lo = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(query[r], inv)));
    const __m256i hi =
        _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(query[r + 1], inv)));
    out[r / 2] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

}  // namespace radixserve_cpu
