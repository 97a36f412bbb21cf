"""Random paged-attention batches for comparing attention backends: a KV pool whose unowned slots
hold NaN (an unmasked read of one poisons the output), shuffled pages, request rows out of order,
cached prefixes already in the pool. ``kv_dtype`` makes the pool's storage dtype differ from the
activations' (an int8 pool: its unowned slots' scales hold NaN; fp8: their codes);
``reference_attention`` attends over what the pool holds, dequantized, in plain torch. Shared
by the interpreter tests (``tests/layers``) and the GPU check (``tests/cuda``); importing it sets
nothing up (no ``TRITON_INTERPRET``)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.layers.attention import Attention, create_attention_backend
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool


@dataclass
class PagedBatch:
    fb: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pool: MHATokenToKVPool
    req_pool: ReqToTokenPool
    heads: int
    kv_heads: int
    head_dim: int


def random_batch(seed: int, mode: ForwardMode, page_size: int, dtype: torch.dtype, heads: int,
                 kv_heads: int, head_dim: int, max_extend: int = 12, max_prefix: int = 30,
                 max_bs: int = 3, device: str = "cpu",
                 kv_dtype: torch.dtype | None = None, kv_tensor_scale: float = 1.0) -> PagedBatch:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bs = rng.randint(1, max_bs)
    prefix_lens = [rng.choice([0, rng.randint(1, max_prefix)]) for _ in range(bs)]
    if mode.is_decode:
        prefix_lens = [max(p, 1) - 1 for p in prefix_lens]
        extend_lens = [1] * bs
    else:
        extend_lens = [rng.randint(1, max_extend) for _ in range(bs)]
    context = max_prefix + max_extend + 1
    num_pages = bs * (-(-context // page_size)) + 2
    rows_total = bs + 3
    pool = MHATokenToKVPool(num_pages * page_size, page_size, kv_dtype or dtype, kv_heads,
                            head_dim, 1, device,
                            layer_scales=[(kv_tensor_scale, kv_tensor_scale)])
    # an int8 pool's scales, or else the values (fp8: the codes, whose layer scale is shared)
    poisoned = pool.k_scale_buffer + pool.v_scale_buffer if pool.row_scaled else (
        pool.k_buffer + pool.v_buffer)
    for buffer in poisoned:
        buffer[page_size:] = float("nan")
    req_pool = ReqToTokenPool(rows_total, context, device)
    pages = list(range(1, num_pages + 1))
    rng.shuffle(pages)
    rows = rng.sample(range(rows_total), bs)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    locs = []
    for row, prefix, extend in zip(rows, prefix_lens, extend_lens, strict=True):
        seq_len = prefix + extend
        own = [pages.pop() for _ in range(-(-seq_len // page_size))]
        slots = torch.tensor([own[p // page_size] * page_size + p % page_size
                              for p in range(seq_len)], device=device)
        req_pool.req_to_token[row, :seq_len] = slots
        pool.set_kv_buffer(0, slots[:prefix], rand(prefix, kv_heads, head_dim),
                           rand(prefix, kv_heads, head_dim))
        locs.append(slots[prefix:])
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    n = sum(extend_lens)
    fb = ForwardBatch(
        forward_mode=mode,
        input_ids=torch.zeros(n, dtype=torch.int64, device=device),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens,
                                                                   strict=True)]).to(device),
        req_pool_indices=torch.tensor(rows, device=device),
        seq_lens=torch.tensor(seq_lens, device=device),
        out_cache_loc=torch.cat(locs),
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens if mode.is_extend else None,
        extend_seq_lens_cpu=extend_lens if mode.is_extend else None,
    )
    return PagedBatch(fb, rand(n, heads * head_dim), rand(n, kv_heads * head_dim),
                      rand(n, kv_heads * head_dim), pool, req_pool, heads, kv_heads, head_dim)


def attend(name: str, b: PagedBatch, kv_splits: int | None = None, window: int | None = None,
           cap: float = 0.0) -> torch.Tensor:
    """One layer of backend ``name`` over the batch (it writes the new K/V into the pool), with
    sliding window ``window`` and soft cap ``cap`` if given."""
    backend = create_attention_backend(name, b.req_pool, b.pool)
    if kv_splits is not None:
        backend.num_kv_splits = kv_splits
    attn = Attention(b.heads, b.head_dim, b.head_dim**-0.5, b.kv_heads, 0, backend, window, cap)
    backend.init_forward_metadata(b.fb)
    return attn(b.q, b.k, b.v, b.fb)


def reference_attention(b: PagedBatch, window: int | None = None, cap: float = 0.0
                        ) -> torch.Tensor:
    """Each request's new tokens over its whole KV as the pool holds it (after a backend wrote
    the new K/V there), dequantized to float32, causally (only the last ``window`` positions up
    to each query, scores soft-capped by ``cap``, if given), in plain torch; float32
    ``[tokens, heads * head_dim]``."""
    fb = b.fb
    group = b.heads // b.kv_heads
    q = b.q.float().view(-1, b.heads, b.head_dim)
    outs, start = [], 0
    for i, seq_len in enumerate(fb.seq_lens_cpu):
        n = 1 if fb.forward_mode.is_decode else fb.extend_seq_lens_cpu[i]
        slots = b.req_pool.req_to_token[fb.req_pool_indices[i], :seq_len]
        k, v = b.pool.get_dequantized(0, slots, torch.float32)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq, d]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[start:start + n].transpose(0, 1)  # [heads, n, d]
        scores = qi @ k.transpose(1, 2) * b.head_dim**-0.5
        if cap:
            scores = cap * torch.tanh(scores / cap)
        pos = torch.arange(seq_len - n, seq_len)[:, None]
        kv_pos = torch.arange(seq_len)[None, :]
        hidden = kv_pos > pos
        if window is not None:
            hidden |= kv_pos <= pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append((scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outs)
