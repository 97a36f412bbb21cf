"""Llama-style decoder (also Mistral, and the base of Qwen2 and Qwen3).

Parameter names match the Hugging Face checkpoints (``model.layers.N.self_attn.q_proj`` ...),
except that q/k/v and gate/up are fused; ``packed_modules_mapping`` tells the loader which
checkpoint tensor fills which shard of a fused layer. The variants differ only in two switches:
``qkv_bias`` (Qwen2) and ``qk_norm`` (Qwen3: RMSNorm per head on q and k before RoPE).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.layers.activation import SiluAndMul
from radixserve.layers.attention import Attention, AttentionBackend
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixserve.layers.logits_processor import LogitsProcessor
from radixserve.layers.pooler import Pooler, PoolingType
from radixserve.layers.quantization import QuantizationConfig
from radixserve.layers.rotary_embedding import ApplyRotaryEmbedding, RotaryEmbedding
from radixserve.layers.vocab_embedding import LMHead, VocabEmbedding
from radixserve.model_config import ModelConfig
from radixserve.model_executor.forward_batch import ForwardBatch

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, signed sin) of RotaryEmbedding.forward


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        attn_backend: AttentionBackend,
        qkv_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=qkv_bias,
            quant_config=config.quantization,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bias=bool(config.hf_config.get("attention_bias", False)),
            quant_config=config.quantization,
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotate = ApplyRotaryEmbedding()
        self.attn = Attention(
            num_heads=self.qkv_proj.num_heads,
            head_dim=head_dim,
            scaling=head_dim**-0.5,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            layer_id=layer_id,
            backend=attn_backend,
        )

    def forward(
        self, rope: Rope, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        n = hidden_states.shape[0]
        heads, head_dim = self.attn.num_heads, self.attn.head_dim
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        qkv = self.qkv_proj(hidden_states)
        v = qkv[:, q_size + kv_size :]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, :q_size].reshape(n, heads, head_dim))
            k = self.k_norm(qkv[:, q_size : q_size + kv_size].reshape(n, -1, head_dim))
            q, k = self.rotate(q, *rope), self.rotate(k, *rope)
        else:
            # q and k heads sit side by side in qkv: one rotation for both.
            qk = self.rotate(qkv[:, : q_size + kv_size].view(n, -1, head_dim), *rope)
            q, k = qk[:, :heads], qk[:, heads:]
        out = self.attn(q.reshape(n, q_size), k.reshape(n, kv_size), v, forward_batch)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias,
            quant_config=quant_config,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, quant_config=quant_config
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        attn_backend: AttentionBackend,
        qkv_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, attn_backend, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=bool(config.hf_config.get("mlp_bias", False)),
            quant_config=config.quantization,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope: Rope,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is ``hidden_states + residual``, the add left to the next norm
        (which fuses it, see ``RMSNorm.forward``); the first layer gets ``residual=None``.
        Returns this layer's ``(hidden_states, residual)`` in the same form."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(rope, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        qkv_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin table for all layers, covering every position a request can reach.
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.context_len, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, attn_backend, qkv_bias, qk_norm)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, hidden_states.dtype)  # looked up once for all layers
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(rope, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Causal LM: ``forward`` returns the logits of the last token of each request in the batch;
    served as an embedder (``--is-embedding``), ``embed`` returns that token's final hidden state,
    L2-normalised (last-token pooling, as gte-Qwen and similar decoder embedders do)."""

    # checkpoint module name → (fused module name, shard id)
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm: bool = False

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(
            config, attn_backend, qkv_bias=self.qkv_bias(config), qk_norm=self.qk_norm
        )
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, config.quantization)
        if config.tie_word_embeddings:
            self.tie_word_embeddings()
        self.logits_processor = LogitsProcessor()
        self.pooler = Pooler(PoolingType.LAST, normalize=True)

    @staticmethod
    def qkv_bias(config: ModelConfig) -> bool:
        """Whether q/k/v projections have a bias (Llama: the ``attention_bias`` flag)."""
        return bool(config.hf_config.get("attention_bias", False))

    def tie_word_embeddings(self) -> None:
        """Make ``lm_head`` share the input embedding's weight."""
        self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden_states = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """``[batch_size, hidden]`` float32 unit vectors (EXTEND batches only)."""
        return self.pooler(self.model(input_ids, positions, forward_batch), forward_batch)
