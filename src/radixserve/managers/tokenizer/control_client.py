"""The client side of the scheduler's control requests (server process; it mirrors
``managers/scheduler/scheduler_control.py``, the scheduler's side).

One generic path for every control request: ``call_all`` sends it to every data-parallel
replica (or ``fan_out`` of them) and awaits their replies; ``call`` picks the one reply to act
on (the first that refuses, else the first) and raises ``ValueError`` with the scheduler's reason
where ``CONTROL_CALLS`` says a refusal is an error. ``CONTROL_CALLS`` is the table of the
control requests: each request type, the reply type the scheduler answers with, how a reply
refuses and what is checked before sending. The ``Engine`` and the HTTP routes build the request
and read the reply; the ``TokenizerManager`` adds what needs its own state (admission around a
weight update or a memory release, the requests in flight around a pause, session ids).

Replies of one request type are answered in order, so one request of a type is in flight at a
time (a lock per reply type). Liveness pings (``check_health``) are the exception: concurrent
checks share pings, answered by sequence number.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from radixserve.managers import io_struct
from radixserve.managers.tokenizer.request_state import SchedulerError

logger = logging.getLogger(__name__)


def _unsuccessful(reply: Any) -> str | None:
    return None if reply.success else reply.message


def _lora_refusal(reply: io_struct.LoRAUpdateOutput) -> str | None:
    return None if reply.success else reply.error_message


def _check_sleep(req: io_struct.SlowDownReqInput, timeout: float) -> None:
    """``slow_down``'s sleep is bounded by ``--watchdog-timeout`` (``timeout``): a longer one
    would only end the server (the watchdog) and outlast the reset's wait."""
    sleep = req.forward_sleep_time
    if sleep is not None and sleep < 0:
        raise ValueError(f"forward_sleep_time must be >= 0, got {sleep}")
    if sleep is not None and sleep > timeout:
        raise ValueError(f"forward_sleep_time must be at most --watchdog-timeout "
                         f"({timeout:g} s), got {sleep:g}")


@dataclass(frozen=True)
class ControlCall:
    """One control request: its reply type, why a reply refuses (None: it does not), and
    whether ``call`` raises that refusal as ``ValueError`` or returns the refusing reply."""

    reply: type
    refusal: Callable[[Any], str | None] | None = None
    raises: bool = True
    # raises ValueError before anything is sent; gets the request and the reply timeout
    check: Callable[[Any, float], None] | None = None


CONTROL_CALLS: dict[type, ControlCall] = {
    # A flush refused while requests run is an answer (success false), not an error.
    io_struct.FlushCacheReq: ControlCall(
        io_struct.FlushCacheReqOutput, _unsuccessful, raises=False
    ),
    io_struct.GetInternalStateReq: ControlCall(io_struct.GetInternalStateReqOutput),
    io_struct.OpenSessionReqInput: ControlCall(io_struct.OpenSessionReqOutput),
    io_struct.PauseGenerationReqInput: ControlCall(io_struct.PauseGenerationReqOutput),
    io_struct.ContinueGenerationReqInput: ControlCall(io_struct.ContinueGenerationReqOutput),
    io_struct.UpdateWeightFromDiskReqInput: ControlCall(
        io_struct.UpdateWeightFromDiskReqOutput, _unsuccessful
    ),
    io_struct.GetWeightsByNameReqInput: ControlCall(
        io_struct.GetWeightsByNameReqOutput,
        lambda reply: reply.message if reply.parameter is None else None,
    ),
    # RL weight sync (weight_sync_client.py); one reply type, one request in flight at a time.
    **dict.fromkeys(
        (io_struct.InitWeightsUpdateGroupReqInput, io_struct.UpdateWeightsFromDistributedReqInput,
         io_struct.UpdateWeightsFromTensorReqInput, io_struct.DestroyWeightsUpdateGroupReqInput),
        ControlCall(io_struct.WeightsUpdateReqOutput, _unsuccessful),
    ),
    io_struct.ReleaseMemoryOccupationReqInput: ControlCall(
        io_struct.ReleaseMemoryOccupationReqOutput, _unsuccessful
    ),
    io_struct.ResumeMemoryOccupationReqInput: ControlCall(
        io_struct.ResumeMemoryOccupationReqOutput, _unsuccessful
    ),
    io_struct.ProfileReq: ControlCall(io_struct.ProfileReqOutput, _unsuccessful),
    io_struct.SetInternalStateReq: ControlCall(
        io_struct.SetInternalStateReqOutput,
        lambda reply: None if reply.updated else reply.message,
    ),
    io_struct.SlowDownReqInput: ControlCall(io_struct.SlowDownReqOutput, check=_check_sleep),
    io_struct.FreezeGCReq: ControlCall(io_struct.FreezeGCReqOutput),
    io_struct.GetLoadReqInput: ControlCall(io_struct.GetLoadReqOutput),
    io_struct.GetInspectorStateReq: ControlCall(io_struct.GetInspectorStateReqOutput),
    # The caller reads a refused reply too: it carries the adapters loaded afterwards.
    io_struct.LoadLoRAAdapterReqInput: ControlCall(
        io_struct.LoRAUpdateOutput, _lora_refusal, raises=False
    ),
    io_struct.UnloadLoRAAdapterReqInput: ControlCall(
        io_struct.LoRAUpdateOutput, _lora_refusal, raises=False
    ),
}
_REPLY_TYPES = {call.reply for call in CONTROL_CALLS.values()}


@dataclass
class _Replies:
    """The replies of one control request so far; the future completes with all of them."""

    future: asyncio.Future
    expected: int
    received: list[Any] = field(default_factory=list)

    def add(self, reply: Any) -> None:
        self.received.append(reply)
        if len(self.received) == self.expected:
            self.future.set_result(self.received)


