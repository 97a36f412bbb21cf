"""Request slots: each running request owns one row mapping its token positions to KV slots."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """``req_to_token[row, pos]`` is the KV slot of token ``pos`` of the request in ``row``."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """One free row, or ``None`` when every row is taken."""
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        assert 0 <= idx < self.size and idx not in self._free, f"double free of row {idx}"
        self._free.append(idx)

    def clear(self) -> None:
        self._free = list(range(self.size))
