"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's changes.

    - RMSNorm scales by ``1 + w`` (``GemmaRMSNorm``: the loader stores ``1 + w``, so the fused
      norm kernels apply unchanged), and each sub-layer has a norm after it too: attention and
      MLP outputs are normed before they join the residual stream, the MLP input after it
      (``pre_feedforward_layernorm``);
    - the input embedding is scaled by ``sqrt(hidden_size)`` (in the model's dtype);
    - the MLP is gated GELU (tanh approximation);
    - attention scales by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
    - layers alternate sliding-window and global attention (``layer_types``; Gemma 2 every other
      layer, Gemma 3 five sliding to one global);
    - Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``) and the final logits
      (``final_logit_softcapping``): ``cap * tanh(x / cap)``;
    - Gemma 3 norms q and k per head before RoPE (as Qwen3 does, with Gemma's norm) and rotates
      its sliding layers with a RoPE of their own base (``rope_local_base_freq``, or the
      ``sliding_attention`` entry of transformers 5's per-layer-type ``rope_parameters``).

Parameter names are those of the Hugging Face checkpoints; q/k/v and gate/up are fused as in
Llama. Tensor and pipeline parallelism work as in ``llama.py``, whose ``LlamaForCausalLM`` this
reuses for everything but the decoder stack.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed import ParallelState, RankGroup
from radixserve.forward_batch import ForwardBatch, StageActivations
from radixserve.layers.attention import Attention, AttentionBackend
from radixserve.layers.custom_op import CustomOp
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixserve.layers.linear_method import WeightSource, materialize
from radixserve.layers.rotary_embedding import ApplyRotaryEmbedding, RotaryEmbedding
from radixserve.layers.vocab_embedding import VocabEmbedding
from radixserve.model_config import ModelConfig
from radixserve.model_executor.models.llama import (
    LlamaForCausalLM,
    MissingLayer,
    QKVAttention,
    Rope,
)

SLIDING = "sliding_attention"
FULL = "full_attention"


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight ``w`` scales by ``1 + w``: loaded as ``1 + w`` (summed
    in float32), after which it is a plain ``RMSNorm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = self._load_offset

    @staticmethod
    def _load_offset(param: nn.Parameter, loaded_weight: WeightSource) -> None:
        if tuple(param.shape) != tuple(loaded_weight.shape):
            raise ValueError(
                f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                f"{tuple(loaded_weight.shape)}"
            )
        param.data.copy_(materialize(loaded_weight).float() + 1.0)


class GeluTanhAndMul(CustomOp):
    """``gelu_tanh(gate) * up`` for the fused ``[..., 2 * d]`` output of ``gate_up_proj``."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's attention, ``sliding_attention`` or ``full_attention``: the config's
    ``layer_types``, else the family's pattern (Gemma 2: every other layer from the first is
    sliding; Gemma 3: every ``sliding_window_pattern``-th layer is global)."""
    n = int(hf["num_hidden_layers"])
    if hf.get("layer_types"):
        types = list(hf["layer_types"])
        if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
            raise ValueError(f"layer_types {types!r} must name {n} of {SLIDING}, {FULL}")
        return types
    if hf.get("model_type") == "gemma2":
        return [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]


def local_rope_theta(hf: dict[str, Any], global_theta: float) -> float:
    """The RoPE base of sliding layers: Gemma 3's local base (plain RoPE), else the global one."""
    params = hf.get("rope_parameters") or {}
    local = params.get(SLIDING) if isinstance(params.get(SLIDING), dict) else None
    if local is not None:
        rope_type = local.get("rope_type", local.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} of sliding layers is not supported")
        return float(local["rope_theta"])
    return float(hf.get("rope_local_base_freq") or global_theta)


class GemmaAttention(QKVAttention):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, tp: RankGroup,
                 sliding: bool, qk_norm: bool, kv_layer: int) -> None:
        super().__init__()
        hf = config.hf_config
        head_dim = config.head_dim
        self.sliding = sliding
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads,
            config.num_key_value_heads, bias=bool(hf.get("attention_bias", False)),
            quant_config=config.quantization, tp=tp,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size,
            bias=bool(hf.get("attention_bias", False)), quant_config=config.quantization, tp=tp,
        )
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotate = ApplyRotaryEmbedding()
        window = hf.get("sliding_window")
        self.attn = Attention(
            num_heads=self.qkv_proj.num_heads,
            head_dim=head_dim,
            scaling=float(hf.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            layer_id=kv_layer,
            backend=attn_backend,
            sliding_window=int(window) if sliding and window else None,
            logit_cap=float(hf.get("attn_logit_softcapping") or 0.0),
        )

    def forward(self, ropes: tuple[Rope, Rope], hidden_states: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        """``ropes``: (global, local) cos/sin; a sliding layer rotates with the local one."""
        return self.attend(ropes[1] if self.sliding else ropes[0], hidden_states, forward_batch)


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: RankGroup) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=False, quant_config=config.quantization, tp=tp
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias=False, quant_config=config.quantization, tp=tp
        )
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, tp: RankGroup,
                 sliding: bool, qk_norm: bool, kv_layer: int) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, attn_backend, tp, sliding, qk_norm, kv_layer)
        self.mlp = GemmaMLP(config, tp)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, ropes: tuple[Rope, Rope], hidden_states: torch.Tensor,
                forward_batch: ForwardBatch, residual: torch.Tensor | None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual protocol of ``LlamaDecoderLayer``: the stream is ``hidden_states +
        residual``, the add fused into the next norm."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(ropes, hidden_states, forward_batch)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, qk_norm: bool,
                 parallel: ParallelState) -> None:
        super().__init__()
        hf = config.hf_config
        info, tp = parallel.info, parallel.tp
        if hf.get("use_bidirectional_attention"):
            raise ValueError("bidirectional Gemma (use_bidirectional_attention) is not supported")
        self.stage_layers = info.stage_layers(config.num_hidden_layers)
        self.embed_tokens = (
            VocabEmbedding(config.vocab_size, config.hidden_size, tp)
            if info.is_first_stage
            else None
        )
        self.embed_scale = config.hidden_size**0.5
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.context_len, config.rope_theta, config.rope_scaling
        )
        self.rotary_emb_local = RotaryEmbedding(
            config.head_dim, config.context_len, local_rope_theta(hf, config.rope_theta)
        )
        types = layer_types(hf)
        start = self.stage_layers.start
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, attn_backend, tp, types[i] == SLIDING, qk_norm, i - start)
            if i in self.stage_layers
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = (
            GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if info.is_last_stage else None
        )

    def forward(
        self, forward_batch: ForwardBatch, previous_stage: StageActivations | None = None
    ) -> torch.Tensor | StageActivations:
        residual: torch.Tensor | None
        if self.embed_tokens is not None:
            hidden_states = self.embed_tokens(forward_batch.input_ids)
            # transformers scales in the model's dtype
            hidden_states = hidden_states * torch.tensor(
                self.embed_scale, dtype=hidden_states.dtype
            )
            residual = None
        else:
            assert previous_stage is not None, "a later pipeline stage needs activations"
            hidden_states, residual = previous_stage.hidden_states, previous_stage.residual
        dtype = hidden_states.dtype
        ropes = (
            self.rotary_emb(forward_batch.positions, dtype),
            self.rotary_emb_local(forward_batch.positions, dtype),
        )
        for layer in self.layers[self.stage_layers.start : self.stage_layers.stop]:
            hidden_states, residual = layer(ropes, hidden_states, forward_batch, residual)
        assert residual is not None
        if self.norm is None:
            return StageActivations(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2; ``forward`` soft-caps the logits when the config says so."""

    qk_norm = False

    def build_model(self, config: ModelConfig, attn_backend: AttentionBackend) -> nn.Module:
        return GemmaModel(config, attn_backend, self.qk_norm, self.parallel)

    def forward(
        self, forward_batch: ForwardBatch, previous_stage: StageActivations | None = None
    ) -> torch.Tensor | StageActivations:
        out = super().forward(forward_batch, previous_stage)
        cap = self.config.hf_config.get("final_logit_softcapping")
        if cap and not isinstance(out, StageActivations):
            out = torch.tanh(out / cap) * cap
        return out


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2 with q/k norms and a local RoPE base for sliding layers."""

    qk_norm = True
