"""HiRadixCache, case by case: write policies, loads from the host and from storage, restarts,
and storage files that must be refused (foreign model, other dtype, corruption)."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from radixserve.mem_cache.hicache_storage import block_tokens_for
from radixserve.mem_cache.kv_file import HEADER_BYTES
from tests.mem_cache.test_hiradix_cache_property import DEVICE_TOKENS, Life, _Req, check, kv_of


def insert(life: Life, key: list[int]) -> None:
    cache = life.cache
    match = cache.match_prefix(key)
    n = len(match.device_indices)
    cache.evict(len(key) - n - life.allocator.available_size())
    slots = life.allocator.alloc_extend([0], [len(key) - n], [-1])
    assert slots is not None
    full = torch.cat((match.device_indices, slots))
    life.write(full, key)
    new = cache.insert(key, full)
    life.allocator.free(slots[: new - n])


def load(life: Life, key: list[int]) -> tuple[int, dict]:
    req = _Req(key)
    life.cache.load_back([req], DEVICE_TOKENS, 1)
    match = life.cache.match_prefix(key)
    n = len(match.device_indices)
    assert torch.equal(life.device_kv(match.device_indices), kv_of(key[:n]))
    check(life, [])
    return n, req.cached_tokens_tiers


DOC = [(7 * i) % 11 for i in range(128)]


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_an_evicted_prefix_comes_back_from_the_host(tmp_path, policy):
    life = Life(4, 1024, policy, None)
    insert(life, DOC)
    assert life.cache.evict(DEVICE_TOKENS) == len(DOC)
    assert len(life.cache.match_prefix(DOC).device_indices) == 0
    n, tiers = load(life, DOC + [1, 2])
    assert n == len(DOC) and tiers == {"host": len(DOC), "storage": 0}


def test_write_through_selective_drops_a_prefix_never_reused():
    life = Life(4, 1024, "write_through_selective", None)
    insert(life, DOC)
    life.cache.evict(DEVICE_TOKENS)
    assert load(life, DOC)[0] == 0
    insert(life, DOC)
    life.cache.match_prefix(DOC)
    life.cache.match_prefix(DOC)  # matched twice: copied to the host
    life.cache.evict(DEVICE_TOKENS)
    assert load(life, DOC)[0] == len(DOC)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_storage_survives_a_restart(tmp_path, policy):
    life = Life(4, 1024, policy, str(tmp_path))
    insert(life, DOC)
    life.cache.evict(DEVICE_TOKENS)  # write_back: now written down
    assert len(list(tmp_path.glob("*.kvblock"))) == len(DOC) // block_tokens_for(4)
    life = Life(4, 1024, policy, str(tmp_path))
    n, tiers = load(life, DOC + [3])
    assert n == len(DOC) and tiers == {"host": 0, "storage": len(DOC)}


def test_the_host_tier_evicts_down_to_storage_and_storage_serves_it(tmp_path):
    life = Life(4, 128, "write_back", str(tmp_path))  # the host holds one document
    other = [(5 * i) % 13 for i in range(128)]
    insert(life, DOC)
    life.cache.evict(DEVICE_TOKENS)
    insert(life, other)
    life.cache.evict(DEVICE_TOKENS)  # DOC leaves the host for good
    n, tiers = load(life, DOC)
    assert n == len(DOC) and tiers == {"host": 0, "storage": len(DOC)}


def _rewrite_header(path, **changes):
    raw = path.read_bytes()
    length = int.from_bytes(raw[8:12], "little")
    header = json.loads(raw[16 : 16 + length])
    header.update(changes)
    blob = json.dumps(header).encode()

    head = raw[:8] + len(blob).to_bytes(4, "little") + zlib.crc32(blob).to_bytes(4, "little")
    path.write_bytes((head + blob).ljust(HEADER_BYTES, b"\0") + raw[HEADER_BYTES:])


@pytest.mark.parametrize("damage", ["fingerprint", "dtype", "payload", "truncated", "magic"])
def test_a_foreign_or_corrupt_block_is_refused_and_recomputed(tmp_path, damage):
    life = Life(4, 1024, "write_through", str(tmp_path))
    insert(life, DOC)
    files = sorted(tmp_path.glob("*.kvblock"))
    assert files
    for path in files:
        if damage == "fingerprint":
            _rewrite_header(path, fingerprint="another-model")
        elif damage == "dtype":
            layout = dict(life.pool.kv_layout(), dtype="bfloat16")
            _rewrite_header(path, layout=layout)
        elif damage == "payload":
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0xFF
            path.write_bytes(bytes(raw))
        elif damage == "truncated":
            path.write_bytes(path.read_bytes()[:-16])
        else:
            path.write_bytes(b"XXXXXXX" + path.read_bytes()[7:])
    life = Life(4, 1024, "write_through", str(tmp_path))
    n, tiers = load(life, DOC)
    assert n == 0 and tiers == {"host": 0, "storage": 0}
    assert life.cache.storage.refused == 1  # the first block: nothing after it is read
    assert len(list(tmp_path.glob("*.kvblock"))) == len(files) - 1  # the refused one is gone
    insert(life, DOC)  # recomputed: written again, and served from then on
    assert len(list(tmp_path.glob("*.kvblock"))) == len(files)
