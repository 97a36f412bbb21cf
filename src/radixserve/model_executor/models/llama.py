"""Llama-style decoder (also Mistral, and the base of Qwen2 and Qwen3).

Parameter names match the Hugging Face checkpoints (``model.layers.N.self_attn.q_proj`` ...),
except that q/k/v and gate/up are fused; ``packed_modules_mapping`` tells the loader which
checkpoint tensor fills which shard of a fused layer. The variants differ only in two switches:
``qkv_bias`` (Qwen2) and ``qk_norm`` (Qwen3: RMSNorm per head on q and k before RoPE).

Parallelism (``ParallelState``): linear layers and the vocabulary are split over the stage's
tensor-parallel group; a pipeline stage builds only its own decoder layers (the others are
``MissingLayer`` placeholders, so parameter names keep the checkpoint's layer numbers), the first
stage the embedding, the last the final norm and the LM head. A stage that is not the last
returns its ``StageActivations`` instead of logits; one that is not the first takes them in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.distributed import ParallelState, RankGroup
from radixserve.forward_batch import ForwardBatch, StageActivations
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

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, signed sin) of RotaryEmbedding.forward


class MissingLayer(nn.Module):
    """A decoder layer held by another pipeline stage: no parameters, never called."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("this decoder layer lives on another pipeline stage")


@dataclass(frozen=True)
class LayerSpec:
    """What every decoder layer of a model is built from: its config, the attention backend, the
    variant's two switches and the stage's tensor-parallel group."""

    config: ModelConfig
    attn_backend: AttentionBackend
    qkv_bias: bool  # a bias on q, k and v (Qwen2)
    qk_norm: bool  # RMSNorm per q and k head before RoPE (Qwen3)
    tp: RankGroup
    sliding_window: int | None = None  # every layer's attention window (Mistral, Phi-3)
    # the MLP of decoder layer i, or None for Llama's (MoE families: ``moe.py``)
    mlp_factory: Callable[[LayerSpec, int], nn.Module | None] | None = None


