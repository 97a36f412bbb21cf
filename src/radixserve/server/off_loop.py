"""Work that grows with a request's input runs off the event loop once the input is large.

The HTTP server serves every request from one asyncio loop: tokenizing a 7 MB prompt or
rendering the chat template of 200,000 messages there would hold every other request (their
streams, their admission, ``/health``) for seconds. ``run_sized`` runs such work on a small
thread pool when the request's body is larger than ``OFF_LOOP_BYTES``, and inline (no thread
hop) below it. ``run_for_size`` does the same for work whose size is not the body's: a stored
conversation a Responses request continues, or a score query joined to each of its items.
The fast tokenizer releases the GIL while it encodes; a Jinja template does not, but the
interpreter still switches to the loop's thread every few milliseconds.

``/get_server_info`` reports ``inputs_off_loop`` (how many requests wait for such work now)
and ``inputs_off_loop_total`` (since the start), which tests synchronise on instead of timing.

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
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="radixserve-input")


class _Counts:
    """Requests waiting for off-loop input work (only the loop's thread changes them)."""

    running = 0
    total = 0


def counts() -> dict[str, int]:
    """``inputs_off_loop`` (now) and ``inputs_off_loop_total`` (since the start)."""
    return {"inputs_off_loop": _Counts.running, "inputs_off_loop_total": _Counts.total}


def body_size(request: Request) -> int:
    """The request body's size, from its ``Content-Length`` (the guard has checked it)."""
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
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    _Counts.running += 1
    _Counts.total += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(_POOL, partial(fn, *args))
    finally:
        _Counts.running -= 1
