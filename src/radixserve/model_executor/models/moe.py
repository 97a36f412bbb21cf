"""Mixture-of-experts families: the Llama decoder (``llama.py``) with a ``FusedMoE`` MLP
(``layers/fused_moe.py``) in its sparse layers.

    Mixtral     ``block_sparse_moe``: router ``gate``, experts ``w1``/``w3``/``w2`` (gate, up,
                down), top-k probabilities always renormalised; every layer sparse.
    Qwen2-MoE   ``mlp``: router ``gate``, experts ``gate_proj``/``up_proj``/``down_proj``,
                renormalised with ``norm_topk_prob``; plus a shared expert (a dense MLP of
                ``shared_expert_intermediate_size``) scaled by ``sigmoid(shared_expert_gate(x))``;
                qkv bias as Qwen2. Layers in ``mlp_only_layers``, or off the
                ``decoder_sparse_step`` grid, are dense (``intermediate_size``).
    Qwen3-MoE   Qwen2-MoE's routing without the shared expert, Qwen3's attention (q/k norms,
                no qkv bias).

Checkpoint names are Hugging Face's; Mixtral's are renamed on the way in
(``split_checkpoint_tensors``: ``block_sparse_moe`` → ``mlp``, ``w2`` → ``down_proj``; ``w1`` and
``w3`` fill ``gate_up_proj`` through ``packed_modules_mapping``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from radixserve.layers.fused_moe import FusedMoE
from radixserve.layers.linear_method import WeightSource
from radixserve.model_executor.models.llama import LayerSpec, LlamaForCausalLM, LlamaMLP
from radixserve.model_executor.models.phi3 import MistralForCausalLM
from radixserve.model_executor.models.qwen2 import Qwen2ForCausalLM
from radixserve.model_executor.models.qwen3 import Qwen3ForCausalLM

TensorList = list[tuple[str, Callable[[], WeightSource]]]


class SparseMoeBlock(nn.Module):
    """The router (``gate``), the experts and, for Qwen2-MoE, the gated shared expert."""

    def __init__(self, spec: LayerSpec, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, shared_intermediate_size: int = 0, ep_size: int = 1) -> None:
        super().__init__()
        config = spec.config
        # replicated on every rank: each computes the same routing
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = FusedMoE(num_experts, top_k, config.hidden_size, intermediate_size,
                                renormalize, config.quantization, spec.tp, ep_size)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(config.hidden_size, shared_intermediate_size, False,
                                          config.quantization, spec.tp)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
            self.shared_expert_gate.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out


def _num_experts(hf: dict[str, Any]) -> int:
    """``num_experts`` (transformers 4, Qwen2-MoE) or ``num_local_experts`` (transformers 5's
    Qwen3-MoE, Mixtral)."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def _sparse_layer(hf: dict[str, Any], layer_index: int) -> bool:
    """Qwen MoE: whether layer ``layer_index`` has experts (else a dense MLP)."""
    if layer_index in (hf.get("mlp_only_layers") or []):
        return False
    step = int(hf.get("decoder_sparse_step") or 1)
    return _num_experts(hf) > 0 and (layer_index + 1) % step == 0


class ExpertParallelMixin:
    """With ``--ep-size``: a rank skips the checkpoint tensors of experts it does not hold
    (``FusedMoE.expert_range``) as it skips other pipeline stages' layers."""

    parallel: Any

    def holds_weight(self, name: str) -> bool:
        if not super().holds_weight(name):  # type: ignore[misc]
            return False  # another pipeline stage's
        parts = name.split(".")  # model.layers.L.mlp.experts.E....
        if self.parallel.ep_size > 1 and parts[3:5] == ["mlp", "experts"] and len(parts) > 5:
            experts = self.model.layers[int(parts[2])].mlp.experts  # type: ignore[attr-defined]
            return int(parts[5]) in experts.expert_range
        return True


class Qwen2MoeForCausalLM(ExpertParallelMixin, Qwen2ForCausalLM):
    shared_expert = True

    def build_mlp(self, spec: LayerSpec, layer_index: int) -> nn.Module | None:
        hf = spec.config.hf_config
        if not _sparse_layer(hf, layer_index):
            return None  # dense: Llama's MLP of intermediate_size
        shared = int(hf.get("shared_expert_intermediate_size") or 0) if self.shared_expert else 0
        return SparseMoeBlock(
            spec, _num_experts(hf), int(hf["num_experts_per_tok"]),
            int(hf["moe_intermediate_size"]), bool(hf.get("norm_topk_prob", False)), shared,
            self.parallel.ep_size,
        )


class Qwen3MoeForCausalLM(ExpertParallelMixin, Qwen3ForCausalLM):
    def build_mlp(self, spec: LayerSpec, layer_index: int) -> nn.Module | None:
        hf = spec.config.hf_config
        if not _sparse_layer(hf, layer_index):
            return None
        return SparseMoeBlock(
            spec, _num_experts(hf), int(hf["num_experts_per_tok"]),
            int(hf["moe_intermediate_size"]), bool(hf.get("norm_topk_prob", False)),
            ep_size=self.parallel.ep_size,
        )


class MixtralForCausalLM(ExpertParallelMixin, MistralForCausalLM):
    packed_modules_mapping = {
        **LlamaForCausalLM.packed_modules_mapping,
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
    }

    def build_mlp(self, spec: LayerSpec, layer_index: int) -> nn.Module | None:
        hf = spec.config.hf_config
        return SparseMoeBlock(
            spec, _num_experts(hf), int(hf["num_experts_per_tok"]),
            spec.config.intermediate_size, renormalize=True, ep_size=self.parallel.ep_size,
        )

    def split_checkpoint_tensors(self, tensors: TensorList) -> TensorList:
        return [
            (name.replace(".block_sparse_moe.", ".mlp.").replace(".w2.", ".down_proj."), source)
            for name, source in tensors
        ]
