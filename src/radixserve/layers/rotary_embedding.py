"""Rotary position embedding (neox style: the head's two halves are the rotated pairs).

The inverse frequencies follow transformers exactly (``default``, ``linear`` and ``llama3``
types), and the cos/sin table is built in float32 for every position up to ``max_position``, then
cast to the activation dtype at use, as transformers does, so fp32 outputs match it bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from radixserve.layers import cpu_kernels
from radixserve.layers.custom_op import CustomOp


def compute_inv_freq(
    head_dim: int, base: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Float32 ``[head_dim // 2]`` inverse frequencies for the given RoPE type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = rope_scaling["rope_type"] if rope_scaling else "default"
    if rope_type == "default":
        return inv_freq
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, factor, rope_scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def _llama3_inv_freq(
    inv_freq: torch.Tensor, factor: float, rope_scaling: dict[str, Any]
) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are divided by ``factor``, short ones kept, and the
    band between the two is interpolated smoothly."""
    low_freq_factor = float(rope_scaling["low_freq_factor"])
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Looks up RoPE's cos/sin rows for a batch's positions, once per forward for all layers;
    each attention layer rotates its q and k with ``ApplyRotaryEmbedding``.

    The tables are stored as ``[cos, cos]`` and ``[-sin, sin]`` over the whole head, so rotating
    is ``x * cos + swap_halves(x) * sin``, and q and k heads can be rotated in one call. The
    products and sums are the same as transformers' ``rotate_half`` form, so fp32 outputs stay
    bit for bit equal to it.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, base, rope_scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        # Not part of the checkpoint; kept float32 whatever the model dtype.
        self.register_buffer("cos_cache", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_cache", torch.cat((-sin, sin), dim=-1), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: ``[n]`` → ``(cos, signed sin)``, each ``[n, 1, head_dim]`` in
        ``dtype``, broadcasting over heads in ``ApplyRotaryEmbedding``."""
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return cos, sin


class ApplyRotaryEmbedding(CustomOp):
    """Rotate ``x``: ``[n, heads, head_dim]`` (neox halves; heads contiguous, rows may be strided
    views of the qkv output) by ``(cos, sin)`` from ``RotaryEmbedding.forward``; returns a new
    contiguous tensor. The CPU kernel is one pass where torch runs four, and computes and rounds
    exactly as these four ops; the CUDA one (``layers/triton_ops.py``) rounds where they do."""

    cpu_dtypes = cpu_kernels.KERNEL_DTYPES
    cpu_ops = ("rotary",)

    def forward_native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((x2, x1), dim=-1) * sin

    def forward_cpu(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.rotary(x, cos, sin)

    def forward_cuda(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from radixserve.layers import triton_ops

        return triton_ops.rotary(x, cos, sin)
