"""Reference attention over the paged KV pool in plain PyTorch (CPU and CUDA, any float dtype).

Per batch it builds, once for all layers:

    slot_table [bs, max_kv]        KV slot of each (request, key position); padding → slot 0
    q_index    [bs, max_q]         row of each (request, new token) in the flat token dimension
    q_valid    [bs, max_q]         which of those are real tokens (the rest are padding)
    mask       [bs, 1, max_q, max_kv]  key position <= query position and < seq_len

where ``max_q`` is the longest extend (1 for decode) and ``max_kv`` the longest ``seq_len``. A
query at extend offset ``j`` of request ``i`` sits at absolute position ``prefix_len[i] + j``, so
the causal mask covers the cached prefix too. Each layer then writes the new K/V into the pool,
gathers the padded K/V of the batch, and makes one batched ``scaled_dot_product_attention`` call.
Padded query rows see every real key of their request, so no row is fully masked (which would
produce NaN); their outputs are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.layers.attention.base_backend import Attention, AttentionBackend
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool
from radixserve.model_executor.forward_batch import ForwardBatch


@dataclass
class _Metadata:
    slot_table: torch.Tensor
    q_index: torch.Tensor
    q_valid: torch.Tensor
    mask: torch.Tensor


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: MHATokenToKVPool):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self._metadata: _Metadata | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        device = self.req_to_token_pool.req_to_token.device
        if fb.forward_mode.is_decode:
            extend_lens = [1] * fb.batch_size
            prefix_lens = [s - 1 for s in fb.seq_lens_cpu]
        else:
            assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
            extend_lens = fb.extend_seq_lens_cpu
            prefix_lens = fb.extend_prefix_lens_cpu
        max_kv = max(fb.seq_lens_cpu)
        max_q = max(extend_lens)

        def as_column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)[:, None]

        kv_pos = torch.arange(max_kv, device=device)
        kv_valid = kv_pos[None, :] < as_column(fb.seq_lens_cpu)
        rows = self.req_to_token_pool.req_to_token[fb.req_pool_indices.to(device), :max_kv]
        slot_table = rows.masked_fill(~kv_valid, 0)

        q_off = torch.arange(max_q, device=device)[None, :]
        extend_t = as_column(extend_lens)
        q_valid = q_off < extend_t
        q_start = torch.cumsum(extend_t, dim=0) - extend_t
        q_index = (q_start + q_off).masked_fill(~q_valid, 0)
        q_abs_pos = as_column(prefix_lens) + q_off
        mask = (kv_pos[None, None, :] <= q_abs_pos[:, :, None]) & kv_valid[:, None, :]
        self._metadata = _Metadata(slot_table, q_index, q_valid, mask[:, None])

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        md = self._metadata
        assert md is not None, "init_forward_metadata must run before attention"
        num_tokens = q.shape[0]
        heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        pool = self.token_to_kv_pool
        pool.set_kv_buffer(
            layer.layer_id,
            forward_batch.out_cache_loc,
            k.view(num_tokens, kv_heads, head_dim),
            v.view(num_tokens, kv_heads, head_dim),
        )
        # [bs, len, heads, head_dim] → [bs, heads, len, head_dim] for SDPA
        keys = pool.get_key_buffer(layer.layer_id)[md.slot_table].to(q.dtype).transpose(1, 2)
        values = pool.get_value_buffer(layer.layer_id)[md.slot_table].to(q.dtype).transpose(1, 2)
        queries = q.view(num_tokens, heads, head_dim)[md.q_index].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=md.mask,
            scale=layer.scaling,
            enable_gqa=heads != kv_heads,
        )
        return out.transpose(1, 2)[md.q_valid].reshape(num_tokens, heads * head_dim)
