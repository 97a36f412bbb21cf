// Prefill (EXTEND) attention straight from the paged KV pool, for CPUs (float32 and bf16):
// flash-style, so a 4096-token chunk costs time linear in the keys each query sees, not a
// padded [queries x keys] score matrix per request.
//
// Each request's new tokens attend causally over its whole KV (cached prefix + new tokens). One
// call per layer first writes the new K/V into the pool, then runs tasks of (request, KV head,
// block of 16 query positions): the rows of a task are those positions times the query heads
// that share the KV head. A task walks the keys in blocks of 64 (aligned to absolute key
// positions), converts each block to float32 once (K transposed, so that 16 scores come out of
// one register), and for every row keeps an online softmax: running maximum m, running sum l and
// the weighted sum of values, rescaled by e^(m_old - m_new) when the maximum grows. Keys past a
// row's position get probability exactly 0; key blocks past it are skipped. The softmax's
// reductions and rescaling run once per block, so a block of 64 keys costs them a quarter of
// what four blocks of 16 did (they had taken a third of the time). Scores and weighted values are
// computed for tiles of four rows, with the sums in registers, so that each key and value vector
// is loaded once per tile rather than once per row (the value pass was bound by loads: two per
// FMA).
//
// A sliding window W (window > 0) limits a row at position p to keys (p - W, p]: its task starts
// at the key block holding its first row's earliest key (blocks stay aligned to absolute
// positions), and a row skips the blocks wholly before its window. A soft cap C (softcap > 0,
// Gemma 2) replaces each scaled score s by C * tanh(s / C) before the softmax.
//
// A row's result depends only on its query, its position and the keys up to it, never on the
// other rows of its task, the chunk it is prefilled in or the tokens cached before it: the same
// operations run in the same order for it whatever the batch (batch invariance, which
// `--enable-deterministic-inference` relies on: chunked prefill of 64 or 4096 tokens and a radix
// cache hit give the bits of a cold prefill).
//
// extend_attention_quant reads a quantized pool (int8 or fp8 codes with a float32 scale per slot
// and KV head, kv_quant.h): a block's rows are dequantized as they are converted to float32, the
// rest is the same. It does not write the new tokens' K/V: the caller quantized them into the
// pool already, so the new tokens attend to their own K/V as the pool holds it, like the prefix.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "kv_quant.h"
#include "paged_attention.h"
#include "vec_math.h"

namespace {

using namespace radixserve_cpu;

constexpr int64_t kKeys = 64;     // keys per block: the softmax bookkeeping is per block
constexpr int kChunks = kKeys / kLanes;  // registers of scores per row and block
constexpr int64_t kQueries = 16;  // query positions per task
constexpr int kRowTile = 4;       // rows whose scores are computed together

template <typename T>
inline const uint16_t* as_u16(const T* p) {
  return reinterpret_cast<const uint16_t*>(p);
}
inline __m512 load_row(const float* p, __mmask16 m = 0xFFFF) { return load16(p, m); }
inline __m512 load_row(const c10::BFloat16* p, __mmask16 m = 0xFFFF) {
  return load16(as_u16(p), m);
}

struct Shape {
  int64_t heads, kv_heads, group, head_dim;
  int64_t q_stride, kv_row, table_stride, out_stride;
};

// Where a task's KV is: codes (or values) of S, and for a quantized pool the float32 scales
// ([slots, kv_heads], read through their strides: check_kv_scales).
template <typename S>
struct PoolKV {
  const S* k;
  const S* v;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  ScaleStrides scale{0, 0};
};

// 16 elements of a pool row in float32, its scale applied (`scale`: the row's scale times
// kScaleFactor; unused for an unquantized pool).
template <typename S>
inline __m512 load_pool(const S* p, __m512 scale) {
  if constexpr (kQuantizedKV<S>) {
    return _mm512_mul_ps(load_kv16(p), scale);
  } else {
    return load_kv16(p);
  }
}

// cols[e] = element e of rows[0..15]: a 16 x 16 float32 transpose. After the unpacks, register
// 4q + c holds, in its 128-bit quarter L, element 4L + c of rows 4q..4q+3; two rounds of
// quarter shuffles gather each element's four quarters.
inline void transpose16(const __m512* rows, __m512* cols) {
  __m512 t[kLanes], u[kLanes];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
  }
  const auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 x = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);  // quarters 0, 2
    const __m512 y = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);  // quarters 1, 3
    const __m512 z = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 w = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    cols[c] = _mm512_shuffle_f32x4(x, z, 0x88);
    cols[4 + c] = _mm512_shuffle_f32x4(y, w, 0x88);
    cols[8 + c] = _mm512_shuffle_f32x4(x, z, 0xDD);
    cols[12 + c] = _mm512_shuffle_f32x4(y, w, 0xDD);
  }
}

