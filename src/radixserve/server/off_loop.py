"""Work that grows with a request's input runs off the event loop once the input is large.

The HTTP server serves every request from one asyncio loop: tokenizing a 7 MB prompt or
rendering the chat template of 200,000 messages there would hold every other request (their
streams, their admission, ``/health``) for seconds. ``run_sized`` runs such work on a small
thread pool when the request's body is larger than ``OFF_LOOP_BYTES``, and inline (no thread
hop) below it. ``run_for_size`` does the same for work whose size is not the body's: a stored
conversation a Responses request continues, or a score query joined to each of its items.
The fast tokenizer releases the GIL while it encodes; a Jinja template does not, but the
interpreter still switches to the loop's thread every few milliseconds.

``run_body`` does the same for a request body's JSON: its parsing and value checks
(``request_guard.py``) and its validation against the route's model (``parsed_body.py``), which
for 8 MiB of small values take seconds.

``/get_server_info`` reports ``inputs_off_loop`` (how many requests wait for such work now)
and ``inputs_off_loop_total`` (since the start), and ``bodies_off_loop`` /
``bodies_off_loop_total`` for the bodies, which tests synchronise on instead of timing.

Bounded by the body limit (8 MiB, ``request_guard.MAX_BODY_BYTES``) and ``--max-batch-size``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")

OFF_LOOP_BYTES = 64 * 1024
BODY_SIZE_KEY = "radixserve.body_size"  # in the ASGI scope: the bytes the guard read
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="radixserve-input")


class _Counts:
    """Requests waiting for off-loop work of one kind (only the loop's thread changes them)."""

    def __init__(self) -> None:
        self.running = 0
        self.total = 0


_INPUTS = _Counts()  # tokenizing, rendering templates
_BODIES = _Counts()  # parsing and validating request bodies


def counts() -> dict[str, int]:
    """``inputs_off_loop`` / ``bodies_off_loop`` (now) and ``inputs_off_loop_total`` /
    ``bodies_off_loop_total`` (since the start)."""
    return {"inputs_off_loop": _INPUTS.running, "inputs_off_loop_total": _INPUTS.total,
            "bodies_off_loop": _BODIES.running, "bodies_off_loop_total": _BODIES.total}


def body_size(request: Request) -> int:
    """The request body's size: as the guard read it (``BODY_SIZE_KEY``, a chunked body has no
    ``Content-Length``), else from its ``Content-Length``."""
    if BODY_SIZE_KEY in request.scope:
        return request.scope[BODY_SIZE_KEY]
    try:
        return int(request.headers.get("content-length", "0"))
    except ValueError:
        return 0


async def run_sized(request: Request, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``: on the pool when ``request``'s body is large, else right here."""
    return await run_for_size(body_size(request), fn, *args)


async def run_for_size(size: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``: on the pool when ``size`` (bytes or characters of input) is large, else
    right here."""
    return await _run(_INPUTS, size, fn, *args)


async def run_body(size: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``, work on a request body of ``size`` bytes: on the pool when it is large,
    else right here (counted as ``bodies_off_loop``)."""
    return await _run(_BODIES, size, fn, *args)


async def _run(counts: _Counts, size: int, fn: Callable[..., T], *args: object) -> T:
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    counts.running += 1
    counts.total += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(_POOL, partial(fn, *args))
    finally:
        counts.running -= 1
