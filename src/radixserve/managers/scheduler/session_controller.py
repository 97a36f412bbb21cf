"""Open sessions, owned by the scheduler: open/close, per-request prompt assembly, turn results.

The scheduler calls ``plan`` for every generate request that carries ``session_params``; the
controller answers with a ``SessionTurn`` (the assembled prompt, or a rejection message), from
which the scheduler builds the ``Req``; ``admit`` then records that request in the session. The
session layer reads requests through ``SessionReq`` and never builds one. ``on_req_finished`` is
called for every finished request, so streaming sessions learn their new history (or roll back
after an abort) and deferred closes happen.

A streaming session's KV is the prefix cache's business (``SessionAwareCache``): the controller
only tells the cache when a session goes away, comes back after a restart, or must be written
out, through the cache's session methods (no-ops on a cache without streaming sessions).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.finish_reason import FinishAbort
from radixserve.managers.io_struct import (
    OpenSessionReqInput,
    OpenSessionReqOutput,
    TokenizedGenerateReqInput,
)
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.sessions.session import (
    RESUME_NEEDS_ID,
    Session,
    SessionError,
    SessionReq,
    SessionReqNode,
    check_session_id,
)

logger = logging.getLogger(__name__)


@dataclass
class SessionTurn:
    """What ``plan`` decided for a session request: the prompt to build its ``Req`` with, or a
    rejection for the caller.

    Nothing in the session changes until the scheduler has validated the request and calls
    ``admit``: the parent to hang it under and the nodes a ``replace`` removes wait here.
    """

    input_ids: list[int]  # the assembled prompt (on a rejection: the request's own ids)
    error: str | None = None
    streaming_session_id: str | None = None  # set on a streaming session's turn
    parent: SessionReqNode | None = None
    to_remove: list[SessionReqNode] = field(default_factory=list)
    replaces_parent: bool = False  # a replace naming ``parent``: it ends if still running


@dataclass(eq=False)
class SessionController:
    """``max_sessions`` bounds the open sessions (None: unbounded); ``default_timeout`` is the
    idle timeout of a session opened without one and the longest one a client may ask for
    (None: such sessions never expire, and any timeout is allowed)."""

    cache: BasePrefixCache
    bos_token_id: int | None
    clock: Callable[[], float] = time.monotonic
    max_sessions: int | None = None
    default_timeout: float | None = None
    sessions: dict[str, Session] = field(default_factory=dict, init=False)

    # ------------------------------------------------------------------ open / close
    def open(self, msg: OpenSessionReqInput) -> OpenSessionReqOutput:
        def fail(message: str) -> OpenSessionReqOutput:
            return OpenSessionReqOutput(session_id=None, success=False, message=message)

        if msg.streaming and not self.cache.supports_streaming_session:
            return fail(
                "streaming sessions need the server to be started with --enable-streaming-session"
            )
        if msg.capacity_of_str_len <= 0:
            return fail(f"capacity_of_str_len must be positive, got {msg.capacity_of_str_len}")
        if msg.timeout is not None and not (math.isfinite(msg.timeout) and msg.timeout > 0):
            return fail(f"timeout must be a positive finite number of seconds, got {msg.timeout}")
        if (msg.timeout is not None and self.default_timeout is not None
                and msg.timeout > self.default_timeout):
            # A client may shorten its session's life, not outlive the server's idle timeout:
            # sessions that never expire would hold --max-sessions until a restart.
            return fail(f"timeout must be at most the server's --session-idle-timeout "
                        f"({self.default_timeout:g} s), got {msg.timeout:g}")
        if msg.session_id is not None:
            try:
                check_session_id(msg.session_id)
            except SessionError as e:
                return fail(str(e))
        if msg.resume and (msg.session_id is None or not msg.streaming):
            return fail(RESUME_NEEDS_ID)
        session = Session(
            capacity_of_str_len=msg.capacity_of_str_len,
            streaming=msg.streaming,
            timeout=msg.timeout if msg.timeout is not None else self.default_timeout,
            last_active=self.clock(),
        )
        if msg.session_id is not None:
            session.session_id = msg.session_id
        if session.session_id in self.sessions:
            return fail(f"session id {session.session_id!r} already exists")
        if self.max_sessions is not None and len(self.sessions) >= self.max_sessions:
            return OpenSessionReqOutput(
                session_id=None, success=False, at_capacity=True,
                message=f"too many open sessions (the limit is {self.max_sessions}, "
                "--max-sessions): close a session or wait for idle ones to time out",
            )
        if msg.resume:
            try:
                session.history_ids = self.cache.resume_session(session.session_id)
            except LookupError as e:
                return fail(f"cannot resume session {session.session_id!r}: {e.args[0]}")
        elif msg.session_id is not None:
            self.cache.release_session(session.session_id)  # a new session starts empty
        self.sessions[session.session_id] = session
        logger.info("session %r %s (streaming=%s, %d tokens of history)", session.session_id,
                    "resumed" if msg.resume else "opened", msg.streaming,
                    len(session.history_ids))
        return OpenSessionReqOutput(session_id=session.session_id, success=True)

    def close(self, session_id: str) -> None:
        """Close ``session_id`` (unknown ids are ignored).

        A streaming session with a turn in flight closes when that turn finishes; until then it
        refuses new requests. A non-streaming session's running requests are left to finish;
        their KV stays in the radix cache.
        """
        session = self.sessions.get(session_id)
        if session is None:
            return
        if session.streaming and session.inflight_rid is not None:
            session.close_pending = True
            return
        self._drop(session)

    def _drop(self, session: Session) -> None:
        del self.sessions[session.session_id]
        session.clear()
        if session.streaming:
            self.cache.release_session(session.session_id)
        logger.info("session %r closed", session.session_id)

    def num_reqs(self) -> int:
        """Requests kept in the trees of open sessions."""
        return sum(len(s.req_nodes) for s in self.sessions.values())

    def expired_ids(self) -> list[str]:
        """Sessions idle for longer than their timeout. The scheduler's first rank closes them
        with ``CloseSessionReqInput`` messages (``RequestReceiver``), so that every rank closes
        them at the same step (each rank's clock would decide differently)."""
        now = self.clock()
        return [s.session_id for s in self.sessions.values() if s.is_expired(now)]

    def on_step(self) -> None:
        """Every scheduler step: let the cache offload sessions idle past
        ``--session-offload-after`` (one rank only: the session store refuses parallel ranks)."""
        self.cache.offload_idle_sessions()

    def persist_all(self) -> None:
        """Write every streaming session to a store that outlives the process (shutdown)."""
        for session in self.sessions.values():
            if session.streaming:
                self.cache.persist_session(session.session_id, session.history_ids)

    # ------------------------------------------------------------------ ordering
    def inflight_rid(self, msg: TokenizedGenerateReqInput) -> str | None:
        """The turn in flight on ``msg``'s streaming session, if any."""
        session = self.sessions.get(msg.session_params.id) if msg.session_params else None
        return session.inflight_rid if session is not None and session.streaming else None

    def running_rid_to_replace(self, msg: TokenizedGenerateReqInput) -> str | None:
        """The unfinished request that ``msg`` replaces (``replace`` naming a running
        ``rid``): it must end, keeping what it generated, before ``msg`` is assembled."""
        params = msg.session_params
        session = self.sessions.get(params.id) if params is not None else None
        if session is None or session.streaming or not params.replace or params.rid is None:
            return None
        node = session.req_nodes.get(params.rid)
        return params.rid if node is not None and not node.req.finished() else None

    # ------------------------------------------------------------------ requests
    def plan(self, msg: TokenizedGenerateReqInput) -> SessionTurn:
        """Assemble the request's prompt from its session; changes nothing."""
        params = msg.session_params
        assert params is not None, "only session requests come here"
        session = self.sessions.get(params.id)
        try:
            if session is None:
                raise SessionError(f"session {params.id!r} does not exist or is closed")
            input_ids, parent, to_remove = session.resolve_input_ids(
                params, msg.input_ids, self.bos_token_id
            )
        except SessionError as e:
            return SessionTurn(list(msg.input_ids), error=str(e))
        return SessionTurn(
            input_ids,
            streaming_session_id=session.session_id if session.streaming else None,
            parent=parent,
            to_remove=to_remove,
            replaces_parent=params.replace and parent is not None,
        )

    def admit(self, turn: SessionTurn, req: SessionReq) -> list[SessionReq]:
        """Record ``req``, validated and built from ``turn``, in its session; returns the
        requests to abort.

        A ``replace`` removes the replaced branch now; its unfinished requests must be aborted,
        and so must the request it names if that still runs (the scheduler ends it first, so
        that the new request inherits all it generated). A streaming session keeps no tree:
        only its history and the request in flight.
        """
        session = self.sessions[req.session_params.id]
        session.touch(self.clock())
        if session.streaming:
            session.inflight_rid = req.rid
            return []
        to_abort = session.remove_nodes(turn.to_remove)
        parent = turn.parent
        if turn.replaces_parent and parent is not None and not parent.req.finished():
            to_abort.append(parent.req)
        session.add_req(req, parent)
        return to_abort

    def on_req_finished(self, req: SessionReq) -> None:
        """A session request finished (any reason): update history, run a deferred close."""
        params = req.session_params
        session = self.sessions.get(params.id) if params is not None else None
        if session is None:
            return
        session.touch(self.clock())
        if not session.streaming or session.inflight_rid != req.rid:
            return
        session.inflight_rid = None
        if not isinstance(req.finished_reason, FinishAbort):
            # Each turn continues from the last successfully finished one.
            session.history_ids = req.origin_input_ids + req.output_ids
        if session.close_pending:
            self._drop(session)
