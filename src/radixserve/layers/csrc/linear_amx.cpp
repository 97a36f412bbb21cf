// bf16 linear layers on AMX (Sapphire Rapids and later): small batches, and larger ones
// (gemm_amx_bf16).
//
// A decode step with few requests reads every weight once for a handful of input rows. The
// blocked weight of csrc/linear.cpp, [N/16][K/2][16][2], is exactly a column of AMX B tiles: a
// block's 32 inputs of 16 outputs are one 1 KiB tile, and one `tdpbf16ps` applies it to up to
// 16 input rows; software prefetch runs ahead. Products and sums are float32 (bf16 x bf16 is
// exact in float32); each output is rounded to bf16 once, after the bias. The tile sums its 32
// inputs in an order of its own, so the AMX path is left out where batch invariance is asked for
// (csrc/linear.cpp's kernel is batch invariant).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "vec_math.h"

namespace {

using namespace radixserve_cpu;

constexpr int64_t kRows = 16;     // output rows per block: one register of float32 sums

__m512 load_bias(const c10::BFloat16* bias) {
  return load_bf16(reinterpret_cast<const uint16_t*>(bias));
}

// Checks what the kernel takes (bf16, a blocked weight matching x's features, an optional [N]
// bias) and returns the bias pointer (null without one).
const c10::BFloat16* check_blocked(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, op,
              " takes bfloat16 inputs");
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == kRows && weight.size(3) == 2 &&
                  weight.is_contiguous(),
              "weight must be blocked [N/16, K/2, 16, 2]");
  TORCH_CHECK(x.dim() == 2 && weight.size(1) * 2 == x.size(1), "x has ", x.size(-1),
              " features, the weight ", weight.size(1) * 2);
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == weight.size(0) * kRows &&
                  bias->is_contiguous(),
              "bias must be [N] bfloat16, contiguous");
  return bias->data_ptr<c10::BFloat16>();
}

// AMX: tiles 0-3 hold float32 sums, 4-5 input rows, 6-7 weight tiles. Up to 16 rows: four
// blocks per pass (one sum tile each); 17 to 32 rows: two row tiles by two blocks.
constexpr int64_t kTileK = 32;       // bf16 inputs per tile row (64 bytes)
constexpr int64_t kAmxMaxRows = 32;  // two tiles of 16 rows

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kAheadElems = 2 * kTileK * kRows;  // prefetched two tiles (2 KiB) ahead

inline void prefetch_tile(const uint16_t* tile) {
  const char* p = reinterpret_cast<const char*>(tile);
  for (int line = 0; line < 16; ++line) _mm_prefetch(p + line * 64, _MM_HINT_T0);
}

