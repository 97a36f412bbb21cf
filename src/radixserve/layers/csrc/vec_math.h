// bf16 loads, rounding and stores, and vectorised float32 math, shared by radixserve's AVX-512
// kernels.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace radixserve_cpu {

constexpr int64_t kLanes = 16;  // float32 values per AVX-512 register

// Lanes [0, left) of a register, for the tail of a row.
inline __mmask16 lanes(int64_t left) {
  return left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

inline __m512 load_bf16(const uint16_t* p, __mmask16 m = 0xFFFF) {
  // bf16 -> float32 is a 16-bit shift of each value
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// float32 -> the nearest bf16 (ties to even), still in float32 lanes: c10::BFloat16's rounding
// bit for bit, denormals kept (vcvtneps2bf16 would flush them to zero) and NaN made 0x7FC0.
inline __m512 round_to_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, bias), _mm512_set1_epi32(~0xFFFF));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(rounded), nan, _mm512_set1_ps(NAN));
}

// Stores lanes that hold bf16 values (round_to_bf16's results): their high halves.
inline void store_bf16(uint16_t* p, __m512 rounded, __mmask16 m = 0xFFFF) {
  __m512i high = _mm512_srli_epi32(_mm512_castps_si512(rounded), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(high));
}

// Loads, stores and the rounding to the storage type, for bf16 (as uint16_t) and float32.
inline __m512 load16(const float* p, __mmask16 m = 0xFFFF) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m = 0xFFFF) { return load_bf16(p, m); }
inline void store16(float* p, __m512 v, __mmask16 m = 0xFFFF) { _mm512_mask_storeu_ps(p, m, v); }
// bf16: v must hold bf16 values already (round_to<uint16_t>)
inline void store16(uint16_t* p, __m512 v, __mmask16 m = 0xFFFF) { store_bf16(p, v, m); }
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return round_to_bf16(v);
  } else {
    return v;
  }
}

// acc + the products of 32 bf16 pairs, summed in pairs into 16 float32 lanes: AVX512-BF16's
// `vdpbf16ps`, or on AVX-512 F without BF16 what it computes: the odd element's product, then
// the even one's, each a float32 multiply-add (bf16 products are exact in float32).
inline __m512 dot_bf16_pairs(__m512 acc, __m512i x, __m512i w) {
#ifdef __AVX512BF16__
  return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
#else
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x, high)),
                        _mm512_castsi512_ps(_mm512_and_si512(w, high)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), acc);
#endif
}

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
