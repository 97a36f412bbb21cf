"""The collectives and point-to-point transfers ranks use, all on ``torch.distributed``.

Bytes (msgspec-encoded ``io_struct`` messages, never pickle) travel as a uint8 tensor behind an
int64 length, on a gloo group. Point-to-point sends never block the sender: a stage sends its
activations and goes on computing while the next stage receives them, and two stages that send to
each other at the same moment (the pipeline's ring: activations forward, tokens back) cannot
deadlock. A sent tensor is kept alive until its transfer completes.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

_LEN = torch.int64


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def broadcast_bytes(data: bytes | None, src: int, group: dist.ProcessGroup | None) -> bytes:
    """``data`` of global rank ``src`` on every rank of ``group`` (others pass None)."""
    is_src = dist.get_rank() == src
    length = torch.tensor([len(data) if is_src and data is not None else 0], dtype=_LEN)
    dist.broadcast(length, src=src, group=group)
    n = int(length.item())
    if n == 0:
        return b""
    payload = _as_tensor(data) if is_src and data is not None else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    return payload.numpy().tobytes()


def all_gather(
    tensor: torch.Tensor, size: int, dim: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape on all) concatenated along ``dim`` in rank order."""
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=dim)


class PointToPoint:
    """Non-blocking sends and blocking receives between two ranks' matching calls.

    Messages between one pair of ranks arrive in the order they were sent; the receiver knows a
    tensor's shape from its own (identical) scheduling decision, and a bytes message's from the
    length sent ahead of it.
    """

    def __init__(
        self, device_group: dist.ProcessGroup | None, cpu_group: dist.ProcessGroup | None
    ) -> None:
        self.device_group = device_group
        self.cpu_group = cpu_group
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def send_tensor(self, tensor: torch.Tensor, dst: int) -> None:
        self._isend(tensor.contiguous(), dst, self.device_group)

    def recv_tensor(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int
    ) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src=src, group=self.device_group)
        return out

    def send_bytes(self, data: bytes, dst: int) -> None:
        self._isend(torch.tensor([len(data)], dtype=_LEN), dst, self.cpu_group)
        if data:
            self._isend(_as_tensor(data), dst, self.cpu_group)

    def recv_bytes(self, src: int) -> bytes:
        length = torch.empty(1, dtype=_LEN)
        dist.recv(length, src=src, group=self.cpu_group)
        n = int(length.item())
        if n == 0:
            return b""
        payload = torch.empty(n, dtype=torch.uint8)
        dist.recv(payload, src=src, group=self.cpu_group)
        return payload.numpy().tobytes()

    def _isend(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> None:
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()
        self._pending.append((dist.isend(tensor, dst=dst, group=group), tensor))
