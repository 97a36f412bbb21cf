// Decode attention straight from the paged KV pool, for CPUs (float32 and bf16).
//
// One new query token per request attends over its cached keys and values, which sit at
// arbitrary KV slots (its req_to_token row). The torch path writes the new K/V with two
// index_puts, gathers every request's K/V into a padded batch (two copies per layer), builds a
// mask and runs SDPA: a handful of kernels whose start-up costs dominate a decode step's small
// tensors. Here one call does it all. Each task (a request's KV heads, or a share of them when
// the threads need more tasks) writes its new K/V rows into the pool, then reads the request's
// slots in place, a block of 64 keys at a time: for each KV head, the query heads that share it
// take the block in passes of as many heads as keep their sums in registers (all of a group of
// 4 at head_dim 64), so each key and value row comes from memory once and from L1 for the other
// passes. (With the sums in memory, one store per multiply-add had made the value pass
// store-bound.) Scores, softmax and the weighted sum of values are float32 whatever the storage
// dtype (but for an fp8 pool's values on CPUs with AVX512-FP16, whose sums of 16 rows run in
// fp16 first: decode_fp16.h); every sum runs in the same order whatever the pass sizes, so a
// request's output does not depend on the batch.
//
// A sliding window W (window > 0) starts each request's keys at position seq_len - W: the
// earlier slots are never read. A soft cap C (softcap > 0, Gemma 2) replaces each scaled score s
// by C * tanh(s / C) before the softmax.
//
// Tasks never race: a task writes only its own heads of its own request's new slot, and reads
// only its own request's slots.
//
// decode_attention_quant reads a quantized pool (int8 or fp8 codes with a float32 scale per slot
// and KV head, kv_quant.h) the same way, a row's codes times its scale as it is loaded: a quarter
// (float32 models) or half (bf16) of the bytes per key, which is what a long decode is bound by.
// It does not write the new token's K/V: the caller quantized it into the pool already. A row's
// scale is folded in once per query head rather than per register of codes: a key's score is
// (q . codes) * scale, a value row is weighted by p * scale.

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

#include "decode_fp16.h"
#include "decode_narrow.h"
#include "decode_rows.h"
#include "kv_quant.h"
#include "paged_attention.h"
#include "vec_math.h"

namespace {

using namespace radixserve_cpu;

constexpr int64_t kMaxHeadRegs = 16;  // head_dim up to 256

// Calls fn(std::integral_constant<int64_t, value>{}) for 1 <= value <= kMax: head_dim's register
// count and a pass's head count become compile-time, so their loops unroll into registers (a
// runtime count made the kernel 2x slower than SDPA).
template <int64_t kMax, int64_t V = 1, typename Fn>
void with_constant(int64_t value, Fn&& fn) {
  if constexpr (V <= kMax) {
    if (value == V) {
      fn(std::integral_constant<int64_t, V>{});
    } else {
      with_constant<kMax, V + 1>(value, fn);
    }
  }
}

// c10::BFloat16 storage, next to vec_math.h's float32 and uint16_t overloads
using radixserve_cpu::load16;
using radixserve_cpu::store16;
inline __m512 load16(const c10::BFloat16* p) {
  return load_bf16(reinterpret_cast<const uint16_t*>(p));
}
inline void store16(c10::BFloat16* p, __m512 v) {
  store_bf16(reinterpret_cast<uint16_t*>(p), round_to_bf16(v));
}

// The query heads of a group handled in one pass: their sums (R registers each) stay in
// registers, at most 16 of the 32 with the key or value row beside them.
constexpr int64_t kPassRegs = 16;
constexpr int64_t heads_per_pass(int64_t regs) {
  return std::max<int64_t>(1, std::min<int64_t>(8, kPassRegs / regs));
}

// The score pass of G heads over keys [t0, t1), four keys at a time (sum4): scores[g][t] =
// query_g . k_t (times a quantized row's scale). For G heads whose four keys' sums, queries and
// a key row fit the 32 registers.
template <typename S, int64_t R, int64_t G>
void score_pass4(const __m512* query, const Rows<S>& rows, int64_t t0, int64_t t1, int64_t len,
                 int64_t head_dim, float* scores) {
  __m512 q[G][R];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < R; ++r) q[g][r] = query[g * R + r];
  four_keys_at_a_time<G, kQuantizedKV<S>, false>(
      t0, t1, len, nullptr, scores, [&](int64_t t, __m512* dot) __attribute__((always_inline)) {
        __m512 row[R];
        load_row<S, R>(rows.k, rows.k_scale, rows, t, len, head_dim, row);
        for (int64_t g = 0; g < G; ++g) {
          dot[g] = _mm512_mul_ps(q[g][0], row[0]);
          for (int64_t r = 1; r < R; ++r) dot[g] = _mm512_fmadd_ps(q[g][r], row[r], dot[g]);
        }
        return row_scale<S>(rows.k_scale, rows, t);
      });
}

