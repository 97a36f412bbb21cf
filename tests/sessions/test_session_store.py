"""The session store with a real KV pool and real files: what goes out comes back bit for bit,
what cannot be trusted is refused, the bound holds, and the session-aware cache offloads to it
and loads back from it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from radixserve.managers.scheduler.memory_check import MemoryChecker
from radixserve.mem_cache import (
    MHATokenToKVPool,
    RadixCache,
    ReqToTokenPool,
    SessionAwareCache,
    TokenToKVPoolAllocator,
)
from radixserve.mem_cache.kv_file import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    KVExpectation,
    model_fingerprint,
)
from radixserve.mem_cache.session_store import (
    DiskSessionStore,
    HostSessionStore,
    SessionStoreError,
)
from tests.checkpoints import build_checkpoint
from tests.sessions.test_session_aware_cache import LENGTH, SessionDriver, ids

KV_TOKENS = 256
ROWS = 6
LAYERS, HEADS, DIM = 2, 2, 4


@dataclass
class Waiting:
    """A waiting request as ``load_back`` sees it."""

    streaming_session_id: str


def make_pool(page_size: int = 1, dtype: torch.dtype = torch.float32) -> MHATokenToKVPool:
    pool = MHATokenToKVPool(KV_TOKENS, page_size, dtype, HEADS, DIM, LAYERS, "cpu")
    gen = torch.Generator().manual_seed(0)
    for buffer in pool.k_buffer + pool.v_buffer:
        buffer.copy_(torch.randn(buffer.shape, generator=gen).to(dtype))
    return pool


def layout(pool: MHATokenToKVPool, fingerprint: str = "model-a") -> KVExpectation:
    return KVExpectation.of_pool(pool, fingerprint)


def kv_at(pool: MHATokenToKVPool, slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([b[slots] for b in pool.k_buffer + pool.v_buffer])


@pytest.fixture
def pool() -> MHATokenToKVPool:
    return make_pool()


def disk(tmp_path: Path, pool: MHATokenToKVPool, fingerprint: str = "model-a",
         max_bytes: int | None = None) -> DiskSessionStore:
    return DiskSessionStore(tmp_path / "store", pool, layout(pool, fingerprint), max_bytes)


# ---------------------------------------------------------------------- the store alone
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_kv_loads_back_bit_for_bit_into_other_slots(tmp_path, dtype):
    pool = make_pool(dtype=dtype)
    store = DiskSessionStore(tmp_path, pool, layout(pool), None)
    src = torch.tensor([5, 9, 10, 11, 40])
    original = kv_at(pool, src).clone()
    assert store.save("chat", [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5], src)
    dst = torch.tensor([100, 101, 102, 103, 104])
    store.load("chat", dst)
    assert torch.equal(kv_at(pool, dst), original)
    # A new store over the same directory (a restart) reads it back too.
    again = DiskSessionStore(tmp_path, pool, layout(pool), None)
    entry = again.open("chat")
    assert entry.token_ids == [1, 2, 3, 4, 5, 6] and entry.kv_token_ids == [1, 2, 3, 4, 5]
    out = torch.tensor([200, 201, 202, 203, 204])
    assert again.load("chat", out) and torch.equal(kv_at(pool, out), original)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_quantized_pool_saves_and_loads_its_scales_with_its_codes(tmp_path, dtype):
    """``--kv-cache-dtype``: the payload carries every slot buffer (codes, and int8's scales;
    fp8's one scale per layer is the pool's)."""
    pool = MHATokenToKVPool(KV_TOKENS, 1, dtype, HEADS, DIM, LAYERS, "cpu")
    for layer in range(LAYERS):
        slots = torch.arange(KV_TOKENS + 1)
        pool.set_kv_buffer(layer, slots, torch.randn(KV_TOKENS + 1, HEADS, DIM),
                           torch.randn(KV_TOKENS + 1, HEADS, DIM))
    store = DiskSessionStore(tmp_path, pool, layout(pool), None)
    src, dst = torch.tensor([5, 9, 10]), torch.tensor([100, 101, 102])
    original = [[b[src].clone() for b in pool.slot_buffers(i)] for i in range(LAYERS)]
    assert store.save("chat", [1, 2, 3, 4], [1, 2, 3], src)
    again = DiskSessionStore(tmp_path, pool, layout(pool), None)  # a restart
    again.open("chat")
    assert again.load("chat", dst)
    for layer in range(LAYERS):
        loaded = [b[dst] for b in pool.slot_buffers(layer)]
        assert len(loaded) == (4 if dtype == torch.int8 else 2)
        for got, want in zip(loaded, original[layer], strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_the_file_is_one_per_session_in_the_storage_tiers_format(tmp_path, pool):
    store = disk(tmp_path, pool)
    store.save("a/../b", [7, 8, 9], [7, 8], torch.tensor([3, 4]))
    (path,) = (tmp_path / "store").iterdir()
    assert path == store.path("a/../b"), "the name is a digest of the id, inside the store"
    data = path.read_bytes()
    assert data.startswith(MAGIC + bytes([FORMAT_VERSION]))
    length, _ = struct.unpack("<II", data[8:16])
    header = json.loads(data[16 : 16 + length])
    assert header["kind"] == "session" and header["session_id"] == "a/../b"
    assert header["fingerprint"] == "model-a" and header["layout"] == pool.kv_layout()
    assert header["page_size"] == 1
    assert header["history"] == [7, 8, 9] and header["token_ids"] == [7, 8]
    assert header["payload_bytes"] == 2 * 2 * LAYERS * HEADS * DIM * 4
    assert len(data) == HEADER_BYTES + header["payload_bytes"], "the payload is page aligned"
    # The payload is the pool's tier format: what read_kv_pages gives for the slots.
    assert data[HEADER_BYTES:] == pool.read_kv_pages(torch.tensor([3, 4])).numpy().tobytes()


def test_kv_of_another_model_or_dtype_is_refused_but_the_history_resumes(tmp_path, pool):
    disk(tmp_path, pool).save("chat", [1, 2, 3], [1, 2], torch.tensor([3, 4]))
    other = disk(tmp_path, pool, fingerprint="model-b").open("chat")
    assert other.token_ids == [1, 2, 3] and other.kv_tokens == 0
    bf16 = make_pool(dtype=torch.bfloat16)
    entry = DiskSessionStore(tmp_path / "store", bf16, layout(bf16), None).open("chat")
    assert entry.token_ids == [1, 2, 3] and entry.kv_tokens == 0


def test_kv_of_a_quantized_pool_is_refused_by_another_kv_dtype(tmp_path):
    """The layout check covers ``--kv-cache-dtype`` and fp8's per-layer scale: e4m3 codes are
    not e5m2's, nor codes under another scale, though each takes the same bytes."""
    def pool(dtype, scales=None):
        return MHATokenToKVPool(KV_TOKENS, 1, dtype, HEADS, DIM, LAYERS, "cpu",
                                layer_scales=scales)

    e4m3 = pool(torch.float8_e4m3fn)
    DiskSessionStore(tmp_path, e4m3, layout(e4m3), None).save(
        "chat", [1, 2, 3], [1, 2], torch.tensor([3, 4]))
    last_v_halved = [(1.0, 1.0)] * (LAYERS - 1) + [(1.0, 0.5)]  # one layer's V scale differs
    for other in (pool(torch.float8_e5m2), pool(torch.float8_e4m3fn, last_v_halved),
                  pool(torch.int8)):
        if other.dtype != torch.int8:
            assert other.kv_bytes_per_token() == e4m3.kv_bytes_per_token(), "same size"
        entry = DiskSessionStore(tmp_path, other, layout(other), None).open("chat")
        assert entry.token_ids == [1, 2, 3] and entry.kv_tokens == 0
    assert DiskSessionStore(tmp_path, e4m3, layout(e4m3), None).open("chat").kv_tokens == 2


