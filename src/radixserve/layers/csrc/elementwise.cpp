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
// separately, as torch's separate kernels round them.

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace radixserve_cpu;

// Elements a thread should get before a call is split over threads: below it, starting the
// OpenMP region costs more than the work (decode batches stay on one thread).
constexpr int64_t kElementsPerThread = 1 << 15;

int64_t row_grain(int64_t row_size) { return std::max<int64_t>(1, kElementsPerThread / row_size); }

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

// Calls fn(T{}) with T the storage type of `t` (bf16 as uint16_t, or float).
template <typename Fn>
void with_storage_type(const char* op, const at::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == at::kBFloat16) {
    fn(uint16_t{});
  } else if (t.scalar_type() == at::kFloat) {
    fn(float{});
  } else {
    TORCH_CHECK(false, op, " takes bfloat16 or float32 tensors, got ", t.scalar_type());
  }
}

void check_like(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " is ", t.scalar_type(),
              ", x is ", x.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// x: [..., hidden]; weight: [hidden]. Returns rows = numel / hidden.
int64_t check_norm(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  check_like(op, "x", x, x);
  check_like(op, "weight", weight, x);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must be [..., hidden], got ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), op, ": weight must be [",
              x.size(-1), "] for x of ", x.sizes(), ", got ", weight.sizes());
  return x.numel() / x.size(-1);
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// x: [..., hidden] contiguous; weight: [hidden], same dtype. Returns a new tensor shaped like x.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out;
  with_storage_type("rms_norm", x, [&](auto tag) {
    using T = decltype(tag);
    const int64_t rows = check_norm("rms_norm", x, weight), n = x.size(-1);
    out = at::empty(x.sizes(), x.options());
    at::parallel_for(0, rows, row_grain(n), [&](int64_t first, int64_t last) {
      rms_norm_rows(ptr<T>(x), ptr<T>(weight), ptr<T>(out), n, static_cast<float>(eps), first,
                    last);
    });
  });
  return out;
}

// In place, as vLLM's and SGLang's fused_add_rms_norm: residual <- x + residual, then
// x <- rms_norm(residual). x and residual: same shape [..., hidden], contiguous, not overlapping.
void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  with_storage_type("fused_add_rms_norm", x, [&](auto tag) {
    using T = decltype(tag);
    const int64_t rows = check_norm("fused_add_rms_norm", x, weight), n = x.size(-1);
    check_like("fused_add_rms_norm", "residual", residual, x);
    TORCH_CHECK(residual.sizes() == x.sizes(), "fused_add_rms_norm: residual is ",
                residual.sizes(), ", x is ", x.sizes());
    at::assert_no_overlap(x, residual);
    at::parallel_for(0, rows, row_grain(n), [&](int64_t first, int64_t last) {
      add_rms_norm_rows(ptr<T>(x), ptr<T>(residual), ptr<T>(weight), n, static_cast<float>(eps),
                        first, last);
    });
  });
}

// x: [..., 2d] contiguous, gate then up (gate_up_proj's output). Returns [..., d].
at::Tensor silu_and_mul(const at::Tensor& x) {
  at::Tensor out;
  with_storage_type("silu_and_mul", x, [&](auto tag) {
    using T = decltype(tag);
    check_like("silu_and_mul", "x", x, x);
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) % 2 == 0,
                "silu_and_mul: x must be [..., 2d] (gate then up), got ", x.sizes());
    const int64_t d = x.size(-1) / 2, rows = x.numel() / x.size(-1);
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = d;
    out = at::empty(sizes, x.options());
    at::parallel_for(0, rows, row_grain(2 * d), [&](int64_t first, int64_t last) {
      silu_and_mul_rows(ptr<T>(x), ptr<T>(out), d, first, last);
    });
  });
  return out;
}

// x: [tokens, heads, head_dim] with contiguous heads (a row-strided view of the fused qkv
// output); cos, sin: [tokens, 1, head_dim] as RotaryEmbedding.forward makes them (neox halves,
// the sign of rotate_half folded into sin). Returns a new contiguous tensor.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor out;
  with_storage_type("rotary", x, [&](auto tag) {
    using T = decltype(tag);
    for (const auto& [name, t] : {std::pair{"cos", &cos}, {"sin", &sin}}) {
      TORCH_CHECK(t->scalar_type() == x.scalar_type(), "rotary: ", name, " is ",
                  t->scalar_type(), ", x is ", x.scalar_type());
    }
    TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1 &&
                    x.stride(1) == x.size(2),
                "x must be [tokens, heads, head_dim] with contiguous heads and an even head_dim, "
                "got ", x.sizes());
    TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == x.size(0) &&
                    cos.size(1) == 1 && cos.size(2) == x.size(2) && cos.is_contiguous() &&
                    sin.is_contiguous(),
                "cos and sin must be contiguous [tokens, 1, head_dim] matching x ", x.sizes());
    const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
    out = at::empty(x.sizes(), x.options());
    at::parallel_for(0, tokens, row_grain(heads * dim), [&](int64_t first, int64_t last) {
      rotary_rows(ptr<T>(x), x.stride(0), ptr<T>(cos), ptr<T>(sin), ptr<T>(out), heads, dim,
                  first, last);
    });
  });
  return out;
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

// logits: [rows, vocab]. Returns int64 [rows]: torch.argmax's answer, the first maximum of each
// row with NaN counting as the maximum. bf16 and float32 take the vectorised two passes; other
// dtypes (float16 logits of a float16 model) torch's argmax.
at::Tensor argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, "argmax takes [rows, vocab] logits, got ", logits.sizes());
  if ((logits.scalar_type() != at::kBFloat16 && logits.scalar_type() != at::kFloat) ||
      logits.size(1) == 0) {
    return logits.argmax(-1);
  }
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  with_storage_type("argmax", x, [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) ids[r] = argmax_row(ptr<T>(x) + r * vocab, vocab);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("argmax(Tensor logits) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &fused_add_rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("rotary", c10::DispatchKey::CPU, &rotary);
  m.impl("argmax", c10::DispatchKey::CPU, &argmax);
}
