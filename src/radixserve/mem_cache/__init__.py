"""KV memory: request rows, KV slot allocation, and the prefix cache that decides what KV outlives
its request. This is the package's face: import these names from here."""

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool

__all__ = [
    "BasePrefixCache",
    "ChunkCache",
    "MHATokenToKVPool",
    "MatchResult",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "create_prefix_cache",
]


def create_prefix_cache(
    disable_radix_cache: bool,
    req_to_token_pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    page_size: int,
) -> BasePrefixCache:
    """``RadixCache`` by default; ``ChunkCache`` (no sharing) with ``--disable-radix-cache``."""
    cache_cls = ChunkCache if disable_radix_cache else RadixCache
    return cache_cls(req_to_token_pool, allocator, page_size)
