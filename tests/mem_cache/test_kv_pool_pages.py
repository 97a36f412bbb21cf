"""The bytes the hierarchical cache moves between tiers (``read_kv_pages`` /
``write_kv_pages``) carry everything a slot holds: K and V of every layer and, in an int8 pool
(``--kv-cache-dtype``), their scales (fp8's one scale per layer is the pool's, not the slot's);
a page written back reads as it was."""

from __future__ import annotations

import pytest
import torch

from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.kv_quant import kv_storage_dtype


@pytest.mark.parametrize("kv_dtype", ["auto", "bf16", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_pages_round_trip_with_their_scales(kv_dtype):
    dtype = kv_storage_dtype(kv_dtype, torch.float32)
    pool = MHATokenToKVPool(32, 4, dtype, 2, 16, 3, "cpu")
    gen = torch.Generator().manual_seed(0)
    src = torch.arange(4, 12)
    for layer in range(3):
        k = torch.randn(len(src), 2, 16, generator=gen) * (layer + 1)
        v = torch.randn(len(src), 2, 16, generator=gen)
        pool.set_kv_buffer(layer, src, k, v)
    data = pool.read_kv_pages(src)
    assert data.dtype == torch.uint8 and data.shape == (len(src), pool.kv_bytes_per_token())
    dst = torch.arange(20, 28)
    pool.write_kv_pages(dst, data)
    assert len(pool.slot_buffers(0)) == (4 if pool.row_scaled else 2)
    for layer in range(3):
        for buffer in pool.slot_buffers(layer):
            assert torch.equal(buffer[dst].view(torch.uint8), buffer[src].view(torch.uint8))
        for was, now in zip(pool.get_dequantized(layer, src, torch.float32),
                            pool.get_dequantized(layer, dst, torch.float32), strict=True):
            assert torch.equal(now, was)
    layout = pool.kv_layout()
    assert ("k_scales" in layout["token_layout"]) == pool.row_scaled
    # codes under a per-layer scale are stored with that scale's value in their layout
    assert (layout["layer_scales"] is not None) == (pool.quantized and not pool.row_scaled)


def test_no_pages_read_and_write_nothing():
    pool = MHATokenToKVPool(8, 4, torch.int8, 2, 16, 2, "cpu")
    empty = pool.read_kv_pages(torch.empty(0, dtype=torch.int64))
    assert empty.shape == (0, pool.kv_bytes_per_token())
    pool.write_kv_pages(torch.empty(0, dtype=torch.int64), empty)
