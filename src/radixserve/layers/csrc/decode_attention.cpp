// Decode attention straight from the paged KV pool, for CPUs (float32 and bf16).
//
// One new query token per request attends over its cached keys and values, which sit at
// arbitrary KV slots (its req_to_token row). The torch path writes the new K/V with two
// index_puts, gathers every request's K/V into a padded batch (two copies per layer), builds a
// mask and runs SDPA: a handful of kernels whose start-up costs dominate a decode step's small
// tensors. Here one call does it all. Each (request, KV head) task writes its new K/V row into the
// pool, then reads the request's slots in place, once: the query heads that share a KV head are
// handled together, so each key and value row is loaded once per group. Scores, softmax and the
// weighted sum of values are float32 whatever the storage dtype.
//
// Tasks never race: a task writes only its own head of its own request's new slot, and reads
// only its own request's slots.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "paged_attention.h"
#include "vec_math.h"

namespace {

using namespace radixserve_cpu;

constexpr int64_t kMaxHeadRegs = 16;  // head_dim up to 256

// Calls fn(std::integral_constant<int64_t, regs>{}) for regs in 1..16.
template <int64_t R = 1, typename Fn>
void with_head_regs(int64_t regs, Fn&& fn) {
  if constexpr (R <= kMaxHeadRegs) {
    if (regs == R) {
      fn(std::integral_constant<int64_t, R>{});
    } else {
      with_head_regs<R + 1>(regs, fn);
    }
  }
}

// c10::BFloat16 storage, next to vec_math.h's float32 and uint16_t overloads
using radixserve_cpu::load16;
using radixserve_cpu::store16;
inline __m512 load16(const c10::BFloat16* p) {
  return load_bf16(reinterpret_cast<const uint16_t*>(p));
}
constexpr int64_t kAhead = 8;  // rows prefetched ahead: slots are scattered, the prefetcher blind

template <typename T>
inline void prefetch_row(const T* row, int64_t head_dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < head_dim * static_cast<int64_t>(sizeof(T)); off += 64) {
    _mm_prefetch(p + off, _MM_HINT_T0);
  }
}

inline void store16(c10::BFloat16* p, __m512 v) {
  store_bf16(reinterpret_cast<uint16_t*>(p), round_to_bf16(v));
}

template <typename T, int64_t kRegs>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& loc, const at::Tensor& k_buffer,
                           const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                           const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                           double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_buffer.size(1), group = heads / kv_heads;
  constexpr int64_t regs = kRegs;
  const int64_t kv_row = kv_heads * head_dim, table_stride = req_to_token.stride(0);
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0), v_stride = v.stride(0);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_new = k.data_ptr<T>();
  const T* v_new = v.data_ptr<T>();
  T* k_ptr = k_buffer.data_ptr<T>();
  T* v_ptr = v_buffer.data_ptr<T>();
  const int64_t* loc_ptr = loc.data_ptr<int64_t>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t* pool_idx = req_pool_indices.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const __m512 scale_v = _mm512_set1_ps(static_cast<float>(scale));

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    // the group's scaled queries and output sums, head_dim / 16 registers per query head
    std::vector<__m512> query(group * regs), acc(group * regs);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, len = len_ptr[b];
      const int64_t* slots = table + pool_idx[b] * table_stride;
      const int64_t head_off = h * head_dim;
      std::copy_n(k_new + b * k_stride + head_off, head_dim, k_ptr + loc_ptr[b] * kv_row + head_off);
      std::copy_n(v_new + b * v_stride + head_off, head_dim, v_ptr + loc_ptr[b] * kv_row + head_off);
      const T* q_group = q_ptr + b * q_stride + h * group * head_dim;
      for (int64_t i = 0; i < group * regs; ++i) {
        query[i] = _mm512_mul_ps(load16(q_group + i * kLanes), scale_v);
      }
      // scores[g][t] = q_g . k_t: each key row is loaded once for the whole group
      scores.resize(group * len);
      for (int64_t t = 0; t < len; ++t) {
        if (t + kAhead < len) prefetch_row(k_ptr + slots[t + kAhead] * kv_row + head_off, head_dim);
        const T* key = k_ptr + slots[t] * kv_row + head_off;
        __m512 key_regs[kRegs];
        for (int64_t r = 0; r < regs; ++r) key_regs[r] = load16(key + r * kLanes);
        for (int64_t g = 0; g < group; ++g) {
          __m512 dot = _mm512_mul_ps(query[g * regs], key_regs[0]);
          for (int64_t r = 1; r < regs; ++r) {
            dot = _mm512_fmadd_ps(query[g * regs + r], key_regs[r], dot);
          }
          scores[g * len + t] = _mm512_reduce_add_ps(dot);
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax over the row, in place
        float* s = scores.data() + g * len;
        const float top = *std::max_element(s, s + len);
        const __m512 top_v = _mm512_set1_ps(top);
        __m512 total_v = _mm512_setzero_ps();
        int64_t t = 0;
        for (; t + kLanes <= len; t += kLanes) {
          __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), top_v));
          _mm512_storeu_ps(s + t, e);
          total_v = _mm512_add_ps(total_v, e);
        }
        float total = _mm512_reduce_add_ps(total_v);
        for (; t < len; ++t) {
          s[t] = std::exp(s[t] - top);
          total += s[t];
        }
        const float inv = 1.0f / total;
        for (t = 0; t < len; ++t) s[t] *= inv;
      }
      for (int64_t i = 0; i < group * regs; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {  // out_g = sum_t p[g][t] v_t, each value row once
        if (t + kAhead < len) prefetch_row(v_ptr + slots[t + kAhead] * kv_row + head_off, head_dim);
        const T* value = v_ptr + slots[t] * kv_row + head_off;
        __m512 value_regs[kRegs];
        for (int64_t r = 0; r < regs; ++r) value_regs[r] = load16(value + r * kLanes);
        for (int64_t g = 0; g < group; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * len + t]);
          for (int64_t r = 0; r < regs; ++r) {
            acc[g * regs + r] = _mm512_fmadd_ps(p, value_regs[r], acc[g * regs + r]);
          }
        }
      }
      T* dst = out_ptr + b * heads * head_dim + h * group * head_dim;
      for (int64_t i = 0; i < group * regs; ++i) store16(dst + i * kLanes, acc[i]);
    }
  });
}

