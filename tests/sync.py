"""Synchronising tests on what the server exposes, never on how fast it is.

A test that needs a request "still running" or "already finished" waits for it in the
scheduler's internal state (``get_server_info()["internal_states"][0]``). To hold a request,
it pauses generation in place (``/pause_generation``, ``Engine.pause_generation``): the request
then stays queued, or keeps its KV, until the test continues. A deadline only bounds a failure;
it is never the synchronisation.

Where a test needs a request that has produced tokens and holds KV, it reads the request's first
output and then pauses: the request cannot finish in between when its ``max_new_tokens`` is
``UNTIL_ABORTED``, about a thousand decode steps against one round trip to the server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

STATE_TIMEOUT_S = 180.0  # a failure bound only: long enough for a loaded machine
POLL_S = 0.02
# max_new_tokens of a request the test ends itself (an abort, a disconnect, a pause): with the
# prompt it stays within the tiny checkpoints' context of 1024 tokens.
UNTIL_ABORTED = 960


def wait_for(
    get_state: Callable[[], dict[str, Any]],
    predicate: Callable[[dict[str, Any]], bool],
    what: str,
    timeout: float = STATE_TIMEOUT_S,
) -> dict[str, Any]:
    """Poll ``get_state()`` until ``predicate`` holds; return that state."""
    deadline = time.monotonic() + timeout
    while True:
        state = get_state()
        if predicate(state):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached after {timeout:.0f}s; last state {state}")
        time.sleep(POLL_S)


def in_background(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """Run a blocking call (say, a request a paused server holds) on a thread of its own."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to whoever reads the future
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future
