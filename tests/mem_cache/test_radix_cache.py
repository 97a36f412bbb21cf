"""RadixCache: matching, page alignment, locks, LRU eviction, and request slot ownership."""

from __future__ import annotations

import pytest
import torch

from radixserve.mem_cache import RadixCache, ReqToTokenPool, TokenToKVPoolAllocator
from tests.mem_cache.asserters import (
    assert_no_overlap,
    assert_page_aligned,
    assert_pages_accounted,
    assert_tree_integrity,
    tree_values,
)
from tests.mem_cache.req_driver import Driver, Req


def make_cache(page_size: int = 1, size: int = 256) -> RadixCache:
    pool = ReqToTokenPool(size=8, max_context_len=128, device="cpu")
    return RadixCache(pool, TokenToKVPoolAllocator(size, page_size, "cpu"), page_size)


def put(cache: RadixCache, tokens: list[int]) -> torch.Tensor:
    """Allocate slots for ``tokens``, insert them, free the duplicates; returns the slots."""
    value = cache.allocator.alloc_extend([0], [len(tokens)], [-1])
    assert value is not None
    dup = cache.insert(tokens, value)
    cache.allocator.free(value[:dup])
    return value


def assert_all_accounted(cache: RadixCache, *held: torch.Tensor) -> None:
    assert_tree_integrity(cache)
    assert_pages_accounted(cache.allocator, [*tree_values(cache), *held])


def test_match_on_empty_cache_is_empty():
    cache = make_cache()
    m = cache.match_prefix([1, 2, 3])
    assert m.device_indices.dtype == torch.int64 and len(m.device_indices) == 0
    cache.inc_lock_ref(m.last_node)  # locking the root is a no-op
    assert cache.protected_size() == 0
    cache.dec_lock_ref(m.last_node)


def test_insert_returns_the_already_cached_length_and_match_returns_its_slots():
    cache = make_cache()
    a = put(cache, [1, 2, 3, 4, 5])
    assert cache.insert([1, 2, 3, 4, 5], a.clone()) == 5
    b = cache.allocator.alloc(5)
    assert cache.insert([1, 2, 3, 9, 9], b) == 3
    cache.allocator.free(b[:3])
    assert cache.total_size() == 7
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices, a)
    assert torch.equal(cache.match_prefix([1, 2, 3, 7]).device_indices, a[:3])
    both = torch.cat((a[:3], b[3:]))
    assert torch.equal(cache.match_prefix([1, 2, 3, 9, 9]).device_indices, both)
    assert len(cache.match_prefix([2, 3]).device_indices) == 0
    assert_all_accounted(cache)


def test_match_inside_a_node_splits_it_so_the_lock_pins_exactly_the_prefix():
    cache = make_cache()
    a = put(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 7])
    assert torch.equal(m.device_indices, a[:3])
    cache.inc_lock_ref(m.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (3, 3)
    assert_all_accounted(cache)
    assert cache.evict(100) == 3
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices, a[:3])
    cache.dec_lock_ref(m.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 3)
    assert_all_accounted(cache)


def test_keys_and_matches_are_whole_pages():
    cache = make_cache(page_size=4)
    a = put(cache, list(range(12)))
    assert len(cache.match_prefix(list(range(11))).device_indices) == 8
    assert len(cache.match_prefix(list(range(3))).device_indices) == 0
    # Diverging inside the second page: only the first page is shared, the node splits there.
    b_tokens = [0, 1, 2, 3, 4, 5, 99, 99]
    b = cache.allocator.alloc_extend([0], [8], [-1])
    assert b is not None
    assert cache.insert(b_tokens, b) == 4
    cache.allocator.free(b[:4])
    m = cache.match_prefix(b_tokens + [7])
    assert torch.equal(m.device_indices, torch.cat((a[:4], b[4:])))
    assert_page_aligned(m.device_indices, 4)
    assert cache.total_size() == 16
    assert_all_accounted(cache)


def test_unaligned_insert_is_rejected():
    cache = make_cache(page_size=4)
    with pytest.raises(AssertionError, match="page aligned"):
        cache.insert([1, 2, 3], torch.tensor([4, 5, 6]))


def test_locked_prefix_survives_eviction_of_everything_else():
    cache = make_cache()
    a = put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 8, 9])
    put(cache, [5, 6])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 4)
    assert cache.evict(1000) == 4
    assert cache.evictable_size() == 0
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).device_indices, a)
    assert len(cache.match_prefix([5, 6]).device_indices) == 0
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(1000) == 4 and cache.total_size() == 0
    assert cache.allocator.available_size() == cache.allocator.size
    assert_all_accounted(cache)


