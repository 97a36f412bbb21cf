// The LoRA deltas of a small batch (a decode step) added to a layer's output in place, in one
// call per adapted layer: each row with an adapter slot s gets
//     out[i, :] += (x[i, :] @ a[s]^T) @ b[s]^T
// where torch takes six ops (casts, two matmuls, a mask, the add) whose start-up costs are most
// of a decode step's time. One parallel region over tiles of up to four rows of one adapter
// (the rows grouped by slot here), so each load of an adapter's weights serves four rows: the
// rank-sized intermediate (float32 sums over x's inputs), then the output rows, read once, the
// delta added in float32 and rounded once to the output's type.
//
// a: [slots, R, K] (the pool's layout); bt: [slots, P], per slot each block's part of B
// transposed, [r1-r0] x [c1-c0], in chunks of 64 output columns: [ceil((c1-c0)/64)][r1-r0][64]
// (zero-padded), block after block (the op keeps that copy per pool version). The expand of a
// chunk then reads its ranks' weights as one contiguous stream, and nothing of the zero blocks:
// rows of [R, N] were R streams at once, which the hardware prefetched at a third of the
// memory's speed on a decode step. Both float32, or
// both bf16 (a bf16 model's copies: half the bytes a decode step streams; sums stay float32).
// blocks [nb, 4]: (r0, r1, c0, c1), ranks [r0, r1) feed columns [c0, c1) only: a fused layer's
// B is block-diagonal (each shard's ranks feed its own outputs), and the zeros are skipped.
// Rows whose slot is negative (the base model) are left as they are.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace radixserve_cpu {
namespace {

constexpr int64_t kTile = 4;  // rows of one adapter sharing each load of its weights
constexpr int64_t kVecs = 4;  // registers of output columns per step of the expand
constexpr int64_t kChunk = kVecs * kLanes;  // output columns per chunk of bt
constexpr int64_t kAhead = 2048;  // elements ahead of the reads to prefetch (4-8 KiB)

// The elements of one block's chunks in bt: its ranks x its columns rounded up to chunks.
inline int64_t chunked_size(const int64_t* block) {
  return (block[1] - block[0]) * ((block[3] - block[2] + kChunk - 1) / kChunk) * kChunk;
}

// The shrink of a tile when both x and A are bf16: 32 inputs per step, no conversions to
// float32 (a bf16 decode's shrink took four times the instructions converting each value).
inline void shrink_bf16(float* xa, const uint16_t* x, const uint16_t* as, const int64_t* rows,
                        int64_t k, int64_t r) {
  for (int64_t j = 0; j < r; ++j) {
    const uint16_t* ar = as + j * k;
    __m512 acc[kTile];
    for (int64_t t = 0; t < kTile; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 2 * kLanes) {
      const int64_t left = k - c;
      const __mmask32 mk = left >= 2 * kLanes ? __mmask32(0xFFFFFFFFu)
                                              : __mmask32((uint64_t(1) << left) - 1);
      // A's rows are one contiguous stream: ask for it ahead (the hardware's prefetch ramps
      // up too slowly on an adapter's few tens of KiB, which a decode step reads from DRAM)
      _mm_prefetch(reinterpret_cast<const char*>(ar + c + kAhead), _MM_HINT_T0);
      const __m512i w = _mm512_maskz_loadu_epi16(mk, ar + c);
      for (int64_t t = 0; t < kTile; ++t) {
        acc[t] = dot_bf16_pairs(acc[t], _mm512_maskz_loadu_epi16(mk, x + rows[t] * k + c), w);
      }
    }
    for (int64_t t = 0; t < kTile; ++t) xa[t * r + j] = _mm512_reduce_add_ps(acc[t]);
  }
}

// The shrink of a tile in float32, 16 inputs per step (x or A float32, or either converted).
template <typename T, typename W>
void shrink_float(float* xa, const T* x, const W* as, const int64_t* rows, int64_t k,
                  int64_t r) {
  for (int64_t j = 0; j < r; ++j) {
    const W* ar = as + j * k;
    __m512 acc[kTile];
    for (int64_t t = 0; t < kTile; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += kLanes) {
      const __mmask16 mk = lanes(k - c);
      const __m512 w = load16(ar + c, mk);
      for (int64_t t = 0; t < kTile; ++t) {
        acc[t] = _mm512_fmadd_ps(load16(x + rows[t] * k + c, mk), w, acc[t]);
      }
    }
    for (int64_t t = 0; t < kTile; ++t) xa[t * r + j] = _mm512_reduce_add_ps(acc[t]);
  }
}

// Where each block's chunks start in a slot's bt (offsets[blk]), and a slot's size (last).
std::vector<int64_t> chunk_offsets(const int64_t* blocks, int64_t nblocks) {
  std::vector<int64_t> offsets(nblocks + 1, 0);
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    offsets[blk + 1] = offsets[blk] + chunked_size(blocks + blk * 4);
  }
  return offsets;
}

