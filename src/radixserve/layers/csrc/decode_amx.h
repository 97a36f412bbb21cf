// Decode attention's score pass on AMX, for a bf16 model over an fp8 pool under one scale per
// layer (decode_attention_quant with bf16_query and amx). A block of 64 keys against a KV head's
// G query heads is a small matrix product the tiles take whole, where the AVX-512 pass
// (score_pass4_narrow) spends a bf16 dot-product instruction per 32 codes, key and query head
// (two uops: on the Xeons measured, what two float32 FMAs cost) and four-key reductions on top.
// What is left per key is moving its codes to bf16 (load_fp8_bf16) into a buffer the tiles load.
//
// The blocks (a block of keys of one KV head: a "unit") run as a three-stage pipeline, so that no
// stage waits on the one before: unit u's keys are converted into one of two buffers while the
// tiles multiply unit u - 1's (stored by the previous step, long written), whose sums go to one
// of two sum buffers, while unit u - 2's sums are gathered into the score rows.
//
// Tiles (amx_begin, G <= 16 query heads per KV head):
//   0-3  sums: 16 keys x G heads (float32) each, the block's four groups of 16 keys
//   4-5  keys: 16 keys x 32 elements (bf16)
//   6    queries: 16 element pairs x G heads (bf16 pairs)
// Products are exact (bf16 x bf16 in float32) and summed in float32 in the tiles' own order, the
// same for a request whatever the batch. As in score_pass4_narrow, codes under fp8's smallest
// normal are read as zero (kv_quant.h), and the query is lifted by kBf16QueryFactor.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx_tiles.h"
#include "decode_rows.h"
#include "kv_quant.h"
#include "vec_math.h"

namespace radixserve_cpu {

constexpr int64_t kAmxMaxGroup = 16;  // query heads per KV head the tiles take

// Tiles shaped as above for G = group, for this thread's tasks; amx_end gives them back.
__attribute__((target("amx-tile"))) inline void amx_begin(int64_t group) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = static_cast<uint16_t>(t == 4 || t == 5 ? 64 : 4 * group);
  }
  _tile_loadconfig(&cfg);
}
__attribute__((target("amx-tile"))) inline void amx_end() { _tile_release(); }

// Query heads [g, g + G) as tile 6's operands: per 32 elements c, the 16 pairs of each head,
// pairs[(c * 16 + p) * G + h] = head g + h's elements (32c + 2p, 32c + 2p + 1). `query` holds
// R2 registers of 32 bf16 lanes per head (the task's lifted bf16 queries).
inline void amx_query_pairs(const __m512i* query, int64_t G, int64_t R2, uint32_t* pairs) {
  alignas(64) uint32_t lanes16[16];
  for (int64_t h = 0; h < G; ++h) {
    for (int64_t c = 0; c < R2; ++c) {
      _mm512_store_si512(lanes16, query[h * R2 + c]);
      for (int64_t p = 0; p < 16; ++p) pairs[(c * 16 + p) * G + h] = lanes16[p];
    }
  }
}

// One unit of the pipeline: keys [t0, t1) (at most kKeyBlock) of a KV head, whose query pairs
// are `pairs`, its scores (G rows `len` apart) at `scores`, times `factor`.
template <typename S>
struct AmxScoreUnit {
  const Rows<S>* rows;
  const uint32_t* pairs;
  float factor;
  int64_t t0, t1;
  float* scores;
};

// The score pass of a task's units in order (see above); `len` and `head_dim` the task's.
template <typename S>
class AmxScorer {
 public:
  AmxScorer(int64_t group, int64_t head_dim)
      : G_(group), head_dim_(head_dim),
        keys_(2 * kKeyBlock * head_dim), sums_(2 * kKeyBlock * group) {}

  void run(const std::vector<AmxScoreUnit<S>>& units, int64_t len) {
    const int64_t n = static_cast<int64_t>(units.size());
    for (int64_t u = 0; u < n + 2; ++u) {
      if (u < n) convert(units[u], u & 1, len);
      if (u >= 1 && u - 1 < n) multiply(units[u - 1], (u - 1) & 1);
      if (u >= 2) gather(units[u - 2], u & 1, len);
    }
  }

 private:
  // the unit's keys as bf16 rows into key buffer `buf`
  void convert(const AmxScoreUnit<S>& unit, int64_t buf, int64_t len) {
    const Rows<S>& rows = *unit.rows;
    uint16_t* dst = keys_.data() + buf * kKeyBlock * head_dim_;
    for (int64_t t = unit.t0; t < unit.t1; ++t) {
      prefetch_ahead(rows.k, rows.k_scale, rows, t, len, head_dim_);
      const S* row = rows.k + rows.slots[t] * rows.kv_row;
      for (int64_t c = 0; c < head_dim_; c += 32) {
        _mm512_storeu_si512(dst + (t - unit.t0) * head_dim_ + c, load_fp8_bf16(row + c));
      }
    }
  }

  // key buffer `buf` times the queries into sum buffer `buf` (all four groups of 16 keys: the
  // rows past the unit's keys are stale keys, finite, their sums never read)
  __attribute__((target("amx-tile,amx-bf16"))) void multiply(const AmxScoreUnit<S>& unit,
                                                             int64_t buf) {
    const uint16_t* keys = keys_.data() + buf * kKeyBlock * head_dim_;
    const int64_t key_stride = head_dim_ * 2, group_elems = 16 * head_dim_;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t c = 0; c < head_dim_; c += 32) {
      _tile_loadd(6, unit.pairs + c / 2 * G_, G_ * 4);
      _tile_loadd(4, keys + c, key_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, keys + group_elems + c, key_stride);
      _tile_dpbf16ps(1, 5, 6);
      _tile_loadd(4, keys + 2 * group_elems + c, key_stride);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(5, keys + 3 * group_elems + c, key_stride);
      _tile_dpbf16ps(3, 5, 6);
    }
    float* sums = sums_.data() + buf * kKeyBlock * G_;
    _tile_stored(0, sums, G_ * 4);
    _tile_stored(1, sums + 16 * G_, G_ * 4);
    _tile_stored(2, sums + 32 * G_, G_ * 4);
    _tile_stored(3, sums + 48 * G_, G_ * 4);
  }

  // sum buffer `buf` ([key][head]) into the unit's score rows, times its factor
  void gather(const AmxScoreUnit<S>& unit, int64_t buf, int64_t len) {
    const float* sums = sums_.data() + buf * kKeyBlock * G_;
    const __m512i column = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(static_cast<int32_t>(G_)));
    const __m512 f = _mm512_set1_ps(unit.factor);
    const int64_t n = unit.t1 - unit.t0;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = lanes(n - j);
      for (int64_t h = 0; h < G_; ++h) {
        const __m512i at = _mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int32_t>(
                                                        j * G_ + h)));
        const __m512 s = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, at, sums, 4);
        _mm512_mask_storeu_ps(unit.scores + h * len + unit.t0 + j, m, _mm512_mul_ps(s, f));
      }
    }
  }

  int64_t G_, head_dim_;
  std::vector<uint16_t> keys_;  // two buffers of kKeyBlock keys x head_dim bf16
  std::vector<float> sums_;     // two buffers of kKeyBlock keys x G float32
};

}  // namespace radixserve_cpu