// acc[r] = acc[r] * alpha[r] + sum_j probs[r][j] v[j] for kRowTile rows from r0 and kDTile * 16
// dimensions from d0: the sums stay in registers while each value vector is loaded once for all
// the rows (and each probability once for all the dimensions). Per row and dimension the
// operations and their order are those of a row on its own; a row that skips the block
// (`live` false) keeps its acc untouched.
template <int kDTile>
inline void weigh_values(float* acc, const float* alpha, const float* probs, const char* live,
                         const float* vb, int64_t D, int64_t r0, int64_t d0) {
  __m512 a[kRowTile][kDTile];
  for (int t = 0; t < kRowTile; ++t) {
    const __m512 al = _mm512_set1_ps(alpha[r0 + t]);
    for (int c = 0; c < kDTile; ++c) {
      a[t][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + t) * D + d0 + c * kLanes), al);
    }
  }
  for (int64_t j = 0; j < kKeys; ++j) {
    __m512 vv[kDTile];
    for (int c = 0; c < kDTile; ++c) vv[c] = _mm512_loadu_ps(vb + j * D + d0 + c * kLanes);
    for (int t = 0; t < kRowTile; ++t) {
      const __m512 p = _mm512_set1_ps(probs[(r0 + t) * kKeys + j]);
      for (int c = 0; c < kDTile; ++c) a[t][c] = _mm512_fmadd_ps(p, vv[c], a[t][c]);
    }
  }
  for (int t = 0; t < kRowTile; ++t) {
    if (!live[r0 + t]) continue;
    for (int c = 0; c < kDTile; ++c) {
      _mm512_storeu_ps(acc + (r0 + t) * D + d0 + c * kLanes, a[t][c]);
    }
  }
}

