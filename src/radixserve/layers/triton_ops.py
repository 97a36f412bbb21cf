"""Triton kernels behind the ``forward_cuda`` of the element-wise ``CustomOp``s: RMSNorm and
add+RMSNorm, neox rotary, SiLU-and-mul. Each is one launch where the torch reference
(``forward_native``) runs four to eight ops with float32 intermediates, which on a GPU decode step
costs far more in host dispatch than in memory traffic.

Each kernel computes in float32 and rounds to the activation dtype where its reference rounds
(after the normalisation before the weight; after each product of the rotary; after the SiLU), so
in bf16/fp16 it differs from the reference at most where float32 sums in another order land on
the other side of a rounding, and in fp32 by a few ulps.

Imported only by ``forward_cuda`` (the ops' CUDA path), and by tests that run the kernels in
Triton's interpreter on CPU (``TRITON_INTERPRET=1`` before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    X, R, W, Out, stride_x, stride_r, stride_o, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The reference adds in the activation dtype and carries that sum on.
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
             .to(tl.float32)).to(X.dtype.element_ty)
        tl.store(R + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D view whose last dimension is contiguous (a copy only when needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm.forward_native(x)`` in one kernel; a new tensor."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n_cols = x2.shape[1]
    _rms_norm_kernel[(x2.shape[0],)](
        x2, x2, weight, out, x2.stride(0), x2.stride(0), out.stride(0), n_cols, eps,
        HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(n_cols),
    )
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``; the sum is written over ``residual`` (so it must be
    a tensor the caller is done with, as for the CPU kernel), the norm into a new tensor."""
    assert residual.is_contiguous(), "the residual is updated in place"
    x2, r2 = _rows(x), residual.view(-1, residual.shape[-1])
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n_cols = x2.shape[1]
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, x2.stride(0), r2.stride(0), out.stride(0), n_cols, eps,
        HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(n_cols),
    )
    return out.view(x.shape), residual


@triton.jit
def _rotary_kernel(
    X, Cos, Sin, Out, stride_xt, stride_xh, stride_ct, stride_st, stride_ot, stride_oh,
    num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    row = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    mask = (heads[:, None] < num_heads) & col_mask[None, :]
    base = X + row * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(Cos + row * stride_ct + cols, mask=col_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(Cos + row * stride_ct + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(Sin + row * stride_st + cols, mask=col_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(Sin + row * stride_st + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    # x * cos + swap_halves(x) * sin, rounding each product and the sum as the reference does.
    out1 = ((x1 * cos1[None, :]).to(dtype).to(tl.float32)
            + (x2 * sin1[None, :]).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos2[None, :]).to(dtype).to(tl.float32)
            + (x1 * sin2[None, :]).to(dtype).to(tl.float32)).to(dtype)
    out = Out + row * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    tl.store(out, out1, mask=mask)
    tl.store(out + HALF, out2, mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``ApplyRotaryEmbedding.forward_native``: ``x`` ``[n, heads, head_dim]`` (heads contiguous,
    rows may be strided), ``cos``/``sin`` ``[n, 1, head_dim]``; a new contiguous tensor."""
    n, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        x = x.contiguous()
    cos2, sin2 = cos.reshape(n, head_dim), sin.reshape(n, head_dim)
    if cos2.stride(1) != 1 or sin2.stride(1) != 1:
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    out = torch.empty((n, heads, head_dim), dtype=x.dtype, device=x.device)
    half = head_dim // 2
    _rotary_kernel[(n,)](
        x, cos2, sin2, out, x.stride(0), x.stride(1), cos2.stride(0), sin2.stride(0),
        out.stride(0), out.stride(1), heads,
        HALF=half, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return out


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``SiluAndMul.forward_native``: ``silu(x[..., :d]) * x[..., d:]``."""
    x2 = _rows(x)
    d = x2.shape[1] // 2
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
        x2, out, x2.stride(0), out.stride(0), d, BLOCK=block
    )
    return out.view(*x.shape[:-1], d)
