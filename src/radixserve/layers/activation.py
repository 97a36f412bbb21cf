"""Gated activation of the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for the fused ``[..., 2 * d]`` output of ``gate_up_proj``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