void check_long_vector(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == n && t.is_contiguous(),
              name, " must be a contiguous int64 [batch] tensor");
}

// q, out: [batch, heads, head_dim]; k, v: [batch, kv_heads, head_dim], the new token's K/V,
// written at slot loc[b]; k_buffer, v_buffer: [slots, kv_heads, head_dim]; req_to_token: int64
// [requests, context], row req_pool_indices[b] holds the slots of request b's seq_lens[b]
// positions (the new one last). One dtype (float32 or bf16); q, k and v may be row-strided views
// (of the fused qkv projection), everything else is contiguous.
void decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& loc, at::Tensor k_buffer, at::Tensor v_buffer,
                      const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                      const at::Tensor& seq_lens, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_buffer.dim() == 3 &&
                  v_buffer.dim() == 3 && out.sizes() == q.sizes(),
              "q and out must be [batch, heads, head_dim], k, v and the KV buffers "
              "[n, kv_heads, head_dim]");
  const int64_t batch = q.size(0);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == batch && k.size(1) == k_buffer.size(1) &&
                  k.size(2) == q.size(2) && k_buffer.sizes() == v_buffer.sizes() &&
                  k_buffer.size(2) == q.size(2),
              "the new K/V and the KV buffers do not match q's batch or head_dim");
  TORCH_CHECK(q.size(1) % k_buffer.size(1) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= kLanes * kMaxHeadRegs,
              "head_dim must be a multiple of 16 up to 256, got ", q.size(2));
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &k_buffer,
                                                                     &v_buffer, &out}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "q, K/V and out must share a dtype");
  }
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q, k and v must have contiguous heads in each row");
  }
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous() && out.is_contiguous(),
              "the KV buffers and out must be contiguous");
  check_long_vector(loc, batch, "loc");
  check_long_vector(req_pool_indices, batch, "req_pool_indices");
  check_long_vector(seq_lens, batch, "seq_lens");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.dim() == 2 &&
                  req_to_token.stride(1) == 1,
              "req_to_token must be int64 [requests, context] with contiguous rows");
  // head_dim as a compile-time register count: the loops over it unroll into registers (a
  // runtime count made the kernel 2x slower than SDPA)
  const auto run = [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    with_head_regs(q.size(2) / kLanes, [&](auto regs) {
      decode_attention_impl<T, decltype(regs)::value>(q, k, v, loc, k_buffer, v_buffer,
                                                      req_to_token, req_pool_indices, seq_lens,
                                                      scale, out);
    });
  };
  with_attention_dtype("decode_attention", q, run);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("decode_attention(" RADIXSERVE_PAGED_ATTENTION_ARGS "float scale, Tensor(c!) out) -> ()");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}