class QKVAttention(nn.Module):
    """The attention step decoder families share: the fused qkv projection, an optional
    per-head norm of q and k (Qwen3, Gemma 3), rotary positions, paged attention, the output
    projection. A subclass builds the six modules ``attend`` uses."""

    qkv_proj: QKVParallelLinear
    o_proj: RowParallelLinear
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    rotate: ApplyRotaryEmbedding
    attn: Attention

    def attend(
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


class LlamaAttention(QKVAttention):
    def __init__(self, spec: LayerSpec, kv_layer: int) -> None:
        super().__init__()
        config, tp = spec.config, spec.tp
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=spec.qkv_bias,
            quant_config=config.quantization,
            tp=tp,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bias=bool(config.hf_config.get("attention_bias", False)),
            quant_config=config.quantization,
            tp=tp,
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.rotate = ApplyRotaryEmbedding()
        self.attn = Attention(
            num_heads=self.qkv_proj.num_heads,
            head_dim=head_dim,
            scaling=head_dim**-0.5,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            layer_id=kv_layer,
            backend=spec.attn_backend,
            sliding_window=spec.sliding_window,
        )

    def forward(
        self, rope: Rope, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self.attend(rope, hidden_states, forward_batch)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        quant_config: QuantizationConfig | None,
        tp: RankGroup,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias,
            quant_config=quant_config, tp=tp,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, quant_config=quant_config, tp=tp
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: LayerSpec, kv_layer: int, layer_index: int = 0) -> None:
        """``kv_layer``: this layer's index in the rank's KV pool (its stage's layers only);
        ``layer_index``: its index in the model."""
        super().__init__()
        config = spec.config
        self.self_attn = LlamaAttention(spec, kv_layer)
        mlp = spec.mlp_factory(spec, layer_index) if spec.mlp_factory is not None else None
        self.mlp = mlp if mlp is not None else LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=bool(config.hf_config.get("mlp_bias", False)),
            quant_config=config.quantization,
            tp=spec.tp,
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
        parallel: ParallelState,
        sliding_window: int | None = None,
        mlp_factory: Callable[[LayerSpec, int], nn.Module | None] | None = None,
    ) -> None:
        super().__init__()
        info, tp = parallel.info, parallel.tp
        self.stage_layers = info.stage_layers(config.num_hidden_layers)
        self.embed_tokens = (
            VocabEmbedding(config.vocab_size, config.hidden_size, tp)
            if info.is_first_stage
            else None
        )
        # One cos/sin table for all layers, covering every position a request can reach.
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.context_len, config.rope_theta, config.rope_scaling
        )
        start = self.stage_layers.start
        spec = LayerSpec(config, attn_backend, qkv_bias, qk_norm, tp, sliding_window,
                         mlp_factory)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, i - start, i)
            if i in self.stage_layers
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if info.is_last_stage else None

    def forward(
        self, forward_batch: ForwardBatch, previous_stage: StageActivations | None = None
    ) -> torch.Tensor | StageActivations:
        """The final hidden states on the last stage, else this stage's ``StageActivations``."""
        residual: torch.Tensor | None
        if self.embed_tokens is not None:
            hidden_states, residual = self.embed_tokens(forward_batch.input_ids), None
        else:
            assert previous_stage is not None, "a later pipeline stage needs activations"
            hidden_states, residual = previous_stage.hidden_states, previous_stage.residual
        # looked up once for all layers
        rope = self.rotary_emb(forward_batch.positions, hidden_states.dtype)
        for layer in self.layers[self.stage_layers.start : self.stage_layers.stop]:
            hidden_states, residual = layer(rope, hidden_states, forward_batch, residual)
        assert residual is not None
        if self.norm is None:
            return StageActivations(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Causal LM: ``forward`` returns the logits (model dtype) of the last token of each request
    in the batch (a pipeline stage other than the last: its ``StageActivations``); served as an
    embedder (``--is-embedding``), ``embed`` returns that token's final hidden state,
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
    supports_parallel = True  # tensor and pipeline parallel (model_loader.load_model)

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        parallel: ParallelState | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel or ParallelState.single()
        info = self.parallel.info
        self.model = self.build_model(config, attn_backend)
        self.lm_head = (
            LMHead(config.vocab_size, config.hidden_size, quant_config=config.quantization,
                   tp=self.parallel.tp)
            if info.is_last_stage
            else None
        )
        self.tied = False
        if config.tie_word_embeddings:
            self.tie_word_embeddings()
        self.logits_processor = LogitsProcessor()
        self.pooler = Pooler(PoolingType.LAST, normalize=True)

    def build_model(self, config: ModelConfig, attn_backend: AttentionBackend) -> nn.Module:
        """The decoder stack (embedding, layers, final norm): the seam a family with other layers
        (``gemma2.py``) overrides, keeping the head, tying and stage logic of this class."""
        return LlamaModel(
            config, attn_backend, qkv_bias=self.qkv_bias(config), qk_norm=self.qk_norm,
            parallel=self.parallel, sliding_window=self.sliding_window(config),
            mlp_factory=self.build_mlp,
        )

    def build_mlp(self, spec: LayerSpec, layer_index: int) -> nn.Module | None:
        """Layer ``layer_index``'s MLP; None: Llama's gated MLP (MoE families override)."""
        return None

    @staticmethod
    def sliding_window(config: ModelConfig) -> int | None:
        """Every layer's attention window; Llama has none (Mistral and Phi-3 read theirs)."""
        return None

    @staticmethod
    def qkv_bias(config: ModelConfig) -> bool:
        """Whether q/k/v projections have a bias (Llama: the ``attention_bias`` flag)."""
        return bool(config.hf_config.get("attention_bias", False))

    @property
    def lm_head_from_embedding(self) -> bool:
        """A tied LM head on a last stage that has no embedding of its own: it loads the
        checkpoint's embedding tensor into a weight of its own."""
        return self.lm_head is not None and self.model.embed_tokens is None and self.tied

    def tie_word_embeddings(self) -> None:
        """Make ``lm_head`` share the input embedding's weight (or, on a last pipeline stage
        without the embedding, load it from the embedding's checkpoint tensor)."""
        self.tied = True
        if self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.tie_to(self.model.embed_tokens)

    def holds_weight(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to this pipeline stage."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.model.stage_layers
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None or self.lm_head_from_embedding
        if name.startswith(("model.norm.", "lm_head.")):
            return self.lm_head is not None
        return True

    def forward(
        self, forward_batch: ForwardBatch, previous_stage: StageActivations | None = None
    ) -> torch.Tensor | StageActivations:
        """Reads the batch's ``input_ids`` and ``positions`` (or ``previous_stage``'s
        activations on a later pipeline stage)."""
        out = self.model(forward_batch, previous_stage)
        if isinstance(out, StageActivations):
            return out
        assert self.lm_head is not None
        return self.logits_processor(out, self.lm_head, forward_batch)

    def embed(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """``[batch_size, hidden]`` float32 unit vectors (EXTEND batches only)."""
        return self.pooler(self.model(forward_batch), forward_batch)