def test_one_format_a_storage_block_is_never_read_as_a_session_nor_a_session_as_a_block(
    tmp_path, pool,
):
    """The storage tier and the session store share the file format and its reader; the
    kind in the header keeps a block and a session apart."""
    from radixserve.mem_cache.hicache_storage import FileKVStorage

    storage = FileKVStorage(tmp_path / "blocks", "model-a", pool.kv_layout(), 1)
    tokens = list(range(storage.block_tokens))
    storage.put("h0", tokens, pool.read_kv_pages(torch.arange(1, 1 + len(tokens))))
    store = disk(tmp_path, pool)
    # A block file where a session's file should be: its header reads, its KV is refused.
    store.path("chat").write_bytes(storage.path("h0").read_bytes())
    with pytest.raises(SessionStoreError, match="names another session"):
        disk(tmp_path, pool).open("chat")
    # A session's file where a block should be: refused, deleted, recomputed.
    store.save("chat", [1, 2, 3], tokens, torch.arange(1, 1 + len(tokens)))
    storage.path("h0").write_bytes(store.path("chat").read_bytes())
    assert storage.get("h0", tokens) is None and storage.refused == 1
    assert not storage.path("h0").exists()


def test_a_truncated_file_is_refused_but_the_history_resumes(tmp_path, pool):
    store = disk(tmp_path, pool)
    store.save("chat", [1, 2, 3], [1, 2], torch.tensor([3, 4]))
    path = store.path("chat")
    path.write_bytes(path.read_bytes()[:-5])
    entry = disk(tmp_path, pool).open("chat")
    assert entry.token_ids == [1, 2, 3] and entry.kv_tokens == 0