template <typename T, typename W>
void lora_add_rows(T* out, const T* x, const W* a, const W* bt, const int64_t* slots,
                   const int64_t* blocks, int64_t nblocks, const std::vector<int64_t>& offsets,
                   int64_t m, int64_t k, int64_t r, int64_t n) {
  const int64_t per_slot = offsets[nblocks];
  // Rows with an adapter, grouped by slot (stable), cut into tiles of up to kTile rows.
  std::vector<int64_t> order;
  for (int64_t i = 0; i < m; ++i) {
    if (slots[i] >= 0) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t p, int64_t q) { return slots[p] < slots[q]; });
  std::vector<std::pair<int64_t, int64_t>> tiles;  // [first, count) in order
  for (size_t i = 0; i < order.size();) {
    size_t j = i + 1;
    while (j < order.size() && j - i < size_t(kTile) && slots[order[j]] == slots[order[i]]) ++j;
    tiles.emplace_back(int64_t(i), int64_t(j - i));
    i = j;
  }
  at::parallel_for(0, int64_t(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xa(kTile * r);
    for (int64_t tile = begin; tile < end; ++tile) {
      const auto [first, count] = tiles[tile];
      int64_t rows[kTile];
      for (int64_t t = 0; t < kTile; ++t) rows[t] = order[first + std::min(t, count - 1)];
      const int64_t s = slots[rows[0]];
      // shrink: xa[t, j] = x[row t] . a[s, j]  (a partial tile repeats its last row)
      if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<W, uint16_t>) {
        shrink_bf16(xa.data(), x, a + s * r * k, rows, k, r);
      } else {
        shrink_float(xa.data(), x, a + s * r * k, rows, k, r);
      }
      // expand, block by block: ranks [r0, r1) feed output columns [c0, c1) only; chunk by
      // chunk of kChunk columns from c0, whose ranks' weights are contiguous in bt
      const W* bs = bt + s * per_slot;
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        const int64_t r0 = blocks[blk * 4], r1 = blocks[blk * 4 + 1];
        const int64_t c0 = blocks[blk * 4 + 2], c1 = blocks[blk * 4 + 3];
        const W* bb = bs + offsets[blk];
        for (int64_t ch = 0; c0 + ch * kChunk < c1; ++ch) {
          const int64_t col = c0 + ch * kChunk;
          __m512 acc[kTile][kVecs];
          __mmask16 mk[kVecs];
          for (int64_t v = 0; v < kVecs; ++v) {
            const int64_t c = col + v * kLanes;
            mk[v] = c < c1 ? lanes(c1 - c) : __mmask16(0);
            for (int64_t t = 0; t < kTile; ++t) acc[t][v] = _mm512_setzero_ps();
          }
          for (int64_t j = r0; j < r1; ++j) {
            const W* brow = bb + (ch * (r1 - r0) + j - r0) * kChunk;
            // a block's chunks are one stream: ask for its lines ahead
            _mm_prefetch(reinterpret_cast<const char*>(brow + kAhead), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(brow + kAhead) + 64, _MM_HINT_T0);
            __m512 w[kVecs];
            for (int64_t v = 0; v < kVecs; ++v) w[v] = load16(brow + v * kLanes, mk[v]);
            for (int64_t t = 0; t < kTile; ++t) {
              const __m512 h = _mm512_set1_ps(xa[t * r + j]);
              for (int64_t v = 0; v < kVecs; ++v) acc[t][v] = _mm512_fmadd_ps(h, w[v], acc[t][v]);
            }
          }
          for (int64_t t = 0; t < count; ++t) {
            T* orow = out + rows[t] * n + col;
            for (int64_t v = 0; v < kVecs; ++v) {
              if (!mk[v]) break;
              T* p = orow + v * kLanes;
              store16(p, round_to<T>(_mm512_add_ps(load16(p, mk[v]), acc[t][v])), mk[v]);
            }
          }
        }
      }
    }
  });
}