def test_evict_frees_least_recently_used_leaves_first():
    cache = make_cache()
    for first in (1, 2, 3):
        put(cache, [first] * 4)
    cache.match_prefix([1, 1])  # refreshes (and splits) sequence 1: now 2 is the oldest
    assert cache.evict(4) == 4
    assert len(cache.match_prefix([2] * 4).device_indices) == 0
    assert len(cache.match_prefix([1] * 4).device_indices) == 4
    assert len(cache.match_prefix([3] * 4).device_indices) == 4
    # 1 was matched before 3 just now: its leaf (the lower half left by the split) goes next.
    assert cache.evict(1) == 2
    assert len(cache.match_prefix([1] * 4).device_indices) == 2
    assert len(cache.match_prefix([3] * 4).device_indices) == 4
    assert_all_accounted(cache)


def test_evict_continues_into_a_parent_that_became_a_leaf():
    cache = make_cache()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])
    assert cache.evict(6) == 6  # both leaves, then their shared parent [1, 2]
    assert cache.total_size() == 0
    assert cache.allocator.available_size() == cache.allocator.size
    assert_all_accounted(cache)


def test_evict_zero_or_from_an_empty_cache_is_a_no_op():
    cache = make_cache()
    assert cache.evict(10) == 0
    put(cache, [1, 2, 3])
    available = cache.allocator.available_size()
    assert cache.evict(0) == 0
    assert cache.total_size() == 3 and cache.allocator.available_size() == available


def test_evict_may_free_more_than_asked_but_whole_nodes_only():
    cache = make_cache(page_size=4)
    put(cache, list(range(8)))
    assert cache.evict(1) == 8
    assert_all_accounted(cache)


def test_reset_returns_every_cached_slot_to_the_allocator():
    cache = make_cache(page_size=2)
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])
    cache.reset()
    assert cache.total_size() == 0 and len(cache.match_prefix([1, 2]).device_indices) == 0
    assert cache.allocator.available_size() == cache.allocator.size


def test_dec_lock_without_inc_is_caught():
    cache = make_cache()
    put(cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    with pytest.raises(AssertionError, match="without a matching inc_lock_ref"):
        cache.dec_lock_ref(node)


def test_pretty_print_lists_nodes_and_totals(capsys):
    cache = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 7])
    cache.pretty_print()
    out = capsys.readouterr().out
    assert "[1, 2] tokens=2 lock=0" in out and "  [7] tokens=1" in out
    assert "total=4 evictable=4 protected=0" in out


# ---- request ownership: cache_finished_req / cache_unfinished_req ----------------------------


@pytest.mark.parametrize("ps", [1, 4])
def test_finished_request_leaves_its_aligned_tokens_in_the_tree_and_frees_the_rest(ps):
    cache = make_cache(page_size=ps)
    drv = Driver(cache, cache.req_to_token_pool, cache.allocator)
    tokens = list(range(10))
    req = drv.admit("a", tokens)
    drv.extend(req, 10)
    assert_all_accounted(cache, drv.own_slots(req))
    slots = drv.row(req)[:10].clone()
    cache.cache_finished_req(req, tokens)
    assert req.req_pool_idx is None
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size
    aligned = 10 // ps * ps
    assert (cache.total_size(), cache.protected_size()) == (aligned, 0)
    assert torch.equal(cache.match_prefix(tokens).device_indices, slots[:aligned])
    assert cache.allocator.available_size() + cache.evictable_size() == cache.allocator.size
    assert_all_accounted(cache)


@pytest.mark.parametrize("ps", [1, 4])
def test_second_request_reuses_the_cached_prefix_and_holds_it_locked(ps):
    cache = make_cache(page_size=ps)
    drv = Driver(cache, cache.req_to_token_pool, cache.allocator)
    prompt = list(range(12))
    a = drv.admit("a", prompt)
    drv.extend(a, 12)
    a_slots = drv.row(a)[:12].clone()
    cache.cache_finished_req(a, prompt)

    b_tokens = prompt + [50, 51, 52]
    b = drv.admit("b", b_tokens)
    assert torch.equal(b.prefix_indices, a_slots)
    assert cache.protected_size() == 12 and cache.evict(1000) == 0
    drv.extend(b, 15)
    assert_all_accounted(cache, drv.own_slots(b))
    cache.cache_finished_req(b, b_tokens)
    assert cache.protected_size() == 0 and cache.total_size() == 15 // ps * ps
    cache.reset()
    assert cache.allocator.available_size() == cache.allocator.size


