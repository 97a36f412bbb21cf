"""The radix tree keeps LoRA adapters apart: KV cached under one adapter's namespace is never
matched by a request of another adapter (or of the base model), and each namespace still shares
within itself, through chunked prefill and finish alike."""

from __future__ import annotations

import pytest

from radixserve.mem_cache import RadixCache, ReqToTokenPool, TokenToKVPoolAllocator
from tests.mem_cache.req_driver import Driver, Req


def _admit(drv: Driver, rid: str, tokens: list[int], namespace: int) -> Req:
    req = Req(rid, lora_namespace=namespace)
    match = drv.cache.match_req(req, tokens)
    req.prefix_indices, req.last_node = match.device_indices, match.last_node
    drv.cache.inc_lock_ref(match.last_node)
    req.req_pool_idx = drv.pool.alloc()
    req.kv_len = len(match.device_indices)
    drv.row(req)[: req.kv_len] = match.device_indices
    return req


@pytest.mark.parametrize("ps", [1, 4])
def test_no_match_crosses_namespaces(ps):
    allocator = TokenToKVPoolAllocator(256, ps, "cpu")
    pool = ReqToTokenPool(8, 64, "cpu")
    cache = RadixCache(pool, allocator, ps)
    drv = Driver(cache, pool, allocator)
    tokens = list(range(16))
    a = _admit(drv, "a", tokens, namespace=1)
    drv.extend(a, 8)
    cache.cache_unfinished_req(a, tokens[:8])  # a first prefill chunk
    drv.extend(a, 16)
    cache.cache_finished_req(a, tokens)
    assert cache.total_size() == 16

    for rid, namespace, cached in (("other", 2, 0), ("base", 0, 0), ("same", 1, 16)):
        req = _admit(drv, rid, tokens, namespace)
        assert len(req.prefix_indices) == cached, rid
        drv.extend(req, 16)
        cache.cache_finished_req(req, tokens)
    assert cache.total_size() == 3 * 16  # three namespaces, one copy each
    assert cache.protected_size() == 0
    cache.evict(1000)
    assert allocator.available_size() == allocator.size
