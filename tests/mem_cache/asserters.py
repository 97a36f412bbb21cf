"""Asserters for memory tests: slot ownership, page alignment and radix-tree integrity.

They read private state (the allocator's free list, the tree's nodes) on purpose: these are
white-box checks that the public counters tell the truth.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from radixserve.mem_cache import RadixCache, TokenToKVPoolAllocator


def tree_values(cache: RadixCache) -> list[torch.Tensor]:
    return [node.value for node in cache._nodes()]


def assert_no_overlap(*slot_sets: torch.Tensor) -> None:
    """No KV slot appears twice across (or within) the given tensors."""
    slots = torch.cat([s.flatten() for s in slot_sets]) if slot_sets else torch.empty(0)
    assert len(torch.unique(slots)) == len(slots), "a KV slot is owned twice"


def assert_page_aligned(slots: torch.Tensor, page_size: int) -> None:
    """``slots`` is a run of whole pages, each holding offsets 0..page_size-1 in order."""
    assert len(slots) % page_size == 0, f"{len(slots)} slots is not a whole number of pages"
    pages = slots.view(-1, page_size)
    expected = pages[:, :1] + torch.arange(page_size)
    assert torch.equal(pages, expected) and bool((pages[:, 0] % page_size == 0).all()), (
        f"slots are not whole pages: {slots.tolist()}"
    )


def assert_pages_accounted(
    allocator: TokenToKVPoolAllocator, owned: Iterable[torch.Tensor]
) -> None:
    """Every page 1..num_pages is either free or owned by exactly one holder; page 0 by nobody.

    ``owned``: the slots of each holder (tree nodes, requests); a holder may use part of a page,
    but no page is shared between two holders or between a holder and the free list.
    """
    ps = allocator.page_size
    holders = [torch.unique(s // ps) for s in owned if len(s)]
    parked = allocator._parked.nonzero().squeeze(1)  # free, kept for a decode run
    assert len(parked) == allocator._num_parked
    assert bool(allocator._page_is_free[parked].all()), "a parked slot is marked taken"
    everything = torch.cat([allocator._free_pages, *allocator._released, parked, *holders])
    assert len(torch.unique(everything)) == len(everything), "a page is free and owned, or shared"
    assert sorted(everything.tolist()) == list(range(1, allocator.num_pages + 1)), (
        "pages leaked, or page 0 handed out"
    )


def assert_tree_integrity(cache: RadixCache) -> None:
    """Structure, page alignment and incrementally kept counters match a full recount."""
    ps = cache.page_size
    evictable = protected = 0
    leaves = set()
    for node in cache._nodes():
        assert len(node.key) > 0 and len(node.key) % ps == 0, "node key is not whole pages"
        assert len(node.value) == len(node.key)
        assert_page_aligned(node.value, ps)
        parent = node.parent
        assert parent.children[cache._child_key(node.key, 0)] is node, "child keyed wrongly"
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), (
            "a locked node has an unlocked ancestor"
        )
        if node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
            if not node.children:
                leaves.add(node)
    assert cache.evictable_size() == evictable, (cache.evictable_size(), evictable)
    assert cache.protected_size() == protected, (cache.protected_size(), protected)
    assert cache._evictable_leaves == leaves, "evictable-leaf set is stale"
    values = tree_values(cache)
    if values:
        assert_no_overlap(*values)
        allocator = cache.allocator
        assert not bool(allocator._page_is_free[torch.cat(values) // ps].any()), (
            "the tree holds a free page"
        )
