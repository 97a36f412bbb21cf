"""RMSNorm computed in float32 and cast back, as transformers' Llama/Qwen implementations do.

bf16 on CPU takes radixserve's fused kernels (``layers/cpu_kernels.py``), which round where this
torch math does; every other dtype and device keeps the torch math.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.layers.cpu_kernels import bf16_kernels_supported, fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise the last dimension of ``x`` (any leading shape).

        With ``residual`` (vLLM/SGLang's convention), add it first and return
        ``(norm(x + residual), x + residual)``: the decoder carries the sum as the next residual,
        and the add fuses into the norm's kernel. That kernel writes both results over ``x`` and
        ``residual``, so callers pass tensors they are done with.
        """
        weight = self.weight
        if residual is None:
            if bf16_kernels_supported(x, weight):
                return rms_norm(x, weight, self.eps)
            return self._norm(x)
        fusable = x.is_contiguous() and residual.is_contiguous()  # the kernel writes in place
        if fusable and bf16_kernels_supported(x, residual, weight):
            fused_add_rms_norm(x, residual, weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
