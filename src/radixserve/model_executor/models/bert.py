"""BERT encoder (all-MiniLM, bge, e5, ...): bidirectional attention, mean-pooled embeddings.

Unlike the decoders it keeps no KV cache: every request is encoded whole in one step (the
scheduler never chunks an encoder's prompt nor reuses a prefix), each token attending to every
token of its own request. The tokens of a batch arrive concatenated (``ForwardBatch``); attention
pads them to ``[batch, longest, ...]`` and masks the padding keys.

Parameter names are those of a Hugging Face ``BertModel`` checkpoint, except that
``query``/``key``/``value`` are fused into ``qkv_proj`` (``packed_modules_mapping``). The output is
the mean of each request's last hidden states, L2-normalised: sentence-transformers' default for
these models. Inputs are single segments (token type 0); the cross-encoders built on these
layers (``bert_classifier.py``) also take pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.forward_batch import ForwardBatch
from radixserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.pooler import Pooler, PoolingType
from radixserve.model_config import ModelConfig


def _padded_layout(lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, valid)``: row of each (request, position) in the flat token dimension, and
    which of those positions are real tokens (``[batch, longest]`` each)."""
    longest = max(lens)
    lens_t = torch.tensor(lens, device=device)[:, None]
    offsets = torch.arange(longest, device=device)[None, :]
    valid = offsets < lens_t
    starts = torch.cumsum(lens_t, dim=0) - lens_t
    return (starts + offsets).masked_fill(~valid, 0), valid


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig, eps: float) -> None:
        super().__init__()
        hf = config.hf_config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(
            int(hf.get("type_vocab_size", 2)), config.hidden_size
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``token_type_ids`` (pair inputs of a cross-encoder): None is segment 0 throughout."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            return self.LayerNorm(x + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class BertSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_heads, bias=True
        )

    def forward(
        self, x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor | None
    ) -> torch.Tensor:
        """``valid`` is None when every request has the same length (no padding to mask)."""
        n = x.shape[0]
        bs, longest = index.shape
        qkv = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim)
        # [n, 3, heads, dim] → [3, bs, heads, longest, dim]
        padded = qkv[index.view(-1)].view(bs, longest, 3, self.num_heads, self.head_dim)
        q, k, v = padded.permute(2, 0, 3, 1, 4)
        mask = None if valid is None else valid[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(bs * longest, self.num_heads * self.head_dim)
        return out if valid is None else out[valid.view(-1)]


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig, eps: float) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = BertSelfAttention(config)
        self.attention.output = nn.Module()
        self.attention.output.dense = RowParallelLinear(
            config.hidden_size, config.hidden_size, bias=True
        )
        self.attention.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = ColumnParallelLinear(
            config.hidden_size, config.intermediate_size, bias=True
        )
        self.output = nn.Module()
        self.output.dense = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=True
        )
        self.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=eps)

    def forward(
        self, x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor | None
    ) -> torch.Tensor:
        attn = self.attention.output.dense(self.attention.self(x, index, valid))
        x = self.attention.output.LayerNorm(attn + x)
        h = self.output.dense(F.gelu(self.intermediate.dense(x)))
        return self.output.LayerNorm(h + x)



def layer_norm_eps(config: ModelConfig) -> float:
    """config.json's ``layer_norm_eps`` (BERT's default 1e-12), shared by BERT's heads."""
    return float(config.hf_config.get("layer_norm_eps", 1e-12))

class BertModel(nn.Module):
    """Embeds each request of an EXTEND batch; ``embed`` is its only entry point."""

    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "query": ("qkv_proj", "q"),
        "key": ("qkv_proj", "k"),
        "value": ("qkv_proj", "v"),
    }

    def __init__(self, config: ModelConfig, attn_backend: object = None) -> None:
        super().__init__()
        eps = layer_norm_eps(config)
        self.config = config
        self.embeddings = BertEmbeddings(config, eps)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            BertLayer(config, eps) for _ in range(config.num_hidden_layers)
        )
        self.pooler = Pooler(PoolingType.MEAN, normalize=True)

    def embed(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """``[batch_size, hidden]`` float32 unit vectors, one per request (of the batch's
        ``input_ids`` at its ``positions``)."""
        lens = forward_batch.extend_seq_lens_cpu
        assert lens is not None and forward_batch.extend_prefix_lens_cpu is not None
        assert not any(forward_batch.extend_prefix_lens_cpu), "an encoder reuses no prefix"
        input_ids = forward_batch.input_ids
        index, valid = _padded_layout(lens, input_ids.device)
        x = self.embeddings(input_ids, forward_batch.positions)
        padding = None if min(lens) == max(lens) else valid
        for layer in self.encoder.layer:
            x = layer(x, index, padding)
        return self.pooler(x, forward_batch)
