"""ChunkCache (radix cache disabled) and the create_prefix_cache factory."""

from __future__ import annotations

import pytest
import torch

from radixserve.mem_cache import (
    ChunkCache,
    RadixCache,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    create_prefix_cache,
)
from tests.mem_cache.asserters import assert_no_overlap, assert_pages_accounted
from tests.mem_cache.req_driver import Driver


def make_cache(page_size: int) -> ChunkCache:
    pool = ReqToTokenPool(size=4, max_context_len=64, device="cpu")
    return ChunkCache(pool, TokenToKVPoolAllocator(64, page_size, "cpu"), page_size)


@pytest.mark.parametrize("ps", [1, 4])
def test_nothing_is_shared_between_requests(ps):
    cache = make_cache(ps)
    drv = Driver(cache, cache.req_to_token_pool, cache.allocator)
    tokens = list(range(9))
    a = drv.admit("a", tokens)
    drv.extend(a, 9)
    cache.cache_finished_req(a, tokens)
    assert len(cache.match_prefix(tokens).device_indices) == 0
    assert cache.evictable_size() == cache.protected_size() == 0
    assert cache.evict(100) == 0
    assert cache.allocator.available_size() == cache.allocator.size
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size
    assert a.req_pool_idx is None


def test_insert_keeps_nothing_so_the_caller_frees_every_slot():
    cache = make_cache(1)
    value = cache.allocator.alloc(4)
    assert value is not None
    assert cache.insert([1, 2, 3, 4], value) == 4
    cache.allocator.free(value)
    assert cache.allocator.available_size() == cache.allocator.size


@pytest.mark.parametrize("ps", [1, 4])
def test_chunked_prefill_keeps_the_request_kv_as_its_prefix(ps):
    cache = make_cache(ps)
    drv = Driver(cache, cache.req_to_token_pool, cache.allocator)
    tokens = list(range(13))
    a, b = drv.admit("a", tokens), drv.admit("b", tokens)
    for chunk_end in (5, 10, 13):
        for req in (a, b):
            drv.extend(req, chunk_end)  # continues the partial page left by the last chunk
            cache.cache_unfinished_req(req, tokens[:chunk_end])
            assert torch.equal(req.prefix_indices, drv.row(req)[:chunk_end])
        assert_no_overlap(drv.row(a)[:chunk_end], drv.row(b)[:chunk_end])
        assert_pages_accounted(cache.allocator, [drv.row(a)[:chunk_end], drv.row(b)[:chunk_end]])
    cache.cache_finished_req(a, tokens)
    cache.cache_finished_req(b, tokens)
    assert cache.allocator.available_size() == cache.allocator.size
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size


@pytest.mark.parametrize(("disable", "cls"), [(False, RadixCache), (True, ChunkCache)])
def test_create_prefix_cache_picks_the_cache_kind(disable, cls):
    pool = ReqToTokenPool(size=2, max_context_len=8, device="cpu")
    cache = create_prefix_cache(disable, pool, TokenToKVPoolAllocator(16, 4, "cpu"), 4)
    assert type(cache) is cls and cache.page_size == 4
