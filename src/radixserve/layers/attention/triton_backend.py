"""The ``triton`` attention backend: paged attention in Triton kernels (``triton_kernels.py``),
the default on CUDA.

Decode reads nothing from the host: its kernels take ``req_pool_indices`` and ``seq_lens`` as
device tensors and a fixed number of KV splits, so a decode step is safe to capture in a CUDA
graph (``model_executor/cuda_graph_runner.py``). Extend builds three small per-request tensors
(prefix lengths, new-token counts, where each request's tokens start) once per batch, in
``init_forward_metadata``, for all layers.

On CPU the backend runs only under Triton's interpreter (``TRITON_INTERPRET=1``, set before
triton is first imported): slow, and meant for tests that check the kernels and the whole engine
against ``torch_native`` and ``transformers`` on machines without a GPU. The interpreter runs
the grid's programs one after another, so there decode splits each request's KV in 2, not 8.

Any KV storage dtype is read: the activations' own, another float, or a quantized pool's int8
or fp8 codes with their scales (``--kv-cache-dtype``), dequantized in the kernels' loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.layers.attention.base_backend import QKV, Attention, PagedAttentionBackend
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool


def triton_unavailable(device: torch.device) -> str | None:
    """Why the triton backend cannot run on ``device``, or None when it can."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the triton attention backend runs on CPU only with TRITON_INTERPRET=1 (tests)"
    if device.type not in ("cpu", "cuda"):
        return f"the triton attention backend does not run on {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton attention backend needs the triton package"
    return None


@dataclass
class _ExtendMetadata:
    prefix_lens: torch.Tensor  # [bs] int64
    extend_lens: torch.Tensor  # [bs] int64
    q_starts: torch.Tensor  # [bs] int64, first row of each request's new tokens
    max_extend: int


class TritonAttnBackend(PagedAttentionBackend):
    BATCH_VARIANT_REASON = (
        "the triton backend splits each decode over a batch-independent but length-dependent grid"
    )

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: MHATokenToKVPool,
        batch_invariant: bool = False,
    ):
        super().__init__(req_to_token_pool, token_to_kv_pool, batch_invariant)
        reason = triton_unavailable(token_to_kv_pool.device)
        if reason is not None:
            raise ValueError(reason)
        from radixserve.layers.attention import triton_kernels

        self.kernels = triton_kernels
        on_gpu = token_to_kv_pool.device.type == "cuda"
        self.num_kv_splits = triton_kernels.NUM_KV_SPLITS if on_gpu else 2
        self._extend: _ExtendMetadata | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self._batch = forward_batch
        self._extend = None
        if forward_batch.forward_mode.is_extend:
            fb = forward_batch
            assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
            device = self.token_to_kv_pool.device
            starts = [0]
            for n in fb.extend_seq_lens_cpu[:-1]:
                starts.append(starts[-1] + n)
            # One host-to-device copy for the three columns.
            table = torch.tensor(
                [fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, starts], dtype=torch.int64
            ).to(device)
            self._extend = _ExtendMetadata(
                table[0], table[1], table[2], max(fb.extend_seq_lens_cpu)
            )

    def forward(self, qkv: QKV, layer: Attention, forward_batch: ForwardBatch) -> torch.Tensor:
        num_tokens = self._store_new_kv(qkv, layer, forward_batch)
        q = qkv.q
        heads, head_dim = layer.num_heads, layer.head_dim
        pool = self.token_to_kv_pool
        q3 = q.reshape(num_tokens, heads, head_dim)
        if q3.stride(-1) != 1:
            q3 = q3.contiguous()
        out = torch.empty((num_tokens, heads, head_dim), dtype=q.dtype, device=q.device)
        kv = self.kernels.PagedKV(
            pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
            *(pool.get_kv_scale_buffers(layer.layer_id) or ()),
        )
        if forward_batch.forward_mode.is_decode:
            self.kernels.decode_attention(
                q3, kv, out, forward_batch.seq_lens, layer.scaling, self.num_kv_splits,
                layer.sliding_window, layer.logit_cap,
            )
        else:
            md = self._extend
            assert md is not None
            self.kernels.extend_attention(
                q3, kv, out, md.prefix_lens, md.extend_lens, md.q_starts, md.max_extend,
                layer.scaling, layer.sliding_window, layer.logit_cap,
            )
        return out.view(num_tokens, heads * head_dim)