// One task: rows = positions [first, first + count) of request b (absolute positions
// prefix + i) times the `group` query heads of KV head h, padded to whole tiles of kRowTile rows
// (padding rows see no key and are never written out).
template <typename T, typename S>
void attend_block(const T* q, const PoolKV<S>& kv, const int64_t* slots,
                  int64_t token0, int64_t prefix, int64_t first, int64_t count, int64_t h,
                  float scale, int64_t window, float cap, T* out, const Shape& s,
                  std::vector<float>& scratch) {
  const int64_t D = s.head_dim, G = s.group, rows = count * G;
  const int64_t padded = (rows + kRowTile - 1) / kRowTile * kRowTile;
  const int64_t max_pos = prefix + first + count - 1;
  // the arrays of registers start on 64-byte lines (their sizes are multiples of 16 floats), so
  // that no load or store of a register splits a cache line; the per-row floats come last
  scratch.resize(padded * D * 2 + kKeys * D * 2 + padded * kKeys + 3 * padded + kLanes);
  const auto misalign = reinterpret_cast<std::uintptr_t>(scratch.data()) % 64;
  float* qs = scratch.data() + (64 - misalign) % 64 / sizeof(float);  // [padded][D] scaled queries
  float* acc = qs + padded * D;           // [padded][D] weighted sums of values
  float* kt = acc + padded * D;           // [D][kKeys] keys, transposed
  float* vb = kt + kKeys * D;             // [kKeys][D] values
  float* probs = vb + kKeys * D;          // [padded][kKeys] scores, then probabilities
  float* m = probs + padded * kKeys;      // [padded] running maximum
  float* l = m + padded;                  // [padded] running sum
  float* alpha = l + padded;              // [padded] this block's rescaling of acc
  std::vector<int64_t> pos(padded, -1);   // -1: a padding row
  std::vector<char> live(padded);         // whether the row sees a key of the current block
  std::fill(qs, acc + padded * D, 0.0f);
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const T* qr = q + (token0 + first + i) * s.q_stride + (h * G + g) * D;
      for (int64_t d = 0; d < D; d += kLanes) {
        _mm512_storeu_ps(qs + r * D + d, _mm512_mul_ps(load_row(qr + d), scale_v));
      }
      pos[r] = prefix + first + i;
    }
  }
  std::fill(m, m + padded, -INFINITY);
  std::fill(l, l + padded, 0.0f);
  std::fill(alpha, alpha + padded, 1.0f);
  const int64_t head_off = h * D;
  const int64_t k_begin =
      window > 0 ? std::max<int64_t>(0, prefix + first - window + 1) / kKeys * kKeys : 0;
  for (int64_t k0 = k_begin; k0 <= max_pos; k0 += kKeys) {
    const int64_t n = std::min(kKeys, max_pos + 1 - k0);
    // the block in float32, a short last block zero-padded: values as they are, keys
    // transposed 16 x 16 in registers (a scalar store per element had cost decode steps in
    // deterministic mode, with few rows per task, more than their scores)
    for (int64_t j0 = 0; j0 < kKeys; j0 += kLanes) {
      const S* kr[kLanes];
      __m512 k_sc[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) {
        const int64_t j = j0 + i, slot = slots[std::min(k0 + j, max_pos)];
        const int64_t row = slot * s.kv_row + head_off;
        kr[i] = kv.k + row;
        const S* vr = kv.v + row;
        __m512 v_sc = _mm512_setzero_ps();
        if constexpr (kQuantizedKV<S>) {
          const int64_t at = slot * kv.scale.row + h * kv.scale.head;
          k_sc[i] = _mm512_set1_ps(kv.k_scale[at] * kScaleFactor<S>);
          v_sc = _mm512_set1_ps(kv.v_scale[at] * kScaleFactor<S>);
        }
        for (int64_t d = 0; d < D; d += kLanes) {
          _mm512_storeu_ps(vb + j * D + d, j < n ? load_pool(vr + d, v_sc) : _mm512_setzero_ps());
        }
      }
      for (int64_t d = 0; d < D; d += kLanes) {
        __m512 rows[kLanes], cols[kLanes];
        for (int64_t i = 0; i < kLanes; ++i) {
          rows[i] = j0 + i < n ? load_pool(kr[i] + d, k_sc[i]) : _mm512_setzero_ps();
        }
        transpose16(rows, cols);
        for (int64_t e = 0; e < kLanes; ++e) _mm512_storeu_ps(kt + (d + e) * kKeys + j0, cols[e]);
      }
    }
    // scores of kRowTile rows at a time: 16 keys per register, one FMA per dimension
    for (int64_t r0 = 0; r0 < padded; r0 += kRowTile) {
      __m512 sc[kRowTile][kChunks];
      for (int t = 0; t < kRowTile; ++t)
        for (int c = 0; c < kChunks; ++c) sc[t][c] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        __m512 kd[kChunks];
        for (int c = 0; c < kChunks; ++c) kd[c] = _mm512_loadu_ps(kt + d * kKeys + c * kLanes);
        for (int t = 0; t < kRowTile; ++t) {
          const __m512 qd = _mm512_set1_ps(qs[(r0 + t) * D + d]);
          for (int c = 0; c < kChunks; ++c) sc[t][c] = _mm512_fmadd_ps(qd, kd[c], sc[t][c]);
        }
      }
      for (int t = 0; t < kRowTile; ++t)
        for (int c = 0; c < kChunks; ++c) {
          _mm512_storeu_ps(probs + (r0 + t) * kKeys + c * kLanes, sc[t][c]);
        }
    }
    if (cap > 0.0f) {
      for (int64_t i = 0; i < padded * kKeys; ++i) probs[i] = cap * std::tanh(probs[i] / cap);
    }
    // the online softmax of each row that sees a key of the block
    for (int64_t r = 0; r < padded; ++r) {
      // the row's first visible key, relative to the block (<= 0: all of the block's start)
      const int64_t lo = window > 0 ? pos[r] - window + 1 - k0 : 0;
      // every key of the block is in this row's future, or before its window
      live[r] = k0 <= pos[r] && lo < n;
      if (!live[r]) continue;
      const int64_t seen = std::min(n, pos[r] + 1 - k0);  // keys of the block it sees, >= 1
      __mmask16 visible[kChunks];
      __m512 sc[kChunks];
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (int c = 0; c < kChunks; ++c) {
        visible[c] = lanes(std::max<int64_t>(0, seen - c * kLanes));
        if (lo > 0) {
          visible[c] &= static_cast<__mmask16>(~lanes(std::clamp<int64_t>(lo - c * kLanes, 0, 16)));
        }
        sc[c] = _mm512_loadu_ps(probs + r * kKeys + c * kLanes);
        top = _mm512_mask_max_ps(top, visible[c], top, sc[c]);
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(top));
      alpha[r] = std::exp(m[r] - m_new);  // 0 for the first block (m = -inf)
      const __m512 m_new_v = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < kChunks; ++c) {
        const __m512 p =
            visible[c] ? _mm512_maskz_mov_ps(visible[c], exp_ps(_mm512_sub_ps(sc[c], m_new_v)))
                       : _mm512_setzero_ps();
        sum = _mm512_add_ps(sum, p);
        _mm512_storeu_ps(probs + r * kKeys + c * kLanes, p);
      }
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
    }
    for (int64_t r0 = 0; r0 < padded; r0 += kRowTile) {
      int64_t d0 = 0;
      for (; d0 + 4 * kLanes <= D; d0 += 4 * kLanes) {
        weigh_values<4>(acc, alpha, probs, live.data(), vb, D, r0, d0);
      }
      switch ((D - d0) / kLanes) {
        case 1: weigh_values<1>(acc, alpha, probs, live.data(), vb, D, r0, d0); break;
        case 2: weigh_values<2>(acc, alpha, probs, live.data(), vb, D, r0, d0); break;
        case 3: weigh_values<3>(acc, alpha, probs, live.data(), vb, D, r0, d0); break;
        default: break;
      }
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      T* dst = out + (token0 + first + i) * s.out_stride + (h * G + g) * D;
      const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
      for (int64_t d = 0; d < D; d += kLanes) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), inv);
        if constexpr (std::is_same_v<T, float>) {
          _mm512_storeu_ps(dst + d, v);
        } else {
          store_bf16(reinterpret_cast<uint16_t*>(dst + d), round_to_bf16(v));
        }
      }
    }
  }
}

