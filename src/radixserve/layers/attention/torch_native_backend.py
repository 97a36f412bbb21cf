"""Reference attention over the paged KV pool in plain PyTorch (CPU and CUDA, any float dtype).

Per batch it builds, once for all layers:

    slot_index [bs * max_kv]   KV slot of each (request, key position), row-major; padding → slot 0
    q_index    [bs, max_q]     row of each (request, new token) in the flat token dimension
    q_valid    [bs, max_q]     which of those are real tokens (the rest are padding)
    mask       [bs, 1, max_q, max_kv]  additive: 0 where key position <= query position and
                                       < seq_len, -inf elsewhere (faster in SDPA than a bool mask)

where ``max_q`` is the longest extend (1 for decode) and ``max_kv`` the longest ``seq_len``. A
query at extend offset ``j`` of request ``i`` sits at absolute position ``prefix_len[i] + j``, so
the causal mask covers the cached prefix too. When every request has ``max_q`` new tokens (always
for decode) the queries are already in that layout and ``q_index``/``q_valid`` are ``None``.

Each layer then writes the new K/V into the pool, gathers the padded K/V of the batch with one
``index_select`` per buffer (several times faster on CPU than advanced indexing), and makes one
batched ``scaled_dot_product_attention`` call; for decode the query heads that share a KV head
are folded into the query-length dimension (``[bs, kv_heads, group, head_dim]``), which is plain
multi-query attention per KV head and about twice as fast on CPU as ``enable_gqa``. Padded query
rows see every real key of their request, so no row is fully masked (which would produce NaN);
their outputs are dropped.

A batch of fresh prompts of equal length (no prefix, no padding: typically a single prompt)
needs none of this: it attends over its own new K/V through SDPA's causal path, which also skips
the blocks above the diagonal.

A quantized pool (``--kv-cache-dtype int8 / fp8_*``) is read through the same gather: the codes
and their per-(slot, head) scales are gathered and multiplied back into the query's dtype. The
new tokens attend to their K/V as the pool holds it (the fresh-prompt shortcut, which would use
the unquantized K/V, is off), as in the other backends.

A sliding-window layer (``Attention.sliding_window``) gets a mask of its own (built once per
batch for each window size in use) that also hides keys W or more positions before the query;
the causal fast path serves it only when no prompt is longer than the window. Soft-capped
scores (``Attention.logit_cap``) cannot go through SDPA: those layers compute the scores, cap
them and take the softmax in plain torch.

This backend is the reference the others are tested against: plain torch, any device and dtype.
The ``cpu`` backend (``cpu_backend.py``) replaces what it has kernels for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.forward_batch import ForwardBatch
from radixserve.layers.attention.base_backend import QKV, Attention, PagedAttentionBackend
from radixserve.mem_cache.kv_quant import dequantize


@dataclass
class _Metadata:
    batch_size: int
    slot_index: torch.Tensor
    max_kv: int
    max_q: int
    q_index: torch.Tensor | None
    q_valid: torch.Tensor | None
    mask: torch.Tensor | None  # None: plain causal attention over the new tokens only


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    cap: float,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA over ``[bs, heads, len, head_dim]`` (``k``/``v`` may have fewer heads: GQA), or, with
    a soft cap ``cap`` > 0, the same in plain torch with the scaled scores capped first."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if not cap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
            enable_gqa=heads != kv_heads,
        )
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if is_causal:
        n = q.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


class TorchNativeAttnBackend(PagedAttentionBackend):
    BATCH_VARIANT_REASON = (
        "torch_native's SDPA sums in an order that depends on the batch's padded shape"
    )
    # The current batch's metadata per sliding window (None: full attention), each built by the
    # batch's first layer that needs it; the constructor is PagedAttentionBackend's.
    _metadata: dict[int | None, _Metadata] | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self._batch = forward_batch
        self._metadata = {}

    def _build_metadata(self, fb: ForwardBatch, window: int | None) -> _Metadata:
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
        if (
            max_q == max_kv and min(extend_lens) == max_q and not self.token_to_kv_pool.quantized
            and (window is None or window >= max_q)
        ):
            # Fresh prompts of equal length (a single prompt, typically): no cached prefix and
            # no padding, so the new K/V are all there is and SDPA's causal path applies.
            empty = torch.empty(0, dtype=torch.int64, device=device)
            return _Metadata(fb.batch_size, empty, max_kv, max_q, None, None, None)

        def as_column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)[:, None]

        kv_pos = torch.arange(max_kv, device=device)
        kv_valid = kv_pos[None, :] < as_column(fb.seq_lens_cpu)
        rows = self.req_to_token_pool.req_to_token[fb.req_pool_indices.to(device), :max_kv]
        slot_index = rows.masked_fill(~kv_valid, 0).view(-1)

        q_off = torch.arange(max_q, device=device)[None, :]
        q_index = q_valid = None
        if any(n != max_q for n in extend_lens):
            extend_t = as_column(extend_lens)
            q_valid = q_off < extend_t
            q_start = torch.cumsum(extend_t, dim=0) - extend_t
            q_index = (q_start + q_off).masked_fill(~q_valid, 0)
        q_abs_pos = as_column(prefix_lens) + q_off
        visible = (kv_pos[None, None, :] <= q_abs_pos[:, :, None]) & kv_valid[:, None, :]
        if window is not None:
            visible &= kv_pos[None, None, :] > q_abs_pos[:, :, None] - window
        pool_dtype = self.token_to_kv_pool.dtype
        mask_dtype = torch.float32 if self.token_to_kv_pool.quantized else pool_dtype
        mask = torch.zeros(visible.shape, dtype=mask_dtype, device=device)
        mask.masked_fill_(~visible, float("-inf"))
        return _Metadata(fb.batch_size, slot_index, max_kv, max_q, q_index, q_valid, mask[:, None])

    def forward(self, qkv: QKV, layer: Attention, forward_batch: ForwardBatch) -> torch.Tensor:
        num_tokens = self._store_new_kv(qkv, layer, forward_batch)
        q, k, v = qkv
        heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        pool = self.token_to_kv_pool
        assert self._metadata is not None, "init_forward_metadata must run before attention"
        window = layer.sliding_window
        if window not in self._metadata:
            self._metadata[window] = self._build_metadata(forward_batch, window)
        md = self._metadata[window]
        cap = layer.logit_cap
        bs = md.batch_size
        if md.mask is None:
            # [bs * len, heads, head_dim] → [bs, heads, len, head_dim] for SDPA
            def dense(x: torch.Tensor, num_heads: int) -> torch.Tensor:
                return x.reshape(bs, md.max_q, num_heads, head_dim).transpose(1, 2)

            out = _sdpa(
                dense(q, heads), dense(k, kv_heads), dense(v, kv_heads), None, layer.scaling, cap,
                is_causal=True,
            )
            return out.transpose(1, 2).reshape(num_tokens, heads * head_dim)

        def gather(buffer: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
            # [bs * max_kv, kv_heads, head_dim] → [bs, kv_heads, max_kv, head_dim] for SDPA
            rows = buffer.index_select(0, md.slot_index)
            if scales is None:
                rows = rows.to(q.dtype)
            else:
                rows = dequantize(rows, scales.index_select(0, md.slot_index), q.dtype)
            return rows.view(bs, md.max_kv, kv_heads, head_dim).transpose(1, 2)

        k_scale, v_scale = pool.get_kv_scale_buffers(layer.layer_id) or (None, None)
        keys = gather(pool.get_key_buffer(layer.layer_id), k_scale)
        values = gather(pool.get_value_buffer(layer.layer_id), v_scale)
        if forward_batch.forward_mode.is_decode:
            # Query head h uses KV head h // group: fold each group into the query dimension.
            queries = q.view(bs, kv_heads, heads // kv_heads, head_dim)
            out = _sdpa(queries, keys, values, md.mask.to(q.dtype), layer.scaling, cap)
            return out.reshape(num_tokens, heads * head_dim)
        queries = q.view(num_tokens, heads, head_dim)
        if md.q_index is None:
            queries = queries.view(bs, md.max_q, heads, head_dim).transpose(1, 2)
        else:
            queries = queries[md.q_index].transpose(1, 2)
        out = _sdpa(queries, keys, values, md.mask.to(q.dtype), layer.scaling, cap)
        out = out.transpose(1, 2)
        if md.q_valid is not None:
            out = out[md.q_valid]
        return out.reshape(num_tokens, heads * head_dim)
