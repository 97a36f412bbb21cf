// Reading a quantized KV pool (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2, see
// mem_cache/kv_quant.py) in the paged attention kernels: 16 codes of a row into 16 float32 lanes,
// which the row's scale then multiplies. The scales come as a float32 [slots, kv_heads] tensor
// read through its strides: int8's are contiguous (one per slot and KV head), fp8's are the
// layer's one scale seen with strides (0, 0) (check_kv_scales).
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
#include <initializer_list>
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

// Where a layer's scales are: that of slot s and KV head h at scales[s * row + h * head].
struct ScaleStrides {
  int64_t row;
  int64_t head;
};

inline ScaleStrides scale_strides(const at::Tensor& scales) {
  return {scales.stride(0), scales.stride(1)};
}

// A quantized pool's K and V scales must be float32 [slots, kv_heads] (the codes' first two
// sizes), each contiguous (a scale per slot and head) or one value broadcast (strides 0, 0), both
// laid out alike.
inline void check_kv_scales(const char* op, const at::Tensor& codes, const at::Tensor& k_scale,
                            const at::Tensor& v_scale) {
  for (const at::Tensor* t : {&k_scale, &v_scale}) {
    const bool shaped = t->scalar_type() == at::kFloat && t->dim() == 2 &&
                        t->size(0) == codes.size(0) && t->size(1) == codes.size(1);
    // (a dimension of size 1 may have any stride)
    const bool one_value = shaped && t->stride(0) == 0 && (t->stride(1) == 0 || t->size(1) == 1);
    TORCH_CHECK(shaped && (t->is_contiguous() || one_value), op,
                ": the scales must be float32 [slots, kv_heads], contiguous or one value "
                "broadcast (strides 0, 0)");
  }
  TORCH_CHECK(k_scale.strides() == v_scale.strides(), op,
              ": the K and V scales must be laid out alike");
}

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
  // sign-extended, the sign fills bits 7-15: shifted by 7 it is in fp16's sign bit and in bit
  // 14, which the mask clears (the exponent's top bit, always 0 for an e4m3 code)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(raw), 7);
  const __m256i bits = _mm256_and_si256(w, _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  return _mm512_cvtph_ps(bits);  // times 2^-8: kScaleFactor
}

// fp8 codes as bf16 lanes, for scoring them with AVX512-BF16 dot products against a bf16
// model's queries (decode_attention's score_pass4_narrow), three instructions per 32 codes: a code
// moved to bf16's bit positions reads as its value times 2^-120 (e4m3fn, exponent bias 7) or
// 2^-112 (e5m2, bias 15), bf16's bias being 127; kBf16CodeFactor undoes that on the sums. Its
// subnormals become bf16 denormals, which the dot product reads as zero: codes under 2^-6
// (e4m3fn) or 2^-14 (e5m2), i.e. key elements under that times the layer's scale (an fp8 pool
// has one per layer, mem_cache/kv_quant.py). An element lost so is off by at most 2^-6 of the
// scale, what e4m3's own rounding (2^-4 relative) costs any element of a quarter of the scale or
// more; e5m2's 2^-14 is far under its rounding. The float32 passes (the prefill kernel, and
// decode without bf16_query) read them exactly.
template <typename S>
constexpr float kBf16CodeFactor = std::is_same_v<S, Fp8E4M3> ? 0x1p120f : 0x1p112f;

template <typename S>
inline __m512i load_fp8_bf16(const S* p) {
  static_assert(std::is_same_v<S, Fp8E4M3> || std::is_same_v<S, Fp8E5M2>);
  // sign-extended: the sign fills bits 7-15, so after the shift it sits in bf16's sign bit and
  // in the bits above the exponent that the mask clears
  const __m512i code =
      _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  constexpr int kShift = std::is_same_v<S, Fp8E4M3> ? 4 : 5;
  constexpr int16_t kKeep = static_cast<int16_t>(std::is_same_v<S, Fp8E4M3> ? 0x87FF : 0x8FFF);
  return _mm512_and_si512(_mm512_slli_epi16(code, kShift), _mm512_set1_epi16(kKeep));
}

// 32 fp8 codes as the fp16 bit patterns of 32 lanes (load_kv16's fp16 step at zmm width): one
// widening, shift (and mask, e4m3fn) for all 32.
template <typename S>
inline __m512i fp8_fp16_bits32(const S* p) {
  static_assert(std::is_same_v<S, Fp8E4M3> || std::is_same_v<S, Fp8E5M2>);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (std::is_same_v<S, Fp8E4M3>) {  // as load_kv16(const Fp8E4M3*)
    return _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(raw), 7),
                            _mm512_set1_epi16(static_cast<int16_t>(0xBFFF)));
  } else {
    return _mm512_slli_epi16(_mm512_cvtepu8_epi16(raw), 8);
  }
}

// 32 fp8 codes into two registers of 16 float32 lanes, as load_kv16 gives them: their fp16 bits
// at once, then two conversions: a row's codes took five instructions per 16 (e4m3fn) where the
// conversion is what the value pass waits on.
template <typename S>
inline void load_kv32(const S* p, __m512* out) {
  const __m512i bits = fp8_fp16_bits32(p);
  out[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(bits));
  out[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1));
}

// Whether a pool of S is read 32 codes at a time (load_kv32).
template <typename S>
constexpr bool kFp8KV = std::is_same_v<S, Fp8E4M3> || std::is_same_v<S, Fp8E5M2>;

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