// Whether score_pass4 keeps G heads' four keys' sums, their queries and a key row in registers.
constexpr bool fits_four_keys(int64_t regs, int64_t heads) {
  return 4 * heads + heads * regs + regs <= 32;
}

// One pass of G heads over keys or values [t0, t1): with kScores, scores[g][t] = query_g . k_t;
// else acc_g += scores[g][t] v_t. `held` (the G heads' queries, or their sums: R registers
// each) stays in registers for the pass; score rows are `len` apart.
template <bool kScores, typename S, int64_t R, int64_t G>
void run_pass(__m512* held, const Rows<S>& rows, int64_t t0, int64_t t1, int64_t len,
              int64_t head_dim, float* scores) {
  __m512 reg[G][R];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < R; ++r) reg[g][r] = held[g * R + r];
  const float* scales = kScores ? rows.k_scale : rows.v_scale;
  for (int64_t t = t0; t < t1; ++t) {
    __m512 row[R];
    load_row<S, R>(kScores ? rows.k : rows.v, scales, rows, t, len, head_dim, row);
    // A quantized row's scale multiplies once per head (the dot product, or the probability
    // its values are weighted by), not once per register of the row.
    const float row_s = row_scale<S>(scales, rows, t);
    for (int64_t g = 0; g < G; ++g) {
      if constexpr (kScores) {
        __m512 dot = _mm512_mul_ps(reg[g][0], row[0]);
        for (int64_t r = 1; r < R; ++r) dot = _mm512_fmadd_ps(reg[g][r], row[r], dot);
        const float score = _mm512_reduce_add_ps(dot);
        scores[g * len + t] = kQuantizedKV<S> ? score * row_s : score;
      } else {
        const float weight = scores[g * len + t];
        const __m512 p = _mm512_set1_ps(kQuantizedKV<S> ? weight * row_s : weight);
        for (int64_t r = 0; r < R; ++r) reg[g][r] = _mm512_fmadd_ps(p, row[r], reg[g][r]);
      }
    }
  }
  if constexpr (!kScores) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < R; ++r) held[g * R + r] = reg[g][r];
  }
}

// Each row of scores (one per query head, `len` long) becomes its softmax, in place.
void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * len;
    __m512 top_v = _mm512_set1_ps(-INFINITY);  // the row's maximum, 16 lanes at a time
    for (int64_t t = 0; t < len; t += kLanes) {
      top_v = _mm512_max_ps(top_v, _mm512_mask_loadu_ps(top_v, lanes(len - t), s + t));
    }
    const float top = _mm512_reduce_max_ps(top_v);
    top_v = _mm512_set1_ps(top);
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
}

