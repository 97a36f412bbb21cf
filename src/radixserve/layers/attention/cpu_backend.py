"""Attention on CPUs through radixserve's kernels (``layers/csrc``), the default on CPU.

DECODE: one kernel call per layer (``csrc/decode_attention.cpp``) writes each request's new K/V
into the pool and attends over the request's slots in place, the query heads of a KV head
together, with a float32 softmax; the torch path runs two index_puts, two gathers, a mask and
SDPA. EXTEND keeps the reference backend's path (``torch_native_backend.py``).

Built only for KV pools the kernels take (float32 or bf16, head_dim a multiple of 16 up to 256,
any number of query heads per KV head); ``create_attention_backend`` reports why otherwise.
"""

from __future__ import annotations

import torch

from radixserve.layers import cpu_kernels
from radixserve.layers.attention.base_backend import Attention
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool
from radixserve.model_executor.forward_batch import ForwardBatch


class CpuAttnBackend(TorchNativeAttnBackend):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: MHATokenToKVPool):
        reason = cpu_kernels.attention_kernels_support(
            token_to_kv_pool.dtype, token_to_kv_pool.head_dim
        )
        if reason is not None or token_to_kv_pool.device.type != "cpu":
            raise ValueError(f"the cpu attention backend cannot run here: {reason or 'not a CPU'}")
        super().__init__(req_to_token_pool, token_to_kv_pool)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        n, heads, kv_heads = q.shape[0], layer.num_heads, layer.num_kv_heads
        head_dim = layer.head_dim
        pool = self.token_to_kv_pool
        out = cpu_kernels.decode_attention(
            q.view(n, heads, head_dim).to(pool.dtype),
            k.view(n, kv_heads, head_dim).to(pool.dtype),
            v.view(n, kv_heads, head_dim).to(pool.dtype),
            forward_batch.out_cache_loc,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            layer.scaling,
        )
        return out.view(n, heads * head_dim).to(q.dtype)
