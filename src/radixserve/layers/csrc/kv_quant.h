// Reading a quantized KV pool (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2, see
// mem_cache/kv_quant.py) in the paged attention kernels: 16 codes of a row into 16 float32 lanes,
// which the row's scale (one float32 per slot and KV head) then multiplies.
//
// fp8 goes through fp16 (vcvtph2ps), since AVX-512 has no fp8 conversion: an e5m2 code is the
// high byte of the fp16 of the same value; an e4m3fn code's sign, exponent and mantissa moved to
// fp16's positions read as the value times 2^-8 (its exponent bias is 7, fp16's 15; subnormals
// too), so kScaleFactor folds the 2^8 into the row's scale. The pool never holds e4m3's NaN
// (values are clamped to +-448 before the cast).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "vec_math.h"

namespace radixserve_cpu {

struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

// Whether a pool of S stores codes with scales.
template <typename S>
constexpr bool kQuantizedKV = std::is_same_v<S, int8_t> || std::is_same_v<S, Fp8E4M3> ||
                              std::is_same_v<S, Fp8E5M2>;

// What a row's scale is multiplied by before it multiplies the lanes load_kv16 gives.
template <typename S>
constexpr float kScaleFactor = std::is_same_v<S, Fp8E4M3> ? 256.0f : 1.0f;

inline __m512 load_kv16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_kv16(const c10::BFloat16* p) {
  return load_bf16(reinterpret_cast<const uint16_t*>(p));
}
inline __m512 load_kv16(const int8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
}
inline __m512 load_kv16(const Fp8E5M2* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8));
}
inline __m512 load_kv16(const Fp8E4M3* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i w = _mm256_cvtepu8_epi16(raw);
  const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
  return _mm512_cvtph_ps(_mm256_or_si256(magnitude, sign));  // times 2^-8: kScaleFactor
}

// Calls fn(S{}) with S the code type of a quantized KV buffer (int8, float8_e4m3fn, float8_e5m2).
template <typename Fn>
void with_quantized_kv_dtype(const char* op, const at::Tensor& buffer, Fn&& fn) {
  switch (buffer.scalar_type()) {
    case at::kChar: fn(int8_t{}); break;
    case at::kFloat8_e4m3fn: fn(Fp8E4M3{}); break;
    case at::kFloat8_e5m2: fn(Fp8E5M2{}); break;
    default:
      TORCH_CHECK(false, op, " reads int8, float8_e4m3fn or float8_e5m2 KV codes, got ",
                  buffer.scalar_type());
  }
}

// The codes of a quantized buffer as S (at::Tensor has no data_ptr<Fp8E4M3>).
template <typename S>
const S* kv_codes(const at::Tensor& buffer) {
  return reinterpret_cast<const S*>(buffer.data_ptr());
}

}  // namespace radixserve_cpu
