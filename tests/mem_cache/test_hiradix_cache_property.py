"""HiRadixCache against a model of its tiers under random inserts, matches, evictions, loads
back and restarts, on a real (tiny, CPU) KV pool, host pool and storage directory.

Every token's KV is written as a function of its position and its prefix's digest, so a slot
loaded from the wrong place shows. The model is what was inserted: the prefixes of this life
(lost at a restart) and, with write_through and a storage tier, the whole blocks of every life.
After each operation:

- soundness: the device KV of every match is exactly the KV its tokens were computed with;
- completeness: with a host tier that can hold everything inserted, a prefix inserted in this
  life is found whole (device + host); after a restart, its whole storage blocks are;
- accounting: every device page is free or owned once (tree nodes, the held lock), every host
  slot handed out belongs to one node (``tier_problems``), the evictable and protected
  counters equal a recount.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.mem_cache import (
    MHATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    create_hierarchical_cache,
)
from radixserve.mem_cache.hicache_storage import block_tokens_for
from tests.mem_cache.asserters import assert_pages_accounted

DEVICE_TOKENS = 192
LAYERS, HEADS, DIM = 2, 1, 2

_key = st.tuples(st.integers(0, 99), st.integers(0, 160), st.lists(st.integers(0, 2),
                                                                    max_size=90))
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), _key),
        st.tuples(st.just("load"), _key),
        st.tuples(st.just("evict"), st.integers(0, DEVICE_TOKENS)),
        st.tuples(st.just("lock"), _key),
        st.tuples(st.just("restart"), st.just(0)),
    ),
    min_size=5,
    max_size=30,
)


def kv_of(key: list[int]) -> torch.Tensor:
    """``[len(key), 2 * LAYERS, HEADS, DIM]``: the KV each token 'computes' (prefix dependent)."""
    rows = []
    digest = hashlib.sha256()
    for pos, tok in enumerate(key):
        digest.update(tok.to_bytes(2, "little"))
        v = int.from_bytes(digest.digest()[:4], "little") % 100003
        rows.append(torch.full((2 * LAYERS, HEADS, DIM), float(v + pos)))
    return torch.stack(rows) if rows else torch.empty(0, 2 * LAYERS, HEADS, DIM)


class Life:
    """One process's pools and cache over a storage directory that outlives it."""

    def __init__(self, page_size: int, host_tokens: int, policy: str, storage: str | None):
        self.pool = MHATokenToKVPool(DEVICE_TOKENS, page_size, torch.float32, HEADS, DIM,
                                     LAYERS, "cpu")
        self.allocator = TokenToKVPoolAllocator(DEVICE_TOKENS, page_size, "cpu")
        self.cache = create_hierarchical_cache(
            ReqToTokenPool(4, 512, "cpu"), self.allocator, page_size, self.pool,
            host_tokens=host_tokens, write_policy=policy, storage_dir=storage,
            model_path="/nonexistent-model",
        )

    def device_kv(self, slots: torch.Tensor) -> torch.Tensor:
        data = self.pool.read_kv_pages(slots)
        return data.view(torch.float32).view(len(slots), 2 * LAYERS, HEADS, DIM)

    def write(self, slots: torch.Tensor, key: list[int]) -> None:
        kv = kv_of(key)
        self.pool.write_kv_pages(slots, kv.contiguous().view(torch.uint8).view(len(key), -1))


class _Req:
    """What ``load_back`` reads of a waiting request."""

    def __init__(self, key: list[int]) -> None:
        self.all_ids = key + [0]
        self.max_prefix_len = len(key)
        self.lora_namespace = 0
        self.cached_tokens_tiers = None


def make_key(spec, keys: list[list[int]], ps: int) -> list[int]:
    which, keep, suffix = spec
    base = keys[which % len(keys)][:keep] if keys else []
    key = base + suffix
    return key[: len(key) // ps * ps]


def check(life: Life, holders: list[torch.Tensor]) -> None:
    cache = life.cache
    values = [n.value for n in cache._nodes() if n.value is not None]
    assert_pages_accounted(life.allocator, values + holders)
    assert cache.tier_problems() == []
    evictable = sum(len(n.key) for n in cache._nodes() if n.value is not None and not n.lock_ref)
    protected = sum(len(n.key) for n in cache._nodes() if n.value is not None and n.lock_ref)
    assert (cache.evictable_size(), cache.protected_size()) == (evictable, protected)


@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(ops=_ops, page_size=st.sampled_from([1, 4]), big_host=st.booleans(),
       storage=st.booleans())
def test_tiers_match_the_model(tmp_path_factory, policy, ops, page_size, big_host, storage):
    directory = str(tmp_path_factory.mktemp("hicache")) if storage else None
    host_tokens = 4096 if big_host else 64
    life = Life(page_size, host_tokens, policy, directory)
    keys: list[list[int]] = []  # every key inserted, any life
    this_life: list[list[int]] = []
    stored_blocks: list[list[int]] = []  # keys whose whole blocks storage must hold
    lock: tuple[object, torch.Tensor] | None = None
    block = block_tokens_for(page_size)
    for op, arg in ops:
        if op == "insert":
            key = make_key(arg, keys, page_size)
            if not key or len(key) > DEVICE_TOKENS // 2:
                continue
            cache = life.cache
            match = cache.match_prefix(key)
            cache.inc_lock_ref(match.last_node)
            n = len(match.device_indices)
            short = len(key) - n - life.allocator.available_size()
            if short > 0:
                cache.evict(short)
            slots = life.allocator.alloc_extend([0], [len(key) - n], [-1])
            cache.dec_lock_ref(match.last_node)
            if slots is None:
                continue
            life.write(torch.cat((match.device_indices, slots)), key)
            new = cache.insert(key, torch.cat((match.device_indices, slots)))
            assert new >= n
            life.allocator.free(slots[: new - n])
            keys.append(key)
            this_life.append(key)
            if policy == "write_through" and storage:
                stored_blocks.append(key)
        elif op == "load":
            key = make_key(arg, keys, page_size)
            req = _Req(key)
            life.cache.load_back([req], DEVICE_TOKENS, 1)
            match = life.cache.match_prefix(key)
            n = len(match.device_indices)
            assert torch.equal(life.device_kv(match.device_indices), kv_of(key[:n]))
            if (big_host and lock is None and len(key) <= DEVICE_TOKENS // 2
                    and policy != "write_through_selective"):  # it drops nodes never reused
                expect = max((len(_common(key, k)) for k in this_life), default=0)
                expect = expect // page_size * page_size
                stored = max((len(_common(key, k)) for k in stored_blocks), default=0)
                assert n >= max(expect, stored // block * block), (n, expect, stored)
        elif op == "evict":
            life.cache.evict(arg)
        elif op == "lock":
            if lock is not None:
                life.cache.dec_lock_ref(lock[0])
                lock = None
            else:
                match = life.cache.match_prefix(make_key(arg, keys, page_size))
                life.cache.inc_lock_ref(match.last_node)
                lock = (match.last_node, match.device_indices)
        elif op == "restart":
            if lock is not None:
                life.cache.dec_lock_ref(lock[0])
                lock = None
            life = Life(page_size, host_tokens, policy, directory)
            this_life = []
        check(life, [])


def _common(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