class ControlClient:
    """Sends control requests and routes their replies back to the waiting callers. All
    methods run on the TokenizerManager's loop."""

    def __init__(
        self,
        send: Callable[[io_struct._Msg], None],
        check_alive: Callable[[], None],
        dp_size: int,
        timeout: float,
    ) -> None:
        """``send``: encodes and sends a request to the scheduler (every replica gets it);
        ``check_alive``: raises once the backend is gone; ``timeout``: how long a reply may
        take (the scheduler answers between steps; ``--watchdog-timeout``)."""
        self._send = send
        self._check_alive = check_alive
        self.dp_size = dp_size
        self.timeout = timeout
        self._locks: dict[type, asyncio.Lock] = {}
        self._waiting: dict[type, _Replies] = {}  # reply type → the request awaiting it
        # Liveness pings: the highest sequence number every replica has answered.
        self._ping_seq = itertools.count(1)
        self._pong_seq = 0
        self._pong = asyncio.Event()
        self._pongs: dict[int, int] = {}  # ping → replicas that answered it

    # ------------------------------------------------------------------ the generic path
    async def call(self, req: io_struct._Msg) -> Any:
        """Send ``req`` to every replica; the first reply that refuses, else the first reply.
        A refusal raises ``ValueError`` with the scheduler's reason, unless the table says the
        caller reads it."""
        spec = CONTROL_CALLS[type(req)]
        replies = await self.call_all(req)
        refusals = (
            (reply, reason) for reply in replies
            if spec.refusal is not None and (reason := spec.refusal(reply)) is not None
        )
        refused = next(refusals, None)
        if refused is None:
            return replies[0]
        if spec.raises:
            raise ValueError(refused[1])
        return refused[0]

    async def call_all(self, req: io_struct._Msg, fan_out: int | None = None) -> list[Any]:
        """Send ``req``; its replies, one per replica that answers (``fan_out``, default every
        data-parallel replica). ``SchedulerError`` when the scheduler failed on it."""
        spec = CONTROL_CALLS[type(req)]
        self._check_alive()
        if spec.check is not None:
            spec.check(req, self.timeout)
        lock = self._locks.setdefault(spec.reply, asyncio.Lock())
        async with lock:
            replies = _Replies(asyncio.get_running_loop().create_future(), fan_out or self.dp_size)
            self._waiting[spec.reply] = replies
            try:
                self._send(req)
                return await asyncio.wait_for(replies.future, self.timeout)
            finally:
                del self._waiting[spec.reply]

    # ------------------------------------------------------------------ requests with logic
    async def internal_states(self) -> list[dict[str, Any]]:
        """Every data-parallel replica's internal state, in replica order."""
        replies = await self.call_all(io_struct.GetInternalStateReq())
        return [r.state for r in sorted(replies, key=lambda r: r.state.get("dp_rank", 0))]

    async def load(self) -> list[dict[str, Any]]:
        """One entry per data-parallel replica (SGLang's ``/get_load`` shape)."""
        replies = await self.call_all(io_struct.GetLoadReqInput())
        return [msgspec.structs.asdict(r) for r in sorted(replies, key=lambda r: r.dp_rank)]

    async def freeze_gc(self) -> dict[str, int]:
        """``gc.freeze()`` in the scheduler and in this process; the objects each froze."""
        reply = await self.call(io_struct.FreezeGCReq())
        gc.collect()
        gc.freeze()
        return {"scheduler": reply.frozen_objects, "tokenizer_manager": gc.get_freeze_count()}

    async def check_health(self, timeout: float) -> bool:
        """Whether the scheduler answers a liveness ping within ``timeout`` seconds (it answers
        between steps, so a step stuck for longer fails it). Concurrent checks share pings."""
        self._check_alive()
        seq = next(self._ping_seq)
        self._send(io_struct.HealthCheckReq(seq=seq))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._pong_seq < seq:
            self._pong.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._pong.wait(), remaining)
            except TimeoutError:
                return False
            self._check_alive()
        return True

    # ------------------------------------------------------------------ replies
    def on_message(self, msg: io_struct.Message) -> bool:
        """Route ``msg`` if it answers a control request or a ping; False for other messages."""
        if isinstance(msg, io_struct.HealthCheckReqOutput):
            answered = self._pongs.pop(msg.seq, 0) + 1
            if answered < self.dp_size:
                self._pongs[msg.seq] = answered
            else:  # every replica answered this ping
                self._pong_seq = max(self._pong_seq, msg.seq)
                self._pong.set()
        elif type(msg) in _REPLY_TYPES:
            replies = self._waiting.get(type(msg))
            if replies is not None and not replies.future.done():
                replies.add(msg)
            else:
                logger.warning("unexpected %s without a waiting caller", type(msg).__name__)
        elif isinstance(msg, io_struct.ControlErrorOutput):
            replies = self._waiting_for(msg.request)
            if replies is not None and not replies.future.done():
                replies.future.set_exception(SchedulerError(msg.message))
            else:
                logger.error("the scheduler failed on %s: %s", msg.request, msg.message)
        else:
            return False
        return True

    def _waiting_for(self, request_name: str) -> _Replies | None:
        """The caller awaiting the reply to the request type named ``request_name``."""
        for req_type, spec in CONTROL_CALLS.items():
            if req_type.__name__ == request_name:
                return self._waiting.get(spec.reply)
        return None

    def fail_all(self, message: str) -> None:
        """The backend is gone: every waiting caller raises ``RuntimeError(message)``."""
        for replies in self._waiting.values():
            if not replies.future.done():
                replies.future.set_exception(RuntimeError(message))
