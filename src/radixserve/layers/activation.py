"""Gated activation of the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.layers import cpu_kernels
from radixserve.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """``silu(gate) * up`` for the fused ``[..., 2 * d]`` output of ``gate_up_proj``. The CPU
    kernel is one pass (torch: two, and an intermediate as large as the output) and rounds as
    torch does; so does the CUDA one (``layers/triton_ops.py``)."""

    cpu_dtypes = cpu_kernels.KERNEL_DTYPES
    cpu_ops = ("silu_and_mul",)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_and_mul(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from radixserve.layers import triton_ops

        return triton_ops.silu_and_mul(x)
