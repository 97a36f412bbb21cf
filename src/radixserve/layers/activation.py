"""Gated activation of the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.cpu_kernels import bf16_kernels_supported, silu_and_mul


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for the fused ``[..., 2 * d]`` output of ``gate_up_proj``; bf16 on CPU
    takes radixserve's fused kernel (``layers/cpu_kernels.py``), which rounds as torch does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bf16_kernels_supported(x):
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
