"""The host tier of the hierarchical cache: a second KV pool in host memory.

It holds KV in the device pool's own per-token byte format (``MHATokenToKVPool.read_kv_pages``),
so it never needs to know the pool's dtype or layout (a quantized pool's scales travel with the
rest). One ``uint8`` buffer of ``[size, kv_bytes_per_token]`` rows, allocated in whole pages of
the device pool's page size; pinned when the device pool is on CUDA, so that copies to and from
the GPU are DMA transfers. On a CPU the buffer is plain host memory: the copies cost a memcpy, and
what they buy is room, since the radix tree can then keep more prefixes than the device pool holds.
"""

from __future__ import annotations

import torch

from radixserve.mem_cache.kv_pool import MHATokenToKVPool


class HostKVPool:
    """``size`` tokens of KV in host memory, handed out a page at a time (slot ``s`` lives in
    page ``s // page_size``; unlike the device pool there is no padding page)."""

    def __init__(self, device_pool: MHATokenToKVPool, size: int) -> None:
        page_size = device_pool.page_size
        self.page_size = page_size
        self.num_pages = max(size // page_size, 0)
        self.size = self.num_pages * page_size
        self.device_pool = device_pool
        self.bytes_per_token = device_pool.kv_bytes_per_token()
        self.pinned = device_pool.device.type == "cuda"
        self.buffer = torch.empty(
            (self.size, self.bytes_per_token), dtype=torch.uint8, pin_memory=self.pinned
        )
        self._free_pages: list[int] = list(range(self.num_pages - 1, -1, -1))  # pop() = lowest
        self._page_is_free = [True] * self.num_pages

    @staticmethod
    def tokens_for_bytes(device_pool: MHATokenToKVPool, nbytes: int) -> int:
        """Tokens a host pool of ``nbytes`` bytes holds (``--hicache-size``)."""
        return nbytes // device_pool.kv_bytes_per_token()

    def available_size(self) -> int:
        return len(self._free_pages) * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for ``num_tokens`` (a whole number of pages), or ``None`` if too few are free."""
        assert num_tokens % self.page_size == 0, "host allocations are whole pages"
        num_pages = num_tokens // self.page_size
        if num_pages > len(self._free_pages):
            return None
        pages = [self._free_pages.pop() for _ in range(num_pages)]
        for page in pages:
            self._page_is_free[page] = False
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (torch.tensor(pages, dtype=torch.int64)[:, None] * self.page_size
                + offsets).flatten()

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages of ``slots``."""
        if slots.numel() == 0:
            return
        for page in torch.unique(slots // self.page_size).tolist():
            assert not self._page_is_free[page], "double free of a host KV page"
            self._page_is_free[page] = True
            self._free_pages.append(page)

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy the KV of device ``device_slots`` into host ``host_slots``."""
        self.buffer[host_slots] = self.device_pool.read_kv_pages(device_slots)

    def restore(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy the KV of host ``host_slots`` into device ``device_slots``."""
        self.device_pool.write_kv_pages(device_slots, self.buffer[host_slots])

    def read(self, host_slots: torch.Tensor) -> torch.Tensor:
        """The KV bytes of ``host_slots`` (for the storage tier)."""
        return self.buffer[host_slots]
