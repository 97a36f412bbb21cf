// What the two paged attention kernels (decode_attention.cpp, extend_attention.cpp) share: the
// dtypes they take and the arguments their schemas start with.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

// The schema arguments both kernels start with: the new tokens' q, k and v, the slots their K/V
// go to, the KV buffers written in place, and where each request's slots are.
#define RADIXSERVE_PAGED_ATTENTION_ARGS                                                       \
  "Tensor q, Tensor k, Tensor v, Tensor loc, Tensor(a!) k_buffer, Tensor(b!) v_buffer, "      \
  "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "

namespace radixserve_cpu {

// Calls fn(T{}) with T the element type of q: float or c10::BFloat16.
template <typename Fn>
void with_attention_dtype(const char* op, const at::Tensor& q, Fn&& fn) {
  if (q.scalar_type() == at::kFloat) {
    fn(float{});
  } else if (q.scalar_type() == at::kBFloat16) {
    fn(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, op, " takes float32 or bfloat16, got ", q.scalar_type());
  }
}

}  // namespace radixserve_cpu
