// bf16 loads, rounding and stores, and vectorised float32 math for the AVX2 kernels: what
// csrc/vec_math.h gives the AVX-512 ones, with 8 lanes and without mask registers (a row's tail
// goes through a masked float32 load or a small buffer). Same values, bit for bit.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

namespace radixserve_cpu::avx2 {

constexpr int64_t kLanes = 8;  // float32 values per AVX2 register

// Lanes [0, left) of a register set (all ones), for vmaskmov.
inline __m256i lane_mask(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(left, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Lanes [0, min(left, 8)) of p; the others are zero.
inline __m256 load8(const float* p, int64_t left) {
  return left >= kLanes ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask(left));
}
inline __m256 load8(const uint16_t* p, int64_t left) {
  __m128i raw;
  if (left >= kLanes) {
    raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    uint16_t buf[kLanes] = {};
    std::memcpy(buf, p, left * sizeof(uint16_t));
    raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
  }
  // bf16 -> float32 is a 16-bit shift of each value
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// float32 -> the nearest bf16 (ties to even), still in float32 lanes: c10::BFloat16's rounding,
// denormals kept and NaN made 0x7FC0 (as csrc/vec_math.h's round_to_bf16).
inline __m256 round_to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
  const __m256i rounded =
      _mm256_and_si256(_mm256_add_epi32(bits, bias), _mm256_set1_epi32(~0xFFFF));
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_set1_ps(NAN),
                          _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// Stores lanes [0, min(left, 8)). bf16: v must hold bf16 values (round_to<uint16_t>).
inline void store8(float* p, __m256 v, int64_t left) {
  if (left >= kLanes) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, lane_mask(left), v);
  }
}
inline void store8(uint16_t* p, __m256 rounded, int64_t left) {
  // the high halves, packed in each 128-bit lane, then the two lanes' halves side by side
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0b1000);
  const __m128i out = _mm256_castsi256_si128(packed);
  if (left >= kLanes) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), out);
  } else {
    uint16_t buf[kLanes];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(buf), out);
    std::memcpy(p, buf, left * sizeof(uint16_t));
  }
}

template <typename T>
inline __m256 round_to(__m256 v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return round_to_bf16(v);
  } else {
    return v;
  }
}

// 2^n for whole n in [-150, 128] (n in float32 lanes), as two factors of normal floats: their
// product with a value in [0.5, 2) is rounded once, as AVX-512's vscalefps rounds.
inline __m256 times_pow2(__m256 p, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256i rest = _mm256_sub_epi32(ni, half);
  const auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(rest));
}

// e^x as csrc/vec_math.h's exp_ps: the same reduction and series, the same bits.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  }
  return times_pow2(p, n);
}

}  // namespace radixserve_cpu::avx2