def test_a_corrupt_payload_is_refused_when_loaded(tmp_path, pool):
    store = disk(tmp_path, pool)
    store.save("chat", [1, 2, 3], [1, 2], torch.tensor([3, 4]))
    path = store.path("chat")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    again = disk(tmp_path, pool)
    assert again.open("chat").kv_tokens == 2  # the header is fine
    before = kv_at(pool, torch.tensor([50, 51])).clone()
    assert not again.load("chat", torch.tensor([50, 51]))
    assert again.get("chat") is None and not path.exists(), "refused KV is dropped"
    assert torch.equal(kv_at(pool, torch.tensor([50, 51])), before), "and never written"


@pytest.mark.parametrize("damage", ["header", "magic", "missing"])
def test_a_session_whose_header_cannot_be_read_cannot_resume(tmp_path, pool, damage):
    store = disk(tmp_path, pool)
    store.save("chat", [1, 2, 3], [1, 2], torch.tensor([3, 4]))
    path = store.path("chat")
    data = bytearray(path.read_bytes())
    if damage == "header":
        data[20] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "magic":
        path.write_bytes(b"not a session file")
    else:
        path.unlink()
    with pytest.raises(SessionStoreError):
        disk(tmp_path, pool).open("chat")


def test_the_bound_drops_least_recently_used_sessions(tmp_path, pool):
    one = disk(tmp_path, pool)._size(4 + 3, 3)
    store = disk(tmp_path, pool, max_bytes=2 * one + 10)
    for name in ("a", "b"):
        assert store.save(name, [1, 2, 3, 4], [1, 2, 3], torch.tensor([1, 2, 3]))
    store.load("a", torch.tensor([7, 8, 9]))  # a is used again: b is now the oldest
    assert store.save("c", [1, 2, 3, 4], [1, 2, 3], torch.tensor([1, 2, 3]))
    assert set(store.entries) == {"a", "c"} and not store.path("b").exists()
    assert store.total_bytes() <= store.max_bytes
    huge = torch.arange(1, 200)
    assert not store.save("huge", list(range(199)), list(range(199)), huge), "over the bound"
    assert store.get("huge") is None


def test_files_of_an_earlier_run_count_against_the_bound_and_go_first(tmp_path, pool):
    one = disk(tmp_path, pool)._size(4 + 3, 3)
    disk(tmp_path, pool).save("old", [1, 2, 3, 4], [1, 2, 3], torch.tensor([1, 2, 3]))
    store = disk(tmp_path, pool, max_bytes=2 * one + 10)
    assert store.total_bytes() > 0
    for name in ("a", "b"):
        store.save(name, [1, 2, 3, 4], [1, 2, 3], torch.tensor([1, 2, 3]))
    assert not store.path("old").exists() and set(store.entries) == {"a", "b"}
    with pytest.raises(SessionStoreError):
        store.open("old")


