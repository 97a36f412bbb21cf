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
             with one ``index_add_``. On AMX CPUs, when every active expert has at most 32
             rows (decode), the experts run as one grouped AMX GEMM per projection
             (``grouped_gemm_amx``: one parallel region for all experts, not three per
             expert) and one silu-and-mul; otherwise one kernel call per expert and projection.

Expert parallelism (``ep_size``, SGLang's ``--ep-size``, a divisor of the tensor-parallel size):
the tensor-parallel group's ranks are split into ``ep_size`` expert groups of
``tp_size / ep_size`` ranks (``ep_rank = tp_rank // moe_tp_size``, as SGLang numbers them). The
ranks of expert group ``g`` hold experts ``[g * n, (g + 1) * n)`` (``n = num_experts /
ep_size``), each sliced over its ``moe_tp_size`` ranks by intermediate size (whole when
``ep_size == tp_size``); other experts are not built and their checkpoint tensors not read.
Attention is tensor-parallel and all-reduced, so every rank already holds every token: each routes
all of them, runs its own experts on the (token, expert) pairs that chose them, and the
all-reduce over the tensor-parallel group that sums the intermediate slices also sums the expert
groups' outputs (the all-gather and reduce-scatter of SGLang's EP, where attention is
data-parallel, reduce to this one all-reduce here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed import RankGroup
from radixserve.layers import cpu_kernels, kernel_dispatch
from radixserve.layers.custom_op import CustomOp
from radixserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixserve.layers.packed_weight import CpuPackedWeight
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
    cpu_ops = ("silu_and_mul",)  # and the AMX GEMMs where amx_available()

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, quant_config: QuantizationConfig | None = None,
                 tp: RankGroup | None = None, ep_size: int = 1) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be between 1 and num_experts {num_experts}")
        self.tp = tp or RankGroup.single()
        self.top_k, self.renormalize = top_k, renormalize
        self.num_experts = num_experts
        self.ep_size, slicing = expert_group(self.tp, ep_size, num_experts)
        self.local_experts = num_experts // self.ep_size
        self.first_expert = self.tp.rank_in_group // slicing.size * self.local_experts
        # children named by their expert index: at ``mlp.experts`` they take the checkpoint's
        # names (``mlp.experts.N.gate_up_proj``)
        for i in self.expert_range:
            self.add_module(str(i), ExpertMLP(hidden_size, intermediate_size, quant_config,
                                              slicing))

    @property
    def expert_range(self) -> range:
        """The experts this rank holds (all of them without expert parallelism)."""
        return range(self.first_expert, self.first_expert + self.local_experts)

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

    def _grouped_amx(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """All active experts' MLPs on their sorted ``rows`` in three kernel calls (grouped
        gate_up GEMM, one silu-and-mul, grouped down GEMM) when every one of them runs the AMX
        kernel at its row count (bf16 on an AMX CPU, at most 32 rows each, as the kernel
        dispatch table says); None otherwise (the per-expert loop then runs)."""
        if rows.dtype != torch.bfloat16:
            return None
        gate_up, down, starts = [], [], [0]
        for e, n in enumerate(counts, self.first_expert):
            if not n:
                continue
            expert = self._modules[str(e)]
            assert isinstance(expert, ExpertMLP)
            w13 = _amx_blocked(expert.gate_up_proj.packed, n)
            w2 = _amx_blocked(expert.down_proj.packed, n)
            if w13 is None or w2 is None:
                return None
            gate_up.append(w13)
            down.append(w2)
            starts.append(starts[-1] + n)
        h = cpu_kernels.grouped_gemm_amx(rows, gate_up, starts)
        return cpu_kernels.grouped_gemm_amx(cpu_kernels.silu_and_mul(h), down, starts)

    def forward_native(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize, x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            if e not in self.expert_range:  # another expert group's
                continue
            token, slot = torch.where(ids == e)
            y = self._expert(e, x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out

    def forward_cpu(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize, x.dtype)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        first = self.first_expert
        skip = sum(counts[:first])  # pairs of lower expert groups' experts
        counts = counts[first : first + self.local_experts]
        order = order[skip : skip + sum(counts)]
        out = torch.zeros_like(x)
        if not len(order):  # no token chose this rank's experts
            return self.tp.all_reduce(out) if self.tp.size > 1 else out
        token = order // self.top_k
        rows = x.index_select(0, token)
        grouped = self._grouped_amx(rows, counts)
        if grouped is not None:
            y = grouped
        else:
            outs = []
            start = 0
            for e, n in enumerate(counts, first):
                if n:
                    outs.append(self._expert(e, rows[start : start + n], _silu_and_mul))
                start += n
            y = torch.cat(outs)
        y = y * weights.reshape(-1)[order, None]
        out.index_add_(0, token, y.to(x.dtype))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


_AMX_MAX_ROWS = cpu_kernels.AMX_MAX_ROWS  # the rows grouped_gemm_amx takes per expert


def _amx_blocked(packed: object, rows: int) -> torch.Tensor | None:
    """The blocked weight of ``packed`` when its kernel for ``rows`` rows is the AMX one."""
    if not isinstance(packed, CpuPackedWeight) or rows > _AMX_MAX_ROWS:
        return None
    kernel = packed.table[kernel_dispatch.BUCKET_OF_ROWS[rows]]
    return packed.blocked if kernel == kernel_dispatch.AMX else None


def expert_group(tp: RankGroup, ep_size: int, num_experts: int) -> tuple[int, RankGroup]:
    """``(ep_size, the ranks that slice this rank's experts)``; the second is a group for the
    slicing of weights only (``rank_in_group`` and ``size``): nothing is reduced over it."""
    if ep_size < 1 or tp.size % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide tp_size {tp.size}")
    if num_experts % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide the model's {num_experts} experts")
    if ep_size == 1:
        return 1, tp
    moe_tp = tp.size // ep_size
    start = tp.rank_in_group // moe_tp * moe_tp
    return ep_size, RankGroup(tp.ranks[start : start + moe_tp], tp.rank)


class _SiluAndMulKernel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_and_mul(x)


_silu_and_mul = _SiluAndMulKernel()
