"""Where each scheduler rank gets the messages of a step, so that all ranks process the same ones.

    rank 0 (stage 0)     the tokenizer's ZMQ socket (drained without blocking), plus the
                         ``CloseSessionReqInput`` of sessions whose timeout passed: only rank 0
                         reads a clock, every rank closes them at the same step
    stage 0, rank > 0    rank 0's list, broadcast over the stage's tensor-parallel group
    stage s > 0          the list of its counterpart in stage s - 1, point to point

and every rank of a stage that is not the last passes the list on to its counterpart in the next
stage. Lists travel as msgspec bytes (``io_struct.encode_batch``). Only rank 0 has a socket to
wait on when idle; the others wait inside the receive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from radixserve.distributed import ParallelState
from radixserve.managers import io_struct, ipc
from radixserve.managers.io_struct import CloseSessionReqInput, Message

logger = logging.getLogger(__name__)


class RequestReceiver:
    def __init__(
        self,
        parallel: ParallelState,
        socket: zmq.Socket | None,
        expired_sessions: Callable[[], list[str]],
    ) -> None:
        """``socket``: the tokenizer's PULL socket (rank 0 only); ``expired_sessions``: the
        scheduler's sessions past their timeout (asked on rank 0 only)."""
        self.parallel = parallel
        self.info = parallel.info
        assert (socket is not None) == self.info.is_entry, "rank 0 and only rank 0 reads ZMQ"
        self.socket = socket
        self.expired_sessions = expired_sessions
        self._poller: zmq.Poller | None = None
        # Read while a slowed-down step slept (``wait_for``): handed out first by ``recv``.
        self._pending: list[Message] = []
        if socket is not None:
            self._poller = zmq.Poller()
            self._poller.register(socket, zmq.POLLIN)

    def recv(self) -> list[Message]:
        """This step's messages, the same list on every rank of the replica."""
        info, parallel = self.info, self.parallel
        if info.is_first_stage:
            msgs: list[Message] = []
            if self.socket is not None:
                for session_id in self.expired_sessions():
                    logger.info("session %r timed out", session_id)
                    msgs.append(CloseSessionReqInput(session_id=session_id))
                msgs.extend(self._pending)
                self._pending.clear()
                msgs.extend(ipc.recv_nowait(self.socket))
            if parallel.tp.size > 1:
                data = io_struct.encode_batch(msgs) if self.socket is not None else None
                msgs = io_struct.decode_batch(parallel.tp.broadcast_bytes(data))
        else:
            assert parallel.p2p is not None
            msgs = io_struct.decode_batch(
                parallel.p2p.recv_bytes(info.stage_rank(info.pp_rank - 1))
            )
        if not info.is_last_stage:
            assert parallel.p2p is not None
            parallel.p2p.send_bytes(
                io_struct.encode_batch(msgs), info.stage_rank(info.pp_rank + 1)
            )
        return msgs

    def wait(self, timeout_ms: int) -> None:
        """Idle: block until a message arrives or ``timeout_ms`` passes (rank 0; the other ranks
        return at once and block in the next ``recv`` instead)."""
        if self._poller is not None:
            self._poller.poll(timeout_ms)

    def wait_for(self, wanted: type, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s`` (``slow_down``'s sleep after a step), ending early when a
        ``wanted`` message (the next ``SlowDownReqInput``) arrives: True then. What arrives
        meanwhile is kept, in order, for the next ``recv``. Ranks without the socket sleep."""
        if any(isinstance(m, wanted) for m in self._pending):
            return True
        if self._poller is None or self.socket is None:
            time.sleep(timeout_s)
            return False
        if not self._poller.poll(max(int(timeout_s * 1000), 1)):
            return False
        arrived = ipc.recv_nowait(self.socket)
        self._pending.extend(arrived)
        return any(isinstance(m, wanted) for m in arrived)
