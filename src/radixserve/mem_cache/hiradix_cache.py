"""The hierarchical radix cache (``--enable-hierarchical-cache``): what the device pool evicts
goes down a tier instead of being forgotten, and comes back instead of being recomputed.

Tiers (docs/hierarchical-cache.md):

- **device**: the KV pool the model reads (``node.value``: device slots);
- **host**: ``HostKVPool``, a second pool in host memory (``node.host_value``: host slots);
- **storage** (optional): ``FileKVStorage``, block files in a directory, found by a chain hash
  of the tokens, so they outlive the process.

A tree node is on the device (``value``), on the host (``host_value``), or both. Every prefix of
a device node is on the device (ancestors of a device node are device nodes), so the device part
of a match is a path from the root, and locks (which pin paths from the root) only ever lock
device nodes: lock counts, ``evictable_size`` and ``protected_size`` mean what they mean in
``RadixCache``, in device tokens.

Writes go down by ``--hicache-write-policy`` (SGLang's names): ``write_back`` copies a node to the
host when the device evicts it; ``write_through`` when it enters the tree; and
``write_through_selective`` when it is matched a second time (a node never reused is dropped at
eviction). A node copied to the host is also written to storage (its whole blocks), when there
is a storage tier. The host evicts least recently used host-only leaves (they are deleted from
the tree: storage may still hold them) and host copies of device nodes.

Loads come back before admission: the scheduler's planner calls ``load_back`` with the waiting
requests; each one's host part is copied into fresh device slots, page by page, and the storage
blocks that follow it are read, checked and inserted; then the request's ordinary match finds
its whole prefix on the device. ``req.cached_tokens_tiers`` records how many of its cached
tokens came from the host and from storage (``cached_tokens_details`` in ``meta_info``).
"""

from __future__ import annotations

import heapq
import logging
from typing import Any

import torch

from radixserve.mem_cache.base_prefix_cache import MatchResult
from radixserve.mem_cache.hicache_host import HostKVPool
from radixserve.mem_cache.hicache_storage import FileKVStorage, chain_hashes
from radixserve.mem_cache.kv_file import model_fingerprint
from radixserve.mem_cache.radix_cache import RadixCache, _TreeNode, namespaced

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
# write_through_selective copies a node to the host once it has been matched this many times
SELECTIVE_HITS = 2


