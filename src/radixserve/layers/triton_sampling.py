"""Triton kernels behind the sampler's CUDA path: the greedy argmax, and temperature sampling
(with min_p) by inverting each row's cumulative distribution, one launch per batch each.

The torch references (``GreedyArgmax.forward_native``, ``TemperatureSample.forward_native`` in
``layers/sampler.py``) run five to ten ops per step over ``[bs, vocab]`` (block maxima, softmax,
a float64 cumulative sum, two searches, clamps); on a GPU decode step each costs a launch and its
host-side dispatch, which at small batch is far more than the memory traffic. Neither kernel
reads anything back to the host: the step's only device-to-host copy stays the one that brings
the next tokens (``SampleOutput.to_host``).

Rounding: the argmax is exact (same first maximum, NaN counting as the maximum, as torch). The
sampler sums in float32 where the reference sums in float64, so a uniform that lands within
float32 rounding of a boundary between two tokens' cumulative masses may pick the neighbour; the
tests check that the chosen token's cumulative interval holds the target up to that rounding.

Imported only by ``forward_cuda`` and by tests that run the kernels in Triton's interpreter on CPU
(``TRITON_INTERPRET=1`` before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # vocabulary entries a program reads per iteration


@triton.jit
def _argmax_kernel(Logits, Out, stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    big = n_cols  # "no index yet": larger than every real one
    best = -float("inf")
    best_idx = big
    first_nan = big
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(Logits + row * stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        is_nan = (x != x) & mask
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan, cols, big), axis=0))
        x = tl.where(is_nan, -float("inf"), x)
        block_max = tl.max(x, axis=0)
        block_idx = tl.min(tl.where((x == block_max) & mask, cols, big), axis=0)
        # Strictly greater: an earlier block keeps a tie (torch returns the first maximum).
        take = (block_max > best) | (best_idx == big)
        best_idx = tl.where(take, block_idx, best_idx)
        best = tl.where(take, block_max, best)
    result = tl.where(first_nan < big, first_nan, best_idx)
    tl.store(Out + row, result.to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a ``[bs, vocab]`` tensor (last dimension contiguous)."""
    bs, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(bs, dtype=torch.int64, device=logits.device)
    if bs:
        _argmax_kernel[(bs,)](logits, out, logits.stride(0), vocab, BLOCK=_BLOCK)
    return out


@triton.jit
def _kept_weights(Logits, row, stride, start, n_cols, inv_t, peak, min_p, BLOCK: tl.constexpr):
    """The block at ``start`` of a row's unnormalised probabilities ``exp(x / T - peak)``, with
    the tokens min_p removes (and the lanes past the row) at 0; and the block's columns."""
    cols = start + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(Logits + row * stride + cols, mask=mask, other=-float("inf"))
    w = tl.exp(x.to(tl.float32) * inv_t - peak)
    return tl.where(mask & (w >= min_p), w, 0.0), cols


@triton.jit
def _temperature_sample_kernel(
    Logits, Temperatures, MinPs, Uniforms, Out, stride, n_cols,
    HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    inv_t = 1.0 / tl.load(Temperatures + row)
    # 1. the row's maximum of logits / temperature (softmax's shift)
    peak = -float("inf")
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(Logits + row * stride + cols, mask=cols < n_cols, other=-float("inf"))
        peak = tl.maximum(peak, tl.max(x.to(tl.float32) * inv_t, axis=0))
    # 2. the kept mass. min_p keeps p_i >= min_p * max_p, i.e. exp(x_i / T - peak) >= min_p.
    min_p = tl.load(MinPs + row) if HAS_MIN_P else 0.0
    total = 0.0
    last = -1  # the last token with mass: where a target rounded up to the total lands
    for start in range(0, n_cols, BLOCK):
        w, cols = _kept_weights(Logits, row, stride, start, n_cols, inv_t, peak, min_p, BLOCK)
        total += tl.sum(w, axis=0)
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, cols, -1), axis=0))
    # 3. the first token whose running mass exceeds uniform * total (searchsorted, right=True)
    target = tl.load(Uniforms + row).to(tl.float32) * total
    running = 0.0
    chosen = n_cols
    for start in range(0, n_cols, BLOCK):
        w, cols = _kept_weights(Logits, row, stride, start, n_cols, inv_t, peak, min_p, BLOCK)
        cdf = running + tl.cumsum(w, axis=0)
        hit = (cols < n_cols) & (cdf > target)
        chosen = tl.minimum(chosen, tl.min(tl.where(hit, cols, n_cols), axis=0))
        running += tl.sum(w, axis=0)
    chosen = tl.minimum(chosen, last)
    # A NaN row has no token with mass (last == -1): clamp into the vocabulary, as the reference.
    chosen = tl.minimum(tl.maximum(chosen, 0), n_cols - 1)
    tl.store(Out + row, chosen.to(tl.int64))


def temperature_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    min_ps: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token per row of float32 ``logits`` ``[bs, vocab]``, drawn from
    ``softmax(logits / temperatures)`` with tokens below ``min_ps`` times the row's most likely
    one removed (None: no min_p), at ``uniforms`` ``[bs, 1]`` in [0, 1)."""
    bs, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(bs, dtype=torch.int64, device=logits.device)
    if bs:
        temps = temperatures.reshape(bs).to(torch.float32).contiguous()
        mins = temps if min_ps is None else min_ps.reshape(bs).to(torch.float32).contiguous()
        _temperature_sample_kernel[(bs,)](
            logits, temps, mins, uniforms.reshape(bs).contiguous(), out, logits.stride(0), vocab,
            HAS_MIN_P=min_ps is not None, BLOCK=_BLOCK,
        )
    return out
