"""KV memory: request rows, KV slot allocation, and the prefix cache that decides what KV outlives
its request. This is the package's face: import these names from here."""

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.hicache_host import HostKVPool
from radixserve.mem_cache.hiradix_cache import HiRadixCache, create_hierarchical_cache
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool
from radixserve.mem_cache.session_aware_cache import SessionAwareCache
from radixserve.mem_cache.session_store import SessionStore, create_session_store

__all__ = [
    "BasePrefixCache",
    "ChunkCache",
    "HiRadixCache",
    "HostKVPool",
    "MHATokenToKVPool",
    "MatchResult",
    "RadixCache",
    "ReqToTokenPool",
    "SessionAwareCache",
    "SessionStore",
    "TokenToKVPoolAllocator",
    "create_hierarchical_cache",
    "create_prefix_cache",
    "create_session_store",
]


def create_prefix_cache(
    disable_radix_cache: bool,
    req_to_token_pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    page_size: int,
    *,
    streaming_sessions: bool = False,
    session_store: SessionStore | None = None,
    session_offload_after: float | None = None,
    tree: BasePrefixCache | None = None,
) -> BasePrefixCache:
    """``RadixCache`` by default; ``ChunkCache`` (no sharing) with ``--disable-radix-cache``;
    either composed into a ``SessionAwareCache`` with ``--enable-streaming-session`` (with the
    store its idle sessions go to). ``tree``: a cache built already (the hierarchical cache,
    ``create_hierarchical_cache``) to use instead of a new ``RadixCache``."""
    cache_cls = ChunkCache if disable_radix_cache else RadixCache
    cache = tree if tree is not None else cache_cls(req_to_token_pool, allocator, page_size)
    if not streaming_sessions:
        return cache
    return SessionAwareCache(
        cache, req_to_token_pool, allocator, page_size,
        store=session_store, offload_after=session_offload_after,
    )
