"""A session: one conversation kept as a tree of requests (SGLang's session control).

Each request of a session is a ``SessionReqNode``; a new request names the ``rid`` it continues
from and inherits that request's prompt and output:

    parent prompt + parent output ──(offset cut)──▶ inherited ids ──(+ new ids)──▶ new prompt

Non-streaming sessions keep every branch; reuse of the shared prefix comes from the radix cache.
Streaming sessions are linear: each turn continues the last successfully finished turn, and
their KV lives in a per-session slot (``streaming_session.py``).

Everything here runs inside the scheduler process, which owns the authoritative session state.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from radixserve.finish_reason import FinishReason
from radixserve.sessions.session_params import SessionParams

# Refusal of an open_session with resume but no session id (the TokenizerManager names the
# sessions opened without one, so it refuses this one itself).
RESUME_NEEDS_ID = (
    'resume continues a stored streaming session: give its session_id and "streaming": true'
)


# Session ids are client strings that appear in logs, error messages and internal state: 1 to
# ``SESSION_ID_MAX_LEN`` visible ASCII characters (no spaces, no control characters).
SESSION_ID_MAX_LEN = 128
_SESSION_ID = re.compile(rf"[\x21-\x7e]{{1,{SESSION_ID_MAX_LEN}}}")


class SessionError(ValueError):
    """A session request that cannot be served; the session is left unchanged."""


def check_session_id(session_id: object) -> None:
    """``SessionError`` unless ``session_id`` is 1 to ``SESSION_ID_MAX_LEN`` visible ASCII
    characters; the message shows (escaped) at most the first 40 characters of it."""
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        shown = repr(session_id)
        if isinstance(session_id, str) and len(shown) > 40:
            shown = f"{shown[:40]}... ({len(session_id)} characters)"
        raise SessionError(
            f"session_id must be 1 to {SESSION_ID_MAX_LEN} visible ASCII characters (no spaces "
            f"or control characters), got {shown}"
        )


class SessionReq(Protocol):
    """What a session reads of a request (``schedule_batch.Req`` satisfies it)."""

    rid: str
    session_params: SessionParams | None
    origin_input_ids: list[int]
    output_ids: list[int]
    finished_reason: FinishReason | None

    def finished(self) -> bool: ...


@dataclass(eq=False)
class SessionReqNode:
    req: SessionReq
    parent: SessionReqNode | None = None
    children: list[SessionReqNode] = field(default_factory=list)

    def descendants(self) -> list[SessionReqNode]:
        """Every node below this one, depth first."""
        out: list[SessionReqNode] = []
        stack = list(self.children)
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children)
        return out


@dataclass
class Session:
    """State of one open session.

    ``streaming`` sessions also track ``history_ids`` (prompt + output of the last finished turn),
    the request in flight, and a close requested while a turn runs.
    """

    capacity_of_str_len: int
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    streaming: bool = False
    timeout: float | None = None
    req_nodes: dict[str, SessionReqNode] = field(default_factory=dict)
    last_active: float = field(default_factory=time.monotonic)
    # streaming only
    history_ids: list[int] = field(default_factory=list)
    inflight_rid: str | None = None
    close_pending: bool = False

    def touch(self, now: float) -> None:
        """Record activity at ``now`` (the controller's clock, which expiry is measured on)."""
        self.last_active = now

    def is_expired(self, now: float) -> bool:
        # Cheapest tests first: this runs every scheduler step for every session.
        return (
            self.timeout is not None
            and now - self.last_active > self.timeout
            and self.inflight_rid is None
            and not self.has_unfinished_reqs()
        )

    def has_unfinished_reqs(self) -> bool:
        return any(not node.req.finished() for node in self.req_nodes.values())

    # ------------------------------------------------------------------ request tree
    def resolve_input_ids(
        self, params: SessionParams, new_ids: list[int], bos_token_id: int | None
    ) -> tuple[list[int], SessionReqNode | None, list[SessionReqNode]]:
        """Assemble a new request's prompt from the tree without changing anything.

        Returns ``(input_ids, parent_node, nodes_to_remove)``; raises ``SessionError``.
        """
        if self.streaming:
            return self._resolve_streaming(params, new_ids, bos_token_id), None, []
        to_remove: list[SessionReqNode] = []
        if params.rid is None:
            if params.replace:
                to_remove = list(self.req_nodes.values())
            return list(new_ids), None, to_remove
        parent = self.req_nodes.get(params.rid)
        if parent is None:
            raise SessionError(
                f"Invalid request session id: rid {params.rid!r} is not in session "
                f"{self.session_id!r}"
            )
        if params.replace:
            # A running parent is aborted by the caller; the new request inherits what it has
            # generated by then.
            to_remove = parent.descendants()
        elif not parent.req.finished():
            raise SessionError(
                f"Invalid request session id: request {params.rid!r} has not finished yet"
            )
        inherited = list(parent.req.origin_input_ids)
        if not params.drop_previous_output:
            inherited += parent.req.output_ids
        if params.offset:
            inherited = inherited[: params.offset]
        return inherited + _strip_bos(new_ids, bos_token_id), parent, to_remove

    def _resolve_streaming(
        self, params: SessionParams, new_ids: list[int], bos_token_id: int | None
    ) -> list[int]:
        if params.replace or params.drop_previous_output or params.offset:
            raise SessionError(
                "streaming sessions are linear: replace, drop_previous_output and offset "
                "are not supported"
            )
        if self.close_pending:
            raise SessionError(f"session {self.session_id!r} is closing")
        if self.inflight_rid is not None:
            raise SessionError(
                f"session {self.session_id!r} already has a request in flight "
                f"({self.inflight_rid!r}); streaming sessions allow one at a time"
            )
        if not self.history_ids:
            return list(new_ids)
        return self.history_ids + _strip_bos(new_ids, bos_token_id)

    def add_req(self, req: SessionReq, parent: SessionReqNode | None) -> None:
        node = SessionReqNode(req, parent)
        if parent is not None:
            parent.children.append(node)
        self.req_nodes[req.rid] = node

    def remove_nodes(self, nodes: list[SessionReqNode]) -> list[SessionReq]:
        """Detach ``nodes`` (whole subtrees) from the tree; return their unfinished requests
        (to abort)."""
        unfinished = []
        for node in nodes:
            if self.req_nodes.get(node.req.rid) is node:
                del self.req_nodes[node.req.rid]
            if node.parent is not None and node in node.parent.children:
                node.parent.children.remove(node)
            if not node.req.finished():
                unfinished.append(node.req)
        _unlink(nodes)
        return unfinished

    def clear(self) -> None:
        """Drop the whole tree (the session closes). The links are cut so that the requests
        are freed at once, not at the next full garbage collection (parent and child nodes
        refer to each other)."""
        _unlink(list(self.req_nodes.values()))
        self.req_nodes.clear()
        self.history_ids = []


def _unlink(nodes: list[SessionReqNode]) -> None:
    for node in nodes:
        node.parent = None
        node.children = []


def _strip_bos(ids: list[int], bos_token_id: int | None) -> list[int]:
    """A continued turn must not restart the sequence with a second BOS."""
    if ids and bos_token_id is not None and ids[0] == bos_token_id:
        return ids[1:]
    return list(ids)
