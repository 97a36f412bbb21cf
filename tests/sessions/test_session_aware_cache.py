"""SessionAwareCache with real pools: a streaming session's KV slot across turns, aborts,
close, memory pressure and the held-token accounting.

Turns are driven the way the scheduler does (``PrefillAdder`` matches and locks,
``prepare_for_extend`` takes a row and KV slots, decode steps add one slot per token, the output
processor calls ``cache_finished_req``). Page accounting is checked with the memory asserters:
every page is free or owned by exactly one holder.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixserve.mem_cache import RadixCache, ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.session_aware_cache import SessionAwareCache
from tests.mem_cache.asserters import assert_pages_accounted, tree_values
from tests.mem_cache.req_driver import Driver, Req

ROWS = 6
KV_TOKENS = 256
LENGTH = {"type": "length", "length": 4}
ABORT = {"type": "abort", "message": "aborted by request"}


class SessionDriver(Driver):
    """Admits, decodes and finishes requests (streaming turns or plain ones) like the scheduler."""

    cache: SessionAwareCache

    def admit_req(self, rid: str, prompt: list[int], session_id: str | None = None) -> Req:
        """Match (a turn: from its session's slot), lock, take a row and prefill ``prompt``."""
        req = Req(rid, streaming_session_id=session_id)
        match = self.cache.match_req(req, prompt[:-1])
        self.cache.inc_lock_ref(match.last_node)
        req.prefix_indices, req.last_node = match.device_indices, match.last_node
        req.req_pool_idx = self.pool.alloc()
        assert req.req_pool_idx is not None, "test pool too small"
        req.kv_len = len(match.device_indices)
        self.row(req)[: req.kv_len] = match.device_indices
        self.extend(req, len(prompt))
        return req

    def decode(self, req: Req, num_tokens: int) -> None:
        """KV of ``num_tokens`` more sampled tokens (the newest token's KV comes one step later)."""
        self.extend(req, req.kv_len + num_tokens)

    def finish(self, req: Req, all_ids: list[int], reason: dict[str, Any] | None) -> None:
        """``reason`` None is a retraction: the request gives its KV up without finishing."""
        req.finished_reason = reason
        self.cache.cache_finished_req(req, all_ids[: req.kv_len])

    def turn(
        self, session_id: str | None, prompt: list[int], output: list[int],
        reason: dict[str, Any] | None = LENGTH,
    ) -> Req:
        """A whole request: prefill, decode ``output`` (all but its last token get KV), finish."""
        req = self.admit_req(f"{session_id}-{len(prompt)}", prompt, session_id)
        self.decode(req, len(output) - 1)
        self.finish(req, prompt + output, reason)
        return req

    def slot_kv(self, session_id: str) -> torch.Tensor:
        slot = self.cache.slots[session_id]
        return self.pool.req_to_token[slot.req_pool_idx, : len(slot.token_ids)]

    def assert_accounted(self, *running: Req) -> None:
        """Pages are free, in the tree, in a slot, or owned by a running request: exactly one."""
        held = [self.slot_kv(s) for s, slot in self.cache.slots.items() if not slot.in_use]
        held += [self.row(r)[: r.kv_len] for r in running]
        assert_pages_accounted(self.allocator, [*tree_values(self.cache.inner), *held])


def make_driver(page_size: int) -> SessionDriver:
    pool = ReqToTokenPool(size=ROWS, max_context_len=128, device="cpu")
    allocator = TokenToKVPoolAllocator(KV_TOKENS, page_size, "cpu")
    inner = RadixCache(pool, allocator, page_size)
    return SessionDriver(SessionAwareCache(inner, pool, allocator, page_size), pool, allocator)


def pages(n: int, page_size: int) -> int:
    """Tokens the allocator hands out for ``n`` tokens."""
    return -(-n // page_size) * page_size


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture(params=[1, 4], ids=["page1", "page4"])
def d(request) -> SessionDriver:
    return make_driver(request.param)


# ---------------------------------------------------------------------- turns
def test_finished_first_turn_becomes_the_session_slot(d):
    ps = d.allocator.page_size
    prompt, output = ids(10, 10), ids(100, 5)
    d.turn("s", prompt, output)
    slot = d.cache.slots["s"]
    assert slot.token_ids == (prompt + output)[:14] and not slot.in_use
    assert d.cache.session_held_size() == pages(14, ps)
    assert d.cache.session_held_rows() == 1 and d.pool.available_size() == ROWS - 1
    assert d.allocator.available_size() == KV_TOKENS - pages(14, ps)
    assert d.cache.protected_size() == 0 and d.cache.evictable_size() == 0
    assert d.cache.inner.total_size() == 0, "a streaming turn must not enter the radix tree"
    d.assert_accounted()


def test_next_turn_reuses_the_slot_and_moves_it_to_its_own_row(d):
    ps = d.allocator.page_size
    prompt, output = ids(10, 10), ids(100, 5)
    d.turn("s", prompt, output)
    old_row, old_kv = d.cache.slots["s"].req_pool_idx, d.slot_kv("s").clone()
    prompt2 = prompt + output + ids(200, 3)
    req = d.admit_req("turn2", prompt2, "s")
    assert torch.equal(req.prefix_indices, old_kv), "the turn must reuse the slot's KV"
    # While the turn runs its slot is protected, not held (nor reclaimable).
    assert d.cache.slot_in_use("s")
    assert d.cache.session_held_size() == 0 and d.cache.reclaimable_size() == 0
    assert d.cache.protected_size() == pages(14, ps)
    assert d.pool.available_size() == ROWS - 2
    d.assert_accounted(req)
    d.decode(req, 3)
    new_row = req.req_pool_idx
    d.finish(req, prompt2 + ids(300, 4), LENGTH)
    slot = d.cache.slots["s"]
    assert slot.req_pool_idx == new_row != old_row and not slot.in_use
    assert slot.token_ids == (prompt2 + ids(300, 4))[: len(prompt2) + 3]
    assert d.pool.available_size() == ROWS - 1, "the old slot's row is freed"
    assert d.cache.session_held_size() == pages(len(prompt2) + 3, ps)
    assert d.cache.protected_size() == 0
    assert d.allocator.available_size() == KV_TOKENS - pages(len(prompt2) + 3, ps)
    d.assert_accounted()


def test_admission_refused_after_matching_keeps_the_slot(d):
    """Abort before running: the turn never gets KV, and the slot stays for the next one."""
    prompt, output = ids(10, 9), ids(100, 4)
    d.turn("s", prompt, output)
    held, available = d.cache.session_held_size(), d.allocator.available_size()
    req = Req("refused", streaming_session_id="s")
    match = d.cache.match_req(req, (prompt + output + ids(200, 2))[:-1])
    d.cache.inc_lock_ref(match.last_node)
    d.cache.dec_lock_ref(match.last_node)
    assert not d.cache.slot_in_use("s")
    assert d.cache.session_held_size() == held and d.allocator.available_size() == available
    again = d.admit_req("next", prompt + output + ids(300, 2), "s")
    assert len(again.prefix_indices) == len(prompt) + len(output) - 1


@pytest.mark.parametrize("reason", [ABORT, None], ids=["abort", "retract"])
def test_first_turn_abort_frees_exactly_its_kv(d, reason):
    available, rows = d.allocator.available_size(), d.pool.available_size()
    req = d.admit_req("first", ids(10, 11), "s")
    d.decode(req, 6)
    d.finish(req, ids(10, 11) + ids(100, 7), reason)
    assert d.allocator.available_size() == available
    assert d.pool.available_size() == rows
    assert "s" not in d.cache.slots and d.cache.session_held_size() == 0
    assert req.req_pool_idx is None and req.last_node is None
    d.assert_accounted()


@pytest.mark.parametrize("reason", [ABORT, None], ids=["abort", "retract"])
def test_later_turn_abort_frees_the_slot_kv_and_both_rows(d, reason):
    available = d.allocator.available_size()
    prompt, output = ids(10, 10), ids(100, 5)
    d.turn("s", prompt, output)
    prompt2 = prompt + output + ids(200, 6)
    req = d.admit_req("turn2", prompt2, "s")
    d.decode(req, 4)
    assert d.pool.available_size() == ROWS - 2
    d.finish(req, prompt2 + ids(300, 5), reason)
    assert d.allocator.available_size() == available
    assert d.pool.available_size() == ROWS
    assert not d.cache.slots and d.cache.session_held_size() == 0
    assert d.cache.protected_size() == 0
    # The next turn has nothing to reuse: it re-prefills the whole history.
    again = d.admit_req("turn3", prompt2 + ids(400, 2), "s")
    assert len(again.prefix_indices) == 0
    d.assert_accounted(again)


def test_unfinished_turn_keeps_its_whole_row_and_shares_nothing(d):
    d.turn("s", ids(10, 8), ids(100, 3))
    prompt2 = ids(10, 8) + ids(100, 3) + ids(200, 5)
    req = d.admit_req("turn2", prompt2, "s")
    available = d.allocator.available_size()
    d.cache.cache_unfinished_req(req, prompt2)
    assert torch.equal(req.prefix_indices, d.row(req)[: len(prompt2)])
    assert d.cache.inner.total_size() == 0 and d.allocator.available_size() == available
    d.assert_accounted(req)


def test_plain_requests_go_to_the_inner_radix_cache(d):
    ps = d.allocator.page_size
    prompt = ids(10, 12)
    d.turn(None, prompt, ids(100, 5))
    assert d.cache.inner.total_size() == (12 + 4) // ps * ps
    plain = Req("plain")
    assert len(d.cache.match_req(plain, prompt + [7]).device_indices) == 12 // ps * ps
    # A first streaming turn on the same ids does not use the tree: its KV is the slot's alone.
    turn = Req("turn", streaming_session_id="s")
    assert len(d.cache.match_req(turn, prompt + [7]).device_indices) == 0


def test_a_slot_that_does_not_prefix_the_turn_is_released_not_reused(d):
    available = d.allocator.available_size()
    d.turn("s", ids(10, 8), ids(100, 3))
    req = Req("diverged", streaming_session_id="s")
    match = d.cache.match_req(req, ids(50, 20))
    assert len(match.device_indices) == 0
    assert "s" not in d.cache.slots and d.allocator.available_size() == available
    assert d.pool.available_size() == ROWS


# ---------------------------------------------------------------------- releasing slots
def test_release_slot_frees_an_idle_slot_and_ignores_unknown_sessions(d):
    available = d.allocator.available_size()
    d.turn("s", ids(10, 10), ids(100, 5))
    d.cache.release_slot("unknown")
    assert d.cache.session_held_rows() == 1
    d.cache.release_slot("s")
    assert d.allocator.available_size() == available and d.pool.available_size() == ROWS
    assert d.cache.session_held_size() == 0 and d.cache.session_held_rows() == 0


def test_evict_takes_the_tree_first_then_idle_slots_least_recently_used(d):
    ps = d.allocator.page_size
    d.turn("old", ids(10, 8), ids(100, 4))
    d.turn("new", ids(20, 8), ids(120, 4))
    d.turn(None, ids(300, 15), ids(400, 2))  # 16 evictable tokens in the tree
    assert d.cache.evictable_size() == 16
    assert d.cache.reclaimable_size() == 16 + 2 * pages(11, ps)
    assert d.cache.evict(ps) == 16  # the tree's single leaf goes whole
    assert set(d.cache.slots) == {"old", "new"}, "the tree must be evicted before any slot"
    assert d.cache.evictable_size() == 0
    freed = d.cache.evict(1)
    assert freed == pages(11, ps)
    assert set(d.cache.slots) == {"new"}, "the least recently used slot goes first"
    d.assert_accounted()


def test_evict_never_releases_a_slot_in_use(d):
    ps = d.allocator.page_size
    d.turn("busy", ids(10, 8), ids(100, 4))
    d.turn("idle", ids(20, 8), ids(120, 4))
    req = d.admit_req("busy-2", ids(10, 8) + ids(100, 4) + ids(200, 3), "busy")
    assert d.cache.reclaimable_size() == pages(11, ps)
    assert d.cache.evict(KV_TOKENS) == pages(11, ps)
    assert set(d.cache.slots) == {"busy"} and d.cache.slot_in_use("busy")
    assert d.cache.reclaimable_size() == 0
    d.assert_accounted(req)
    d.decode(req, 2)
    d.finish(req, ids(10, 8) + ids(100, 4) + ids(200, 3) + ids(300, 3), LENGTH)
    assert not d.cache.slot_in_use("busy") and d.cache.session_held_rows() == 1
    d.assert_accounted()


def test_release_idle_rows_takes_the_least_recently_used_idle_slots(d):
    for name in ("a", "b", "c"):
        d.turn(name, ids(10, 6), ids(100, 2))
    req = d.admit_req("a-2", ids(10, 6) + ids(100, 2) + ids(200, 2), "a")
    assert d.cache.release_idle_rows(1) == 1
    assert set(d.cache.slots) == {"a", "c"}, "b is the least recently used idle slot"
    assert d.cache.release_idle_rows(5) == 1
    assert set(d.cache.slots) == {"a"} and d.cache.slot_in_use("a")
    d.assert_accounted(req)


def test_reset_releases_every_slot_and_the_tree(d):
    d.turn("a", ids(10, 9), ids(100, 3))
    d.turn("b", ids(20, 9), ids(120, 3))
    d.turn(None, ids(300, 12), ids(400, 2))
    d.cache.reset()
    assert not d.cache.slots and d.cache.inner.total_size() == 0
    assert d.allocator.available_size() == KV_TOKENS and d.pool.available_size() == ROWS
    assert d.cache.session_held_size() == 0 == d.cache.reclaimable_size()


def test_held_tokens_are_counted_in_whole_pages():
    d = make_driver(4)
    d.turn("s", ids(10, 5), ids(100, 2))  # KV of 6 tokens: two pages
    assert d.cache.session_held_size() == 8
    assert d.allocator.available_size() == KV_TOKENS - 8
    d.cache.release_slot("s")
    assert d.allocator.available_size() == KV_TOKENS
