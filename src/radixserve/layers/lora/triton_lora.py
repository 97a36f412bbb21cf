"""Triton kernels behind ``LoRADelta.forward_cuda``: the batched LoRA delta as SGLang's triton
LoRA backend shapes it, a "shrink" (``x @ A^T``, down to the rank) and an "expand"
(``(x A^T) @ B^T``, up to the layer's width) over **segments**: runs of consecutive rows that use
one adapter (a request's tokens in an extend, neighbouring requests of one adapter in a decode).

Each program takes a block of one segment's rows, so the adapter's weights are read once per
block and multiplied with ``tl.dot``, however many adapters the batch mixes; base-model rows
belong to no segment and keep the zeros the output starts with. Ranks are padded to the dot's
minimum block of 16 and masked.

Rounding: ``x`` is cast to the adapter weights' dtype (as the native reference does), products
sum in float32, and the rank-sized intermediate is rounded to that dtype before the expand (as
the reference's einsum keeps it). fp32 weights take IEEE-precision dots (no TF32), so fp32 output
matches the reference up to summation order.

Imported only by ``forward_cuda`` and by tests that run the kernels in Triton's interpreter on CPU
(``TRITON_INTERPRET=1`` before this module is imported).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

_BLOCK_M = 16  # rows of a segment per program
_BLOCK_K = 64  # input features per iteration of the shrink
_BLOCK_O = 64  # output features per program of the expand


@triton.jit
def _segment_block(SegStart, SegLen, SegSlot, BLOCK_M: tl.constexpr):
    """This program's segment: its first row, adapter slot, and the program's block of rows
    within it (offsets from the first row) with their mask."""
    seg = tl.program_id(0)
    start, n = tl.load(SegStart + seg), tl.load(SegLen + seg)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    return start, tl.load(SegSlot + seg), rows, rows < n


@triton.jit
def _shrink_kernel(
    X, A, Out, SegStart, SegLen, SegSlot, stride_xm, stride_as, stride_ar, stride_om, K, R,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):
    start, slot, rows, row_mask = _segment_block(SegStart, SegLen, SegSlot, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        x = tl.load(X + (start + rows)[:, None] * stride_xm + cols[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        a = tl.load(A + slot * stride_as + ranks[:, None] * stride_ar + cols[None, :],
                    mask=rank_mask[:, None] & col_mask[None, :], other=0.0)
        x = x.to(a.dtype)
        if IEEE:
            acc += tl.dot(x, tl.trans(a), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(a))
    out = Out + (start + rows)[:, None] * stride_om + ranks[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit
def _expand_kernel(
    XA, B, Out, SegStart, SegLen, SegSlot, stride_xam, stride_bs, stride_bo, stride_om, N_OUT, R,
    BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):
    start, slot, rows, row_mask = _segment_block(SegStart, SegLen, SegSlot, BLOCK_M)
    outs = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
    out_mask = outs < N_OUT
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    xa = tl.load(XA + (start + rows)[:, None] * stride_xam + ranks[None, :],
                 mask=row_mask[:, None] & rank_mask[None, :], other=0.0)
    b = tl.load(B + slot * stride_bs + outs[:, None] * stride_bo + ranks[None, :],
                mask=out_mask[:, None] & rank_mask[None, :], other=0.0)
    if IEEE:
        acc = tl.dot(xa, tl.trans(b), input_precision="ieee")
    else:
        acc = tl.dot(xa, tl.trans(b))
    out = Out + (start + rows)[:, None] * stride_om + outs[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=row_mask[:, None] & out_mask[None, :])


def lora_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``LoRADelta.forward_native``'s result: ``x`` ``[rows, in]``, ``a`` ``[slots, R, in]``,
    ``b`` ``[slots, out, R]``, and the segments (int64 ``[segments]`` each: first row, length,
    adapter slot) of the rows that use an adapter; ``reduce`` sums the rank-sized intermediate
    over the tensor-parallel group before the expand (row-parallel layers)."""
    rows, in_features = x.shape
    _, rank, _ = a.shape
    out_features = b.shape[1]
    delta = torch.zeros((rows, out_features), dtype=x.dtype, device=x.device)
    segments = seg_starts.numel()
    if segments == 0 or rows == 0:
        return delta
    if x.stride(1) != 1:
        x = x.contiguous()
    a, b = a.contiguous(), b.contiguous()
    # zeros: under tensor parallelism base rows take part in the sum over the group too
    xa = (torch.zeros if reduce is not None else torch.empty)(
        (rows, rank), dtype=a.dtype, device=x.device
    )
    block_r = max(16, triton.next_power_of_2(rank))
    ieee = a.dtype == torch.float32
    row_blocks = triton.cdiv(max_seg_len, _BLOCK_M)
    _shrink_kernel[(segments, row_blocks)](
        x, a, xa, seg_starts, seg_lens, seg_slots, x.stride(0), a.stride(0), a.stride(1),
        xa.stride(0), in_features, rank,
        BLOCK_M=_BLOCK_M, BLOCK_K=_BLOCK_K, BLOCK_R=block_r, IEEE=ieee,
    )
    if reduce is not None:
        xa = reduce(xa)
    _expand_kernel[(segments, row_blocks, triton.cdiv(out_features, _BLOCK_O))](
        xa, b, delta, seg_starts, seg_lens, seg_slots, xa.stride(0), b.stride(0), b.stride(1),
        delta.stride(0), out_features, rank,
        BLOCK_M=_BLOCK_M, BLOCK_O=_BLOCK_O, BLOCK_R=block_r, IEEE=ieee,
    )
    return delta
