"""A request stand-in and the scheduler's side of the cache protocol, for cache unit tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.finish_reason import FinishReason
from radixserve.mem_cache import BasePrefixCache, ReqToTokenPool, TokenToKVPoolAllocator


@dataclass
class Req:
    """Satisfies ``CacheableReq``; ``kv_len`` counts positions of the row that hold KV."""

    rid: str
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    streaming_session_id: str | None = None
    finished_reason: FinishReason | None = None
    kv_len: int = 0
    all_ids: list[int] = field(default_factory=list)
    lora_namespace: int = 0  # the base model's part of the tree


class Driver:
    """Admits, extends and finishes requests the way the scheduler does."""

    def __init__(
        self, cache: BasePrefixCache, pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator
    ) -> None:
        self.cache, self.pool, self.allocator = cache, pool, allocator

    def admit(self, rid: str, tokens: list[int]) -> Req:
        """Match and lock the cached prefix, take a row, point it at the prefix."""
        match = self.cache.match_prefix(tokens)
        req = Req(rid, prefix_indices=match.device_indices, last_node=match.last_node)
        self.cache.inc_lock_ref(match.last_node)
        req.req_pool_idx = self.pool.alloc()
        assert req.req_pool_idx is not None
        req.kv_len = len(match.device_indices)
        self.row(req)[: req.kv_len] = match.device_indices
        return req

    def extend(self, req: Req, new_len: int) -> None:
        """Allocate KV for positions ``[kv_len, new_len)`` (continuing the last partial page)."""
        last_loc = int(self.row(req)[req.kv_len - 1]) if req.kv_len else -1
        slots = self.allocator.alloc_extend([req.kv_len], [new_len], [last_loc])
        assert slots is not None, "test pool too small"
        self.row(req)[req.kv_len : new_len] = slots
        req.kv_len = new_len

    def row(self, req: Req) -> torch.Tensor:
        assert req.req_pool_idx is not None
        return self.pool.req_to_token[req.req_pool_idx]

    def own_slots(self, req: Req) -> torch.Tensor:
        """KV slots the request owns (past the cache's page-aligned part of its prefix)."""
        ps = self.allocator.page_size
        return self.row(req)[len(req.prefix_indices) // ps * ps : req.kv_len]
