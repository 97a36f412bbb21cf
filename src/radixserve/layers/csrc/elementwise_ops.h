// The elementwise ops (RMSNorm alone or after the residual add, SwiGLU, rotary, greedy argmax)
// as torch sees them: argument checks, output allocation and the split over threads, shared by
// every kernel set. Each set's elementwise.cpp defines the row functions declared here with its
// own registers (csrc/elementwise.cpp: AVX-512; csrc/avx2/elementwise.cpp: AVX2), then calls
// define_elementwise_ops; the two compute the same values in the same order.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

namespace radixserve_cpu {

// Row functions, per element type T (uint16_t holds bf16, or float), defined by the kernel set.
//   rms_norm:      out = T(w * T(x * rsqrt(mean(x^2) + eps)))
//   add + norm:    residual = T(x + residual); x = rms_norm(residual)
//   silu_and_mul:  out = T(T(silu(gate)) * up), rows [gate (d) | up (d)] -> [d]
//   rotary:        out = T(T(x * cos) + T(rotate_half(x) * sin)) (sin carries the sign); x rows
//                  of `heads` contiguous heads, `x_stride` apart; cos, sin [tokens, dim]
//   argmax:        the first maximum of a row, NaN counting as the maximum
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t n, float eps, int64_t first,
                   int64_t last);
template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* w, int64_t n, float eps, int64_t first,
                       int64_t last);
template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t d, int64_t first, int64_t last);
template <typename T>
void rotary_rows(const T* xs, int64_t x_stride, const T* cs, const T* ss, T* ys, int64_t heads,
                 int64_t dim, int64_t first, int64_t last);
template <typename T>
int64_t argmax_row(const T* x, int64_t vocab);

namespace elementwise {

// Elements a thread should get before a call is split over threads: below it, starting the
// OpenMP region costs more than the work (decode batches stay on one thread).
constexpr int64_t kElementsPerThread = 1 << 15;

inline int64_t row_grain(int64_t row_size) {
  return std::max<int64_t>(1, kElementsPerThread / row_size);
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

inline void check_like(const char* op, const char* name, const at::Tensor& t,
                       const at::Tensor& x) {
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " is ", t.scalar_type(),
              ", x is ", x.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// x: [..., hidden]; weight: [hidden]. Returns rows = numel / hidden.
inline int64_t check_norm(const char* op, const at::Tensor& x, const at::Tensor& weight) {
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
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
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
inline void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight, double eps) {
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
inline at::Tensor silu_and_mul(const at::Tensor& x) {
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
inline at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
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

// logits: [rows, vocab]. Returns int64 [rows]: torch.argmax's answer, the first maximum of each
// row with NaN counting as the maximum. bf16 and float32 take the kernel set's row function;
// other dtypes (float16 logits of a float16 model) torch's argmax.
inline at::Tensor argmax(const at::Tensor& logits) {
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

}  // namespace elementwise

// Registers the five ops (call from the kernel set's TORCH_LIBRARY_FRAGMENT).
inline void define_elementwise_ops(torch::Library& m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("argmax(Tensor logits) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &elementwise::rms_norm);
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &elementwise::fused_add_rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &elementwise::silu_and_mul);
  m.impl("rotary", c10::DispatchKey::CPU, &elementwise::rotary);
  m.impl("argmax", c10::DispatchKey::CPU, &elementwise::argmax);
}

}  // namespace radixserve_cpu
