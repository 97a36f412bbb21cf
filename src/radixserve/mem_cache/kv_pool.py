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
