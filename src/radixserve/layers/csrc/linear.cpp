// Linear layers for AVX-512 CPUs at every batch size, bf16 and float32. bf16 multiplies with
// AVX512-BF16's `vdpbf16ps` where the CPU has it, else with two float32 multiply-adds in the same
// order (the same sums but for denormals, which `vdpbf16ps` flushes to zero).
//
// The weight is stored once, blocked by 16 output columns so that one 64-byte load is one
// input step of 16 columns:
//   bf16:    [N/16][K/2][16][2]  input pairs (k, k+1) of 16 columns; `vdpbf16ps` multiplies a
//                                 broadcast input pair into 16 float32 sums
//   float32: [N/16][K][16]       one input of 16 columns; `vfmadd` as above
// N and K are zero-padded up to whole blocks and pairs, so any layer shape (a vocabulary that
// is not a multiple of 16, an odd hidden size) takes the same kernels.
//
// A tile of MR input rows by NB blocks keeps MR x NB float32 sums in registers while it walks
// the whole input dimension: NB weight loads and MR broadcasts feed MR x NB multiply-adds per
// step. Decode batches (a few rows) stream every weight from memory once, the blocks side by
// side; prefills (many rows) reuse a panel of NB blocks from the L2 cache for every row tile.
//
// Each output is one chain of multiply-adds over the input in ascending order, started from
// zero, then the bias is added and the sum rounded once (to bf16 as c10 rounds). That order does
// not depend on the number of rows, on the tile a row lands in or on the thread that computes
// it: a row's output is the same bits whatever batch it is part of (batch invariance, which
// `--enable-deterministic-inference` relies on).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "linear_args.h"
#include "vec_math.h"

namespace {

using namespace radixserve_cpu;

constexpr int64_t kBlock = 16;  // output columns per block: one register of float32 sums
constexpr int kMaxRows = 6;     // rows per tile: 6 x 4 sums + 4 weights + 1 input in 32 registers
constexpr int kPanel = 4;       // blocks per tile
// Each block of a tile is a stream of its own; the hardware prefetcher does not keep them all
// ahead, so each step asks for its blocks' weights 1 KiB ahead (one cache line per step and
// block): from memory, 1.1-1.2x faster at 1 to 16 rows on an AMX Xeon.
constexpr int64_t kAheadBytes = 1024;

// One step of the input for the bf16 and float32 layouts.
struct Bf16 {
  using T = uint16_t;
  static constexpr int64_t kStep = 2;  // inputs per step: a pair
  static __m512 madd(__m512 acc, const T* x, __m512i w) {
    const __m512i pair = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x));
    return dot_bf16_pairs(acc, pair, w);
  }
  static __m512 load(const T* p, __mmask16 m) { return load_bf16(p, m); }
  static void store(T* p, __m512 v, __mmask16 m) { store_bf16(p, round_to_bf16(v), m); }
};

struct F32 {
  using T = float;
  static constexpr int64_t kStep = 1;
  static __m512 madd(__m512 acc, const T* x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_set1_ps(*x), _mm512_castsi512_ps(w), acc);
  }
  static __m512 load(const T* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(T* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
};

struct Problem {
  int64_t n, steps;        // output columns; input steps (K / kStep, padded)
  int64_t x_stride;        // elements between input rows
  int64_t block_elems;     // elements of one weight block (steps * 16 * kStep)
  int64_t y_stride;        // elements between output rows
};

// Rows [0, MR) of x times blocks [0, NB) of w (already offset to the tile), into y at column
// `col`; the last block of the layer may be partial (`n - col` columns left).
template <typename D, int MR, int NB>
void tile(const typename D::T* x, const typename D::T* w, const typename D::T* bias,
          typename D::T* y, int64_t col, const Problem& p) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t s = 0; s < p.steps; ++s) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w + b * p.block_elems + s * kBlock * D::kStep) +
                       kAheadBytes,
                   _MM_HINT_T0);
    }
    for (int b = 0; b < NB; ++b) {
      wv[b] = _mm512_loadu_si512(w + b * p.block_elems + s * kBlock * D::kStep);
    }
    for (int r = 0; r < MR; ++r) {
      const typename D::T* xr = x + r * p.x_stride + s * D::kStep;
      for (int b = 0; b < NB; ++b) acc[r][b] = D::madd(acc[r][b], xr, wv[b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t c = col + b * kBlock;
    const __mmask16 m = lanes(p.n - c);
    const __m512 add = bias ? D::load(bias + c, m) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) D::store(y + r * p.y_stride + c, _mm512_add_ps(acc[r][b], add), m);
  }
}

