// A grammar's token bitmask applied to the logits: every token the bitmask forbids becomes -inf.
//
// The bitmask is the one xgrammar fills (constrained/base.py): int32 [batch, ceil(vocab / 32)],
// bit t % 32 of word t / 32 set where token t may come next. xgrammar's own CPU apply tests the
// tokens one at a time; here each word of the bitmask is, negated, the lane mask of a masked
// store of -inf over its 32 logits (one 512-bit store in bf16, two in float32), and a word that
// allows all 32 costs one compare. Nothing is read from the logits, so a row costs about its
// share of the bitmask plus the writes of the forbidden entries. Tokens past the bitmask's width
// (a vocabulary padded beyond the tokenizer's) are left as they are, as xgrammar leaves them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// The lanes of a word whose tokens fall inside the first `limit` tokens of the row.
inline uint32_t valid_lanes(int64_t first_token, int64_t limit) {
  const int64_t left = limit - first_token;
  return left >= 32 ? 0xFFFFFFFFu : (uint32_t{1} << left) - 1;
}

void mask_row_f32(float* x, const int32_t* words, int64_t n_words, int64_t limit) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t w = 0; w < n_words; ++w) {
    const uint32_t forbidden = ~static_cast<uint32_t>(words[w]) & valid_lanes(32 * w, limit);
    if (forbidden == 0) continue;
    _mm512_mask_storeu_ps(x + 32 * w, static_cast<__mmask16>(forbidden), neg_inf);
    _mm512_mask_storeu_ps(x + 32 * w + 16, static_cast<__mmask16>(forbidden >> 16), neg_inf);
  }
}

void mask_row_bf16(uint16_t* x, const int32_t* words, int64_t n_words, int64_t limit) {
  const __m512i neg_inf = _mm512_set1_epi16(static_cast<int16_t>(0xFF80));  // bf16 -inf
  for (int64_t w = 0; w < n_words; ++w) {
    const uint32_t forbidden = ~static_cast<uint32_t>(words[w]) & valid_lanes(32 * w, limit);
    if (forbidden == 0) continue;
    _mm512_mask_storeu_epi16(x + 32 * w, static_cast<__mmask32>(forbidden), neg_inf);
  }
}

// logits: [batch, vocab] float32 or bf16 with contiguous rows; bitmask: int32 [batch, words] on
// the CPU; rows: the rows to mask (the constrained requests of the batch).
void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask,
                         at::IntArrayRef rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "apply_token_bitmask takes [batch, vocab] logits with contiguous rows, got ",
              logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "apply_token_bitmask takes float32 or bf16 logits, got ", logits.scalar_type());
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt &&
                  bitmask.is_contiguous() && bitmask.size(0) == logits.size(0),
              "the bitmask must be contiguous int32 [batch, words] for logits ", logits.sizes(),
              ", got ", bitmask.sizes());
  const int64_t batch = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  const int64_t limit = std::min(vocab, 32 * words);
  const int64_t n_words = (limit + 31) / 32;
  for (int64_t r : rows) TORCH_CHECK(r >= 0 && r < batch, "row ", r, " outside the batch");
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  const int64_t stride = logits.stride(0);
  const bool f32 = logits.scalar_type() == at::kFloat;
  char* base = static_cast<char*>(logits.data_ptr());
  const int64_t n = static_cast<int64_t>(rows.size());
  // A row is about a vocabulary of stores: rows go to threads only in batches worth it.
  at::parallel_for(0, n, std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(vocab, 1)),
                   [&](int64_t first, int64_t last) {
                     for (int64_t i = first; i < last; ++i) {
                       const int64_t r = rows[i];
                       const int32_t* row_words = mask + r * words;
                       if (f32) {
                         mask_row_f32(reinterpret_cast<float*>(base) + r * stride, row_words,
                                      n_words, limit);
                       } else {
                         mask_row_bf16(reinterpret_cast<uint16_t*>(base) + r * stride, row_words,
                                       n_words, limit);
                       }
                     }
                   });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, int[] rows) -> ()");
  m.impl("apply_token_bitmask", c10::DispatchKey::CPU, &apply_token_bitmask);
}