void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
               const at::Tensor& slots, const at::Tensor& blocks) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && a.dim() == 3 && bt.dim() == 2,
              "lora_add_: out [M, N], x [M, K], a [S, R, K], bt [S, the blocks' chunks]");
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && a.is_contiguous() &&
                  bt.is_contiguous() && slots.is_contiguous(),
              "lora_add_: contiguous tensors only");
  TORCH_CHECK(a.scalar_type() == bt.scalar_type() &&
                  (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "lora_add_: float32 or bf16 adapter weights, a and bt of one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == x.size(0),
              "lora_add_: one int64 slot per row");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "lora_add_: out and x of one dtype");
  const int64_t m = x.size(0), k = x.size(1), r = a.size(1), n = out.size(1);
  TORCH_CHECK(out.size(0) == m && a.size(2) == k && bt.size(0) == a.size(0),
              "lora_add_: shapes do not match");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(s[i] < a.size(0), "lora_add_: slot ", s[i], " of ", a.size(0));
  }
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 2 && blocks.size(1) == 4 &&
                  blocks.is_contiguous(),
              "lora_add_: blocks int64 [nb, 4]");
  const int64_t nb = blocks.size(0);
  const int64_t* bl = blocks.data_ptr<int64_t>();
  for (int64_t i = 0; i < nb; ++i) {
    TORCH_CHECK(0 <= bl[4 * i] && bl[4 * i] <= bl[4 * i + 1] && bl[4 * i + 1] <= r &&
                    0 <= bl[4 * i + 2] && bl[4 * i + 2] <= bl[4 * i + 3] && bl[4 * i + 3] <= n,
                "lora_add_: block ", i, " outside the ranks or the columns");
  }
  const std::vector<int64_t> offsets = chunk_offsets(bl, nb);
  TORCH_CHECK(bt.size(1) == offsets[nb], "lora_add_: bt holds ", bt.size(1),
              " per slot, the blocks ", offsets[nb]);
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "lora_add_: bf16 or float32 activations");
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
  const bool bf16_w = a.scalar_type() == at::kBFloat16;
  auto run = [&](auto* o, const auto* xp, const auto* ap, const auto* bp) {
    lora_add_rows(o, xp, ap, bp, s, bl, nb, offsets, m, k, r, n);
  };
  auto as_u16 = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
  auto as_f32 = [](const at::Tensor& t) { return t.data_ptr<float>(); };
  if (bf16_out && bf16_w) {
    run(as_u16(out), static_cast<const uint16_t*>(as_u16(x)), static_cast<const uint16_t*>(as_u16(a)),
        static_cast<const uint16_t*>(as_u16(bt)));
  } else if (bf16_out) {
    run(as_u16(out), static_cast<const uint16_t*>(as_u16(x)), static_cast<const float*>(as_f32(a)),
        static_cast<const float*>(as_f32(bt)));
  } else if (bf16_w) {
    run(as_f32(out), static_cast<const float*>(as_f32(x)), static_cast<const uint16_t*>(as_u16(a)),
        static_cast<const uint16_t*>(as_u16(bt)));
  } else {
    run(as_f32(out), static_cast<const float*>(as_f32(x)), static_cast<const float*>(as_f32(a)),
        static_cast<const float*>(as_f32(bt)));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, Tensor slots, "
        "Tensor blocks) -> ()");
  m.impl("lora_add_", c10::DispatchKey::CPU, &lora_add_);
}

}  // namespace radixserve_cpu
