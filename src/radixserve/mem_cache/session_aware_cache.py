"""KV that outlives a turn of a streaming session, composed around the prefix cache.

A streaming session keeps its conversation's KV in a ``SessionSlot``: a request row and the KV
slots it points at. The session's next turn takes that row over, so it prefills only its new
tokens. The cache composes with the prefix cache through ``try_*`` hooks: each one handles what
belongs to a session and answers "not mine" (``None`` / ``False``) for everything else, which
then falls through to the inner cache. Nothing outside this module touches a slot.

A session's life (row ``r``; ``P`` the page-aligned part of its first prompt the tree holds):

    | event                         | KV and request rows                                     |
    |-------------------------------|---------------------------------------------------------|
    | first turn admitted           | matched in the tree like any request (a system prompt   |
    |                               | shared by many sessions is computed once); its prompt   |
    |                               | enters the tree by the normal unfinished-request path   |
    | first turn finishes           | the slot takes ``r``: [0, P) stays the tree's, locked   |
    |                               | by the session (protected); [P, kv_len) is the slot's   |
    | next turn matched and locked  | the turn takes ``r`` over; the slot's KV past the common |
    |                               | prefix with the turn's prompt is freed (whole pages)    |
    | turn finishes, or retracted   | the slot keeps ``r`` and all of its KV (a retracted     |
    |                               | turn's too: its retry re-matches the slot)              |
    | turn aborted                  | the slot is released: tree lock undone, [P, kv_len)     |
    |                               | and ``r`` freed; the next turn re-prefills the history  |
    | idle while the pool runs      | offloaded: its KV goes to the session store (dropped    |
    | short, or idle too long       | without one), the lock is undone, [P, kv_len) and ``r`` |
    |                               | are freed                                               |
    | a turn of an offloaded        | ``load_back`` copies the KV into fresh slots and a row: |
    | session waits                 | a slot again, with no tree prefix (P = 0)               |
    | close                         | released, and forgotten by the store                    |

Later turns never touch the tree. An idle slot's KV past ``P`` counts as ``session_held`` (whole
pages); ``P`` counts as protected, locked by the session until it lets go of its slot.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.finish_reason import FinishAbort
from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, CacheableReq, MatchResult
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool
from radixserve.mem_cache.session_store import SessionStore

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.int64)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


@dataclass(eq=False)
class SessionSlot:
    session_id: str
    req_pool_idx: int
    token_ids: list[int]  # tokens whose KV is in req_to_token[req_pool_idx, :len(token_ids)]
    history: list[int]  # what the session's next turn continues: its last finished turn
    tree_node: Any = None  # the inner cache's node the session keeps locked (pins [0, P))
    protected_len: int = 0  # P: leading tokens whose KV the inner cache owns
    in_use: bool = False  # a turn holds the row
    lru: int = 0  # least recently used slots are offloaded first
    idle_since: float = 0.0
    stored: bool = False  # the store holds ``history`` and the KV of a prefix of token_ids
    # The LoRA adapter load the KV was computed under (``req.lora_namespace``; 0: the base
    # model): a turn under another one must not reuse it.
    lora_namespace: int = 0


@dataclass(eq=False)
class SessionNode:
    """The ``last_node`` of a turn that resumes ``slot``: its first ``prefix_len`` tokens."""

    slot: SessionSlot
    prefix_len: int = field(default=0)


class SessionAwareCache(BasePrefixCache):
    def __init__(
        self,
        inner: BasePrefixCache,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        page_size: int,
        store: SessionStore | None = None,
        offload_after: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(req_to_token_pool, allocator, page_size)
        self.inner = inner
        self.store = store
        self.offload_after = offload_after
        self.clock = clock
        self.slots: dict[str, SessionSlot] = {}
        self._lru = itertools.count()

    @property
    def supports_streaming_session(self) -> bool:
        return True

    # ------------------------------------------------------------------ try_* hooks
    def try_match_prefix(self, req: CacheableReq, key: list[int]) -> MatchResult | None:
        """The part of ``key`` that ``req``'s session slot holds, or None (not a session turn,
        or its session has no slot: the tree answers)."""
        session_id = req.streaming_session_id
        slot = self.slots.get(session_id) if session_id is not None else None
        if slot is None or slot.in_use:
            return None
        if slot.lora_namespace != req.lora_namespace:
            # A turn under another LoRA adapter (or the same name reloaded): the slot's KV is
            # another model's. The turn recomputes its history through the tree, which keeps
            # adapters apart; the slot goes.
            self._release(slot)
            self._forget_stored(slot.session_id)
            return None
        n = _common_prefix_len(slot.token_ids, key)
        if n == 0 or n < slot.protected_len:
            # The slot does not lead this prompt (a retracted first turn whose retry was
            # aborted, followed by another prompt): it can never be reused.
            self._release(slot)
            self._forget_stored(slot.session_id)
            return None
        indices = self.req_to_token_pool.req_to_token[slot.req_pool_idx, :n].clone()
        return MatchResult(indices, SessionNode(slot, n), req_pool_idx=slot.req_pool_idx)

    def try_inc_lock_ref(self, node: Any) -> bool:
        """Lock a slot for the turn that matched it: the slot's KV past the matched prefix
        (a retracted attempt's tail, or a stale partial output) is freed, whole pages only."""
        if not isinstance(node, SessionNode):
            return False
        slot = node.slot
        assert not slot.in_use, f"slot of {slot.session_id} locked twice"
        self._truncate(slot, node.prefix_len)
        slot.in_use = True
        return True

    def try_dec_lock_ref(self, node: Any) -> bool:
        if not isinstance(node, SessionNode):
            return False
        self._mark_idle(node.slot)
        return True

    def try_cache_finished_req(self, req: CacheableReq, token_ids: list[int]) -> bool:
        """A turn gives its row back to its session (finished or retracted), or releases the
        slot (aborted). An aborted first turn is not the session's: it goes to the tree."""
        session_id = req.streaming_session_id
        if session_id is None:
            return False
        node = req.last_node
        slot = node.slot if isinstance(node, SessionNode) else None
        if isinstance(req.finished_reason, FinishAbort):
            if slot is None:
                return False
            self._release(slot, kv_len=len(token_ids))
            _detach(req)
            return True
        if slot is None:
            # The first turn: the lock on its tree prefix passes to the session.
            stale = self.slots.get(session_id)
            if stale is not None:
                self._release(stale)
            assert req.req_pool_idx is not None, f"{req.rid}: a turn holds a row until it ends"
            slot = SessionSlot(
                session_id, req.req_pool_idx, [], [], tree_node=node,
                protected_len=self.inner.protected_prefix_len(req),
                lora_namespace=req.lora_namespace,
            )
            self.slots[session_id] = slot
        slot.token_ids = list(token_ids)
        slot.stored = False  # what the store holds (if anything) is an earlier state
        if req.finished_reason is not None:  # finished (a retraction keeps the history)
            slot.history = list(req.all_ids)
            self._forget_stored(session_id)
        self._mark_idle(slot)
        _detach(req)
        return True

    def try_cache_unfinished_req(self, req: CacheableReq, token_ids: list[int]) -> bool:
        """A resumed turn keeps its whole row to itself until it finishes; a first turn's
        prompt goes to the tree (False)."""
        if not isinstance(req.last_node, SessionNode):
            return False
        row = req.req_pool_idx
        req.prefix_indices = self.req_to_token_pool.req_to_token[row, : len(token_ids)].clone()
        return True

    # ------------------------------------------------------------------ the cache contract
    def match_prefix(self, key: list[int]) -> MatchResult:
        return self.inner.match_prefix(key)

    def match_req(self, req: CacheableReq, key: list[int]) -> MatchResult:
        return self.try_match_prefix(req, key) or self.inner.match_req(req, key)

    def inc_lock_ref(self, node: Any) -> None:
        if not self.try_inc_lock_ref(node):
            self.inner.inc_lock_ref(node)

    def dec_lock_ref(self, node: Any) -> None:
        if not self.try_dec_lock_ref(node):
            self.inner.dec_lock_ref(node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        return self.inner.insert(key, value)

    def cache_finished_req(self, req: CacheableReq, token_ids: list[int]) -> None:
        if not self.try_cache_finished_req(req, token_ids):
            self.inner.cache_finished_req(req, token_ids)

    def cache_unfinished_req(self, req: CacheableReq, token_ids: list[int]) -> None:
        if not self.try_cache_unfinished_req(req, token_ids):
            self.inner.cache_unfinished_req(req, token_ids)

    def protected_prefix_len(self, req: CacheableReq) -> int:
        if isinstance(req.last_node, SessionNode):
            return req.last_node.slot.protected_len
        return self.inner.protected_prefix_len(req)

    def pinned_size(self, nodes: list[Any]) -> int:
        return self.inner.pinned_size(nodes)

    def releasable_size(self, nodes: list[Any]) -> int:
        return self.inner.releasable_size(nodes)

    def evict(self, num_tokens: int) -> int:
        """The tree first; then idle sessions' slots, least recently used first."""
        return self._evict(num_tokens, spare=())

    def reset(self) -> None:
        """Drop every slot (flush_cache, nothing running) and the tree. The store keeps what
        it holds: sessions offloaded there come back from it."""
        for slot in list(self.slots.values()):
            self._release(slot)
        self.inner.reset()

    # ------------------------------------------------------------------ memory accounting
    def evictable_size(self) -> int:
        return self.inner.evictable_size()

    def protected_size(self) -> int:
        return self.inner.protected_size()

    def reclaimable_size(self) -> int:
        """The tree's evictable tokens, idle slots' own KV, and the tree prefixes that only
        idle sessions keep locked (offloading those sessions makes them evictable)."""
        idle = [s for s in self.slots.values() if not s.in_use]
        return (
            self.inner.reclaimable_size()
            + sum(self._own_tokens(s) for s in idle)
            + self.inner.releasable_size([s.tree_node for s in idle if s.tree_node is not None])
        )

    def tier_figures(self) -> dict[str, int]:
        return self.inner.tier_figures()

    def tier_problems(self) -> list[str]:
        return self.inner.tier_problems()

    def session_held_tokens(self) -> int:
        return sum(self._own_tokens(s) for s in self.slots.values() if not s.in_use)

    def snapshot(self, max_nodes: int) -> dict[str, Any] | None:
        """The inner tree's snapshot, and each slot's held tokens by session."""
        inner = self.inner.snapshot(max_nodes)
        if inner is None:
            return None
        slots = {sid: len(slot.token_ids) for sid, slot in self.slots.items()}
        return {**inner, "session_slots": slots}

    def session_held_rows(self) -> int:
        return sum(not s.in_use for s in self.slots.values())

    def session_protected_tokens(self) -> int:
        return self.inner.pinned_size(
            [s.tree_node for s in self.slots.values() if s.tree_node is not None]
        )

    def session_offloaded_tokens(self) -> int:
        if self.store is None:
            return 0
        return sum(e.kv_tokens for sid, e in self.store.entries.items() if sid not in self.slots)

    # ------------------------------------------------------------------ sessions
    def release_session(self, session_id: str) -> None:
        slot = self.slots.get(session_id)
        if slot is not None:
            assert not slot.in_use, f"session {session_id} released while its turn runs"
            self._release(slot)
        self._forget_stored(session_id)

    def evict_session_rows(self, num_rows: int, spare: Container[str | None] = ()) -> int:
        victims = sorted(self._idle_lru(), key=lambda s: s.session_id in spare)[:num_rows]
        for slot in victims:
            self._offload(slot)
        return len(victims)

    def offload_idle_sessions(self) -> None:
        if self.offload_after is None:
            return
        now = self.clock()
        for slot in self._idle_lru():
            if now - slot.idle_since >= self.offload_after:
                self._offload(slot)

    def load_back(self, reqs: list[Any], max_tokens: int, max_rows: int) -> None:
        """Copy offloaded sessions of waiting turns back into the pool, in queue order, while
        the budgets last; other idle sessions may be offloaded to make room. The inner cache
        loads what its lower tiers hold for the other requests (the hierarchical cache)."""
        self.inner.load_back([r for r in reqs if r.streaming_session_id is None], max_tokens,
                             max_rows)
        if self.store is None:
            return
        waiting = {r.streaming_session_id for r in reqs}
        for req in reqs:
            session_id = req.streaming_session_id
            if session_id is None or session_id in self.slots:
                continue
            entry = self.store.get(session_id)
            if entry is None or entry.kv_tokens == 0:
                continue
            need = self._pages(entry.kv_tokens)
            if need > max_tokens or max_rows < 1:
                return
            if not self._load(session_id, entry.token_ids, entry.kv_token_ids, waiting):
                return
            if session_id in self.slots:  # else its payload was refused: it re-prefills
                max_tokens -= need
                max_rows -= 1

    def resume_session(self, session_id: str) -> list[int]:
        if self.store is None or not self.store.survives_restart:
            return super().resume_session(session_id)
        return list(self.store.open(session_id).token_ids)

    def persist_session(self, session_id: str, history: list[int]) -> None:
        if self.store is None or not self.store.survives_restart:
            return
        slot = self.slots.get(session_id)
        if slot is not None:
            if not (slot.stored and slot.history == history):
                slot.history = list(history)
                self._save(slot)
            return
        entry = self.store.get(session_id)
        if entry is None or entry.token_ids != history:
            # Its KV left the pool (an aborted turn): the resumed session re-prefills.
            self.store.save(session_id, history, [], _EMPTY)

    # ------------------------------------------------------------------ helpers
    def _row(self, slot: SessionSlot) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[slot.req_pool_idx]

    def _pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size) * self.page_size

    def _own_tokens(self, slot: SessionSlot) -> int:
        return max(self._pages(len(slot.token_ids)) - slot.protected_len, 0)

    def _idle_lru(self) -> list[SessionSlot]:
        return sorted((s for s in self.slots.values() if not s.in_use), key=lambda s: s.lru)

    def _mark_idle(self, slot: SessionSlot) -> None:
        slot.in_use = False
        slot.lru = next(self._lru)
        slot.idle_since = self.clock()

    def _truncate(self, slot: SessionSlot, n: int) -> None:
        """Keep the KV of the first ``n`` tokens; free the slot's pages past them."""
        end = len(slot.token_ids)
        keep = self._pages(n)
        if end > keep:
            self.allocator.free(self._row(slot)[keep:end])
        slot.token_ids = slot.token_ids[:n]
        entry = self.store.get(slot.session_id) if self.store is not None else None
        if entry is not None and entry.kv_token_ids[:n] != slot.token_ids:
            self._forget_stored(slot.session_id)

    def _release(self, slot: SessionSlot, kv_len: int | None = None) -> None:
        """Give back the slot's lock, its own KV (the first ``kv_len`` positions of its row,
        default its tokens') and its row."""
        if self.slots.get(slot.session_id) is slot:
            del self.slots[slot.session_id]
        if slot.tree_node is not None:
            self.inner.dec_lock_ref(slot.tree_node)
        end = len(slot.token_ids) if kv_len is None else kv_len
        if end > slot.protected_len:
            self.allocator.free(self._row(slot)[slot.protected_len : end])
        self.req_to_token_pool.free(slot.req_pool_idx)

    def _offload(self, slot: SessionSlot) -> None:
        """An idle slot leaves the pool: to the store when there is one, else dropped."""
        assert not slot.in_use, f"slot of {slot.session_id} offloaded while its turn runs"
        if self.store is not None and not slot.stored:
            self._save(slot)
        self._release(slot)

    def _save(self, slot: SessionSlot) -> None:
        """Store the slot's history and KV. KV computed under a LoRA adapter is not stored
        (a namespace names an adapter load of this process only): its history is, and the
        session's next turn re-prefills it."""
        assert self.store is not None
        if slot.lora_namespace:
            slot.stored = self.store.save(slot.session_id, slot.history, [], _EMPTY)
            return
        kv = self._row(slot)[: len(slot.token_ids)]
        slot.stored = self.store.save(slot.session_id, slot.history, slot.token_ids, kv)

    def _forget_stored(self, session_id: str) -> None:
        if self.store is not None:
            self.store.discard(session_id)
        slot = self.slots.get(session_id)
        if slot is not None:
            slot.stored = False

    def _evict(self, num_tokens: int, spare: Container[str | None]) -> int:
        """The tree, then idle slots (their sessions not in ``spare``) least recently used
        first, each followed by the tree again: an offloaded session's prefix is no longer
        locked."""
        freed = self.inner.evict(num_tokens)
        for slot in self._idle_lru():
            if freed >= num_tokens:
                break
            if slot.session_id in spare:
                continue
            freed += self._own_tokens(slot)
            self._offload(slot)
            freed += self.inner.evict(num_tokens - freed)
        return freed

    def _load(
        self, session_id: str, history: list[int], kv_token_ids: list[int],
        spare: Container[str | None],
    ) -> bool:
        """Bring ``session_id``'s stored KV back as an idle slot; False if the pool cannot
        make room. A refused payload leaves the session without a slot (it re-prefills)."""
        kv_tokens = len(kv_token_ids)
        short = self._pages(kv_tokens) - self.allocator.available_size()
        if short > 0:
            self._evict(short, spare)
        if self.req_to_token_pool.available_size() == 0:
            return False
        kv = self.allocator.alloc_extend([0], [kv_tokens], [-1])
        if kv is None:
            return False
        row = self.req_to_token_pool.alloc()
        assert row is not None
        self.req_to_token_pool.req_to_token[row, :kv_tokens] = kv
        assert self.store is not None
        if not self.store.load(session_id, kv):
            self.allocator.free(kv)
            self.req_to_token_pool.free(row)
            return True
        slot = SessionSlot(session_id, row, list(kv_token_ids), list(history), stored=True)
        self._mark_idle(slot)
        self.slots[session_id] = slot
        logger.info("session %r loaded back from the store (%d tokens)", session_id, kv_tokens)
        return True


def _detach(req: CacheableReq) -> None:
    req.req_pool_idx = None
    req.prefix_indices = _EMPTY
    req.last_node = None
