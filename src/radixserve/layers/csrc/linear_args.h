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
