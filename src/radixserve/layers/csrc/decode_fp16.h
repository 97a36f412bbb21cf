// The value pass of decode_attention_quant for a bf16 model (bf16_query) over an fp8 pool (one
// scale per layer), on CPUs with AVX512-FP16 (Sapphire Rapids and later), head_dim a multiple
// of 32.
//
// The float32 value pass widens each row's 32 codes to fp16 bit patterns (kv_quant.h), converts
// them to two registers of float32 and takes one FMA per 16 products and head. Here the fp16
// lanes are used as they are: one `vfmadd231ph` per 32 products and head (which costs this
// CPU what a float32 FMA does) and no conversion per row. The kernel alone ran 1.1-1.2x faster
// over e4m3 codes (RESULTS.md, session 28).
//
// The sums of kFp16Rows rows run in fp16 lanes and are then added into the float32 sums, so
// rounding to fp16's 11 bits touches only a few rows' partial sums: the output stays within
// 3-5e-5 (about 2^-15) of the values' largest magnitude of the float32 pass's (tests/layers/
// test_kv_cache_quant.py), where e4m3's codes are 2^-4 apart relatively and a bf16 output is
// rounded to 2^-9. (Sums of 64 rows: 5-8e-5; RESULTS.md, session 28.)
//
// The layer's scale multiplies the partial sums once, in float32, so an fp16 sum holds
// probabilities times codes, never the values' own magnitudes: the softmax is over the whole
// context, so a sum of probabilities is at most 1 and a sum at most the largest code, 1.75
// (e4m3, read as its value times 2^-8) or 57344 (e5m2), under fp16's 65504. fp16 arithmetic
// keeps subnormal inputs and results at full speed (DAZ and FTZ do not apply to it).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "decode_rows.h"
#include "kv_quant.h"
#include "vec_math.h"

namespace radixserve_cpu {

#ifdef __AVX512FP16__

constexpr bool kFp16Values = true;
constexpr int64_t kFp16Rows = 16;  // rows summed in fp16 before their sums go to float32

// acc_g += sum over keys [t0, t1) (at most kKeyBlock) of p_g[t] v_t, for G heads: `held` holds
// their float32 sums (R2 * 2 registers each, in element order), `scores` their probabilities
// (`len` apart) and `layer_scale` the codes' scale (times kScaleFactor).
template <typename S, int64_t R2, int64_t G>
void value_pass_fp16(__m512* held, const Rows<S>& rows, int64_t t0, int64_t t1, int64_t len,
                     int64_t head_dim, const float* scores, float layer_scale) {
  static_assert(kFp8KV<S>, "fp16 value sums hold fp8 codes: int8's per-row scales would put "
                           "the values' own magnitudes in them");
  // the block's probabilities as fp16, 16 at a time: each row then broadcasts its own
  alignas(64) _Float16 weight[G][kKeyBlock];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = t0; t < t1; t += kLanes) {
      const __mmask16 m = lanes(t1 - t);
      _mm256_mask_storeu_epi16(&weight[g][t - t0], m, _mm256_castph_si256(_mm512_cvtxps_ph(
          _mm512_maskz_loadu_ps(m, scores + g * len + t))));
    }
  }
  const __m512 scale = _mm512_set1_ps(layer_scale);
  for (int64_t s0 = t0; s0 < t1; s0 += kFp16Rows) {
    const int64_t s1 = std::min(t1, s0 + kFp16Rows);
    __m512h acc[G][R2];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < R2; ++r) acc[g][r] = _mm512_setzero_ph();
    for (int64_t t = s0; t < s1; ++t) {
      prefetch_ahead(rows.v, rows.v_scale, rows, t, len, head_dim);
      const S* row = rows.v + rows.slots[t] * rows.kv_row;
      __m512h value[R2];
      for (int64_t r = 0; r < R2; ++r) {
        value[r] = _mm512_castsi512_ph(fp8_fp16_bits32(row + 32 * r));
      }
      for (int64_t g = 0; g < G; ++g) {
        const __m512h p = _mm512_set1_ph(weight[g][t - t0]);
        for (int64_t r = 0; r < R2; ++r) acc[g][r] = _mm512_fmadd_ph(p, value[r], acc[g][r]);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t r = 0; r < R2; ++r) {
        const __m512i bits = _mm512_castph_si512(acc[g][r]);
        __m512* sum = held + g * 2 * R2 + 2 * r;
        sum[0] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(bits)), scale, sum[0]);
        sum[1] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1)), scale,
                                 sum[1]);
      }
    }
  }
}

#else

constexpr bool kFp16Values = false;

#endif

}  // namespace radixserve_cpu
