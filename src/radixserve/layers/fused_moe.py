"""Mixture-of-experts MLP: top-k routing over ``num_experts`` gated (SwiGLU) experts.

Each expert is an ``ExpertMLP``: a fused ``gate_up_proj`` and a ``down_proj``, the linear layers
of the dense MLP, so the checkpoint's per-expert tensors (``experts.N.gate_proj`` ...) load
through the usual fused-layer loaders, split over the tensor-parallel group like a dense MLP
(each rank holds a slice of every expert's intermediate size), and pack for the device's
kernels (the CPU's blocked bf16 kernels, or int8 with ``--quantization int8``). A rank's
partial sums of all experts are reduced over the group once per layer, not per expert.

``FusedMoE`` (a ``CustomOp``) routes and runs the experts:

    routing  softmax of the router logits in float32, the top ``top_k`` probabilities,
             renormalised to sum to 1 when the family says so (Mixtral always, Qwen MoE with
             ``norm_topk_prob``), cast to the activations' dtype (transformers' order);
    native   the reference: for each expert that any token chose, in expert order, its MLP on
             those tokens, weighted and added into the output (transformers' loop);
    cpu      one sort of the (token, choice) pairs by expert and one gather, then each expert's
             MLP as one matmul per layer on its contiguous run of tokens (grouped GEMMs on the
             blocked kernels), the weights applied in one multiply and the results added back
             with one ``index_add_``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed import RankGroup
from radixserve.layers import cpu_kernels
from radixserve.layers.custom_op import CustomOp
from radixserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixserve.layers.quantization import QuantizationConfig


class ExpertMLP(nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))``; ``down_proj`` is never called as a module
    (its partial sums are reduced once for all experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int,
                 quant_config: QuantizationConfig | None, tp: RankGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=False,
            quant_config=quant_config, tp=tp,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, quant_config=quant_config, tp=tp
        )


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [n, top_k] in dtype, expert ids [n, top_k])`` of each token."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class FusedMoE(CustomOp):
    cpu_dtypes = cpu_kernels.KERNEL_DTYPES

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, quant_config: QuantizationConfig | None = None,
                 tp: RankGroup | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be between 1 and num_experts {num_experts}")
        self.tp = tp or RankGroup.single()
        self.top_k, self.renormalize = top_k, renormalize
        # children named 0, 1, ...: at ``mlp.experts`` they take the checkpoint's names
        # (``mlp.experts.N.gate_up_proj``)
        self.num_experts = num_experts
        for i in range(num_experts):
            self.add_module(str(i), ExpertMLP(hidden_size, intermediate_size, quant_config,
                                              self.tp))

    def _expert(self, index: int, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
        """Expert ``index`` on rows ``x``: this rank's partial sums (unreduced)."""
        expert = self._modules[str(index)]
        assert isinstance(expert, ExpertMLP)
        h = expert.gate_up_proj(x)
        if act is None:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = act(h)
        return expert.down_proj.packed.linear(h, None)

    def forward_native(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize, x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            y = self._expert(e, x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out

    def forward_cpu(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize, x.dtype)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, token)
        outs = []
        start = 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self._expert(e, rows[start : start + n], _silu_and_mul))
            start += n
        y = torch.cat(outs) * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class _SiluAndMulKernel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_and_mul(x)


_silu_and_mul = _SiluAndMulKernel()