bool amx_permitted() {
  // Linux hands out the 8 KiB AMX state only to processes that ask for it.
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

TileConfig tile_config(int64_t m) {
  TileConfig cfg;
  const int64_t top = std::min<int64_t>(m, 16), bottom = m - top;
  // sums: tiles 0-1 the top rows; 2-3 the bottom rows (two row tiles) or the top rows again
  const int64_t rows[6] = {top, top, bottom ? bottom : top, bottom ? bottom : top, top, bottom};
  for (int t = 0; t < 6; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  for (int t = 6; t < 8; ++t) {  // weight tiles: 16 input pairs of 16 outputs
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  return cfg;
}

// float32 sums [rows][16 * blocks] (+ bias) -> bf16 outputs at column `col` of `out` [M, N]
// (AMX CPUs all have AVX512-BF16; the build may leave it out elsewhere)
__attribute__((target("avx512bf16"))) void store_rows(const float* sums, int64_t sum_stride, int64_t rows, int64_t cols,
                const c10::BFloat16* bias, int64_t col, uint16_t* out, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += kRows) {
      __m512 v = _mm512_loadu_ps(sums + r * sum_stride + c);
      if (bias) v = _mm512_add_ps(v, load_bias(bias + col + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * n + col + c),
                          (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_blocks(
    const uint16_t* x, const uint16_t* weight, const c10::BFloat16* bias, uint16_t* out,
    int64_t m, int64_t k, int64_t n, int64_t first, int64_t last) {
  const TileConfig cfg = tile_config(m);
  _tile_loadconfig(&cfg);
  const int64_t chunks = k / kTileK, block_elems = k * kRows, x_stride = k * 2;
  alignas(64) float sums[16 * 4 * kRows];  // 16 rows x 4 blocks or 32 rows x 2 blocks
  if (m <= 16) {
    int64_t b = first;
    for (; b + 4 <= last; b += 4) {  // four blocks at a time: tiles 0-3
      const uint16_t* w = weight + b * block_elems;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t off = c * kTileK * kRows;
        for (int blk = 0; blk < 4; ++blk) prefetch_tile(w + blk * block_elems + off + kAheadElems);
        _tile_loadd(4, x + c * kTileK, x_stride);
        _tile_loadd(6, w + off, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w + block_elems + off, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, w + 2 * block_elems + off, 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, w + 3 * block_elems + off, 64);
        _tile_dpbf16ps(3, 4, 7);
      }
      _tile_stored(0, sums, 4 * kRows * 4);
      _tile_stored(1, sums + kRows, 4 * kRows * 4);
      _tile_stored(2, sums + 2 * kRows, 4 * kRows * 4);
      _tile_stored(3, sums + 3 * kRows, 4 * kRows * 4);
      store_rows(sums, 4 * kRows, m, 4 * kRows, bias, b * kRows, out, n);
    }
    for (; b < last; ++b) {  // the last blocks one at a time
      const uint16_t* w = weight + b * block_elems;
      _tile_zero(0);
      for (int64_t c = 0; c < chunks; ++c) {
        prefetch_tile(w + c * kTileK * kRows + kAheadElems);
        _tile_loadd(4, x + c * kTileK, x_stride);
        _tile_loadd(6, w + c * kTileK * kRows, 64);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, sums, kRows * 4);
      store_rows(sums, kRows, m, kRows, bias, b * kRows, out, n);
    }
  } else {
    const uint16_t* x_bottom = x + 16 * k;
    int64_t b = first;
    for (; b + 2 <= last; b += 2) {  // two blocks at a time, two row tiles: tiles 0-3
      const uint16_t* w = weight + b * block_elems;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t off = c * kTileK * kRows;
        prefetch_tile(w + off + kAheadElems);
        prefetch_tile(w + block_elems + off + kAheadElems);
        _tile_loadd(4, x + c * kTileK, x_stride);
        _tile_loadd(5, x_bottom + c * kTileK, x_stride);
        _tile_loadd(6, w + off, 64);
        _tile_loadd(7, w + block_elems + off, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, sums, 2 * kRows * 4);
      _tile_stored(1, sums + kRows, 2 * kRows * 4);
      _tile_stored(2, sums + 16 * 2 * kRows, 2 * kRows * 4);
      _tile_stored(3, sums + 16 * 2 * kRows + kRows, 2 * kRows * 4);
      store_rows(sums, 2 * kRows, m, 2 * kRows, bias, b * kRows, out, n);
    }
    for (; b < last; ++b) {
      const uint16_t* w = weight + b * block_elems;
      _tile_zero(0); _tile_zero(2);
      for (int64_t c = 0; c < chunks; ++c) {
        prefetch_tile(w + c * kTileK * kRows + kAheadElems);
        _tile_loadd(4, x + c * kTileK, x_stride);
        _tile_loadd(5, x_bottom + c * kTileK, x_stride);
        _tile_loadd(6, w + c * kTileK * kRows, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
      }
      _tile_stored(0, sums, kRows * 4);
      _tile_stored(2, sums + 16 * kRows, kRows * 4);
      store_rows(sums, kRows, m, kRows, bias, b * kRows, out, n);
    }
  }
  _tile_release();
}

// x: [M, K] bf16 contiguous, 1 <= M <= 32, K a multiple of 32; weight: blocked [N/16, K/2, 16,
// 2] bf16 (N a multiple of 16); bias: [N] bf16 or None.
// What small_gemm_amx_bf16 and gemm_amx_bf16 both check and set up, x's shape aside: AMX
// granted, a blocked bf16 weight matching x, K a multiple of 32, and the [M, N] output.
struct AmxGemm {
  const uint16_t* x;
  const uint16_t* weight;
  const c10::BFloat16* bias;
  int64_t m, k, blocks, n;
  at::Tensor out;
  uint16_t* y;
};

AmxGemm amx_gemm_call(const char* op, const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_permitted(), "AMX is not available to this process");
  const c10::BFloat16* bias_ptr = check_blocked(op, x, weight, bias);
  TORCH_CHECK(x.size(1) % kTileK == 0, "K must be a multiple of ", kTileK, ", got ", x.size(1));
  const int64_t m = x.size(0), blocks = weight.size(0);
  at::Tensor out = at::empty({m, blocks * kRows}, x.options());
  return {reinterpret_cast<const uint16_t*>(x.data_ptr()),
          reinterpret_cast<const uint16_t*>(weight.data_ptr()),
          bias_ptr, m, x.size(1), blocks, blocks * kRows, out,
          reinterpret_cast<uint16_t*>(out.data_ptr())};
}

at::Tensor small_gemm_amx_bf16(const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kAmxMaxRows && x.is_contiguous(),
              "x must be [M, K] with 1 <= M <= ", kAmxMaxRows, ", contiguous");
  const AmxGemm g = amx_gemm_call("small_gemm_amx_bf16", x, weight, bias);
  at::parallel_for(0, g.blocks, 4, [&](int64_t first, int64_t last) {
    amx_blocks(g.x, g.weight, g.bias, g.y, g.m, g.k, g.n, first, last);
  });
  return g.out;
}

// Batches of more than 32 rows (prefill, large decode batches): 32-row chunks of x against pairs
// of weight blocks, four sum tiles (two row tiles by two weight tiles, so each tile loaded
// serves two products), over the whole K before the sums leave the tiles. Cache blocking: a
// thread takes its blocks kBlockPanelBytes of weight at a time and, within them, x kRowBlockBytes
// at a time, so both stay in L2 while every pair meets every chunk; a last chunk of fewer than 32
// rows is copied once into zeroed rows. oneDNN's GEMM (`F.linear`) packs the weight on every
// call; here it is packed once, at load. Which is faster on a CPU and shape is measured
// (layers/kernel_dispatch.py).
constexpr int64_t kChunkRows = 32;
constexpr int64_t kRowBlockBytes = 256 << 10;
constexpr int64_t kBlockPanelBytes = 512 << 10;

// sums [32][16 * kBlocks] (row stride 32 floats) of one 32-row chunk `xa` against kBlocks (1
// or 2) weight blocks from `w`: tiles 0-1 the top 16 rows, 2-3 the bottom.
// `ahead`: the blocks come from memory (a row block's first chunk), so their tiles two steps on
// are asked for (as in amx_blocks); later chunks find them in L2.
template <int kBlocks>
__attribute__((target("amx-tile,amx-bf16"))) void amx_chunk(const uint16_t* xa, int64_t k,
                                                            const uint16_t* w, float* sums,
                                                            bool ahead) {
  const int64_t chunks = k / kTileK, block_elems = k * kRows, stride = k * 2;
  const uint16_t* xb = xa + 16 * k;
  _tile_zero(0); _tile_zero(2);
  if constexpr (kBlocks == 2) { _tile_zero(1); _tile_zero(3); }
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t off = c * kTileK * kRows;
    if (ahead) {
      for (int blk = 0; blk < kBlocks; ++blk) {
        prefetch_tile(w + blk * block_elems + off + kAheadElems);
      }
    }
    _tile_loadd(4, xa + c * kTileK, stride);
    _tile_loadd(6, w + off, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kBlocks == 2) {
      _tile_loadd(7, w + block_elems + off, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_loadd(5, xb + c * kTileK, stride);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (kBlocks == 2) _tile_dpbf16ps(3, 5, 7);
  }
  constexpr int64_t row_bytes = kChunkRows * 4;
  _tile_stored(0, sums, row_bytes);
  _tile_stored(2, sums + 16 * kChunkRows, row_bytes);
  if constexpr (kBlocks == 2) {
    _tile_stored(1, sums + kRows, row_bytes);
    _tile_stored(3, sums + 16 * kChunkRows + kRows, row_bytes);
  }
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_gemm_blocks(
    const uint16_t* x, const uint16_t* weight, const c10::BFloat16* bias, uint16_t* out,
    int64_t m, int64_t k, int64_t n, int64_t first, int64_t last) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const int64_t block_elems = k * kRows;
  const int64_t row_block =
      std::max<int64_t>(1, kRowBlockBytes / (kChunkRows * k * 2)) * kChunkRows;
  const int64_t panel = std::max<int64_t>(1, kBlockPanelBytes / (2 * block_elems * 2)) * 2;
  alignas(64) float sums[kChunkRows * kChunkRows];
  std::vector<uint16_t> tail;  // the last chunk's rows, zero-padded to 32
  for (int64_t b0 = first; b0 < last; b0 += panel) {
    const int64_t b1 = std::min(last, b0 + panel);
    for (int64_t m0 = 0; m0 < m; m0 += row_block) {
      const int64_t m1 = std::min(m, m0 + row_block);
      for (int64_t b = b0; b < b1; b += 2) {
        const bool pair = b + 1 < b1;
        for (int64_t r = m0; r < m1; r += kChunkRows) {
          const int64_t rows = std::min(kChunkRows, m1 - r);
          const uint16_t* xa = x + r * k;
          if (rows < kChunkRows) {
            if (tail.empty()) {
              tail.assign(kChunkRows * k, 0);
              std::copy_n(xa, rows * k, tail.data());
            }
            xa = tail.data();
          }
          const uint16_t* w = weight + b * block_elems;
          if (pair) {
            amx_chunk<2>(xa, k, w, sums, r == m0);
          } else {
            amx_chunk<1>(xa, k, w, sums, r == m0);
          }
          store_rows(sums, kChunkRows, rows, pair ? 2 * kRows : kRows, bias, b * kRows,
                     out + r * n, n);
        }
      }
    }
  }
  _tile_release();
}

// x: [M, K] bf16 contiguous, any M >= 1, K a multiple of 32; weight: blocked [N/16, K/2, 16, 2];
// bias: [N] bf16 or None. Up to 32 rows: small_gemm_amx_bf16's kernel; more: amx_gemm_blocks.
at::Tensor gemm_amx_bf16(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.is_contiguous(),
              "x must be [M, K] with M >= 1, contiguous");
  if (x.size(0) <= kAmxMaxRows) return small_gemm_amx_bf16(x, weight, bias);
  const AmxGemm g = amx_gemm_call("gemm_amx_bf16", x, weight, bias);
  at::parallel_for(0, (g.blocks + 1) / 2, 1, [&](int64_t first, int64_t last) {  // block pairs
    amx_gemm_blocks(g.x, g.weight, g.bias, g.y, g.m, g.k, g.n, 2 * first,
                    std::min(g.blocks, 2 * last));
  });
  return g.out;
}

// Grouped (MoE experts): x [T, K] bf16 contiguous, its rows in groups [starts[g], starts[g+1])
// of 1 to 32 rows; group g is multiplied by weights[g] (blocked, all of one N and K). One
// parallel region for all groups (a region per expert costs a barrier each, and on a busy
// machine a barrier can wait a whole scheduler slice); work items are (group, 4 blocks).
at::Tensor grouped_gemm_amx_bf16(const at::Tensor& x, at::TensorList weights,
                                 at::IntArrayRef starts) {
  TORCH_CHECK(amx_permitted(), "AMX is not available to this process");
  const int64_t groups = static_cast<int64_t>(weights.size());
  TORCH_CHECK(groups >= 1 && static_cast<int64_t>(starts.size()) == groups + 1,
              "need one weight per group and groups + 1 starts");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && starts[0] == 0 && starts[groups] == x.size(0),
              "x must be [T, K] contiguous, the starts covering its T rows");
  TORCH_CHECK(x.size(1) % kTileK == 0, "K must be a multiple of ", kTileK, ", got ", x.size(1));
  const int64_t k = x.size(1), blocks = weights[0].size(0), n = blocks * kRows;
  std::vector<const uint16_t*> ws(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = starts[g + 1] - starts[g];
    TORCH_CHECK(rows >= 1 && rows <= kAmxMaxRows, "group ", g, " has ", rows,
                " rows; each must have 1 to ", kAmxMaxRows);
    check_blocked("grouped_gemm_amx_bf16", x, weights[g], std::nullopt);
    TORCH_CHECK(weights[g].size(0) == blocks, "the weights must share one shape");
    ws[g] = reinterpret_cast<const uint16_t*>(weights[g].data_ptr());
  }
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* y = reinterpret_cast<uint16_t*>(out.data_ptr());
  constexpr int64_t kPer = 4;  // blocks per work item
  const int64_t chunks = (blocks + kPer - 1) / kPer;
  at::parallel_for(0, groups * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / chunks, first = (i % chunks) * kPer;
      const int64_t r0 = starts[g], m = starts[g + 1] - r0;
      amx_blocks(xs + r0 * k, ws[g], nullptr, y + r0 * n, m, k, n, first,
                 std::min(blocks, first + kPer));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu, m) {
  m.def("amx_permitted() -> bool", &amx_permitted);
  m.def("small_gemm_amx_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("small_gemm_amx_bf16", c10::DispatchKey::CPU, &small_gemm_amx_bf16);
  m.def("gemm_amx_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("gemm_amx_bf16", c10::DispatchKey::CPU, &gemm_amx_bf16);
  m.def("grouped_gemm_amx_bf16(Tensor x, Tensor[] weights, int[] starts) -> Tensor");
  m.impl("grouped_gemm_amx_bf16", c10::DispatchKey::CPU, &grouped_gemm_amx_bf16);
}
