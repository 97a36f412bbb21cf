"""The contract between a model's attention layers and an attention backend.

Per model step the runner calls ``init_forward_metadata(forward_batch)`` once; then every layer's
``Attention`` calls ``backend.forward(q, k, v, layer, forward_batch)``, which stores the new
tokens' K and V in the KV pool at ``forward_batch.out_cache_loc`` and attends each query over its
request's whole KV (cached prefix + new tokens, causally). The batch is always passed explicitly;
a backend keeps only the metadata derived from the current batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from radixserve.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute what all layers share for this batch (slot tables, masks)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """``q`` ``[num_tokens, heads * head_dim]``, ``k``/``v`` ``[num_tokens, kv_heads *
        head_dim]`` for the new tokens of all requests, concatenated in batch order (EXTEND:
        each request's new tokens; DECODE: one per request). Returns ``[num_tokens, heads *
        head_dim]``."""


class Attention(nn.Module):
    """A model's attention over the paged KV cache: holds the shape facts a backend needs and
    delegates the computation to the backend it was built with."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id
        self.backend = backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self.backend.forward(q, k, v, self, forward_batch)
