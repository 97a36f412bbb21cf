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

Prefill requests take the extend kernel or torch's SDPA, per (head_dim, GQA group, extend and
prefix length bucket): ``extend_dispatch.py`` chooses, by measurement at start-up
(``choose_extend_kernels``) or by its static table; deterministic inference keeps the kernel, and
so do layers with a sliding window or a soft cap (``Attention.sliding_window`` / ``logit_cap``:
the kernels honour both, SDPA's candidate neither).

Built only for KV pools the kernels take (float32 or bf16, head_dim a multiple of 16 up to 256,
any number of query heads per KV head); ``create_attention_backend`` reports why otherwise.

A quantized pool (``--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2``) takes the kernels'
``*_quant`` variants: the pool quantizes the new K/V with their scales (``set_kv_buffer``), then
the kernel reads codes and scales in place, in float32 (a quarter or half of the bytes per key of
a float32 or bf16 pool: the bandwidth a long decode is bound by), with the same windows and soft
caps as the plain kernels (one shared loop).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.layers import cpu_kernels, kernel_dispatch
from radixserve.layers.attention import extend_dispatch as xd
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
            raise ValueError(
                f"the cpu attention backend cannot run here (a {token_to_kv_pool.dtype} KV "
                f"cache): {reason or 'not a CPU'}"
            )
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.batch_invariant = batch_invariant
        self._extend_lens: torch.Tensor | None = None
        # extend kernel choice per cell (extend_dispatch); None: the static table at first use
        self.extend_table: tuple[str, ...] | None = None
        self._plan: _SdpaPlan | None = None

    def _extend_candidates(self) -> tuple[str, ...]:
        """The prefill candidates this pool allows: a quantized pool is read by the kernels'
        ``*_quant`` variants only (SDPA would need its K/V dequantized first)."""
        only_kernel = self.batch_invariant or self.token_to_kv_pool.quantized
        return xd.allowed_candidates(only_kernel)

    def static_extend_table(self) -> tuple[str, ...]:
        return xd.static_table(
            self._extend_candidates(), cpu_kernels.amx_available(), self.token_to_kv_pool.dtype
        )

    def choose_extend_kernels(self, num_heads: int, autotune: str) -> tuple[str, ...]:
        """Set the prefill kernel table for layers of ``num_heads`` query heads: measured (and
        cached with the linear kernels' choices) when ``autotune`` is ``on``, else static."""
        pool = self.token_to_kv_pool
        shape = xd.Shape(
            pool.dtype, pool.head_dim, num_heads // pool.head_num, self._extend_candidates(),
        )
        cache = None
        if autotune == "on" and len(shape.candidates) > 1:
            cache = kernel_dispatch.machine_cache()
            self.extend_table = xd.tune(shape, self.static_extend_table(), cache)
        else:
            self.extend_table = self.static_extend_table()
            xd.logger.info("attention dispatch %s (static): %s", shape.key(),
                           xd.describe(self.extend_table))
        return self.extend_table

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        lens = forward_batch.extend_seq_lens_cpu
        if lens is None and self.batch_invariant:  # decode as a one-token extend
            lens = [1] * len(forward_batch.seq_lens_cpu)
        self._extend_lens = None if lens is None else torch.tensor(lens, dtype=torch.int64)
        self._plan = None
        prefixes = forward_batch.extend_prefix_lens_cpu
        if forward_batch.forward_mode.is_decode or lens is None or prefixes is None:
            return
        if self.extend_table is None:
            self.extend_table = self.static_extend_table()
        table = self.extend_table
        if xd.SDPA not in table:
            return
        choices = [table[xd.cell_index(e, p)] for e, p in zip(lens, prefixes, strict=True)]
        if xd.SDPA in choices:
            self._plan = _SdpaPlan.build(choices, lens, prefixes, forward_batch.req_pool_indices)

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
        if pool.quantized:
            k_scale, v_scale = pool.get_kv_scale_buffers(layer.layer_id)
            pool.set_kv_buffer(
                layer.layer_id, forward_batch.out_cache_loc,
                k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim),
            )
            out = cpu_kernels.paged_attention_quant(
                q.reshape(n, heads, head_dim).float(),
                pool.get_key_buffer(layer.layer_id),
                pool.get_value_buffer(layer.layer_id),
                k_scale,
                v_scale,
                self.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices,
                forward_batch.seq_lens,
                layer.scaling,
                extend_lens,
                layer.sliding_window,
                layer.logit_cap,
                bf16_query=q.dtype == torch.bfloat16,
            )
            return out.view(n, heads * head_dim).to(q.dtype)
        q3 = q.view(n, heads, head_dim).to(pool.dtype)
        k3 = k.view(n, kv_heads, head_dim).to(pool.dtype)
        v3 = v.view(n, kv_heads, head_dim).to(pool.dtype)
        k_buffer = pool.get_key_buffer(layer.layer_id)
        v_buffer = pool.get_value_buffer(layer.layer_id)
        # The SDPA candidate knows no window or soft cap: such layers keep the kernel (which
        # writes the whole batch's K/V itself), the plan serves the other layers of the batch.
        if self._plan is not None and layer.sliding_window is None and not layer.logit_cap:
            batch = xd.PagedExtend(
                q3, k3, v3, forward_batch.out_cache_loc, k_buffer, v_buffer,
                self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                forward_batch.seq_lens, extend_lens, layer.scaling,
            )
            out = self._plan.attend(batch)
        else:
            out = cpu_kernels.paged_attention(
                q3, k3, v3, forward_batch.out_cache_loc, k_buffer, v_buffer,
                self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                forward_batch.seq_lens, layer.scaling, extend_lens, layer.sliding_window,
                layer.logit_cap,
            )
        return out.view(n, heads * head_dim).to(q.dtype)