// S: the pool's element type, T's own or (quantized) the codes; a quantized pool comes with its
// scales and no new K/V to write (k, v and loc undefined).
template <typename T, typename S>
void extend_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& loc, at::Tensor& k_buffer, at::Tensor& v_buffer,
                           const at::Tensor& k_scale, const at::Tensor& v_scale,
                           const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                           const at::Tensor& seq_lens, const at::Tensor& extend_lens,
                           double scale, int64_t window, double softcap, at::Tensor& out) {
  const int64_t tokens = q.size(0), batch = seq_lens.size(0);
  Shape s{q.size(1), k_buffer.size(1), q.size(1) / k_buffer.size(1), q.size(2), q.stride(0),
          k_buffer.size(1) * q.size(2), req_to_token.stride(0), out.stride(0)};
  const T* qp = q.data_ptr<T>();
  S* kb = static_cast<S*>(k_buffer.data_ptr());
  S* vbuf = static_cast<S*>(v_buffer.data_ptr());
  PoolKV<S> kv{kb, vbuf};
  if constexpr (kQuantizedKV<S>) {
    kv.k_scale = k_scale.data_ptr<float>();
    kv.v_scale = v_scale.data_ptr<float>();
    kv.scale = scale_strides(k_scale);
  } else {
    // the new tokens' K/V into the pool
    const int64_t* loc_p = loc.data_ptr<int64_t>();
    const S* kn = static_cast<const S*>(k.data_ptr());
    const S* vn = static_cast<const S*>(v.data_ptr());
    const int64_t k_stride = k.stride(0), v_stride = v.stride(0), row = s.kv_row;
    at::parallel_for(0, tokens, 64, [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t) {
        std::copy_n(kn + t * k_stride, row, kb + loc_p[t] * row);
        std::copy_n(vn + t * v_stride, row, vbuf + loc_p[t] * row);
      }
    });
  }
  // tasks: (request, KV head, block of kQueries new positions), longest first
  struct Task {
    int64_t b, token0, prefix, first, count, h;
  };
  std::vector<Task> tasks;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* ext = extend_lens.data_ptr<int64_t>();
  int64_t token0 = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t prefix = lens[b] - ext[b];
    for (int64_t first = 0; first < ext[b]; first += kQueries) {
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        tasks.push_back({b, token0, prefix, first, std::min(kQueries, ext[b] - first), h});
      }
    }
    token0 += ext[b];
  }
  TORCH_CHECK(token0 == tokens, "extend_attention: the extend lengths sum to ", token0,
              ", q has ", tokens, " tokens");
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
    return a.prefix + a.first > b.prefix + b.first;
  });
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t* pool_idx = req_pool_indices.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      const Task& t = tasks[i];
      attend_block(qp, kv, table + pool_idx[t.b] * s.table_stride, t.token0, t.prefix,
                   t.first, t.count, t.h, static_cast<float>(scale), window,
                   static_cast<float>(softcap), op, s, scratch);
    }
  });
}