def test_host_memory_store_round_trip(pool):
    store = HostSessionStore(pool, layout(pool, ""), None)
    src = torch.tensor([3, 4, 5])
    original = kv_at(pool, src).clone()
    store.save("chat", [1, 2, 3, 4], [1, 2, 3], src)
    assert store.load("chat", torch.tensor([90, 91, 92]))
    assert torch.equal(kv_at(pool, torch.tensor([90, 91, 92])), original)
    assert not store.survives_restart


def test_model_fingerprint_tells_checkpoints_apart(tmp_path):
    a = build_checkpoint(tmp_path / "a", "llama", seed=0)
    b = build_checkpoint(tmp_path / "b", "llama", seed=1)
    assert model_fingerprint(a) == model_fingerprint(a) != model_fingerprint(b)


def test_model_fingerprint_tells_gguf_files_apart(tmp_path):
    from tests.gguf_checkpoints import convert_checkpoint

    a = convert_checkpoint(build_checkpoint(tmp_path / "a", "llama", seed=0), tmp_path / "a.gguf")
    b = convert_checkpoint(build_checkpoint(tmp_path / "b", "llama", seed=1), tmp_path / "b.gguf")
    assert model_fingerprint(a) == model_fingerprint(a) != model_fingerprint(b)
    (tmp_path / "only").mkdir()
    a.rename(tmp_path / "only" / "a.gguf")  # the directory holding it: the same digest
    assert model_fingerprint(tmp_path / "only") == model_fingerprint(tmp_path / "only" / "a.gguf")


# ---------------------------------------------------------------------- with the cache
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def store_driver(tmp_path: Path, page_size: int = 1, offload_after: float | None = None,
                 clock: Clock | None = None) -> tuple[SessionDriver, MHATokenToKVPool]:
    kv = make_pool(page_size)
    pool = ReqToTokenPool(size=ROWS, max_context_len=128, device="cpu")
    allocator = TokenToKVPoolAllocator(KV_TOKENS, page_size, "cpu")
    store = DiskSessionStore(tmp_path / "store", kv, layout(kv), None)
    cache = SessionAwareCache(
        RadixCache(pool, allocator, page_size), pool, allocator, page_size, store=store,
        offload_after=offload_after, clock=clock or Clock(),
    )
    return SessionDriver(cache, pool, allocator), kv


def check(d: SessionDriver, *running) -> None:
    record = MemoryChecker(d.cache, d.allocator, d.pool, KV_TOKENS).check(list(running))
    assert record["ok"], record


@pytest.mark.parametrize("page_size", [1, 4])
def test_an_evicted_slot_goes_to_the_store_and_comes_back_with_the_same_kv(tmp_path, page_size):
    d, kv = store_driver(tmp_path, page_size)
    prompt, output = ids(10, 10), ids(100, 5)
    d.turn("s", prompt, output)
    slot_kv = kv_at(kv, d.slot_kv("s")).clone()
    free_before = d.allocator.available_size()
    d.cache.evict(KV_TOKENS)
    assert "s" not in d.cache.slots and d.cache.session_offloaded_tokens() == 14
    assert d.allocator.available_size() == KV_TOKENS, "the prefix in the tree went too"
    assert d.allocator.available_size() > free_before
    check(d)
    turn = prompt + output + ids(200, 3)
    d.cache.load_back([Waiting("s")], KV_TOKENS, ROWS)
    slot = d.cache.slots["s"]
    assert slot.stored and slot.protected_len == 0 and slot.history == prompt + output
    assert d.cache.session_offloaded_tokens() == 0
    assert torch.equal(kv_at(kv, d.slot_kv("s")), slot_kv), "one copy back, the same KV"
    check(d)
    req = d.admit_req("t2", turn, "s")
    assert len(d.matched) == 14 and req.req_pool_idx == slot.req_pool_idx
    d.decode(req, 2)
    d.finish(req, turn + ids(300, 3), LENGTH)
    assert d.cache.store.get("s") is None, "the stored copy is stale once a turn finished"
    check(d)


