"""KV slot allocation: hands out indices into the KV pool, one page at a time.

Slot ``s`` lives in page ``s // page_size``. Page 0 (slots ``0..page_size-1``) is the padding page
the KV pool reserves: it is never handed out, so a zeroed ``req_to_token`` row or a padded
``out_cache_loc`` points at harmless memory. Pages ``1..size // page_size`` are allocatable.

A page has one owner at a time: a request, or a radix-tree node. A request's last page may be
partly filled; ``alloc_extend`` and ``alloc_decode`` continue it (slot ``last_loc + 1`` onwards)
before taking a new page, so a request's KV is made of whole pages plus one partial page at its
end, and the prefix cache can take over whole pages. ``free`` works on pages too: passing any slot
of a page returns the whole page.

The free list and the double-free bookkeeping are tensors on the pool's device; Python loops run
per request (in ``alloc_extend``/``alloc_decode``), never per token. Freed pages queue behind the
free list as they come and join it when it runs short, or when ``MAX_QUEUED_FREES`` frees have
queued (which bounds the queue's memory): appending them to it on every ``free`` copied the whole
list (millions of slots in a pool sized by memory: milliseconds per finished or evicted request,
on the scheduler's thread).

Decode runs (``decode_run > 1``, page size 1; the model runner sets ``HOST_DECODE_RUN`` for a
pool in host memory). A decode step asks for one slot per request of the batch; taken from the
free list in order, those slots are adjacent, so the tokens a batch generates are interleaved and
a request's generated rows lie the batch size apart. The CPU attention kernels then read each
row from a different place in memory, and a batch of 16 long generations attended 1.75x slower
than over the same rows in runs (benchmarks/RESULTS.md, session 24). So a request that needs a
slot gets a run of ``decode_run`` free slots: the first now, the rest *parked*, and its next
decode steps take the slot after its last one while that slot is parked. Parked slots are free
in every sense that counts (``available_size``, the double-free check): nobody owns them, and
when the free list runs short they rejoin it (all at once). Runs are parked only while the free
list has room to spare (``PARK_HEADROOM`` runs per slot asked for), so a nearly full pool
behaves as before.
"""

from __future__ import annotations

import torch

