"""The contract between a model's attention layers and an attention backend.

Per model step the runner calls ``init_forward_metadata(forward_batch)`` once; then every layer's
``Attention`` calls ``backend.forward(QKV(q, k, v), layer, forward_batch)``, which stores the new
tokens' K and V in the KV pool at ``forward_batch.out_cache_loc`` and attends each query over its
request's whole KV (cached prefix + new tokens, causally; a layer with a ``sliding_window`` W
sees only the last W positions up to each query, itself included, and reads no KV before them;
one with ``logit_cap`` C soft-caps its scaled scores to ``C * tanh(s / C)`` before the softmax,
as Gemma 2 does). The batch is always passed explicitly;
a backend keeps only the metadata derived from the current batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool


class QKV(NamedTuple):
    """The new tokens' query, key and value projections, which travel together from a model's
    attention to its backend: ``q`` ``[num_tokens, heads * head_dim]``, ``k``/``v``
    ``[num_tokens, kv_heads * head_dim]``, the new tokens of all requests concatenated in batch
    order (EXTEND: each request's new tokens; DECODE: one per request)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute what all layers share for this batch (slot tables, masks)."""

    @abstractmethod
    def forward(self, qkv: QKV, layer: Attention, forward_batch: ForwardBatch) -> torch.Tensor:
        """Attention of ``layer`` for the new tokens; returns ``[num_tokens, heads * head_dim]``."""


class PagedAttentionBackend(AttentionBackend):
    """What the backends that attend over the pools themselves share: the pools, the batch
    ``init_forward_metadata`` was last given, and writing the new tokens' K/V into the pool.

    A subclass that cannot compute batch-invariant attention names why in
    ``BATCH_VARIANT_REASON``; asking it for ``--enable-deterministic-inference`` is refused.
    """

    BATCH_VARIANT_REASON: str | None = None

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: MHATokenToKVPool,
        batch_invariant: bool = False,
    ):
        if batch_invariant and self.BATCH_VARIANT_REASON is not None:
            raise ValueError(
                "--enable-deterministic-inference needs the cpu attention backend: "
                + self.BATCH_VARIANT_REASON
            )
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self._batch: ForwardBatch | None = None

    def _store_new_kv(self, qkv: QKV, layer: Attention, forward_batch: ForwardBatch) -> int:
        """Write the new tokens' K/V into the pool at ``out_cache_loc``; returns their count."""
        assert self._batch is forward_batch, "init_forward_metadata must run before attention"
        num_tokens = qkv.q.shape[0]
        self.token_to_kv_pool.set_kv_buffer(
            layer.layer_id,
            forward_batch.out_cache_loc,
            qkv.k.reshape(num_tokens, layer.num_kv_heads, layer.head_dim),
            qkv.v.reshape(num_tokens, layer.num_kv_heads, layer.head_dim),
        )
        return num_tokens


@dataclass(frozen=True, eq=False)
class Attention:
    """A model's attention over the paged KV cache: the shape facts a backend needs, and the
    backend it was built with, which computes it. It holds no parameters, so it is no
    ``nn.Module``."""

    num_heads: int
    head_dim: int
    scaling: float
    num_kv_heads: int
    layer_id: int  # the layer's index in the KV pool
    backend: AttentionBackend
    # Keys a query sees, itself included (transformers' ``sliding_window``: key position kv is
    # visible from query position q when q - W < kv <= q); None: every earlier position.
    sliding_window: int | None = None
    logit_cap: float = 0.0  # soft-capping of the scaled scores; 0: none

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self.backend.forward(QKV(q, k, v), self, forward_batch)
