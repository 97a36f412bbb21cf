"""Compile each grammar once, off the caller's thread, and keep the most recent ones.

``GrammarCache.get(key)`` returns a ``Future`` of the compiled grammar: done at once for a key
compiled before, shared by every request that asks while the same key compiles, and failing with
``GrammarError`` for an invalid grammar (failures are cached too: the same bad schema sent again
is refused without compiling). Compilation runs on one worker thread, which also builds the
backend on first use (building xgrammar's vocabulary tables takes a moment for a large
vocabulary, and servers that never see a grammar should not pay it at start-up).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from radixserve.constrained.base import GrammarBackend, GrammarKey

DEFAULT_MAX_ENTRIES = 1024


class GrammarCache:
    """LRU of compile futures keyed by ``GrammarKey``; used from one thread (the scheduler's)."""

    def __init__(
        self,
        backend_factory: Callable[[], GrammarBackend],
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self._factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._max_entries = max_entries
        self._entries: OrderedDict[GrammarKey, Future[Any]] = OrderedDict()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.hits = 0
        self.misses = 0

    @property
    def backend(self) -> GrammarBackend:
        """The backend; built on the worker thread by the first compile, or here if asked
        before (blocking)."""
        if self._backend is None:
            self._backend = self._factory()
        return self._backend

    def get(self, key: GrammarKey) -> Future[Any]:
        """The compile future of ``key`` (see the module docstring)."""
        future = self._entries.get(key)
        if future is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return future
        self.misses += 1
        future = self._executor.submit(self._compile, key)
        self._entries[key] = future
        self._evict()
        return future

    def _compile(self, key: GrammarKey) -> Any:
        return self.backend.compile(key)

    def _evict(self) -> None:
        """Drop the least recently used finished entries beyond the limit (a running compile
        stays: requests wait on it)."""
        excess = len(self._entries) - self._max_entries
        for key in [k for k, f in self._entries.items() if f.done()][: max(excess, 0)]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every finished compilation (``flush_cache``)."""
        for key in [k for k, f in self._entries.items() if f.done()]:
            del self._entries[key]
