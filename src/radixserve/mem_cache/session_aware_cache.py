"""KV that outlives a turn of a streaming session, composed around the prefix cache.

A streaming session keeps its conversation's KV in a ``SessionSlot`` (a request-pool row plus
the KV slots it points at) instead of the radix tree, so the next turn prefills only its new
tokens. Requests that do not belong to a streaming session go straight to the inner cache.

A turn's life, for session ``s`` (row ``r_old`` held by the slot, ``r`` the turn's own row):

    | event                | KV slots                                  | request rows            |
    |----------------------|-------------------------------------------|-------------------------|
    | match (admission)    | the slot's KV becomes the turn's prefix;  | slot keeps r_old; the   |
    |                      | the slot is marked in use (protected)     | turn gets r             |
    | finish (stop/length) | all of r[:kv_len] becomes the new slot's  | r_old freed; slot = r   |
    | abort or retraction  | all of r[:kv_len] freed (old slot too)    | r_old and r freed; the  |
    |                      |                                           | slot is gone            |

A slot's KV is owned by the slot alone (a streaming turn never shares radix-tree nodes), so
releasing it never touches the tree. The first turn has no slot: it prefills from scratch and its
finish creates one. Idle slots count as ``session_held``; they are released (their session's next
turn re-prefills) when the pool runs short, so sessions never starve other requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, CacheableReq, MatchResult
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class SessionSlot:
    session_id: str
    req_pool_idx: int
    token_ids: list[int]  # tokens whose KV is in req_to_token[req_pool_idx, :len(token_ids)]
    in_use: bool = False
    last_used: int = 0


@dataclass(eq=False)
class SessionNode:
    """The ``last_node`` of a streaming turn: the slot it resumes (``None`` on a first turn)."""

    session_id: str
    slot: SessionSlot | None = field(default=None)


class SessionAwareCache(BasePrefixCache):
    def __init__(
        self,
        inner: BasePrefixCache,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        page_size: int,
    ) -> None:
        super().__init__(req_to_token_pool, allocator, page_size)
        self.inner = inner
        self.slots: dict[str, SessionSlot] = {}
        self._clock = itertools.count()

    # ------------------------------------------------------------------ matching
    def match_prefix(self, key: list[int]) -> MatchResult:
        return self.inner.match_prefix(key)

    def match_req(self, req: CacheableReq, key: list[int]) -> MatchResult:
        session_id = req.streaming_session_id
        if session_id is None:
            return self.inner.match_prefix(key)
        slot = self.slots.get(session_id)
        if slot is None or slot.in_use:
            return MatchResult(_EMPTY, SessionNode(session_id))
        n = len(slot.token_ids)
        if n > len(key) or key[:n] != slot.token_ids:
            # The session's history moved on without this slot (cannot happen for a linear
            # history, but a stale slot must never be reused).
            self.release_slot(session_id)
            return MatchResult(_EMPTY, SessionNode(session_id))
        indices = self.req_to_token_pool.req_to_token[slot.req_pool_idx, :n].clone()
        return MatchResult(indices, SessionNode(session_id, slot))

    def inc_lock_ref(self, node: Any) -> None:
        if isinstance(node, SessionNode):
            if node.slot is not None:
                assert not node.slot.in_use, f"slot of {node.session_id} locked twice"
                node.slot.in_use = True
            return
        self.inner.inc_lock_ref(node)

    def dec_lock_ref(self, node: Any) -> None:
        if isinstance(node, SessionNode):
            if node.slot is not None:
                node.slot.in_use = False
                node.slot.last_used = next(self._clock)
            return
        self.inner.dec_lock_ref(node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        return self.inner.insert(key, value)

    # ------------------------------------------------------------------ request lifecycle
    def cache_finished_req(self, req: CacheableReq, token_ids: list[int]) -> None:
        node = req.last_node
        if not isinstance(node, SessionNode):
            self.inner.cache_finished_req(req, token_ids)
            return
        row = req.req_pool_idx
        assert row is not None, f"{req.rid}: a streaming turn holds a row until it finishes"
        old = node.slot
        reason = req.finished_reason
        if old is not None:
            old.in_use = False
            if self.slots.get(node.session_id) is old:
                del self.slots[node.session_id]
            # The old slot's KV is the prefix of this row: it either moves to the new slot or is
            # freed below with the rest of the row. Only the old row itself is released here.
            self.req_to_token_pool.free(old.req_pool_idx)
        if reason is not None and reason.get("type") != "abort":
            self.slots[node.session_id] = SessionSlot(
                node.session_id, row, list(token_ids), last_used=next(self._clock)
            )
        else:
            # Aborted, or retracted (not finished): the whole conversation KV goes.
            if token_ids:
                self.allocator.free(self.req_to_token_pool.req_to_token[row, : len(token_ids)])
            self.req_to_token_pool.free(row)
        req.req_pool_idx = None
        req.prefix_indices = _EMPTY
        req.last_node = None

    def cache_unfinished_req(self, req: CacheableReq, token_ids: list[int]) -> None:
        if not isinstance(req.last_node, SessionNode):
            self.inner.cache_unfinished_req(req, token_ids)
            return
        # Nothing is shared: the request keeps owning its whole row until it finishes.
        row = req.req_pool_idx
        req.prefix_indices = self.req_to_token_pool.req_to_token[row, : len(token_ids)].clone()

    # ------------------------------------------------------------------ slots
    def release_slot(self, session_id: str) -> None:
        """Free an idle slot's KV and row (close, flush, memory pressure)."""
        slot = self.slots.pop(session_id, None)
        if slot is None:
            return
        assert not slot.in_use, f"slot of {session_id} released while its turn runs"
        if slot.token_ids:
            self.allocator.free(
                self.req_to_token_pool.req_to_token[slot.req_pool_idx, : len(slot.token_ids)]
            )
        self.req_to_token_pool.free(slot.req_pool_idx)

    def slot_in_use(self, session_id: str) -> bool:
        slot = self.slots.get(session_id)
        return slot is not None and slot.in_use

    def _idle_slots_lru(self) -> list[SessionSlot]:
        return sorted((s for s in self.slots.values() if not s.in_use), key=lambda s: s.last_used)

    def release_idle_rows(self, num_rows: int, spare: Container[str | None] = ()) -> int:
        """Release up to ``num_rows`` idle slots, least recently used first.

        Slots of the sessions in ``spare`` (say, those with a turn waiting to reuse its slot)
        go last.
        """
        released = 0
        victims = sorted(self._idle_slots_lru(), key=lambda s: s.session_id in spare)
        for slot in victims[:num_rows]:
            self.release_slot(slot.session_id)
            released += 1
        return released

    def _slot_kv_size(self, slot: SessionSlot) -> int:
        return -(-len(slot.token_ids) // self.page_size) * self.page_size

    # ------------------------------------------------------------------ memory accounting
    def evict(self, num_tokens: int) -> int:
        """The tree first; then idle sessions' slots, least recently used first."""
        freed = self.inner.evict(num_tokens)
        for slot in self._idle_slots_lru():
            if freed >= num_tokens:
                break
            freed += self._slot_kv_size(slot)
            self.release_slot(slot.session_id)
        return freed

    def evictable_size(self) -> int:
        return self.inner.evictable_size()

    def reclaimable_size(self) -> int:
        return self.inner.reclaimable_size() + sum(
            self._slot_kv_size(s) for s in self.slots.values() if not s.in_use
        )

    def protected_size(self) -> int:
        return self.inner.protected_size() + sum(
            self._slot_kv_size(s) for s in self.slots.values() if s.in_use
        )

    def session_held_size(self) -> int:
        return sum(self._slot_kv_size(s) for s in self.slots.values() if not s.in_use)

    def snapshot(self, max_nodes: int) -> dict[str, Any] | None:
        """The inner tree's snapshot, and each slot's held tokens by session."""
        inner = self.inner.snapshot(max_nodes)
        if inner is None:
            return None
        slots = {sid: len(slot.token_ids) for sid, slot in self.slots.items()}
        return {**inner, "session_slots": slots}

    def session_held_rows(self) -> int:
        return len(self.slots)

    def reset(self) -> None:
        for session_id in list(self.slots):
            self.release_slot(session_id)
        self.inner.reset()
