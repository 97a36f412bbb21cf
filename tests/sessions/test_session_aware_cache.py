"""SessionAwareCache with real pools: a streaming session's slot across turns, the first turn
through the radix tree, retraction, aborts, memory pressure and the memory invariant.

Turns are driven the way the scheduler does (``PrefillAdder`` matches and locks and takes the
slot's row when the match offers one, ``prepare_for_extend`` allocates, the output processor
calls ``cache_unfinished_req`` after the prefill and ``cache_finished_req`` at the end). After
each step the pages are checked (every page free or owned by exactly one holder) and so is the
scheduler's own invariant check (``MemoryChecker``) on the same pools.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.finish_reason import FinishAbort, FinishLength, FinishReason
from radixserve.managers.scheduler.memory_check import MemoryChecker
from radixserve.mem_cache import (
    ChunkCache,
    RadixCache,
    ReqToTokenPool,
    SessionAwareCache,
    TokenToKVPoolAllocator,
)
from radixserve.mem_cache.session_aware_cache import SessionNode
from tests.mem_cache.asserters import assert_pages_accounted, tree_values
from tests.mem_cache.req_driver import Driver, Req

ROWS = 6
KV_TOKENS = 256
LENGTH = FinishLength(length=4)
ABORT = FinishAbort(message="aborted by request")


class SessionDriver(Driver):
    """Admits, decodes, finishes and retracts requests (streaming turns or plain ones)."""

    cache: SessionAwareCache
    matched: torch.Tensor  # the prefix the last ``admit_req`` matched

    def admit_req(self, rid: str, prompt: list[int], session_id: str | None = None,
                  namespace: int = 0) -> Req:
        """Match and lock; take the slot's row or a free one; prefill ``prompt``; hand the
        prefill to the cache as the output processor does. ``namespace``: the LoRA adapter
        load the request runs under (0: the base model)."""
        req = Req(rid, streaming_session_id=session_id, lora_namespace=namespace)
        match = self.cache.match_req(req, prompt[:-1])
        self.cache.inc_lock_ref(match.last_node)
        req.prefix_indices, req.last_node = match.device_indices, match.last_node
        self.matched = match.device_indices
        req.req_pool_idx = match.req_pool_idx
        if req.req_pool_idx is None:
            req.req_pool_idx = self.pool.alloc()
            assert req.req_pool_idx is not None, "test pool too small"
        req.kv_len = len(match.device_indices)
        self.row(req)[: req.kv_len] = match.device_indices
        self.extend(req, len(prompt))
        self.cache.cache_unfinished_req(req, prompt)
        return req

    def decode(self, req: Req, num_tokens: int) -> None:
        """KV of ``num_tokens`` more sampled tokens (the newest token's KV comes one step later)."""
        self.extend(req, req.kv_len + num_tokens)

    def finish(self, req: Req, all_ids: list[int], reason: FinishReason | None) -> None:
        """``reason`` None is a retraction: the request gives its KV up without finishing."""
        req.finished_reason, req.all_ids = reason, list(all_ids)
        self.cache.cache_finished_req(req, all_ids[: req.kv_len])

    def turn(
        self, session_id: str | None, prompt: list[int], output: list[int],
        reason: FinishReason | None = LENGTH, namespace: int = 0,
    ) -> Req:
        """A whole request: prefill, decode ``output`` (all but its last token get KV), finish."""
        req = self.admit_req(f"{session_id}-{len(prompt)}", prompt, session_id, namespace)
        self.decode(req, len(output) - 1)
        self.finish(req, prompt + output, reason)
        return req

    def slot_kv(self, session_id: str) -> torch.Tensor:
        slot = self.cache.slots[session_id]
        return self.pool.req_to_token[slot.req_pool_idx, : len(slot.token_ids)]

    def assert_accounted(self, *running: Req) -> None:
        """Pages are free, in the tree, a slot's own, or a running request's own: exactly one.
        The scheduler's invariant check agrees."""
        cache = self.cache
        held = [self.slot_kv(s)[slot.protected_len:]
                for s, slot in cache.slots.items() if not slot.in_use]
        held += [self.row(r)[cache.protected_prefix_len(r) : r.kv_len] for r in running]
        tree = tree_values(cache.inner) if isinstance(cache.inner, RadixCache) else []
        assert_pages_accounted(self.allocator, [*tree, *held])
        record = MemoryChecker(cache, self.allocator, self.pool, KV_TOKENS).check(running)
        assert record["ok"], record


def make_driver(page_size: int, inner_cls: type = RadixCache) -> SessionDriver:
    pool = ReqToTokenPool(size=ROWS, max_context_len=128, device="cpu")
    allocator = TokenToKVPoolAllocator(KV_TOKENS, page_size, "cpu")
    inner = inner_cls(pool, allocator, page_size)
    return SessionDriver(SessionAwareCache(inner, pool, allocator, page_size), pool, allocator)


def pages(n: int, page_size: int) -> int:
    """Tokens the allocator hands out for ``n`` tokens."""
    return -(-n // page_size) * page_size


def aligned(n: int, page_size: int) -> int:
    return n // page_size * page_size


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture(params=[1, 4], ids=["page1", "page4"])
def d(request) -> SessionDriver:
    return make_driver(request.param)


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_TEST_STRICT", "1")


# ---------------------------------------------------------------------- the first turn
def test_first_turn_goes_through_the_tree_and_the_session_keeps_its_prefix_locked(d):
    ps = d.allocator.page_size
    prompt, output = ids(10, 10), ids(100, 5)
    req = d.admit_req("t1", prompt, "s")
    assert not isinstance(req.last_node, SessionNode), "a first turn is matched by the tree"
    # Its prompt entered the tree by the unfinished-request path, locked by the turn.
    assert d.cache.inner.total_size() == aligned(10, ps) == d.cache.protected_size()
    d.assert_accounted(req)
    d.decode(req, 4)
    d.finish(req, prompt + output, LENGTH)
    slot = d.cache.slots["s"]
    assert slot.token_ids == (prompt + output)[:14] and slot.history == prompt + output
    assert slot.protected_len == aligned(10, ps) and not slot.in_use
    # The prefix stays protected, now by the session; the slot holds only what is past it.
    assert d.cache.protected_size() == aligned(10, ps) == d.cache.session_protected_tokens()
    assert d.cache.evictable_size() == 0
    assert d.cache.session_held_tokens() == pages(14, ps) - aligned(10, ps)
    assert d.cache.session_held_rows() == 1 and d.pool.available_size() == ROWS - 1
    assert d.allocator.available_size() == KV_TOKENS - pages(14, ps)
    d.assert_accounted()


def test_sessions_sharing_a_system_prompt_compute_it_once(d):
    ps = d.allocator.page_size
    system = ids(10, 12)
    d.turn("a", system + ids(50, 3), ids(100, 4))
    shared = d.slot_kv("a")[:12].clone()
    match = d.cache.match_req(Req("probe", streaming_session_id="b"), system + ids(60, 2))
    assert torch.equal(match.device_indices, shared), "b's first turn reuses a's prefix"
    req = d.admit_req("b1", system + ids(60, 3), "b")
    assert torch.equal(req.prefix_indices[:12], shared)
    d.decode(req, 2)
    d.finish(req, system + ids(60, 3) + ids(120, 3), LENGTH)
    # Both sessions lock the shared prefix; it is protected once.
    assert d.cache.session_protected_tokens() == d.cache.protected_size()
    assert d.cache.protected_size() == aligned(15, ps) + aligned(15, ps) - 12
    d.assert_accounted()
    d.cache.release_session("a")
    assert d.cache.protected_size() == aligned(15, ps) == d.cache.session_protected_tokens()
    assert torch.equal(d.slot_kv("b")[:12], shared)
    d.assert_accounted()


def test_first_turn_abort_goes_to_the_tree_like_any_request(d):
    ps = d.allocator.page_size
    req = d.admit_req("first", ids(10, 11), "s")
    d.decode(req, 6)
    d.finish(req, ids(10, 11) + ids(100, 7), ABORT)
    assert "s" not in d.cache.slots and d.cache.session_held_tokens() == 0
    assert d.cache.evictable_size() == aligned(17, ps) and d.cache.protected_size() == 0
    assert d.pool.available_size() == ROWS
    assert req.req_pool_idx is None
    d.assert_accounted()


def test_a_turn_alone_works_over_a_chunk_cache_too():
    d = make_driver(4, ChunkCache)
    d.turn("s", ids(10, 9), ids(100, 3))
    slot = d.cache.slots["s"]
    assert slot.protected_len == 0 and slot.tree_node is None
    assert d.cache.session_held_tokens() == pages(11, 4)
    req = d.admit_req("t2", ids(10, 9) + ids(100, 3) + ids(200, 2), "s")
    assert len(d.matched) == 11 and req.req_pool_idx == slot.req_pool_idx
    d.assert_accounted(req)


# ---------------------------------------------------------------------- later turns
def test_next_turn_takes_the_slot_row_over_and_never_touches_the_tree(d):
    ps = d.allocator.page_size
    prompt, output = ids(10, 10), ids(100, 5)
    d.turn("s", prompt, output)
    tree_size = d.cache.inner.total_size()
    row, kv = d.cache.slots["s"].req_pool_idx, d.slot_kv("s").clone()
    prompt2 = prompt + output + ids(200, 3)
    req = d.admit_req("t2", prompt2, "s")
    assert req.req_pool_idx == row and torch.equal(d.matched, kv)
    assert d.pool.available_size() == ROWS - 1, "the turn needs no row of its own"
    # While the turn runs its slot is neither held nor reclaimable: the turn owns the row.
    assert d.cache.slots["s"].in_use
    assert d.cache.session_held_tokens() == 0 and d.cache.session_held_rows() == 0
    assert d.cache.reclaimable_size() == 0
    d.assert_accounted(req)
    d.decode(req, 3)
    out2 = ids(300, 4)
    d.finish(req, prompt2 + out2, LENGTH)
    slot = d.cache.slots["s"]
    assert slot.req_pool_idx == row and not slot.in_use
    assert slot.token_ids == (prompt2 + out2)[: len(prompt2) + 3]
    assert slot.history == prompt2 + out2
    assert d.cache.inner.total_size() == tree_size, "later turns never touch the tree"
    assert d.cache.session_held_tokens() == pages(len(prompt2) + 3, ps) - aligned(10, ps)
    d.assert_accounted()


def test_admission_refused_after_matching_keeps_the_slot(d):
    """Abort before running: the turn never gets KV, and the slot stays for the next one."""
    prompt, output = ids(10, 9), ids(100, 4)
    d.turn("s", prompt, output)
    held, available = d.cache.session_held_tokens(), d.allocator.available_size()
    req = Req("refused", streaming_session_id="s")
    match = d.cache.match_req(req, (prompt + output + ids(200, 2))[:-1])
    d.cache.inc_lock_ref(match.last_node)
    d.cache.dec_lock_ref(match.last_node)
    assert not d.cache.slots["s"].in_use
    assert d.cache.session_held_tokens() == held and d.allocator.available_size() == available
    again = d.admit_req("next", prompt + output + ids(300, 2), "s")
    assert len(d.matched) == len(prompt) + len(output) - 1
    d.assert_accounted(again)


def test_later_turn_abort_releases_the_slot_and_its_lock_on_the_tree(d):
    ps = d.allocator.page_size
    prompt, output = ids(10, 10), ids(100, 5)
    d.turn("s", prompt, output)
    prompt2 = prompt + output + ids(200, 6)
    req = d.admit_req("turn2", prompt2, "s")
    d.decode(req, 4)
    d.finish(req, prompt2 + ids(300, 5), ABORT)
    assert not d.cache.slots and d.pool.available_size() == ROWS
    assert d.cache.session_held_tokens() == 0 and d.cache.protected_size() == 0
    # The first prompt is still in the tree, evictable now; nothing else survived.
    assert d.cache.evictable_size() == aligned(10, ps)
    assert d.allocator.available_size() == KV_TOKENS - aligned(10, ps)
    d.assert_accounted()
    # The next turn re-prefills the history, through the tree again.
    again = d.admit_req("turn3", prompt2 + ids(400, 2), "s")
    assert len(d.matched) == aligned(10, ps)
    assert not isinstance(again.last_node, SessionNode)
    d.assert_accounted(again)


# ---------------------------------------------------------------------- retraction
def test_retraction_keeps_the_slot_and_the_retry_resumes_it_whole(d):
    ps = d.allocator.page_size
    prompt, output = ids(10, 10), ids(100, 5)
    d.turn("s", prompt, output)
    prompt2 = prompt + output + ids(200, 6)
    req = d.admit_req("t2", prompt2, "s")
    d.decode(req, 5)
    all_ids = prompt2 + ids(300, 6)  # six tokens sampled, the KV of five written
    available, rows = d.allocator.available_size(), d.pool.available_size()
    d.finish(req, all_ids, None)
    slot = d.cache.slots["s"]
    assert slot.token_ids == all_ids[:26] and slot.history == prompt + output
    assert d.allocator.available_size() == available and d.pool.available_size() == rows
    assert d.cache.session_held_tokens() == pages(26, ps) - aligned(10, ps)
    # Memory pressure may take it all: its own KV, then its prefix in the tree.
    assert d.cache.reclaimable_size() == d.cache.session_held_tokens() + aligned(10, ps)
    d.assert_accounted()
    # The retried request (same ids: its output so far is kept) computes only its last token.
    retry = d.admit_req("t2", all_ids, "s")
    assert len(d.matched) == 26 and retry.req_pool_idx == slot.req_pool_idx
    assert d.allocator.available_size() == available - (pages(27, ps) - pages(26, ps))
    d.assert_accounted(retry)


def test_a_turn_frees_the_slot_tail_its_prompt_does_not_share_in_whole_pages(d):
    """A retracted turn whose retry was aborted before running leaves its KV in the slot; the
    next turn keeps the history's part and frees the rest."""
    ps = d.allocator.page_size
    prompt, output = ids(10, 10), ids(100, 5)
    history = prompt + output
    d.turn("s", prompt, output)
    req = d.admit_req("t2", history + ids(200, 6), "s")
    d.decode(req, 5)
    d.finish(req, history + ids(200, 6) + ids(300, 6), None)
    available = d.allocator.available_size()
    nxt = d.admit_req("t3", history + ids(400, 3), "s")
    # The common prefix is the history (15 tokens); pages past it went back, then the turn
    # allocated its own three new tokens.
    assert len(d.matched) == 15
    freed = pages(26, ps) - pages(15, ps)
    assert d.allocator.available_size() == available + freed - (pages(18, ps) - pages(15, ps))
    d.assert_accounted(nxt)


def test_a_slot_that_does_not_lead_the_prompt_is_released_not_reused(d):
    """A retracted first turn whose retry was aborted, then another prompt."""
    req = d.admit_req("t1", ids(10, 8), "s")
    d.decode(req, 2)
    d.finish(req, ids(10, 8) + ids(100, 3), None)
    assert d.cache.slots["s"].history == []
    other = d.admit_req("t1b", ids(50, 20), "s")
    assert len(d.matched) == 0 and not isinstance(other.last_node, SessionNode)
    assert "s" not in d.cache.slots
    d.assert_accounted(other)


def test_a_turn_under_another_lora_adapter_recomputes_instead_of_reusing_the_slot(d):
    """The slot's KV was computed under adapter load 1; a turn under load 2 (another adapter,
    or the same name reloaded) or the base model matches nothing and the slot goes."""
    prompt, output = ids(10, 10), ids(100, 5)
    d.turn("s", prompt, output, namespace=1)
    assert d.cache.slots["s"].lora_namespace == 1
    turn = prompt + output + ids(200, 3)
    for namespace in (2, 0):
        req = d.admit_req(f"t{namespace}", turn, "s", namespace)
        assert len(d.matched) == 0 and not isinstance(req.last_node, SessionNode)
        assert "s" not in d.cache.slots
        d.assert_accounted(req)
        d.decode(req, 2)
        d.finish(req, turn + ids(300, 3), LENGTH)
        assert d.cache.slots["s"].lora_namespace == namespace
        d.assert_accounted()
    same = d.admit_req("t3", turn + ids(300, 3) + [7], "s", 0)
    assert len(d.matched) == len(turn) + 2 and isinstance(same.last_node, SessionNode)


# ---------------------------------------------------------------------- memory pressure
def test_release_session_frees_an_idle_slot_and_ignores_unknown_sessions(d):
    ps = d.allocator.page_size
    d.turn("s", ids(10, 10), ids(100, 5))
    d.cache.release_session("unknown")
    assert d.cache.session_held_rows() == 1
    d.cache.release_session("s")
    assert d.pool.available_size() == ROWS and d.cache.session_held_tokens() == 0
    assert d.cache.protected_size() == 0 and d.cache.evictable_size() == aligned(10, ps)
    d.assert_accounted()


def test_evict_takes_the_tree_first_then_idle_slots_least_recently_used(d):
    ps = d.allocator.page_size
    d.turn("old", ids(10, 8), ids(100, 4))
    d.turn("new", ids(20, 8), ids(120, 4))
    d.turn(None, ids(300, 15), ids(400, 2))  # 16 evictable tokens in the tree
    own = pages(11, ps) - 8
    assert d.cache.evictable_size() == 16
    # Offloading a session also frees the prefix it alone keeps locked in the tree.
    assert d.cache.reclaimable_size() == 16 + 2 * (own + 8)
    assert d.cache.evict(16) == 16
    assert set(d.cache.slots) == {"old", "new"}, "the tree must be evicted before any slot"
    assert d.cache.evict(1) == own
    assert set(d.cache.slots) == {"new"}, "the least recently used slot goes first"
    # The dropped session's tree prefix is no longer locked: evictable like any entry.
    assert d.cache.evictable_size() == 8 and d.cache.reclaimable_size() == 8 + own + 8
    # The tree's 8, then the other slot, then the prefix that slot no longer locks.
    assert d.cache.evict(8 + own + 1) == 8 + own + 8
    assert not d.cache.slots and d.cache.inner.total_size() == 0
    d.assert_accounted()


def test_evict_never_takes_a_slot_in_use(d):
    ps = d.allocator.page_size
    d.turn("busy", ids(10, 8), ids(100, 4))
    d.turn("idle", ids(20, 8), ids(120, 4))
    req = d.admit_req("busy-2", ids(10, 8) + ids(100, 4) + ids(200, 3), "busy")
    own = pages(11, ps) - 8
    assert d.cache.reclaimable_size() == own + 8
    assert d.cache.evict(KV_TOKENS) == own + 8  # idle's slot, then its unlocked prefix
    assert set(d.cache.slots) == {"busy"} and d.cache.slots["busy"].in_use
    d.assert_accounted(req)
    d.decode(req, 2)
    d.finish(req, ids(10, 8) + ids(100, 4) + ids(200, 3) + ids(300, 3), LENGTH)
    assert d.cache.session_held_rows() == 1
    d.assert_accounted()


def test_evict_session_rows_takes_idle_slots_least_recently_used_sparing_some(d):
    for name in ("a", "b", "c"):
        d.turn(name, ids(10, 6), ids(100, 2))
    req = d.admit_req("a-2", ids(10, 6) + ids(100, 2) + ids(200, 2), "a")
    assert d.cache.evict_session_rows(1, spare={"b"}) == 1
    assert set(d.cache.slots) == {"a", "b"}, "b is spared: c goes"
    assert d.cache.evict_session_rows(5) == 1
    assert set(d.cache.slots) == {"a"} and d.cache.slots["a"].in_use
    d.assert_accounted(req)


def test_reset_releases_every_slot_and_the_tree(d):
    d.turn("a", ids(10, 9), ids(100, 3))
    d.turn("b", ids(20, 9), ids(120, 3))
    d.turn(None, ids(300, 12), ids(400, 2))
    d.cache.reset()
    assert not d.cache.slots and d.cache.inner.total_size() == 0
    assert d.allocator.available_size() == KV_TOKENS and d.pool.available_size() == ROWS
    assert d.cache.session_held_tokens() == 0 == d.cache.reclaimable_size()


def test_held_tokens_are_counted_in_whole_pages_past_the_protected_prefix():
    d = make_driver(4)
    d.turn("s", ids(10, 5), ids(100, 3))  # KV of 7 tokens: 4 in the tree, 3 in the slot's page
    assert d.cache.protected_size() == 4 and d.cache.session_held_tokens() == 4
    assert d.allocator.available_size() == KV_TOKENS - 8
    d.cache.release_session("s")
    assert d.allocator.available_size() == KV_TOKENS - 4  # the prompt's page stays cached
    d.assert_accounted()


def test_the_invariant_check_catches_a_leaked_page(d):
    d.turn("s", ids(10, 10), ids(100, 5))
    leaked = d.allocator.alloc_extend([0], [d.allocator.page_size], [-1])
    assert leaked is not None
    with pytest.raises(RuntimeError, match="memory leak detected"):
        MemoryChecker(d.cache, d.allocator, d.pool, KV_TOKENS).check([])


# ---------------------------------------------------------------------- one cache contract
def test_hooks_answer_not_mine_for_everything_but_a_session_turn(d):
    plain = d.admit_req("plain", ids(10, 9))
    assert d.cache.try_match_prefix(plain, ids(10, 8)) is None
    assert d.cache.try_inc_lock_ref(plain.last_node) is False
    assert d.cache.try_dec_lock_ref(plain.last_node) is False
    assert d.cache.try_cache_unfinished_req(plain, ids(10, 9)) is False
    first = Req("first", streaming_session_id="s")
    assert d.cache.try_match_prefix(first, ids(10, 8)) is None, "no slot yet: the tree answers"
    d.decode(plain, 1)
    d.finish(plain, ids(10, 9) + ids(100, 2), LENGTH)
    d.assert_accounted()


@pytest.mark.parametrize("cache_cls", [RadixCache, ChunkCache])
def test_a_cache_without_sessions_answers_the_session_methods_with_defaults(cache_cls):
    pool = ReqToTokenPool(size=ROWS, max_context_len=128, device="cpu")
    cache = cache_cls(pool, TokenToKVPoolAllocator(KV_TOKENS, 1, "cpu"), 1)
    assert not cache.supports_streaming_session
    cache.release_session("any")
    cache.offload_idle_sessions()
    cache.load_back([], KV_TOKENS, ROWS)
    cache.persist_session("any", [1, 2])
    assert cache.session_held_tokens() == cache.session_held_rows() == 0
    assert cache.session_protected_tokens() == cache.session_offloaded_tokens() == 0
    assert cache.evict_session_rows(3) == 0
    with pytest.raises(LookupError, match="--session-store"):
        cache.resume_session("any")
