"""uvicorn's h11 protocol with what a public server needs before the app sees a request.

- A deadline for the request head: a connection must deliver a complete request line and
  headers within ``--request-read-timeout`` seconds of opening (or of its previous response),
  else it is answered 408 and closed. uvicorn has no such bound: a client that opens
  connections and sends a header byte now and then (slowloris) holds each one forever. The
  body is bounded by the same timeout in ``request_guard.RequestGuard``.
- The OpenAI error object for a request h11 cannot parse (a malformed ``Content-Length``, a bad
  request line), instead of uvicorn's plain-text 400; and 431, not 400, for a head that outgrows
  h11's buffer before it ends. Whether an oversized head is still arriving when h11 looks at it
  depends on how TCP splits it, so both paths (this one and ``RequestGuard``'s) must say 431.

The server always runs this protocol (``uvicorn.Config(http=...)``), whether or not ``httptools``
is installed, so both behaviours hold everywhere.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from radixserve.server.errors import error_body


def guarded_protocol(read_timeout: float) -> type[H11Protocol]:
    """The protocol class uvicorn instantiates per connection, bound to ``read_timeout``."""
    return type("GuardedH11Protocol", (_GuardedH11Protocol,), {"read_timeout": read_timeout})


class _GuardedH11Protocol(H11Protocol):
    read_timeout: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        # uvicorn drops h11's reason when it answers 400: keep it for the error message.
        self._parse_error = ""
        self._parse_error_status = 400
        next_event = self.conn.next_event

        def next_event_keeping_the_reason() -> Any:
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._parse_error = str(e)
                self._parse_error_status = e.error_status_hint
                raise

        self.conn.next_event = next_event_keeping_the_reason  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()  # a kept-alive connection has the same time for its next request

    def send_400_response(self, msg: str) -> None:
        self._cancel_head_deadline()
        if self._parse_error_status == 431:  # h11: the head outgrew its buffer unfinished
            limit = self.config.h11_max_incomplete_event_size
            self._answer_and_close(
                431, "Request Header Fields Too Large",
                f"The request head is more than {limit} bytes long; at most {limit} bytes "
                "of request line and headers are accepted.")
            return
        reason = self._parse_error or msg
        self._answer_and_close(400, "Bad Request", f"The request is not valid HTTP/1.1: {reason}.")

    def _watch_head(self) -> None:
        """Arm the deadline while a request head is awaited, disarm it once one arrived."""
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self._cancel_head_deadline()
        elif self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.read_timeout, self._head_too_slow)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self.conn.trailing_data[0]:  # an idle connection, no request begun: just close
            self.transport.close()
            return
        self._answer_and_close(
            408, "Request Timeout",
            f"The request headers did not arrive within {self.read_timeout:g}s "
            "(--request-read-timeout).",
        )

    def _answer_and_close(self, status: int, reason: str, message: str) -> None:
        """Write the error object straight to the socket (h11 has no request to answer) and
        close the connection."""
        body = json.dumps(error_body(status, message)).encode()
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        self.transport.write(head + body)
        self.transport.close()
