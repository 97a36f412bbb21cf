"""The KV cache itself: per-layer K and V tensors indexed by KV slot.

Slots ``0..page_size-1`` form a reserved padding page that the allocator never hands out, so
usable slots are ``page_size..size+page_size-1``. Attention backends point the padding entries of
their slot tables at slot 0 and mask them, which keeps every gather in bounds.

Only the padding page is zeroed: every other slot is written before it is read, and leaving the
rest uninitialised keeps a large CPU pool from committing all of its RAM up front. Masked entries
still have to be finite (a NaN survives masking), which the zeroed padding page guarantees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class MHATokenToKVPool:
    """K and V buffers of shape ``[size + page_size, head_num, head_dim]`` for each layer,
    allocated when the pool is made. A dataclass for its constructor; pools compare by identity."""

    size: int
    page_size: int
    dtype: torch.dtype
    head_num: int
    head_dim: int
    layer_num: int
    device: torch.device  # a str is accepted and converted
    k_buffer: list[torch.Tensor] = field(init=False, repr=False, default_factory=list)
    v_buffer: list[torch.Tensor] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        assert self.size % self.page_size == 0, (
            f"KV pool size {self.size} is not a multiple of {self.page_size}"
        )
        self.device = torch.device(self.device)
        self.allocate()

    def allocate(self) -> None:
        """(Re)create the buffers; only the padding page is zeroed (see the module docstring)."""
        shape = (self.size + self.page_size, self.head_num, self.head_dim)
        kwargs = {"dtype": self.dtype, "device": self.device}
        self.k_buffer = [torch.empty(shape, **kwargs) for _ in range(self.layer_num)]
        self.v_buffer = [torch.empty(shape, **kwargs) for _ in range(self.layer_num)]
        for buffer in self.k_buffer + self.v_buffer:
            buffer[: self.page_size].zero_()

    def release(self) -> None:
        """Free the buffers (``release_memory_occupation``); ``allocate`` brings them back.
        Every slot's content is lost: the caller flushes whatever referred to it."""
        self.k_buffer, self.v_buffer = [], []

    @staticmethod
    def bytes_per_token(head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        """KV bytes one token takes across all layers (K and V)."""
        return 2 * layer_num * head_num * head_dim * dtype.itemsize

    def size_bytes(self) -> int:
        """Bytes held by all K and V buffers, padding page included."""
        return sum(b.numel() * b.element_size() for b in self.k_buffer + self.v_buffer)

    # ---- page copies between tiers (mem_cache/hiradix_cache.py, hicache_storage.py) -------------
    # The hierarchical cache moves KV between this pool, host memory and files only through the
    # three methods below, as opaque bytes per token: a pool that stores more per token (a
    # quantized pool's scales) extends them, and every tier carries what it returns unchanged.

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's KV takes in ``read_kv_pages``'s format (all layers, K and V)."""
        return self.bytes_per_token(self.head_num, self.head_dim, self.layer_num, self.dtype)

    def kv_layout(self) -> dict[str, object]:
        """What KV bytes of this pool mean: stored KV whose layout differs is never loaded."""
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "layer_num": self.layer_num,
            "head_num": self.head_num,
            "head_dim": self.head_dim,
            "kv_bytes_per_token": self.kv_bytes_per_token(),
            "token_layout": "k_layers,v_layers",
        }

    def read_kv_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV of ``slots`` (whole pages, in practice) as a CPU ``uint8`` tensor of shape
        ``[len(slots), kv_bytes_per_token()]``: per token, K of every layer then V of every
        layer, each ``[head_num, head_dim]``."""
        index = slots.to(self.device)
        kv = torch.stack([b[index] for b in self.k_buffer + self.v_buffer], dim=1)
        data = kv.cpu().contiguous().view(torch.uint8)
        return data.reshape(len(slots), self.kv_bytes_per_token())

    def write_kv_pages(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        """Write ``data`` (``read_kv_pages``'s format, on any device) into ``slots``."""
        n = len(slots)
        assert data.shape == (n, self.kv_bytes_per_token()), (
            f"KV bytes of shape {tuple(data.shape)} for {n} slots"
        )
        kv = data.to(self.device, non_blocking=True).contiguous().view(self.dtype)
        kv = kv.view(n, 2 * self.layer_num, self.head_num, self.head_dim)
        index = slots.to(self.device)
        for i, buffer in enumerate(self.k_buffer + self.v_buffer):
            buffer[index] = kv[:, i]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write ``k``, ``v`` (``[n, head_num, head_dim]``) into slots ``loc`` (``[n]``)."""
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)