void check_long_vector(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == n && t.is_contiguous(),
              "extend_attention: ", name, " must be a contiguous int64 [", n, "] tensor");
}

// q, out: [tokens, heads, head_dim] (q may be row-strided); k, v: [tokens, kv_heads,
// head_dim], the new tokens' K/V, written at slots loc[t]; k_buffer, v_buffer: [slots,
// kv_heads, head_dim]; request b's tokens are the next extend_lens[b] rows, at positions
// seq_lens[b] - extend_lens[b] onwards, its slots the first seq_lens[b] of req_to_token's row
// req_pool_indices[b].
void extend_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& loc, at::Tensor k_buffer, at::Tensor v_buffer,
                      const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                      const at::Tensor& seq_lens, const at::Tensor& extend_lens, double scale,
                      int64_t window, double softcap, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_buffer.dim() == 3 &&
                  v_buffer.dim() == 3 && out.sizes() == q.sizes(),
              "extend_attention: q and out must be [tokens, heads, head_dim], k, v and the KV "
              "buffers [n, kv_heads, head_dim]");
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == tokens && k.size(1) == k_buffer.size(1) &&
                  k.size(2) == head_dim && k_buffer.sizes() == v_buffer.sizes() &&
                  k_buffer.size(2) == head_dim,
              "extend_attention: the new K/V and the KV buffers do not match q");
  TORCH_CHECK(q.size(1) % k_buffer.size(1) == 0,
              "extend_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(head_dim % kLanes == 0 && head_dim <= 256,
              "extend_attention: head_dim must be a multiple of 16 up to 256, got ", head_dim);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &k_buffer,
                                                                     &v_buffer, &out}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(),
                "extend_attention: q, K/V and out must share a dtype");
  }
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "extend_attention: q, k and v must have contiguous heads in each row");
  }
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous() && out.is_contiguous(),
              "extend_attention: the KV buffers and out must be contiguous");
  const int64_t batch = seq_lens.size(0);
  check_long_vector(loc, tokens, "loc");
  check_long_vector(req_pool_indices, batch, "req_pool_indices");
  check_long_vector(seq_lens, batch, "seq_lens");
  check_long_vector(extend_lens, batch, "extend_lens");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.dim() == 2 &&
                  req_to_token.stride(1) == 1,
              "extend_attention: req_to_token must be int64 [requests, context] with "
              "contiguous rows");
  if (tokens == 0) return;
  with_attention_dtype("extend_attention", q, [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    extend_attention_impl<T, T>(q, k, v, loc, k_buffer, v_buffer, at::Tensor(), at::Tensor(),
                                req_to_token, req_pool_indices, seq_lens, extend_lens, scale,
                                window, softcap, out);
  });
}