@dataclass
class _SdpaPlan:
    """A prefill batch where some requests take SDPA (the rest the extend kernel), built once per
    batch for all layers."""

    sdpa: list[tuple[int, int, int, int]]  # (first row, extend, prefix, pool row) per request
    sdpa_rows: torch.Tensor | None  # their token rows (None: all rows)
    native_requests: torch.Tensor | None  # indices of the kernel's requests (None: no such)
    native_rows: torch.Tensor | None  # their token rows

    @classmethod
    def build(
        cls, choices: list[str], extend_lens: list[int], prefix_lens: list[int],
        req_pool_indices: torch.Tensor,
    ) -> _SdpaPlan:
        starts = [0, *itertools.accumulate(extend_lens)]
        pool_rows = req_pool_indices.tolist()
        sdpa, native, rows, sdpa_rows = [], [], [], []
        for i, choice in enumerate(choices):
            span = range(starts[i], starts[i + 1])
            if choice == xd.SDPA:
                sdpa.append((starts[i], extend_lens[i], prefix_lens[i], pool_rows[i]))
                sdpa_rows.extend(span)
            else:
                native.append(i)
                rows.extend(span)
        if not native:
            return cls(sdpa, None, None, None)
        return cls(sdpa, torch.tensor(sdpa_rows), torch.tensor(native), torch.tensor(rows))

    def attend(self, b: xd.PagedExtend) -> torch.Tensor:
        """The kernel for its requests (on their rows), SDPA for the others, one output. The
        SDPA requests' new K/V go into the pool first (the kernel writes its own): later steps
        read them, and SDPA reads a prefixed request's whole K/V from there."""
        rows = self.sdpa_rows
        loc, k, v = (b.loc, b.k, b.v) if rows is None else (b.loc[rows], b.k[rows], b.v[rows])
        b.k_buffer.index_copy_(0, loc, k)
        b.v_buffer.index_copy_(0, loc, v)
        out = torch.empty_like(b.q)
        if self.native_requests is not None:
            reqs, rows = self.native_requests, self.native_rows
            part = xd.PagedExtend(
                b.q[rows], b.k[rows], b.v[rows], b.loc[rows], b.k_buffer, b.v_buffer,
                b.req_to_token, b.req_pool_indices[reqs], b.seq_lens[reqs], b.extend_lens[reqs],
                b.scale,
            )
            out[rows] = xd.attend_native(part)
        for start, extend, prefix, pool_row in self.sdpa:
            xd.attend_sdpa_one(b, start, extend, prefix, pool_row, out)
        return out
