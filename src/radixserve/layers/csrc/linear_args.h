// What radixserve's linear kernels (linear.cpp, linear_int8.cpp, linear_int4.cpp) check and
// dispatch alike: activations [M, K] in bf16 or float32, an optional bias [n] of their dtype,
// and the kernel instantiated for the activations' element type (uint16_t holds bf16).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace radixserve_cpu {

inline void check_activations(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              " takes bfloat16 or float32 activations, got ", x.scalar_type());
}

// The bias' data (null without one); refused unless it is a contiguous [n] tensor of x's dtype.
inline const void* checked_bias(const char* op, const at::Tensor& x,
                                const std::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->dim() == 1 &&
                  bias->size(0) == n && bias->is_contiguous(),
              op, ": bias must be a contiguous [", n, "] tensor of x's dtype");
  return bias->data_ptr();
}

// x [M, K] (rows contiguous) against a blocked weight [N/block, K/step, block, step] of x's
// dtype (step 2 for bf16's input pairs, 1 for float32) for an n-column output.
inline void check_blocked_linear(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                 int64_t n, int64_t block) {
  check_activations(op, x);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": x is ", x.scalar_type(),
              ", the weight ", weight.scalar_type());
  const int64_t step = x.scalar_type() == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == block && weight.size(3) == step &&
                  weight.is_contiguous(),
              "weight must be blocked [N/", block, ", K/", step, ", ", block, ", ", step, "]");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == weight.size(1) * step,
              "x must be [M, K] with contiguous rows and K = ", weight.size(1) * step,
              " (the weight's padded input size), got ", x.sizes());
  TORCH_CHECK(n > (weight.size(0) - 1) * block && n <= weight.size(0) * block, "n = ", n,
              " does not fit the weight's ", weight.size(0), " blocks");
}

// f(T{}) with T the element type of x's values: uint16_t for bf16, float for float32.
template <typename F>
void with_element_type(const at::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kBFloat16) {
    f(uint16_t{});
  } else {
    f(float{});
  }
}

}  // namespace radixserve_cpu