// extend_attention over a quantized pool: q and out float32 [tokens, heads, head_dim];
// k_buffer, v_buffer [slots, kv_heads, head_dim] of int8 or fp8 codes; k_scale, v_scale float32
// [slots, kv_heads] (check_kv_scales: per slot, or one per layer with strides 0). The new
// tokens' K/V must be in the pool already.
void extend_attention_quant(const at::Tensor& q, at::Tensor k_buffer, at::Tensor v_buffer,
                            const at::Tensor& k_scale, const at::Tensor& v_scale,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, const at::Tensor& extend_lens,
                            double scale, int64_t window, double softcap, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && out.sizes() == q.sizes() &&
                  k_buffer.sizes() == v_buffer.sizes() && k_buffer.size(2) == q.size(2),
              "extend_attention_quant: q and out must be [tokens, heads, head_dim], the KV "
              "buffers [slots, kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "extend_attention_quant: q and out must be float32");
  TORCH_CHECK(k_buffer.scalar_type() == v_buffer.scalar_type(),
              "extend_attention_quant: K and V codes must share a dtype");
  TORCH_CHECK(q.size(1) % k_buffer.size(1) == 0,
              "extend_attention_quant: heads must be a multiple of kv_heads");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= 256,
              "extend_attention_quant: head_dim must be a multiple of 16 up to 256");
  check_kv_scales("extend_attention_quant", k_buffer, k_scale, v_scale);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2),
              "extend_attention_quant: q must have contiguous heads in each row");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous() && out.is_contiguous(),
              "extend_attention_quant: the KV buffers and out must be contiguous");
  const int64_t batch = seq_lens.size(0);
  check_long_vector(req_pool_indices, batch, "req_pool_indices");
  check_long_vector(seq_lens, batch, "seq_lens");
  check_long_vector(extend_lens, batch, "extend_lens");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.dim() == 2 &&
                  req_to_token.stride(1) == 1,
              "extend_attention_quant: req_to_token must be int64 [requests, context] with "
              "contiguous rows");
  if (q.size(0) == 0) return;
  with_quantized_kv_dtype("extend_attention_quant", k_buffer, [&](auto code_tag) {
    extend_attention_impl<float, decltype(code_tag)>(
        q, at::Tensor(), at::Tensor(), at::Tensor(), k_buffer, v_buffer, k_scale, v_scale,
        req_to_token, req_pool_indices, seq_lens, extend_lens, scale, window, softcap, out);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("extend_attention(" RADIXSERVE_PAGED_ATTENTION_ARGS
        "Tensor extend_lens, float scale, int window, float softcap, Tensor(c!) out) -> ()");
  m.impl("extend_attention", c10::DispatchKey::CPU, &extend_attention);
  m.def("extend_attention_quant(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor k_scale, "
        "Tensor v_scale, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "Tensor extend_lens, float scale, int window, float softcap, Tensor(c!) out) -> ()");
  m.impl("extend_attention_quant", c10::DispatchKey::CPU, &extend_attention_quant);
}
