"""ZMQ sockets between the processes of one launch.

Every launch gets a private temporary directory of ``ipc://`` endpoints. Each receiving process
binds one PULL socket; senders connect PUSH sockets to it. Messages go through ``io_struct``'s
codec only.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import zmq
import zmq.asyncio

from radixserve.managers import io_struct


@dataclass(frozen=True)
class PortArgs:
    """Endpoints of one launch (passed to each spawned process)."""

    scheduler_input: str
    detokenizer_input: str
    tokenizer_input: str

    @classmethod
    def create(cls) -> PortArgs:
        d = tempfile.mkdtemp(prefix="radixserve-")
        return cls(
            scheduler_input=f"ipc://{os.path.join(d, 'scheduler')}",
            detokenizer_input=f"ipc://{os.path.join(d, 'detokenizer')}",
            tokenizer_input=f"ipc://{os.path.join(d, 'tokenizer')}",
        )

    def replica_input(self, dp_rank: int, dp_size: int) -> str:
        """Where a replica's rank 0 receives: the tokenizer's endpoint itself with one replica,
        else one of its own, fed by the data-parallel controller (which binds the former)."""
        if dp_size == 1:
            return self.scheduler_input
        return f"{self.scheduler_input}-dp{dp_rank}"

    @property
    def directory(self) -> str:
        return os.path.dirname(self.scheduler_input.removeprefix("ipc://"))


def pull_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


def push_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def send(sock: zmq.Socket, msg: io_struct._Msg) -> None:
    sock.send(io_struct.encode(msg), copy=False)


def recv_nowait(sock: zmq.Socket) -> list[io_struct.Message]:
    """Drain every message that is already waiting, without blocking."""
    msgs = []
    while True:
        try:
            data = sock.recv(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return msgs
        msgs.append(io_struct.decode(data))