template <typename D, int NB>
void row_tiles(const typename D::T* x, int64_t m, const typename D::T* w,
               const typename D::T* bias, typename D::T* y, int64_t col, const Problem& p) {
  int64_t r = 0;
  for (; r + kMaxRows <= m; r += kMaxRows) {
    tile<D, kMaxRows, NB>(x + r * p.x_stride, w, bias, y + r * p.y_stride, col, p);
  }
  const auto* xr = x + r * p.x_stride;
  auto* yr = y + r * p.y_stride;
  switch (m - r) {
    case 1: tile<D, 1, NB>(xr, w, bias, yr, col, p); break;
    case 2: tile<D, 2, NB>(xr, w, bias, yr, col, p); break;
    case 3: tile<D, 3, NB>(xr, w, bias, yr, col, p); break;
    case 4: tile<D, 4, NB>(xr, w, bias, yr, col, p); break;
    case 5: tile<D, 5, NB>(xr, w, bias, yr, col, p); break;
    default: break;
  }
}

// Blocks [first, last) of the layer for all m rows, a panel of kPanel blocks at a time.
template <typename D>
void panels(const typename D::T* x, int64_t m, const typename D::T* w, const typename D::T* bias,
            typename D::T* y, int64_t first, int64_t last, const Problem& p) {
  int64_t b = first;
  for (; b + kPanel <= last; b += kPanel) {
    row_tiles<D, kPanel>(x, m, w + b * p.block_elems, bias, y, b * kBlock, p);
  }
  const auto* wb = w + b * p.block_elems;
  switch (last - b) {
    case 1: row_tiles<D, 1>(x, m, wb, bias, y, b * kBlock, p); break;
    case 2: row_tiles<D, 2>(x, m, wb, bias, y, b * kBlock, p); break;
    case 3: row_tiles<D, 3>(x, m, wb, bias, y, b * kBlock, p); break;
    default: break;
  }
}

template <typename D>
void run(const at::Tensor& x, const at::Tensor& w, const void* bias, at::Tensor& y, int64_t n) {
  const int64_t m = x.size(0), blocks = w.size(0);
  const Problem p{n, w.size(1), x.stride(0), w.stride(0), n};
  using T = typename D::T;
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  const T* bp = static_cast<const T*>(bias);
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  // Threads split the output columns, whole panels each; a small layer stays on one thread.
  const int64_t panels_total = (blocks + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, m * p.block_elems));
  at::parallel_for(0, panels_total, grain, [&](int64_t first, int64_t last) {
    panels<D>(xp, m, wp, bp, yp, first * kPanel, std::min(last * kPanel, blocks), p);
  });
}

// x: [M, K] (bf16 or float32; rows contiguous); weight: the blocked layout above for K padded to
// weight.size(1) steps; bias: [N] of x's dtype or None. Returns [M, n].
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, int64_t n) {
  check_blocked_linear("linear", x, weight, n, kBlock);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* bp = checked_bias("linear", x, bias, n);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  if (bf16) {
    run<Bf16>(x, weight, bp, y, n);
  } else {
    run<F32>(x, weight, bp, y, n);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, int n) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, &linear);
}
