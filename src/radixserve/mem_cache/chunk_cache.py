"""The prefix cache used with ``--disable-radix-cache``: nothing is shared between requests.

It still implements the chunked-prefill half of the contract: between chunks the request keeps its
own KV (``cache_unfinished_req`` only records it as the prefix of the next chunk), and at finish
every slot and the request row go back to the pools.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, CacheableReq, MatchResult


class ChunkCache(BasePrefixCache):
    """A cache that holds nothing: matches are empty, locks are no-ops, sizes are 0."""

    def match_prefix(self, key: list[int]) -> MatchResult:
        empty = torch.empty(0, dtype=torch.int64, device=self.allocator.device)
        return MatchResult(device_indices=empty, last_node=None)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Keeps nothing: reports every token as a duplicate, so the caller keeps (frees) all."""
        return len(key)

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def cache_finished_req(self, req: CacheableReq, token_ids: list[int]) -> None:
        assert req.req_pool_idx is not None, f"request {req.rid} holds no request slot"
        row = req.req_pool_idx
        self.allocator.free(self.req_to_token_pool.req_to_token[row, : len(token_ids)])
        self.req_to_token_pool.free(row)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: CacheableReq, token_ids: list[int]) -> None:
        assert req.req_pool_idx is not None, f"request {req.rid} holds no request slot"
        row = req.req_pool_idx
        req.prefix_indices = self.req_to_token_pool.req_to_token[row, : len(token_ids)].clone()

    def protected_prefix_len(self, req: CacheableReq) -> int:
        """Nothing is shared: a request's whole row is its own."""
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass
