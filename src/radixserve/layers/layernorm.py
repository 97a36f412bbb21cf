"""RMSNorm computed in float32 and cast back, as transformers' Llama/Qwen implementations do.

On CPU the fused kernels (``layers/cpu_kernels.py``) round where this torch math does; on CUDA
one Triton kernel (``layers/triton_ops.py``) does the add and the norm.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.layers import cpu_kernels
from radixserve.layers.custom_op import CustomOp

NormOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class RMSNorm(CustomOp):
    """Normalise the last dimension of ``x`` (any leading shape).

    With ``residual`` (vLLM/SGLang's convention), add it first and return
    ``(norm(x + residual), x + residual)``: the decoder carries the sum as the next residual, and
    the add fuses into the norm's kernel. The CPU kernel writes both results over ``x`` and
    ``residual``, so callers pass tensors they are done with.
    """

    cpu_dtypes = cpu_kernels.KERNEL_DTYPES
    cpu_ops = ("rms_norm", "fused_add_rms_norm")

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> NormOutput:
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> NormOutput:
        if residual is None:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        # The decoder passes its own contiguous activations; a view is summed out of place.
        if not (x.is_contiguous() and residual.is_contiguous()):
            x, residual = x.contiguous(), residual.contiguous()
        cpu_kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> NormOutput:
        from radixserve.layers import triton_ops

        if residual is None:
            return triton_ops.rms_norm(x, self.weight, self.eps)
        if not residual.is_contiguous():
            residual = residual.contiguous()
        return triton_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