// S: the pool's element type, T's own or (quantized) the codes; a quantized pool comes with its
// scales (k_scale, v_scale) and no new K/V to write (k, v and loc undefined).
template <typename T, typename S, int64_t kRegs>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& loc, const at::Tensor& k_buffer,
                           const at::Tensor& v_buffer, const at::Tensor& k_scale,
                           const at::Tensor& v_scale, const at::Tensor& req_to_token,
                           const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                           double scale, int64_t window, double softcap, at::Tensor& out,
                           bool bf16_query = false) {
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_buffer.size(1), group = heads / kv_heads;
  constexpr int64_t regs = kRegs;
  constexpr int64_t pass = heads_per_pass(kRegs);
  const int64_t kv_row = kv_heads * head_dim, table_stride = req_to_token.stride(0);
  constexpr bool quantized = kQuantizedKV<S>;
  const int64_t q_stride = q.stride(0);
  const int64_t k_stride = quantized ? 0 : k.stride(0), v_stride = quantized ? 0 : v.stride(0);
  const T* q_ptr = q.data_ptr<T>();
  const S* k_new = quantized ? nullptr : static_cast<const S*>(k.data_ptr());
  const S* v_new = quantized ? nullptr : static_cast<const S*>(v.data_ptr());
  S* k_ptr = static_cast<S*>(k_buffer.data_ptr());
  S* v_ptr = static_cast<S*>(v_buffer.data_ptr());
  const float* k_scale_ptr = quantized ? k_scale.data_ptr<float>() : nullptr;
  const float* v_scale_ptr = quantized ? v_scale.data_ptr<float>() : nullptr;
  const ScaleStrides scale_at = quantized ? scale_strides(k_scale) : ScaleStrides{0, 0};
  const int64_t* loc_ptr = quantized ? nullptr : loc.data_ptr<int64_t>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t* pool_idx = req_pool_indices.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const __m512 scale_v = _mm512_set1_ps(static_cast<float>(scale));
  const float cap = static_cast<float>(softcap);

  // A task takes one request's KV heads [h0, h0 + span), every head over a block of keys before
  // the next block, so the block's rows (each head's side by side, kv_row apart) are one stretch
  // of memory read in one go. (A task per KV head read one line of every kv_heads over the whole
  // context, and the other heads' tasks read the lines between later: see RESULTS.md, session
  // 23.) Requests are split by heads only as far as the threads need work: two tasks a thread.
  if (batch == 0) return;
  const int64_t want_chunks =
      std::min(kv_heads, (2 * at::get_num_threads() + batch - 1) / batch);
  const int64_t span = (kv_heads + want_chunks - 1) / want_chunks;
  const int64_t chunks = (kv_heads + span - 1) / span;
  at::parallel_for(0, batch * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    // the task's query heads (span KV heads' groups, in order): their scaled queries and output
    // sums, head_dim / 16 registers per query head
    const int64_t q_heads = span * group;
    std::vector<__m512> query(q_heads * regs), acc(q_heads * regs);
    std::vector<Rows<S>> rows(span);
    // bf16_query: the same queries as int16 (regs / 2 registers per head) and their scales
    constexpr bool kInt16Keys = std::is_same_v<S, int8_t> && regs % 2 == 0;
    const bool int16_scores = kInt16Keys && bf16_query;
    std::vector<__m512i> query16(int16_scores ? q_heads * regs / 2 : 0);
    std::vector<float> query16_scale(int16_scores ? q_heads : 0);
    // bf16_query over fp8 keys: the unscaled queries as bf16 (regs / 2 registers per head)
    constexpr bool kBf16Keys =
        (std::is_same_v<S, Fp8E4M3> || std::is_same_v<S, Fp8E5M2>) && regs % 2 == 0;
    const bool bf16_scores = kBf16Keys && bf16_query;
    std::vector<__m512i> query_bf16(bf16_scores ? q_heads * regs / 2 : 0);
    std::vector<float> bf16_factor(bf16_scores ? q_heads : 0, 0.0f);
    if constexpr (kBf16Keys) {
      std::fill(bf16_factor.begin(), bf16_factor.end(),
                static_cast<float>(scale) * (kBf16CodeFactor<S> / kBf16QueryFactor));
    }
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, h0 = task % chunks * span;
      const int64_t n_kv = std::min(span, kv_heads - h0), n_q = n_kv * group;
      // the keys the query sees: positions [first, seq_len)
      const int64_t first = window > 0 ? std::max<int64_t>(0, len_ptr[b] - window) : 0;
      const int64_t len = len_ptr[b] - first;
      for (int64_t i = 0; i < n_kv; ++i) {
        const int64_t h = h0 + i, head_off = h * head_dim;
        rows[i] = Rows<S>{k_ptr + head_off, v_ptr + head_off,
                          table + pool_idx[b] * table_stride + first, kv_row};
        if constexpr (quantized) {
          rows[i].k_scale = k_scale_ptr + h * scale_at.head;
          rows[i].v_scale = v_scale_ptr + h * scale_at.head;
          rows[i].scale_row = scale_at.row;
        } else {
          std::copy_n(k_new + b * k_stride + head_off, head_dim,
                      k_ptr + loc_ptr[b] * kv_row + head_off);
          std::copy_n(v_new + b * v_stride + head_off, head_dim,
                      v_ptr + loc_ptr[b] * kv_row + head_off);
        }
      }
      const T* q_task = q_ptr + b * q_stride + h0 * group * head_dim;
      for (int64_t i = 0; i < n_q * regs; ++i) {
        query[i] = _mm512_mul_ps(load16(q_task + i * kLanes), scale_v);
        acc[i] = _mm512_setzero_ps();
      }
      if constexpr (kBf16Keys) {
        if (bf16_scores) {
          const __m512 lift = _mm512_set1_ps(kBf16QueryFactor);
          for (int64_t i = 0; i < n_q * regs / 2; ++i) {
            query_bf16[i] =
                pack_bf16_values(_mm512_mul_ps(load16(q_task + 2 * i * kLanes), lift),
                                 _mm512_mul_ps(load16(q_task + (2 * i + 1) * kLanes), lift));
          }
        }
      }
      if constexpr (kInt16Keys) {
        if (int16_scores) {
          for (int64_t g = 0; g < n_q; ++g) {
            quantize_query<regs>(query.data() + g * regs, query16.data() + g * regs / 2,
                                 query16_scale.data() + g);
          }
        }
      }
      // Keys, then values, a block at a time, every head of the task over the block before the
      // next: each block's rows come from memory once and from L1 for the other passes.
      scores.resize(n_q * len);
      const auto over_blocks = [&](auto scores_tag, __m512* held) {
        for (int64_t t0 = 0; t0 < len; t0 += kKeyBlock) {
          const int64_t t1 = std::min(len, t0 + kKeyBlock);
          for (int64_t i = 0; i < n_kv; ++i) {
            for (int64_t g0 = 0; g0 < group; g0 += pass) {
              const int64_t g = i * group + g0;  // the pass's first query head in the task
              float* head_scores = scores.data() + g * len;
              with_constant<pass>(std::min(pass, group - g0), [&](auto heads_tag) {
                constexpr int64_t heads_now = decltype(heads_tag)::value;
                constexpr bool scoring = decltype(scores_tag)::value;
                if constexpr (scoring && kInt16Keys &&
                              fits_four_keys_narrow(regs / 2, heads_now)) {
                  if (int16_scores) {
                    score_pass4_narrow<Int16Keys, regs / 2, heads_now>(
                        query16.data() + g * regs / 2, query16_scale.data() + g, rows[i], t0,
                        t1, len, head_dim, head_scores);
                    return;
                  }
                }
                if constexpr (scoring && kBf16Keys &&
                              fits_four_keys_narrow(regs / 2, heads_now)) {
                  if (bf16_scores) {
                    score_pass4_narrow<Bf16Keys<S>, regs / 2, heads_now>(
                        query_bf16.data() + g * regs / 2, bf16_factor.data(), rows[i], t0, t1,
                        len, head_dim, head_scores);
                    return;
                  }
                }
                if constexpr (!scoring && kFp16Values && kBf16Keys) {
                  if (bf16_scores && rows[i].scale_row == 0) {  // fp8's scale per layer
                    value_pass_fp16<S, regs / 2, heads_now>(
                        held + g * regs, rows[i], t0, t1, len, head_dim, head_scores,
                        row_scale<S>(rows[i].v_scale, rows[i], t0));
                    return;
                  }
                }
                if constexpr (scoring && fits_four_keys(regs, heads_now)) {
                  score_pass4<S, regs, heads_now>(held + g * regs, rows[i], t0, t1, len,
                                                   head_dim, head_scores);
                } else {
                  run_pass<scoring, S, regs, heads_now>(held + g * regs, rows[i], t0, t1, len,
                                                        head_dim, head_scores);
                }
              });
            }
          }
        }
      };
      over_blocks(std::true_type{}, query.data());
      if (cap > 0.0f) {
        for (float& x : scores) x = cap * std::tanh(x / cap);
      }
      softmax_rows(scores.data(), n_q, len);
      over_blocks(std::false_type{}, acc.data());
      T* dst = out_ptr + b * heads * head_dim + h0 * group * head_dim;
      for (int64_t i = 0; i < n_q * regs; ++i) store16(dst + i * kLanes, acc[i]);
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
                      const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                      at::Tensor out) {
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
  const auto run = [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    with_constant<kMaxHeadRegs>(q.size(2) / kLanes, [&](auto regs) {
      decode_attention_impl<T, T, decltype(regs)::value>(
          q, k, v, loc, k_buffer, v_buffer, at::Tensor(), at::Tensor(), req_to_token,
          req_pool_indices, seq_lens, scale, window, softcap, out);
    });
  };
  with_attention_dtype("decode_attention", q, run);
}

// decode_attention over a quantized pool: q and out float32 [batch, heads, head_dim]; k_buffer,
// v_buffer [slots, kv_heads, head_dim] of int8 or fp8 codes; k_scale, v_scale float32 [slots,
// kv_heads] (check_kv_scales: per slot, or one per layer with strides 0). The new token's K/V
// must be in the pool already (the caller quantized it there).
// bf16_query (q holds bf16 values: a bf16 model's queries), head_dim a multiple of 32: int8
// keys are scored against the query quantised to int16 (score_pass4_narrow, finer than the bf16
// it came from), fp8 keys as bf16 against the bf16 query (score_pass4_narrow); otherwise in
// float32.
void decode_attention_quant(const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& k_scale,
                            const at::Tensor& v_scale, const at::Tensor& req_to_token,
                            const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                            double scale, int64_t window, double softcap, at::Tensor out,
                            bool bf16_query) {
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && out.sizes() == q.sizes() &&
                  k_buffer.sizes() == v_buffer.sizes() && k_buffer.size(2) == q.size(2),
              "decode_attention_quant: q and out must be [batch, heads, head_dim], the KV "
              "buffers [slots, kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "decode_attention_quant: q and out must be float32");
  TORCH_CHECK(k_buffer.scalar_type() == v_buffer.scalar_type(),
              "decode_attention_quant: K and V codes must share a dtype");
  TORCH_CHECK(q.size(1) % k_buffer.size(1) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= kLanes * kMaxHeadRegs,
              "head_dim must be a multiple of 16 up to 256, got ", q.size(2));
  check_kv_scales("decode_attention_quant", k_buffer, k_scale, v_scale);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2),
              "decode_attention_quant: q must have contiguous heads in each row");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous() && out.is_contiguous(),
              "the KV buffers and out must be contiguous");
  const int64_t batch = q.size(0);
  check_long_vector(req_pool_indices, batch, "req_pool_indices");
  check_long_vector(seq_lens, batch, "seq_lens");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.dim() == 2 &&
                  req_to_token.stride(1) == 1,
              "req_to_token must be int64 [requests, context] with contiguous rows");
  with_quantized_kv_dtype("decode_attention_quant", k_buffer, [&](auto code_tag) {
    using S = decltype(code_tag);
    with_constant<kMaxHeadRegs>(q.size(2) / kLanes, [&](auto regs) {
      decode_attention_impl<float, S, decltype(regs)::value>(
          q, at::Tensor(), at::Tensor(), at::Tensor(), k_buffer, v_buffer, k_scale, v_scale,
          req_to_token, req_pool_indices, seq_lens, scale, window, softcap, out, bf16_query);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("decode_attention(" RADIXSERVE_PAGED_ATTENTION_ARGS
        "float scale, int window, float softcap, Tensor(c!) out) -> ()");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
  m.def("decode_attention_quant(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor k_scale, "
        "Tensor v_scale, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "float scale, int window, float softcap, Tensor(c!) out, bool bf16_query=False) -> ()");
  m.impl("decode_attention_quant", c10::DispatchKey::CPU, &decode_attention_quant);
}