# frees queued before they join the free list: one copy of the list per this many frees
MAX_QUEUED_FREES = 1024
# decode_run for a pool in host memory: a request's generated tokens in runs of this many slots
# (16 gave back most of the interleaved layout's loss in session 24's measurement, 64 nearly all)
HOST_DECODE_RUN = 32
# runs are parked only while the free list holds this many runs per slot a decode step asks for
PARK_HEADROOM = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TokenToKVPoolAllocator:
    """Page-granular allocator of KV slots (``size`` tokens, a multiple of ``page_size``)."""

    def __init__(self, size: int, page_size: int, device: torch.device | str,
                 decode_run: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if decode_run < 1 or (decode_run > 1 and page_size > 1):
            raise ValueError(f"decode_run must be 1, or > 1 with page_size 1; got {decode_run} "
                             f"with page_size {page_size}")
        if size < 0 or size % page_size:
            raise ValueError(
                f"KV pool size must be a non-negative multiple of page_size={page_size}, got {size}"
            )
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self.decode_run = decode_run
        self._free_pages: torch.Tensor  # handed out first, in order
        self._released: list[torch.Tensor]  # pages freed since, in order, not yet in _free_pages
        self._num_released: int
        self._page_is_free: torch.Tensor  # [num_pages + 1] bool: catches double frees cheaply
        self._parked: torch.Tensor  # [num_pages + 1] bool: free slots kept for a decode run
        self._num_parked: int
        self.clear()

    @property
    def reads_last_locs(self) -> bool:
        """Whether ``alloc_extend``/``alloc_decode`` read ``last_locs`` (else any value does)."""
        return self.page_size > 1 or self.decode_run > 1

    def clear(self) -> None:
        """Make every page free again (flush_cache, when no request holds KV)."""
        self._free_pages = torch.arange(
            1, self.num_pages + 1, dtype=torch.int64, device=self.device
        )
        self._released = []
        self._num_released = 0
        self._page_is_free = torch.ones(self.num_pages + 1, dtype=torch.bool, device=self.device)
        self._page_is_free[0] = False
        self._parked = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=self.device)
        self._num_parked = 0

    def available_size(self) -> int:
        """Free KV slots (whole free pages, in tokens; parked slots are free)."""
        return (len(self._free_pages) + self._num_released + self._num_parked) * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` fresh slots (``page_size == 1`` only), or ``None`` if too few are free."""
        assert self.page_size == 1, "alloc(n) is for page_size 1; use alloc_extend"
        return self._take_pages(num_tokens)

    def alloc_extend(
        self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]
    ) -> torch.Tensor | None:
        """Slots for positions ``[prefix_lens[i], seq_lens[i])`` of each request, concatenated.

        A request whose prefix ends inside a page (``prefix_len % page_size != 0``) first gets the
        rest of that page (``last_locs[i] + 1, ...``; ``last_locs[i]`` is the slot of its token at
        ``prefix_len - 1``, or -1 without a prefix), then whole new pages. All or nothing: returns
        ``None`` and allocates nothing when the new pages do not fit.
        """
        ps = self.page_size
        if ps == 1:
            return self._take_pages(sum(s - p for p, s in zip(prefix_lens, seq_lens, strict=True)))

        num_new_pages = 0
        for p, s, last in zip(prefix_lens, seq_lens, last_locs, strict=True):
            assert 0 <= p <= s, f"bad extend: prefix_len {p}, seq_len {s}"
            assert p % ps == 0 or (last >= ps and last % ps == (p - 1) % ps), (
                f"last_loc {last} is not the slot of position {p - 1} (page_size {ps})"
            )
            num_new_pages += _cdiv(s, ps) - _cdiv(p, ps)
        pages = self._take_pages(num_new_pages)
        if pages is None:
            return None

        offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        parts: list[torch.Tensor] = []
        next_page = 0
        for p, s, last in zip(prefix_lens, seq_lens, last_locs, strict=True):
            fill = min(s - p, -p % ps)  # room left in the request's partial last page
            if fill:
                parts.append(
                    torch.arange(last + 1, last + 1 + fill, dtype=torch.int64, device=self.device)
                )
            k = _cdiv(s, ps) - _cdiv(p, ps)
            if k:
                slots = (pages[next_page : next_page + k, None] * ps + offsets).flatten()
                parts.append(slots[: s - p - fill])
                next_page += k
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(parts)

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """One slot per request for its newest token (``seq_lens`` count that token).

        The slot is ``last_locs[i] + 1`` while the request's last page has room, else the first
        slot of a new page. At page size 1 with decode runs, ``last_locs[i] + 1`` while it is
        parked, else the first slot of a new run. All or nothing, like ``alloc_extend``.
        """
        ps = self.page_size
        if ps == 1:
            if self.decode_run > 1:
                return self._alloc_decode_runs(last_locs)
            return self._take_pages(len(seq_lens))

        needs_page = []
        for s, last in zip(seq_lens, last_locs, strict=True):
            assert s >= 1, f"bad decode seq_len {s}"
            new_page = (s - 1) % ps == 0
            assert new_page or (last >= ps and last % ps == (s - 2) % ps), (
                f"last_loc {last} is not the slot of position {s - 2} (page_size {ps})"
            )
            needs_page.append(new_page)
        pages = self._take_pages(sum(needs_page))
        if pages is None:
            return None
        out = torch.tensor(last_locs, dtype=torch.int64, device=self.device) + 1
        out[torch.tensor(needs_page, dtype=torch.bool, device=self.device)] = pages * ps
        return out

    def _alloc_decode_runs(self, last_locs: list[int]) -> torch.Tensor | None:
        """``alloc_decode`` with decode runs: the parked slot after a request's last one, else
        the first of a new run; all or nothing."""
        out = torch.tensor(last_locs, dtype=torch.int64, device=self.device) + 1
        out[out > self.num_pages] = 0  # slot 0 (padding) is never parked
        hit = self._parked[out]
        hits = out[hit]
        self._parked[hits] = False  # ours now; back on failure below
        self._num_parked -= len(hits)
        misses = int(len(out) - len(hits))
        if misses:
            fresh = self._take_runs(misses)
            if fresh is None:
                self._parked[hits] = True
                self._num_parked += len(hits)
                return None
            out[~hit] = fresh
        self._page_is_free[hits] = False
        return out

    def _take_runs(self, num_runs: int) -> torch.Tensor | None:
        """The first slot of each of ``num_runs`` fresh runs, the rest of each run parked; single
        slots when the free list has no room to spare."""
        run = self.decode_run
        if len(self._free_pages) + self._num_released < PARK_HEADROOM * num_runs * run:
            return self._take_pages(num_runs)
        slots = self._take_pages(num_runs * run)
        assert slots is not None  # the headroom check saw them free
        rest = slots.view(num_runs, run)[:, 1:].flatten()
        self._page_is_free[rest] = True
        self._parked[rest] = True
        self._num_parked += len(rest)
        return slots[::run]

    def _unpark_all(self) -> None:
        """Every parked slot back on the free list (it ran short)."""
        parked = self._parked.nonzero().squeeze(1)
        self._parked[parked] = False
        self._num_parked = 0
        self._free_pages = torch.cat((self._free_pages, parked))

    def free(self, indices: torch.Tensor) -> None:
        """Return every page that has a slot in ``indices`` (duplicates within a page are fine)."""
        if indices.numel() == 0:
            return
        pages = torch.unique(indices // self.page_size)  # sorted
        assert self.page_size > 1 or len(pages) == indices.numel(), "double free of a KV slot"
        assert 1 <= int(pages[0]) and int(pages[-1]) <= self.num_pages, (
            f"freeing slots outside pages 1..{self.num_pages} (page 0 is padding)"
        )
        assert not bool(self._page_is_free[pages].any()), "double free of a KV page"
        self._page_is_free[pages] = True
        self._released.append(pages)
        self._num_released += len(pages)
        if len(self._released) >= MAX_QUEUED_FREES:
            self._join_released()

    def _join_released(self) -> None:
        if self._released:
            self._free_pages = torch.cat((self._free_pages, *self._released))
            self._released = []
            self._num_released = 0

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        """The first ``num_pages`` free pages (slots, when page_size is 1), or ``None``."""
        if num_pages > len(self._free_pages):
            if num_pages > len(self._free_pages) + self._num_released + self._num_parked:
                return None
            self._join_released()  # one copy per pass through the free list, not per free
            if num_pages > len(self._free_pages):
                self._unpark_all()
        pages = self._free_pages[:num_pages]
        self._free_pages = self._free_pages[num_pages:]
        self._page_is_free[pages] = False
        return pages