class _HiNode(_TreeNode):
    __slots__ = ("host_value",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.host_value: torch.Tensor | None = None


class HiRadixCache(RadixCache):
    """A ``RadixCache`` whose evicted nodes go to host memory and storage (module docstring).
    Built with ``attach_tiers`` after construction (``create_prefix_cache``)."""

    host: HostKVPool
    storage: FileKVStorage | None
    write_policy: str

    def attach_tiers(
        self, host: HostKVPool, storage: FileKVStorage | None, write_policy: str
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {WRITE_POLICIES}")
        self.host = host
        self.storage = storage
        self.write_policy = write_policy
        self.device_pool = host.device_pool
        self._loading: set[int] = set()  # ids of host nodes being loaded: the host keeps them
        self.loaded_host_tokens = 0  # over the cache's life
        self.loaded_storage_tokens = 0
        self.backed_up_tokens = 0

    def _init_tree(self) -> None:
        super()._init_tree()
        self._root = _HiNode(next(self._ids), [], self._empty(), None, 0)
        self._evictable_leaves = set()  # unused: eviction scans device leaves (see evict)

    # ---- queries -----------------------------------------------------------------------------

    def match_prefix(self, key: list[int]) -> MatchResult:
        """The device part of the longest cached prefix (host nodes below it are not used:
        ``load_back`` brings them to the device first)."""
        node, _, values, _ = self._walk(key)
        indices = torch.cat(values) if values else self._empty()
        return MatchResult(device_indices=indices, last_node=node)

    def _walk(self, key: list[int]) -> tuple[_HiNode, int, list[torch.Tensor], list[_HiNode]]:
        """``(last device node, device length, device values, host-only nodes after it)``;
        splits nodes so the match ends on node boundaries."""
        device_node, device_len = self._root, 0
        values: list[torch.Tensor] = []
        host_nodes: list[_HiNode] = []
        for child, pos, n in self._descend(key, next(self._clock)):
            if child.value is not None:
                child.hits += 1
                self.hit_tokens += n
                values.append(child.value)
                device_node, device_len = child, pos + n
                if (self.write_policy == "write_through_selective"
                        and child.hits >= SELECTIVE_HITS and child.host_value is None):
                    self._backup(child)
            else:
                host_nodes.append(child)
        return device_node, device_len, values, host_nodes

    def host_size(self) -> int:
        """Host tokens the tree holds."""
        return self.host.size - self.host.available_size()

    def tier_figures(self) -> dict[str, int]:
        return {
            "host_kv_tokens": self.host_size(),
            "host_total_kv_tokens": self.host.size,
            "storage_kv_tokens": 0 if self.storage is None else self.storage.stored_tokens(),
            "hicache_loaded_host_tokens": self.loaded_host_tokens,
            "hicache_loaded_storage_tokens": self.loaded_storage_tokens,
        }

    def tier_problems(self) -> list[str]:
        """Violations of the tiers' invariants (the idle memory check): every host slot the
        host pool has handed out belongs to exactly one node, and every node holds KV on the
        device or on the host."""
        problems: list[str] = []
        held = 0
        for node in self._nodes():
            if node.value is None and node.host_value is None:
                problems.append(f"node {node.id} holds KV in no tier")
            if node.value is None and node.lock_ref:
                problems.append(f"host-only node {node.id} is locked")
            if node.value is not None and node.parent is not self._root and (
                node.parent.value is None
            ):
                problems.append(f"device node {node.id} under a host-only node")
            if node.host_value is not None:
                held += len(node.host_value)
        if held != self.host_size():
            problems.append(f"host pool: {self.host_size()} tokens handed out, tree holds {held}")
        return problems

    # ---- updates -----------------------------------------------------------------------------

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """As ``RadixCache.insert``; host-only nodes on the path take the caller's slots (the
        request recomputed them) and count as new, so the returned length is the device part."""
        assert len(key) % self.page_size == 0, f"insert of {len(key)} tokens is not page aligned"
        assert len(value) == len(key), "insert: key and value lengths differ"
        tick = next(self._clock)
        node, pos = self._root, 0
        device_len = 0
        for node, start, n in self._descend(key, tick):  # key is page aligned: all of it
            pos = start + n
            if node.value is None:  # host only: the request's slots become the node's
                node.value = value[start:pos].clone()
                self._evictable_size += n
            else:
                device_len = pos
        if pos < len(key):
            leaf = _HiNode(next(self._ids), key[pos:], value[pos:].clone(), node, tick)
            node.children[self._child_key(key, pos)] = leaf
            self._evictable_size += len(leaf.key)
            if self.write_policy == "write_through":
                self._backup(leaf)
        return device_len

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots, least recently used device leaves first;
        each goes to the host (by the write policy) or, without a host copy, is dropped with
        the host-only nodes below it."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._nodes() if self._device_evictable(n)]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self._device_evictable(node):
                continue
            if node.host_value is None and self.write_policy == "write_back":
                self._backup(node)
            parent = node.parent
            freed.append(node.value)
            num_freed += len(node.value)
            self._evictable_size -= len(node.key)
            node.value = None
            if node.host_value is None:
                self._delete_subtree(node)
            if parent is not self._root and self._device_evictable(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if freed:
            self.allocator.free(torch.cat(freed))
        self.evicted_tokens += num_freed
        return num_freed

    def reset(self) -> None:
        assert self._protected_size == 0, "reset while running requests lock the tree"
        nodes = self._nodes()
        values = [n.value for n in nodes if n.value is not None]
        if values:
            self.allocator.free(torch.cat(values))
        host_values = [n.host_value for n in nodes if n.host_value is not None]
        if host_values:
            self.host.free(torch.cat(host_values))
        self._init_tree()

    # ---- loading back ------------------------------------------------------------------------

    def load_back(self, reqs: list[Any], max_tokens: int, max_rows: int) -> None:
        """Bring each waiting request's host and storage hits to the device, in queue order,
        while ``max_tokens`` (free + reclaimable device tokens) and ``max_rows`` (requests that
        can be admitted) last. The prefix of each request considered stays locked until the end
        of the call, so that a later request's load cannot evict what an earlier one loaded
        (they would evict each other's documents every step and admit none of them whole)."""
        held: list[Any] = []
        try:
            for req in reqs[:max_rows]:
                if req.cached_tokens_tiers is None:
                    req.cached_tokens_tiers = {"host": 0, "storage": 0}
                key = namespaced(req.all_ids[: req.max_prefix_len], req.lora_namespace)
                loaded = self._load_prefix(key, max_tokens)
                if loaded is None:
                    break
                host, storage = loaded
                if host or storage:
                    req.cached_tokens_tiers = {"host": host, "storage": storage}
                max_tokens -= host + storage
                node = self.match_prefix(key).last_node
                self.inc_lock_ref(node)
                held.append(node)
        finally:
            for node in held:
                self.dec_lock_ref(node)

    def _load_prefix(self, key: list[int], max_tokens: int) -> tuple[int, int] | None:
        """Load ``key``'s host part, then its storage blocks; ``(host, storage)`` tokens
        loaded, or ``None`` when the device has no room for it."""
        device_node, device_len, _, host_nodes = self._walk(key)
        host_len = sum(len(n.key) for n in host_nodes)
        stored = self._stored_blocks(key, device_len + host_len)
        storage_len = sum(n for _, _, n in stored)
        if host_len + storage_len == 0:
            return 0, 0
        if host_len + storage_len > max_tokens:
            return None
        self.inc_lock_ref(device_node)  # the path the load hangs from stays on the device
        self._loading.update(n.id for n in host_nodes)
        try:
            slots = self._alloc_device(host_len + storage_len)
            if slots is None:
                return None
            offset = 0
            for node in host_nodes:
                n = len(node.key)
                node.value = slots[offset : offset + n].clone()
                self.host.restore(node.host_value, node.value)
                self._evictable_size += n
                offset += n
            self.loaded_host_tokens += host_len
            storage_len = self._load_blocks(key, device_len + host_len, stored, slots[offset:])
            self.loaded_storage_tokens += storage_len
            return host_len, storage_len
        finally:
            self._loading.clear()
            self.dec_lock_ref(device_node)

    def _stored_blocks(self, key: list[int], start: int) -> list[tuple[str, int, int]]:
        """Storage blocks continuing ``key`` from ``start``: ``(hash, block index, tokens past
        start it adds)``, stopping at the first block storage lacks."""
        if self.storage is None:
            return []
        block = self.storage.block_tokens
        out: list[tuple[str, int, int]] = []
        pos = start
        for i, digest in enumerate(chain_hashes(key, block)):
            end = (i + 1) * block
            if end <= pos:
                continue
            if not self.storage.contains(digest):
                break
            out.append((digest, i, end - pos))
            pos = end
        return out

    def _load_blocks(
        self, key: list[int], start: int, stored: list[tuple[str, int, int]],
        slots: torch.Tensor,
    ) -> int:
        """Read ``stored`` into ``slots`` and insert them after ``key[:start]``; a refused
        block ends the load (the rest is recomputed, its slots freed). Returns tokens loaded."""
        if not stored:
            return 0
        assert self.storage is not None
        block = self.storage.block_tokens
        pos = start
        for digest, i, n in stored:
            data = self.storage.get(digest, key[i * block : (i + 1) * block])
            if data is None:
                break
            self.device_pool.write_kv_pages(slots[pos - start : pos - start + n], data[block - n:])
            pos += n
        self.allocator.free(slots[pos - start :])
        if pos == start:
            return 0
        prefix = self.match_prefix(key[:start]).device_indices
        assert len(prefix) == start, "the path a storage load hangs from left the device"
        self.insert(key[:pos], torch.cat((prefix, slots[: pos - start])))
        return pos - start

    def _alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Fresh device slots (whole pages), evicting unlocked device nodes if needed."""
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.evict(short)
        return self.allocator.alloc_extend([0], [num_tokens], [-1])

    # ---- writing down ------------------------------------------------------------------------

    def _backup(self, node: _HiNode) -> bool:
        """Copy device node ``node`` to the host (and its whole blocks to storage); False when
        the host has no room even after evicting."""
        n = len(node.key)
        slots = self.host.alloc(n)
        if slots is None:
            self._evict_host(n - self.host.available_size())
            slots = self.host.alloc(n)
            if slots is None:
                return False
        self.host.backup(node.value, slots)
        node.host_value = slots
        self.backed_up_tokens += n
        if self.storage is not None:
            self._write_storage(node)
        return True

    def _write_storage(self, node: _HiNode) -> None:
        """Write the blocks that end inside ``node`` (the path to it is on the device)."""
        assert self.storage is not None
        path: list[_HiNode] = []
        walk = node
        while walk is not self._root:
            path.append(walk)
            walk = walk.parent
        path.reverse()
        key = [t for p in path for t in p.key]
        start = len(key) - len(node.key)
        block = self.storage.block_tokens
        hashes = chain_hashes(key, block)
        wanted = [i for i in range(len(hashes)) if (i + 1) * block > start
                  and not self.storage.contains(hashes[i])]
        if not wanted:
            return
        slots = torch.cat([p.value for p in path])
        for i in wanted:
            lo, hi = i * block, (i + 1) * block
            self.storage.put(hashes[i], key[lo:hi], self.device_pool.read_kv_pages(slots[lo:hi]))

    def _evict_host(self, num_tokens: int) -> int:
        """Free host slots, least recently used first: host copies of device nodes, and
        host-only leaves (deleted from the tree; storage may still hold their blocks)."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._nodes() if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.parent is None or not self._host_evictable(node):
                continue
            self.host.free(node.host_value)
            freed += len(node.host_value)
            node.host_value = None
            if node.value is None:
                parent = node.parent
                del parent.children[self._child_key(node.key, 0)]
                node.parent = None
                if parent is not self._root and self._host_evictable(parent):
                    heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    # ---- helpers -----------------------------------------------------------------------------

    def _device_evictable(self, node: _HiNode) -> bool:
        return (node.value is not None and node.lock_ref == 0 and node.parent is not None
                and not any(c.value is not None for c in node.children.values()))

    def _host_evictable(self, node: _HiNode) -> bool:
        if node.host_value is None or node.id in self._loading:
            return False
        return node.value is not None or not node.children

    def _delete_subtree(self, node: _HiNode) -> None:
        """Remove ``node`` (no KV on the device) and its host-only descendants."""
        parent = node.parent
        del parent.children[self._child_key(node.key, 0)]
        node.parent = None
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.value is None, "a device node under a dropped node"
            if n.host_value is not None:
                self.host.free(n.host_value)
                n.host_value = None
            stack.extend(n.children.values())

    def _split(self, node: _HiNode, n: int) -> _HiNode:
        """Cut ``node`` after ``n`` tokens in every tier it is in; returns the upper half."""
        parent = node.parent
        assert parent is not None and 0 < n < len(node.key) and n % self.page_size == 0
        value = None if node.value is None else node.value[:n].clone()
        upper = _HiNode(next(self._ids), node.key[:n], value, parent, node.last_access)
        upper.lock_ref = node.lock_ref
        upper.hits = node.hits
        if node.host_value is not None:
            upper.host_value = node.host_value[:n].clone()
            node.host_value = node.host_value[n:].clone()
        parent.children[self._child_key(node.key, 0)] = upper
        node.key = node.key[n:]
        if node.value is not None:
            node.value = node.value[n:].clone()
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        if node.id in self._loading:
            self._loading.add(upper.id)
        return upper

    def snapshot(self, max_nodes: int) -> dict[str, Any]:
        out = super().snapshot(max_nodes)
        out.update(self.tier_figures())
        return out


def create_hierarchical_cache(
    req_to_token_pool: Any,
    allocator: Any,
    page_size: int,
    device_pool: Any,
    *,
    host_tokens: int,
    write_policy: str,
    storage_dir: str | None,
    model_path: str,
) -> HiRadixCache:
    """A ``HiRadixCache`` with a host tier of ``host_tokens`` tokens and, with
    ``storage_dir``, a file storage tier keyed by the model's fingerprint."""
    cache = HiRadixCache(req_to_token_pool, allocator, page_size)
    host = HostKVPool(device_pool, host_tokens)
    storage = None
    if storage_dir is not None:
        storage = FileKVStorage(storage_dir, model_fingerprint(model_path),
                                device_pool.kv_layout(), page_size)
    cache.attach_tiers(host, storage, write_policy)
    logger.info(
        "hierarchical cache: host tier %d tokens (%.2f GB%s), storage %s, %s",
        host.size, host.size * host.bytes_per_token / 1e9, ", pinned" if host.pinned else "",
        storage_dir or "off", write_policy,
    )
    return cache
