"""The prefix-cache contract shared by ``RadixCache``, ``ChunkCache`` and ``SessionAwareCache``.

A cache sits on top of the ``ReqToTokenPool`` (request row → KV slot indices) and the
``TokenToKVPoolAllocator`` (KV slots) it is constructed with, and decides which KV slots outlive
the request that computed them.

Ownership of KV slots of one request (row ``req_to_token[req.req_pool_idx]``):

    | range                          | owner                                                 |
    |--------------------------------|-------------------------------------------------------|
    | [0, len(req.prefix_indices))   | the cache, pinned by the lock on ``req.last_node``     |
    |                                | (the tail past the page-aligned part, if any, is the   |
    |                                | request's own: see ``cache_unfinished_req``)          |
    | [len(prefix_indices), kv_len)  | the request; handed to the cache or freed at finish    |

All sizes are in tokens (KV slots), never pages.

Streaming sessions (``SessionAwareCache``) compose with this contract rather than beside it: a
session's slot answers ``match_req`` with a row that already holds the prefix, its node locks
like a tree node, and the session-facing methods below have defaults that mean "no sessions
here", so the scheduler and the session controller never ask which cache they hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from radixserve.finish_reason import FinishReason

if TYPE_CHECKING:
    from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
    from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool


@dataclass
class MatchResult:
    """``device_indices``: KV slots of the longest cached prefix (page aligned, int64; a
    session's slot may end inside its own last page).
    ``last_node``: the node to lock to pin exactly that prefix (opaque to callers).
    ``req_pool_idx``: a request row that already holds the prefix and that the request takes
    over when admitted (a streaming session's slot), or ``None``: the request needs a free row."""

    device_indices: torch.Tensor
    last_node: Any
    req_pool_idx: int | None = None


class CacheableReq(Protocol):
    """What a cache reads and writes on a request (``schedule_batch.Req`` satisfies it)."""

    rid: str
    req_pool_idx: int | None
    prefix_indices: torch.Tensor
    last_node: Any
    streaming_session_id: str | None  # set on a streaming session's turn (SessionAwareCache)
    finished_reason: FinishReason | None  # None while the request runs
    all_ids: list[int]  # prompt + output so far
    lora_namespace: int  # 0: the base model; else its LoRA adapter load's (radix_cache.py)


@dataclass(eq=False)
class BasePrefixCache(ABC):
    """The pools every cache is constructed with; a subclass that keeps more state sets it up
    in ``__post_init__`` (calling this one first), so that it need not repeat the signature."""

    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    page_size: int

    def __post_init__(self) -> None:
        if self.page_size != self.allocator.page_size:
            raise ValueError(
                f"page_size {self.page_size} differs from the allocator's "
                f"{self.allocator.page_size}"
            )

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of ``key``, truncated to a multiple of ``page_size``.

        Does not lock: callers lock ``last_node`` with ``inc_lock_ref`` before allocating, so that
        eviction cannot take the matched slots. Refreshes the LRU time of the matched path.
        """

    def match_req(self, req: CacheableReq, key: list[int]) -> MatchResult:
        """The cached prefix to use for ``req`` (whose prompt so far is ``key``).

        Plain caches answer from ``key`` alone; ``SessionAwareCache`` answers a streaming
        session's turn from that session's slot.
        """
        return self.match_prefix(key)

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert ``key`` → KV slots ``value`` (``len(key)`` must be page aligned).

        Returns how many leading tokens were already cached. The caller still owns
        ``value[:returned]`` (duplicates) and must free them; the cache owns the rest.
        """

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Pin ``node`` and its ancestors: locked tokens count as protected, never evicted."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one ``inc_lock_ref``; unlocked tokens become evictable again."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, least recently used first.

        Evicting 0 is a no-op. May free more than asked (whole nodes, whole pages) or fewer when
        not enough is evictable. Returns the number of slots freed.
        """

    @abstractmethod
    def cache_finished_req(self, req: CacheableReq, token_ids: list[int]) -> None:
        """Hand a finished (or retracted) request's KV to the cache and release the request.

        ``token_ids`` are the tokens whose KV is in ``req_to_token[req.req_pool_idx,
        :len(token_ids)]``. The page-aligned part is inserted; duplicate slots and the unaligned
        tail are freed; the lock on ``req.last_node`` is released; the request row is freed and
        ``req.req_pool_idx`` set to ``None``.
        """

    @abstractmethod
    def cache_unfinished_req(self, req: CacheableReq, token_ids: list[int]) -> None:
        """After a prefill chunk: insert the page-aligned part, keep the request running.

        Afterwards ``req.prefix_indices`` covers all of ``token_ids`` (cached part + the
        request's own unaligned tail), ``req.last_node`` is the new locked node, and the request
        row points at the cache's slots for the cached part.
        """

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held by the cache and not locked."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held by the cache and locked by running requests."""

    @abstractmethod
    def reset(self) -> None:
        """Drop everything (used by flush_cache when no request runs)."""

    def reclaimable_size(self) -> int:
        """Tokens ``evict`` could free: evictable tree tokens (plus idle session slots)."""
        return self.evictable_size()

    def protected_prefix_len(self, req: CacheableReq) -> int:
        """Leading tokens of ``req``'s row whose KV the cache owns (pinned by its lock); the
        rest of the row up to its KV length is the request's own. Page aligned."""
        return len(req.prefix_indices) // self.page_size * self.page_size

    def pinned_size(self, nodes: list[Any]) -> int:
        """Tokens that locking every node of ``nodes`` pins (shared ancestors counted once)."""
        return 0

    def releasable_size(self, nodes: list[Any]) -> int:
        """Tokens that would become evictable if one lock on each node of ``nodes`` (a
        node may repeat) were released: those pinned by these locks alone."""
        return 0

    # ------------------------------------------------------------------ streaming sessions
    # Defaults for a cache without streaming sessions; ``SessionAwareCache`` overrides them.

    @property
    def supports_streaming_session(self) -> bool:
        return False

    def release_session(self, session_id: str) -> None:
        """Forget ``session_id``'s KV everywhere (pool and store): the session closed."""
        return None

    def session_held_tokens(self) -> int:
        """KV tokens idle sessions hold outside the tree, in whole pages."""
        return 0

    def session_held_rows(self) -> int:
        """Request rows idle sessions hold."""
        return 0

    def session_protected_tokens(self) -> int:
        """Tree tokens that sessions (not running requests) keep locked."""
        return 0

    def session_offloaded_tokens(self) -> int:
        """KV tokens of sessions that left the pool for the session store."""
        return 0

    def evict_session_rows(self, num_rows: int, spare: Container[str | None] = ()) -> int:
        """Give back up to ``num_rows`` request rows that idle sessions hold (their KV goes
        to the store, or is dropped); sessions in ``spare`` go last. Returns rows freed."""
        return 0

    def load_back(self, reqs: list[Any], max_tokens: int, max_rows: int) -> None:
        """Bring back into the pool what waiting ``reqs`` will match but the pool no longer
        holds (an offloaded session), taking at most ``max_tokens`` KV tokens (free or
        reclaimable) and ``max_rows`` request rows."""
        return None

    def offload_idle_sessions(self) -> None:
        """Move sessions idle for longer than the configured time to the store."""
        return None

    def resume_session(self, session_id: str) -> list[int]:
        """The stored history of ``session_id`` (a session kept across a restart); its KV
        stays in the store until its next turn. ``LookupError`` says why it cannot resume."""
        raise LookupError("resuming a session needs a session store (--session-store DIR)")

    def persist_session(self, session_id: str, history: list[int]) -> None:
        """Write ``session_id`` (its history, and its KV where the pool holds it) to a store
        that outlives the process, so that a restarted server can resume it."""
        return None

    # ------------------------------------------------------------------ lower tiers
    # Defaults for a cache without tiers below the device pool; ``HiRadixCache`` overrides them.

    def tier_figures(self) -> dict[str, int]:
        """Counters of the tiers below the device pool (host, storage), for the memory check
        and ``/metrics``; empty without them."""
        return {}

    def tier_problems(self) -> list[str]:
        """Violations of the lower tiers' invariants (checked with the device pool's)."""
        return []

    def snapshot(self, max_nodes: int) -> dict[str, Any] | None:
        """For the inspector page: the tree's nodes (at most ``max_nodes``, breadth first) and
        its hit and eviction counters; ``None`` for a cache without a tree."""
        return None
