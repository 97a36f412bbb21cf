"""Triton kernels of the ``triton`` attention backend: paged attention over the KV pool, reading
each request's KV slots through its ``req_to_token`` row (so any page size works: a page is only
a run of consecutive slots the allocator handed out together).

Decode (one new token per request) is split-KV in two stages, SGLang's design:

    stage 1  grid (batch, kv_heads, NUM_KV_SPLITS): each program takes the query heads that share
             one KV head (GQA: one load of a key block serves the whole group, through one
             ``tl.dot``) and a contiguous split of the request's positions; it writes the split's
             normalised partial output and log-sum-exp in float32.
    stage 2  grid (batch, heads): merges the splits of each head by their log-sum-exp.

The split length is computed inside the kernel from ``seq_lens`` (``cdiv(seq_len,
NUM_KV_SPLITS)``), so the launch depends on no host value but the batch size: a decode step can be
captured in a CUDA graph and replayed with other lengths.

Extend (new tokens after a cached prefix) has a grid (batch, heads, query blocks); a query at
extend offset ``j`` sits at position ``prefix + j`` and attends causally over every position up
to it, prefix and new tokens alike, all read from the pool (the backend writes the new K/V there
first). Blocks past a request's own new tokens return at once.

A sliding window W (``WINDOW`` > 0) limits a query at position p to keys (p - W, p]: decode
splits only the last W positions of each request, extend starts each query block at the key
block holding its first row's earliest key; the earlier slots are never read. A soft cap C
(``SOFTCAP`` > 0, Gemma 2) replaces each scaled score s by C * tanh(s / C) before the softmax.
Both are compile-time constants (a model has at most two windows).

Scores, softmax and sums are float32; fp32 models take ``tl.dot`` in IEEE precision (no TF32),
so their greedy output matches ``transformers``. Every kernel masks head dimensions up to the
next power of two, so head_dim 64-256 (and sizes like 80 or 96) all run.

Triton's interpreter (``TRITON_INTERPRET=1``) runs these on CPU for the tests; it computes fp32
and fp16 exactly but not bf16.

A quantized pool (``--kv-cache-dtype``, ``mem_cache/kv_quant.py``) is read in the same loads:
``KV_FORMAT`` (a constexpr, so each format compiles its own kernel) says how a row's codes become
float32 before its scale (one float32 per slot and KV head for int8; the layer's one scale, read
with strides 0, for fp8) multiplies them. fp8 codes arrive as
uint8 and are widened through fp16 bits in integer arithmetic (e5m2: the high byte of the same
fp16; e4m3fn: its fields moved to fp16's, which reads as the value times 2^-8), which runs the
same on every GPU and in the interpreter, without fp8 types in the kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

NUM_KV_SPLITS = 8  # SGLang's default max_kv_splits

# KV_FORMAT of a pool's storage: the activations' own dtype (or another float), int8 codes,
# fp8 e4m3fn codes, fp8 e5m2 codes (both passed as uint8)
KV_PLAIN, KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2 = 0, 1, 2, 3
_KV_FORMATS = {torch.int8: KV_INT8, torch.float8_e4m3fn: KV_FP8_E4M3,
               torch.float8_e5m2: KV_FP8_E5M2}


@triton.jit
def _load_kv_rows(buf, scales, slots, kv_head, stride_t, stride_h, stride_s, stride_sh, offs_d,
                  kv_mask, n_mask, dtype, KV_FORMAT: tl.constexpr):
    """The rows ``slots`` of one KV head of ``buf`` as ``dtype``, dequantized with their scales
    when ``KV_FORMAT`` says the buffer holds codes."""
    raw = tl.load(buf + slots[:, None] * stride_t + kv_head * stride_h + offs_d[None, :],
                  mask=kv_mask, other=0)
    if KV_FORMAT == 0:
        return raw.to(dtype)
    if KV_FORMAT == 1:
        x = raw.to(tl.float32)
    elif KV_FORMAT == 2:
        u = raw.to(tl.uint16)
        bits = ((u & 0x7F) << 7) | ((u & 0x80) << 8)
        x = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        u = raw.to(tl.uint16)
        x = (u << 8).to(tl.float16, bitcast=True).to(tl.float32)
    scale = tl.load(scales + slots * stride_s + kv_head * stride_sh, mask=n_mask, other=0.0)
    return (x * scale[:, None]).to(dtype)


@triton.jit
def _attend_kv_block(
    q, acc, m_i, l_i, q_pos, pos, end, offs_d, d_mask,
    K_buf, V_buf, K_scale, V_scale, req_to_token, row, kv_head, sm_scale,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_s, stride_sh, stride_r2t,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, KV_FORMAT: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One online-softmax step, shared by decode and extend: attend the query rows ``q`` to the
    KV positions ``pos`` (those at ``end`` or past it masked; with ``CAUSAL``, also those past
    each row's ``q_pos``), reading the slots through the request's ``req_to_token`` row, and
    return the updated ``(acc, m_i, l_i)``."""
    n_mask = pos < end
    slots = tl.load(req_to_token + row * stride_r2t + pos, mask=n_mask, other=0)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = _load_kv_rows(K_buf, K_scale, slots, kv_head, stride_kt, stride_kh, stride_s, stride_sh,
                      offs_d, kv_mask, n_mask, q.dtype, KV_FORMAT)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * sm_scale
    if SOFTCAP > 0:
        # tanh(x) = 2 sigmoid(2x) - 1, in float32
        qk = SOFTCAP * (2.0 / (1.0 + tl.exp(-2.0 * qk / SOFTCAP)) - 1.0)
    if CAUSAL:
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        qk = tl.where(visible, qk, float("-inf"))
    else:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row that has seen no key yet (a window starting past this block) keeps m = -inf: shift
    # by 0 instead, so that its alpha and p are 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_shift)
    p = tl.exp(qk - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv_rows(V_buf, V_scale, slots, kv_head, stride_vt, stride_vh, stride_s, stride_sh,
                      offs_d, kv_mask, n_mask, q.dtype, KV_FORMAT)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _decode_stage1(
    Q, K_buf, V_buf, K_scale, V_scale, req_to_token, req_pool_indices, seq_lens, Mid_O, Mid_LSE,
    sm_scale,
    stride_qb, stride_qh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_s, stride_sh,
    stride_r2t,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    row = tl.load(req_pool_indices + b)
    first = 0
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0)
    split_len = tl.cdiv(seq_len - first, NUM_SPLITS)
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    offs_h = kv_head * KV_GROUP + offs_g
    h_mask = offs_g < KV_GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(
        Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for block in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend_kv_block(
            q, acc, m_i, l_i, end, block + offs_n, end, offs_d, d_mask,
            K_buf, V_buf, K_scale, V_scale, req_to_token, row, kv_head, sm_scale,
            stride_kt, stride_kh, stride_vt, stride_vh, stride_s, stride_sh, stride_r2t,
            CAUSAL=False, IEEE=IEEE, KV_FORMAT=KV_FORMAT,
            WINDOW=WINDOW, SOFTCAP=SOFTCAP,
        )
    if end > start:
        tl.store(
            Mid_O + b * stride_mob + offs_h[:, None] * stride_moh + split * stride_mos
            + offs_d[None, :],
            acc / l_i[:, None],
            mask=h_mask[:, None] & d_mask[None, :],
        )
        tl.store(Mid_LSE + b * stride_mlb + offs_h * stride_mlh + split, m_i + tl.log(l_i),
                 mask=h_mask)


@triton.jit
def _decode_stage2(
    Mid_O, Mid_LSE, Out, seq_lens,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens + b)
    if WINDOW > 0:
        seq_len = tl.minimum(seq_len, WINDOW)  # the positions stage 1 split
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(0, NUM_SPLITS):
        if split * split_len < seq_len:
            o = tl.load(
                Mid_O + b * stride_mob + h * stride_moh + split * stride_mos + offs_d,
                mask=d_mask,
                other=0.0,
            )
            lse = tl.load(Mid_LSE + b * stride_mlb + h * stride_mlh + split)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            weight = tl.exp(lse - m_new)
            acc = acc * alpha + weight * o
            total = total * alpha + weight
            m = m_new
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, (acc / total).to(Out.dtype.element_ty),
             mask=d_mask)


@triton.jit
def _extend_kernel(
    Q, Out, K_buf, V_buf, K_scale, V_scale, req_to_token, req_pool_indices, prefix_lens,
    extend_lens, q_starts,
    sm_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_s, stride_sh,
    stride_r2t,
    KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, KV_FORMAT: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    extend_len = tl.load(extend_lens + b)
    if m_block * BLOCK_M < extend_len:
        prefix = tl.load(prefix_lens + b)
        q_start = tl.load(q_starts + b)
        row = tl.load(req_pool_indices + b)
        kv_head = h // KV_GROUP
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < extend_len
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        offs_n = tl.arange(0, BLOCK_N)
        q = tl.load(
            Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        q_pos = prefix + offs_m
        # Every real row sees at least itself; padding rows' output is not stored.
        kv_end = tl.minimum(prefix + (m_block + 1) * BLOCK_M, prefix + extend_len)
        kv_begin = 0
        if WINDOW > 0:
            kv_begin = tl.maximum(prefix + m_block * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for block in range(kv_begin, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_kv_block(
                q, acc, m_i, l_i, q_pos, block + offs_n, kv_end, offs_d, d_mask,
                K_buf, V_buf, K_scale, V_scale, req_to_token, row, kv_head, sm_scale,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_s, stride_sh, stride_r2t,
                CAUSAL=True, IEEE=IEEE, KV_FORMAT=KV_FORMAT,
                WINDOW=WINDOW, SOFTCAP=SOFTCAP,
            )
        tl.store(
            Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            # padding rows past a window see no key (l = 0); their output is not stored
            (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(Out.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


class PagedKV(NamedTuple):
    """Where both kernels read a batch's KV: the pool's ``k_buffer``/``v_buffer``
    (``[slots, kv_heads, head_dim]``) through the ``req_to_token`` rows of the batch's requests
    (``req_pool_indices``); a quantized pool's codes come with their float32 scales
    (``[slots, kv_heads]``, contiguous or one value with strides 0)."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


_KVArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]


def _kv_args(kv: PagedKV) -> _KVArgs:
    """The buffers as the kernels take them (fp8 codes as uint8), the scales (the buffers
    themselves when there are none: never read), the scales' slot and head strides (0 and 0 for
    a layer's one scale) and ``KV_FORMAT``."""
    fmt = _KV_FORMATS.get(kv.k_buffer.dtype, KV_PLAIN)
    k, v = kv.k_buffer, kv.v_buffer
    if fmt in (KV_FP8_E4M3, KV_FP8_E5M2):
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    if fmt == KV_PLAIN:
        return k, v, k, v, 0, 0, fmt
    assert kv.k_scale is not None and kv.v_scale is not None, "a quantized pool needs its scales"
    assert kv.k_scale.stride() == kv.v_scale.stride(), "K and V scales laid out alike"
    return k, v, kv.k_scale, kv.v_scale, kv.k_scale.stride(0), kv.k_scale.stride(1), fmt


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def decode_attention(
    q: torch.Tensor,
    kv: PagedKV,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int = NUM_KV_SPLITS,
    window: int | None = None,
    softcap: float = 0.0,
) -> None:
    """Attention of one query token per request (``q`` ``[bs, heads, head_dim]``) over each
    request's ``seq_lens[i]`` positions of ``kv`` (the last ``window`` of them, with a sliding
    window); written into ``out`` (``[bs, heads, head_dim]``)."""
    req_to_token, req_pool_indices = kv.req_to_token, kv.req_pool_indices
    k_buffer, v_buffer, k_scale, v_scale, stride_s, stride_sh, kv_format = _kv_args(kv)
    bs, heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    group = heads // kv_heads
    block_d = _block_d(head_dim)
    mid_o = torch.empty((bs, heads, num_kv_splits, head_dim), dtype=torch.float32,
                        device=q.device)
    mid_lse = torch.empty((bs, heads, num_kv_splits), dtype=torch.float32, device=q.device)
    _decode_stage1[(bs, kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices, seq_lens, mid_o,
        mid_lse,
        sm_scale,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), stride_s,
        stride_sh,
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        KV_GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=64 if block_d <= 128 else 32,
        NUM_SPLITS=num_kv_splits, IEEE=q.dtype == torch.float32, KV_FORMAT=kv_format,
        WINDOW=window or 0, SOFTCAP=float(softcap),
    )
    _decode_stage2[(bs, heads)](
        mid_o, mid_lse, out, seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_kv_splits, WINDOW=window or 0,
    )


def extend_attention(
    q: torch.Tensor,
    kv: PagedKV,
    out: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_starts: torch.Tensor,
    max_extend: int,
    sm_scale: float,
    window: int | None = None,
    softcap: float = 0.0,
) -> None:
    """Causal attention of each request's new tokens (``q`` ``[num_tokens, heads, head_dim]``,
    request ``i``'s ``extend_lens[i]`` rows from ``q_starts[i]``) over its prefix and new tokens,
    all already in ``kv``; written into ``out`` (same shape as ``q``)."""
    req_to_token, req_pool_indices = kv.req_to_token, kv.req_pool_indices
    k_buffer, v_buffer, k_scale, v_scale, stride_s, stride_sh, kv_format = _kv_args(kv)
    _, heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    block_d = _block_d(head_dim)
    small = block_d > 128 or q.dtype == torch.float32  # shared memory on the GPU
    block_m = 32 if small else 64
    bs = req_pool_indices.shape[0]
    _extend_kernel[(bs, heads, triton.cdiv(max_extend, block_m))](
        q, out, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices,
        prefix_lens, extend_lens, q_starts,
        sm_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), stride_s,
        stride_sh,
        req_to_token.stride(0),
        KV_GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=32 if small else 64, IEEE=q.dtype == torch.float32,
        KV_FORMAT=kv_format,
        WINDOW=window or 0, SOFTCAP=float(softcap),
    )
