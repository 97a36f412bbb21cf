"""The memory invariant of docs/architecture.md §3, one check for idle and busy schedulers.

    KV slots:      available + evictable + protected + session_held + in_batch == total
    request rows:  free + session_held_rows + rows of running requests == pool size

``in_batch`` is the KV running requests own: each one's row up to its KV length (whole pages)
minus the prefix the cache owns and pins for it (``protected_prefix_len``). ``protected`` counts
tree nodes locked by running requests and by streaming sessions (a session's first-turn prefix
stays locked while it holds its slot). When nothing runs, ``in_batch`` is 0 and the only locks
left must be the sessions': ``protected == session_protected``. ``session_offloaded`` (KV in the
session store) holds no pool memory and is reported beside the sums. With the hierarchical cache
the lower tiers are checked too (``tier_problems``): every host slot handed out belongs to one
tree node, no node holds KV in no tier, and no host-only node is locked.

The scheduler checks whenever it goes idle; with ``RADIXSERVE_STRICT_MEM_CHECK=busy`` also after
every step, raising on a violation. A violation is a bug: "memory leak detected" is logged with the
figures, and raised in tests (``RADIXSERVE_TEST_STRICT``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from radixserve import envs
from radixserve.managers.scheduler.schedule_batch import Req
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache

logger = logging.getLogger(__name__)

BUSY = "busy"
_MODES = ("", "idle", BUSY)


def busy_check_enabled() -> bool:
    """``RADIXSERVE_STRICT_MEM_CHECK``: unset or ``idle`` (checks when idle), or ``busy``."""
    mode = envs.RADIXSERVE_STRICT_MEM_CHECK.get("").strip().lower()
    if mode not in _MODES:
        raise ValueError(f"RADIXSERVE_STRICT_MEM_CHECK must be 'idle' or 'busy', got {mode!r}")
    return mode == BUSY


class MemoryChecker:
    def __init__(
        self, tree_cache: BasePrefixCache, allocator: Any, req_to_token_pool: Any, total: int
    ) -> None:
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.total = total
        self.page_size: int = allocator.page_size

    def figures(self) -> dict[str, int]:
        """The pools' counters (the ``memory`` of ``get_server_info``'s internal state)."""
        cache = self.tree_cache
        return {
            "available_kv_tokens": self.allocator.available_size(),
            "evictable_kv_tokens": cache.evictable_size(),
            "protected_kv_tokens": cache.protected_size(),
            "session_held_kv_tokens": cache.session_held_tokens(),
            "session_offloaded_tokens": cache.session_offloaded_tokens(),
            "total_kv_tokens": self.total,
            "free_req_slots": self.req_to_token_pool.available_size(),
            "total_req_slots": self.req_to_token_pool.size,
            **cache.tier_figures(),
        }

    def check(self, holders: Iterable[Req]) -> dict[str, Any]:
        """Check the invariant with ``holders``: every request that holds a request row.
        Returns the record (``ok``, time, figures); logs, and raises when strict, on a leak."""
        holding = [r for r in holders if r.req_pool_idx is not None]
        cache = self.tree_cache
        m = self.figures()
        in_batch = sum(
            -(-r.kv_len // self.page_size) * self.page_size - cache.protected_prefix_len(r)
            for r in holding
        )
        accounted = (
            m["available_kv_tokens"] + m["evictable_kv_tokens"] + m["protected_kv_tokens"]
            + m["session_held_kv_tokens"] + in_batch
        )
        rows = m["free_req_slots"] + cache.session_held_rows() + len(holding)
        ok = accounted == m["total_kv_tokens"] and rows == m["total_req_slots"]
        if not holding:
            ok = ok and m["protected_kv_tokens"] == cache.session_protected_tokens()
        problems = cache.tier_problems()
        ok = ok and not problems
        record = {"ok": ok, "time": time.time(), "in_batch_kv_tokens": in_batch, **m}
        if problems:
            record["tier_problems"] = problems
        if not ok:
            message = f"memory leak detected: {record}"
            logger.error(message)
            if envs.RADIXSERVE_TEST_STRICT.get() or busy_check_enabled():
                raise RuntimeError(message)
        return record