def test_a_lora_slot_is_stored_without_its_kv(tmp_path):
    """A namespace names an adapter load of this process only: the history is stored, the
    KV is not, and the session's next turn re-prefills."""
    d, _ = store_driver(tmp_path)
    d.turn("s", ids(10, 10), ids(100, 5), namespace=3)
    d.cache.evict(KV_TOKENS)
    entry = d.cache.store.get("s")
    assert entry is not None and entry.token_ids == ids(10, 10) + ids(100, 5)
    assert entry.kv_tokens == 0 and d.cache.session_offloaded_tokens() == 0
    d.cache.load_back([Waiting("s")], KV_TOKENS, ROWS)
    assert "s" not in d.cache.slots
    check(d)


def test_offloading_an_unchanged_slot_again_writes_nothing(tmp_path):
    d, _ = store_driver(tmp_path)
    d.turn("s", ids(10, 10), ids(100, 5))
    d.cache.evict(KV_TOKENS)
    writes = []
    store = d.cache.store
    original = store._write
    store._write = lambda *a: writes.append(a) or original(*a)
    d.cache.load_back([Waiting("s")], KV_TOKENS, ROWS)
    d.cache.evict(KV_TOKENS)
    assert writes == [] and d.cache.session_offloaded_tokens() == 14
    check(d)


def test_load_back_respects_its_budgets(tmp_path):
    d, _ = store_driver(tmp_path)
    d.turn("s", ids(10, 10), ids(100, 5))
    d.cache.evict(KV_TOKENS)
    waiting = [Waiting("s")]
    d.cache.load_back(waiting, 13, ROWS)
    d.cache.load_back(waiting, KV_TOKENS, 0)
    assert "s" not in d.cache.slots
    d.cache.load_back(waiting, 14, 1)
    assert "s" in d.cache.slots
    check(d)


def test_sessions_idle_past_the_offload_time_go_to_the_store(tmp_path):
    clock = Clock()
    d, _ = store_driver(tmp_path, offload_after=30.0, clock=clock)
    d.turn("idle", ids(10, 10), ids(100, 5))
    clock.now = 20.0
    d.turn("recent", ids(30, 10), ids(130, 5))
    busy = d.admit_req("recent-2", ids(30, 10) + ids(130, 5) + ids(200, 2), "recent")
    d.cache.offload_idle_sessions()
    assert set(d.cache.slots) == {"idle", "recent"}
    clock.now = 31.0
    d.cache.offload_idle_sessions()
    assert set(d.cache.slots) == {"recent"} and d.cache.store.get("idle") is not None
    clock.now = 1000.0
    d.cache.offload_idle_sessions()
    assert set(d.cache.slots) == {"recent"}, "a slot in use is never offloaded"
    check(d, busy)


def test_persist_and_resume_carry_a_session_across_a_restart(tmp_path):
    d, kv = store_driver(tmp_path)
    prompt, output = ids(10, 10), ids(100, 5)
    d.turn("s", prompt, output)
    slot_kv = kv_at(kv, d.slot_kv("s")).clone()
    d.cache.persist_session("s", prompt + output)
    d.cache.persist_session("gone", [4, 5, 6])  # no KV in the pool: its history alone
    # A new process: new pools, whose KV buffers hold nothing of the old one.
    d2, kv2 = store_driver(tmp_path)
    for buffer in kv2.k_buffer + kv2.v_buffer:
        buffer.zero_()
    assert d2.cache.resume_session("s") == prompt + output
    assert d2.cache.resume_session("gone") == [4, 5, 6]
    with pytest.raises(LookupError, match="no stored session"):
        d2.cache.resume_session("never")
    d2.cache.load_back([Waiting("s")], KV_TOKENS, ROWS)
    assert torch.equal(kv_at(kv2, d2.slot_kv("s")), slot_kv)
    check(d2)
