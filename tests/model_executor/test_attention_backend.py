"""The paged attention backends (``torch_native``, the reference, and ``cpu``, radixserve's CPU
kernels) and the KV pool, against a naive per-request attention over the same keys and values."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.layers.attention import Attention, create_attention_backend
from radixserve.layers.cpu_kernels import attention_kernels_support
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool
from tests.layers.helpers import require_kernels

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 16, 2
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """Causal attention of ``q`` (``[n, HEADS, D]``, positions ``prefix..``) over ``k``/``v``
    (``[prefix + n, KV_HEADS, D]``), in float64, one request."""
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=0)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=0)
    scores = q @ k.transpose(1, 2) * HEAD_DIM**-0.5
    q_pos = torch.arange(q.shape[1])[:, None] + prefix
    scores = scores.masked_fill(torch.arange(k.shape[1])[None, :] > q_pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(q.shape[1], HEADS * HEAD_DIM)


def _run(mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], page_size: int,
         dtype: torch.dtype, backend_name: str, batch_invariant: bool = False) -> torch.Tensor:
    """One layer's attention over a batch of requests with cached prefixes, checked against
    ``_reference``; returns its output. A request's K/V and queries depend only on its index
    and length, so the same token gets the same inputs in an EXTEND and a DECODE batch."""
    gen = torch.Generator().manual_seed(0)
    num_pages = 64
    pool = MHATokenToKVPool(num_pages * page_size, page_size, dtype, KV_HEADS, HEAD_DIM, LAYERS,
                            "cpu")
    req_pool = ReqToTokenPool(8, 64, "cpu")
    layer = LAYERS - 1
    # Slots nobody in this batch owns hold NaN: reading one unmasked would poison the output.
    for buffer in pool.k_buffer + pool.v_buffer:
        buffer[page_size:] = float("nan")
    pages = list(range(1, num_pages + 1))
    random.Random(0).shuffle(pages)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    rows, locs, full_k, full_v, qs = [], [], [], [], []
    for i, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        row = 7 - i  # rows out of order
        seq_len = prefix + extend
        own = [pages.pop() for _ in range(-(-seq_len // page_size))]
        slots = torch.tensor([own[p // page_size] * page_size + p % page_size
                              for p in range(seq_len)])
        req_pool.req_to_token[row, :seq_len] = slots
        k, v = rand(seq_len, KV_HEADS, HEAD_DIM), rand(seq_len, KV_HEADS, HEAD_DIM)
        q = rand(seq_len, HEADS, HEAD_DIM)
        pool.set_kv_buffer(layer, slots[:prefix], k[:prefix], v[:prefix])  # the cached prefix
        rows.append(row)
        locs.append(slots[prefix:])
        full_k.append(k)
        full_v.append(v)
        qs.append(q[prefix:])

    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    num_tokens = sum(extend_lens)
    fb = ForwardBatch(
        forward_mode=mode,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens,
                                                                   strict=True)]),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        out_cache_loc=torch.cat(locs),
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens if mode.is_extend else None,
        extend_seq_lens_cpu=extend_lens if mode.is_extend else None,
    )
    backend = create_attention_backend(backend_name, req_pool, pool, batch_invariant)
    attn = Attention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, layer, backend)
    backend.init_forward_metadata(fb)
    new_k = torch.cat([k[p:] for k, p in zip(full_k, prefix_lens, strict=True)])
    new_v = torch.cat([v[p:] for v, p in zip(full_v, prefix_lens, strict=True)])
    out = attn(torch.cat(qs).flatten(1), new_k.flatten(1), new_v.flatten(1), fb)

    assert out.shape == (num_tokens, HEADS * HEAD_DIM) and out.dtype == dtype
    assert torch.equal(pool.get_key_buffer(layer)[fb.out_cache_loc], new_k)
    assert torch.equal(pool.get_value_buffer(layer)[fb.out_cache_loc], new_v)
    expected = torch.cat([_reference(q, k, v, p) for q, k, v, p in
                          zip(qs, full_k, full_v, prefix_lens, strict=True)])
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    return out


def backends(dtype: torch.dtype) -> list[str]:
    """The backends that run a pool of ``dtype`` here."""
    cpu = attention_kernels_support(dtype, HEAD_DIM) is None
    return ["torch_native", "cpu"] if cpu else ["torch_native"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_attends_over_cached_prefix_and_new_tokens(page_size, dtype):
    for backend in backends(dtype):
        _run(ForwardMode.EXTEND, [0, 7, 3, 12], [5, 3, 1, 9], page_size, dtype, backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_attends_over_the_whole_sequence(page_size, dtype):
    for backend in backends(dtype):
        _run(ForwardMode.DECODE, [0, 6, 11, 3], [1, 1, 1, 1], page_size, dtype, backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_cpu_backend_decodes_a_token_to_its_prefill_bits(dtype):
    """--enable-deterministic-inference: a token decoded gets the bits it gets prefilled, so a
    radix hit on generated tokens equals a cold prefill (without it the two sum differently)."""
    require_kernels()
    prefix_lens, extend_lens = [0, 6, 11, 20], [9, 4, 1, 12]  # 63 of the 64 slots
    prefill = _run(ForwardMode.EXTEND, prefix_lens, extend_lens, 1, dtype, "cpu", True)
    # each request's last token again, decoded after the rest
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    decode = _run(ForwardMode.DECODE, [s - 1 for s in seq_lens], [1] * 4, 1, dtype, "cpu", True)
    last = torch.tensor(extend_lens).cumsum(0) - 1
    assert torch.equal(decode, prefill[last])


def test_torch_native_backend_refuses_to_promise_batch_invariance():
    pool = MHATokenToKVPool(8, 1, torch.float32, KV_HEADS, HEAD_DIM, LAYERS, "cpu")
    with pytest.raises(ValueError, match="needs the cpu attention backend"):
        create_attention_backend("torch_native", ReqToTokenPool(1, 8, "cpu"), pool, True)


def test_kv_pool_reserves_a_zeroed_padding_page():
    pool = MHATokenToKVPool(32, 16, torch.bfloat16, KV_HEADS, HEAD_DIM, LAYERS, "cpu")
    assert pool.get_key_buffer(1).shape == (32 + 16, KV_HEADS, HEAD_DIM)
    for layer in range(LAYERS):
        assert not pool.get_key_buffer(layer)[:16].any()
        assert not pool.get_value_buffer(layer)[:16].any()
    per_token = MHATokenToKVPool.bytes_per_token(KV_HEADS, HEAD_DIM, LAYERS, torch.bfloat16)
    assert per_token == 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    assert pool.size_bytes() == (32 + 16) * per_token


def test_kv_pool_stores_in_its_own_dtype():
    pool = MHATokenToKVPool(8, 1, torch.float16, KV_HEADS, HEAD_DIM, LAYERS, "cpu")
    k = torch.randn(2, KV_HEADS, HEAD_DIM)
    pool.set_kv_buffer(0, torch.tensor([3, 5]), k, -k)
    assert pool.get_key_buffer(0).dtype == torch.float16
    assert torch.equal(pool.get_key_buffer(0)[torch.tensor([3, 5])], k.half())
    assert torch.equal(pool.get_value_buffer(0)[5], -k[1].half())


def test_unknown_attention_backend_is_rejected():
    pool = MHATokenToKVPool(8, 1, torch.float32, KV_HEADS, HEAD_DIM, LAYERS, "cpu")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*torch_native, cpu"):
        create_attention_backend("flash", ReqToTokenPool(1, 8, "cpu"), pool)


def test_cpu_backend_refuses_a_pool_its_kernels_cannot_take():
    pool = MHATokenToKVPool(8, 1, torch.float16, KV_HEADS, HEAD_DIM, LAYERS, "cpu")
    with pytest.raises(ValueError, match="the cpu attention backend cannot run here"):
        create_attention_backend("cpu", ReqToTokenPool(1, 8, "cpu"), pool)