@pytest.mark.parametrize("ps", [1, 4])
def test_concurrent_identical_requests_cache_one_copy_and_free_the_duplicate(ps):
    cache = make_cache(page_size=ps)
    drv = Driver(cache, cache.req_to_token_pool, cache.allocator)
    tokens = list(range(9))
    a, b = drv.admit("a", tokens), drv.admit("b", tokens)  # both miss: nothing cached yet
    drv.extend(a, 9)
    drv.extend(b, 9)
    assert_no_overlap(drv.own_slots(a), drv.own_slots(b))
    cache.cache_finished_req(a, tokens)
    cache.cache_finished_req(b, tokens)
    assert cache.total_size() == 9 // ps * ps
    assert cache.allocator.available_size() + cache.total_size() == cache.allocator.size
    assert_all_accounted(cache)
    cache.reset()
    assert cache.allocator.available_size() == cache.allocator.size


@pytest.mark.parametrize("ps", [1, 4])
def test_chunked_prefill_caches_each_chunk_and_keeps_the_tail_with_the_request(ps):
    cache = make_cache(page_size=ps)
    drv = Driver(cache, cache.req_to_token_pool, cache.allocator)
    tokens = list(range(100, 117))
    req = drv.admit("a", tokens)
    for chunk_end in (6, 11, 17):
        drv.extend(req, chunk_end)
        cache.cache_unfinished_req(req, tokens[:chunk_end])
        aligned = chunk_end // ps * ps
        assert len(req.prefix_indices) == chunk_end
        assert torch.equal(req.prefix_indices, drv.row(req)[:chunk_end])
        assert cache.protected_size() == aligned and cache.evictable_size() == 0
        assert torch.equal(cache.match_prefix(tokens).device_indices, req.prefix_indices[:aligned])
        assert_all_accounted(cache, drv.own_slots(req))
    cache.cache_finished_req(req, tokens)
    assert cache.protected_size() == 0 and cache.total_size() == 17 // ps * ps
    cache.reset()
    assert cache.allocator.available_size() == cache.allocator.size


@pytest.mark.parametrize("ps", [1, 4])
def test_unfinished_duplicate_is_freed_and_the_row_repointed_at_the_tree(ps):
    """Two identical prompts chunked side by side: the second's copy of each cached chunk is
    freed and its row must then point at the tree's slots, never at a freed page (with pages, its
    own partial page from the previous chunk is part of the duplicate)."""
    cache = make_cache(page_size=ps)
    drv = Driver(cache, cache.req_to_token_pool, cache.allocator)
    tokens = list(range(16))
    a, b = drv.admit("a", tokens), drv.admit("b", tokens)
    for chunk_end in (6, 12, 16):
        for req in (a, b):
            drv.extend(req, chunk_end)
            cache.cache_unfinished_req(req, tokens[:chunk_end])
        aligned = chunk_end // ps * ps
        assert torch.equal(drv.row(a)[:aligned], drv.row(b)[:aligned])
        assert not bool(cache.allocator._page_is_free[drv.row(b)[:chunk_end] // ps].any())
        assert_all_accounted(cache, drv.own_slots(a), drv.own_slots(b))
        assert cache.total_size() == aligned
    cache.cache_finished_req(a, tokens)
    cache.cache_finished_req(b, tokens)
    assert cache.protected_size() == 0
    cache.reset()
    assert cache.allocator.available_size() == cache.allocator.size
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size


def test_retracted_request_can_be_admitted_again_from_its_cached_prefix():
    cache = make_cache(page_size=4)
    drv = Driver(cache, cache.req_to_token_pool, cache.allocator)
    tokens = list(range(10))
    req = drv.admit("a", tokens)
    drv.extend(req, 10)
    cache.cache_finished_req(req, tokens)  # retraction releases like a finish
    again = drv.admit("a", tokens)
    assert len(again.prefix_indices) == 8
    drv.extend(again, 10)
    cache.cache_finished_req(again, tokens)
    cache.reset()
    assert cache.allocator.available_size() == cache.allocator.size


def test_mismatched_page_size_is_rejected():
    pool = ReqToTokenPool(size=2, max_context_len=8, device="cpu")
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(pool, TokenToKVPoolAllocator(16, 4, "cpu"), 1)


def test_finishing_a_request_without_a_row_is_caught():
    cache = make_cache()
    with pytest.raises(AssertionError, match="holds no request slot"):
        cache.cache_finished_req(Req("x"), [1, 2])
