"""Attention on CPUs through radixserve's kernels (``layers/csrc``), the default on CPU.

One kernel call per layer writes the new tokens' K/V into the pool and attends over each
request's slots in place, the query heads of a KV head together, in float32 (the torch path runs
two index_puts, two gathers, a mask and SDPA):

    DECODE  ``csrc/decode_attention.cpp``: one query per request, scores then softmax then values
    EXTEND  ``csrc/extend_attention.cpp``: flash-style over blocks of 16 keys with an online
            softmax, cached prefix included; time linear in the keys each query sees

Both are batch invariant: a token's result does not depend on the other requests, the prefill
chunk it falls in, or whether its prefix came from the radix cache. They sum in different orders,
though, so a token decoded differs in its last bits from the same token prefilled; with
``batch_invariant`` (``--enable-deterministic-inference``) decode steps run the EXTEND kernel
too, one new token per request, and a radix hit on generated tokens gives a cold prefill's bits.

Built only for KV pools the kernels take (float32 or bf16, head_dim a multiple of 16 up to 256,
any number of query heads per KV head); ``create_attention_backend`` reports why otherwise.
"""

from __future__ import annotations

import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.layers import cpu_kernels
from radixserve.layers.attention.base_backend import QKV, Attention, AttentionBackend
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool


class CpuAttnBackend(AttentionBackend):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: MHATokenToKVPool,
        batch_invariant: bool = False,
    ):
        reason = cpu_kernels.attention_kernels_support(
            token_to_kv_pool.dtype, token_to_kv_pool.head_dim
        )
        if reason is not None or token_to_kv_pool.device.type != "cpu":
            raise ValueError(f"the cpu attention backend cannot run here: {reason or 'not a CPU'}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.batch_invariant = batch_invariant
        self._extend_lens: torch.Tensor | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        lens = forward_batch.extend_seq_lens_cpu
        if lens is None and self.batch_invariant:  # decode as a one-token extend
            lens = [1] * len(forward_batch.seq_lens_cpu)
        self._extend_lens = None if lens is None else torch.tensor(lens, dtype=torch.int64)

    def forward(self, qkv: QKV, layer: Attention, forward_batch: ForwardBatch) -> torch.Tensor:
        """One kernel call writes this step's K/V into the pool and attends: DECODE takes the
        decode kernel, EXTEND (and, batch invariant, DECODE too) the extend kernel. Per-head views
        in the pool's dtype in, ``[tokens, heads * head_dim]`` in q's dtype out."""
        extend_lens = None
        if not forward_batch.forward_mode.is_decode or self.batch_invariant:
            assert self._extend_lens is not None, "init_forward_metadata must run before attention"
            extend_lens = self._extend_lens
        q, k, v = qkv
        n, heads, kv_heads = q.shape[0], layer.num_heads, layer.num_kv_heads
        head_dim = layer.head_dim
        pool = self.token_to_kv_pool
        out = cpu_kernels.paged_attention(
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
            extend_lens,
            layer.sliding_window,
            layer.logit_cap,
        )
        return out.view(n, heads * head_dim).to(q.dtype)
