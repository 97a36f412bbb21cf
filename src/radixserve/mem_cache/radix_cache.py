"""Radix-tree prefix cache: requests that share a prompt prefix share its KV slots.

The tree maps token ids to KV slots. Every edge key is a whole number of pages, children are keyed
by their first page, and nodes split only at page boundaries; so every slot range in the tree is
made of whole pages the tree owns outright, which is what the page-granular allocator frees.

A node is *protected* while a running request locks it or a descendant (``inc_lock_ref`` pins the
whole path to the root) and *evictable* otherwise. Both counters change incrementally, in O(depth)
per lock, and unlocked leaves are kept in a set, so neither accounting nor eviction walks the tree.

KV depends on the LoRA adapter a request runs under, so the tree keeps adapters apart: a
request's tokens are keyed ``token + namespace * NAMESPACE_STRIDE`` (``req.lora_namespace``: 0
for the base model, a number per adapter load, ``lora/lora_manager.py``). Keys of different
namespaces never compare equal, so no match crosses adapters, and page alignment is unchanged.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Any

import torch

from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, CacheableReq, MatchResult

# Larger than any vocabulary: namespaced token ids of two namespaces never meet.
NAMESPACE_STRIDE = 1 << 32


def namespaced(key: list[int], namespace: int) -> list[int]:
    """``key`` in ``namespace``'s part of the tree (itself for the base model's 0)."""
    if not namespace:
        return key
    offset = namespace * NAMESPACE_STRIDE
    return [t + offset for t in key]


class _TreeNode:
    """One edge of the tree: ``key`` tokens (whole pages) whose KV lives in slots ``value``."""

    __slots__ = ("id", "key", "value", "parent", "children", "lock_ref", "last_access", "hits")

    def __init__(
        self,
        node_id: int,
        key: list[int],
        value: torch.Tensor,
        parent: _TreeNode | None,
        last_access: int,
    ) -> None:
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[Hashable, _TreeNode] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.hits = 0  # matches that reused this node (for the inspector page)


class RadixCache(BasePrefixCache):
    """The default prefix cache (see ``BasePrefixCache`` for the contract)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.device = self.allocator.device
        self._ids = itertools.count()
        self._clock = itertools.count(1)  # logical time: deterministic LRU order
        self.hit_tokens = 0  # tokens served by matches, over the cache's life
        self.evicted_tokens = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self._root = _TreeNode(next(self._ids), [], self._empty(), None, 0)
        self._evictable_size = 0
        self._protected_size = 0
        self._evictable_leaves: set[_TreeNode] = set()  # unlocked nodes without children

    # ---- queries -----------------------------------------------------------------------------

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix; splits a node so ``last_node`` ends exactly there."""
        node = self._root
        values: list[torch.Tensor] = []
        for node, _, n in self._descend(key, next(self._clock)):
            node.hits += 1
            self.hit_tokens += n
            values.append(node.value)
        indices = torch.cat(values) if values else self._empty()
        return MatchResult(device_indices=indices, last_node=node)

    def _descend(self, key: list[int], tick: int) -> Iterator[tuple[Any, int, int]]:
        """Walk down along ``key``'s page-aligned prefix: yields ``(node, pos, n)`` for each
        node matched (its ``n`` tokens start at ``key[pos]``), splitting a node so the match
        ends on its boundary and stamping its ``last_access`` with ``tick``. The one walk of
        both caches' matches and inserts; the caller updates each node before the walk goes on
        below it."""
        end = len(key) // self.page_size * self.page_size
        node, pos = self._root, 0
        while pos < end:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                return
            child.last_access = tick
            n = self._match_len(child.key, key, pos, end)
            if n < len(child.key):
                child = self._split(child, n)
            yield child, pos, n
            node, pos = child, pos + n

    def match_req(self, req: CacheableReq, key: list[int]) -> MatchResult:
        return self.match_prefix(namespaced(key, req.lora_namespace))

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        """Tokens held by the tree (evictable + protected)."""
        return self._evictable_size + self._protected_size

    def releasable_size(self, nodes: list[_TreeNode]) -> int:
        passes: dict[int, int] = {}
        on_paths: dict[int, _TreeNode] = {}
        for node in nodes:
            while node is not self._root:
                passes[node.id] = passes.get(node.id, 0) + 1
                on_paths[node.id] = node
                node = node.parent
        return sum(len(n.key) for i, n in on_paths.items() if n.lock_ref == passes[i])

    def pinned_size(self, nodes: list[_TreeNode]) -> int:
        seen: set[int] = set()
        total = 0
        for node in nodes:
            while node is not self._root and node.id not in seen:
                seen.add(node.id)
                total += len(node.key)
                node = node.parent
        return total

    # ---- updates -----------------------------------------------------------------------------

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        assert len(key) % self.page_size == 0, f"insert of {len(key)} tokens is not page aligned"
        assert len(value) == len(key), "insert: key and value lengths differ"
        tick = next(self._clock)
        node, pos = self._root, 0
        for child, start, n in self._descend(key, tick):  # key is page aligned: all of it
            node, pos = child, start + n
        if pos < len(key):
            # Clone: ``value`` is usually a view of a request row that will be reused.
            leaf = _TreeNode(next(self._ids), key[pos:], value[pos:].clone(), node, tick)
            node.children[self._child_key(key, pos)] = leaf
            self._evictable_size += len(leaf.key)
            self._evictable_leaves.discard(node)
            self._evictable_leaves.add(leaf)
        return pos

    def inc_lock_ref(self, node: _TreeNode) -> None:
        while node is not self._root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: _TreeNode) -> None:
        while node is not self._root:
            assert node.lock_ref > 0, "dec_lock_ref without a matching inc_lock_ref"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                if not node.children:
                    self._evictable_leaves.add(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = [(leaf.last_access, leaf.id, leaf) for leaf in self._evictable_leaves]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, 0)]
            self._evictable_leaves.remove(leaf)
            self._evictable_size -= len(leaf.key)
            freed.append(leaf.value)
            num_freed += len(leaf.value)
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                self._evictable_leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if freed:
            self.allocator.free(torch.cat(freed))
        self.evicted_tokens += num_freed
        return num_freed

    def _insert_req(
        self, req: CacheableReq, token_ids: list[int]
    ) -> tuple[int, torch.Tensor, int, int, int]:
        """Insert the whole pages of ``token_ids`` (the request's row) into the tree.

        Returns ``(row, kv, aligned, cached, new_prefix)``: the request's row and its KV slots
        up to ``len(token_ids)``, the page-aligned length inserted, the page-aligned part of the
        prefix the request had locked (after an earlier ``cache_unfinished_req`` its
        ``prefix_indices`` may end in its own partial page, which is not the tree's), and how
        many leading tokens the tree already held before this insert.
        """
        assert req.req_pool_idx is not None, f"request {req.rid} holds no request slot"
        row = req.req_pool_idx
        kv = self.req_to_token_pool.req_to_token[row, : len(token_ids)]
        aligned = len(token_ids) // self.page_size * self.page_size
        cached = len(req.prefix_indices) // self.page_size * self.page_size
        new_prefix = self.insert(namespaced(token_ids[:aligned], req.lora_namespace),
                                 kv[:aligned])
        assert new_prefix >= cached, "the request's locked prefix vanished from the tree"
        return row, kv, aligned, cached, new_prefix

    def cache_finished_req(self, req: CacheableReq, token_ids: list[int]) -> None:
        row, kv, aligned, cached, new_prefix = self._insert_req(req, token_ids)
        # Slots of ``kv`` (positions of the request row):
        #   | [0, cached)          | tree's, pinned by req.last_node  | unlocked below           |
        #   | [cached, new_prefix) | request's; another request       | freed (duplicates)       |
        #   |                      | cached these tokens meanwhile    |                          |
        #   | [new_prefix, aligned)| request's                        | inserted: now the tree's |
        #   | [aligned, len)       | request's partial last page      | freed                    |
        self.allocator.free(torch.cat((kv[cached:new_prefix], kv[aligned:])))
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: CacheableReq, token_ids: list[int]) -> None:
        row, kv, aligned, cached, new_prefix = self._insert_req(req, token_ids)
        # Slots of ``kv`` (positions of the request row):
        #   | [0, cached)          | tree's, pinned by req.last_node  | lock moves to new node   |
        #   | [cached, new_prefix) | request's; already in the tree   | freed; row repointed at  |
        #   |                      |                                  | the tree's slots         |
        #   | [new_prefix, aligned)| request's                        | inserted: now the tree's |
        #   | [aligned, len)       | request's partial last page      | kept by the request      |
        self.allocator.free(kv[cached:new_prefix])
        match = self.match_prefix(namespaced(token_ids[:aligned], req.lora_namespace))
        assert len(match.device_indices) == aligned, "a just-inserted prefix did not match"
        tail = kv[aligned:].clone()
        self.req_to_token_pool.req_to_token[row, cached:aligned] = match.device_indices[cached:]
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat((match.device_indices, tail))
        req.last_node = match.last_node

    def reset(self) -> None:
        """Drop every node and return its slots to the allocator (no request may hold a lock)."""
        assert self._protected_size == 0, "reset while running requests lock the tree"
        values = [node.value for node in self._nodes()]
        if values:
            self.allocator.free(torch.cat(values))
        self._init_tree()

    def pretty_print(self) -> None:
        """Print one line per node (head of its key, token count, lock count) and the totals."""
        stack = [(child, 0) for child in self._root.children.values()]
        while stack:
            node, depth = stack.pop()
            head = node.key[:8] if len(node.key) <= 8 else [*node.key[:8], "..."]
            print(f"{'  ' * depth}{head} tokens={len(node.key)} lock={node.lock_ref}")
            stack.extend((child, depth + 1) for child in node.children.values())
        print(
            f"total={self.total_size()} evictable={self._evictable_size} "
            f"protected={self._protected_size}"
        )

    # ---- helpers -----------------------------------------------------------------------------

    def _child_key(self, key: list[int], pos: int) -> Hashable:
        """Children are keyed by their first page (a token id when page_size is 1)."""
        if self.page_size == 1:
            return key[pos]
        return tuple(key[pos : pos + self.page_size])

    def _match_len(self, node_key: list[int], key: list[int], pos: int, end: int) -> int:
        """Length of the common prefix of ``node_key`` and ``key[pos:end]``, in whole pages."""
        n = min(len(node_key), end - pos)
        ps = self.page_size
        i = 0
        if ps == 1:
            while i < n and node_key[i] == key[pos + i]:
                i += 1
        else:
            while i < n and node_key[i : i + ps] == key[pos + i : pos + i + ps]:
                i += ps
        return i

    def _split(self, node: _TreeNode, n: int) -> _TreeNode:
        """Cut ``node`` after ``n`` tokens (a page boundary); returns the new upper half."""
        parent = node.parent
        assert parent is not None and 0 < n < len(node.key) and n % self.page_size == 0
        upper = _TreeNode(
            next(self._ids), node.key[:n], node.value[:n].clone(), parent, node.last_access
        )
        upper.lock_ref = node.lock_ref  # same locks: every lock on node passes through upper
        upper.hits = node.hits
        parent.children[self._child_key(node.key, 0)] = upper
        node.key = node.key[n:]
        node.value = node.value[n:].clone()
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    def snapshot(self, max_nodes: int) -> dict[str, Any]:
        nodes: list[dict[str, int]] = []
        queue = collections.deque([self._root])
        while queue and len(nodes) < max_nodes:
            node = queue.popleft()
            nodes.append({
                "id": node.id,
                "parent": -1 if node.parent is None else node.parent.id,
                "tokens": len(node.key),
                "lock_ref": node.lock_ref,
                "hits": node.hits,
            })
            queue.extend(node.children.values())
        return {
            "nodes": nodes,
            "truncated": bool(queue),
            "hit_tokens": self.hit_tokens,
            "evicted_tokens": self.evicted_tokens,
            "evictable_tokens": self._evictable_size,
            "protected_tokens": self._protected_size,
        }

    def _nodes(self) -> list[_TreeNode]:
        """Every node but the root."""
        out: list[_TreeNode] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)
