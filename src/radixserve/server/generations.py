"""Driving generations for the routes: the first or last item of a generation, priming a stream
so that errors fail the request before it starts, merging ``n`` choices, and cancelling the work
of a client that went away. Closing any of these iterators aborts its requests in the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import Request

from radixserve.managers.tokenizer.generate_request import GenerateReqInput
from radixserve.managers.tokenizer.tokenizer_manager import TokenizerManager
from radixserve.server.errors import APIError

T = TypeVar("T")


async def first_item(agen: AsyncIterator[T]) -> T:
    """The first item of ``agen`` (for a non-stream generation: its only one), closing it."""
    async with contextlib.aclosing(agen):  # type: ignore[type-var]
        async for item in agen:
            return item
    raise RuntimeError("the generation ended without output")


async def prime(request: Request, agen: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first item, so that validation errors fail the request before it streams.

    Returns an iterator over every item, the first included; closing it closes ``agen``. On an
    error, or when the client goes away before the first item (``cancel_on_disconnect``: a
    request queued for long must not outlive its client), ``agen`` is closed, aborting its
    request, and the error propagates to the route.
    """
    first = await cancel_on_disconnect(request, _first_or_close(agen))

    async def chained() -> AsyncIterator[T]:
        async with contextlib.aclosing(agen):  # type: ignore[type-var]
            yield first
            async for item in agen:
                yield item

    return chained()


async def _first_or_close(agen: AsyncIterator[T]) -> T:
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        raise RuntimeError("the generation ended without output") from None
    except BaseException:
        await agen.aclose()  # type: ignore[attr-defined]
        raise


async def collect_final(merged: AsyncIterator[tuple[int, T]], n: int) -> list[T]:
    """The last item of each of ``n`` merged generations, in index order."""
    finals: dict[int, T] = {}
    async with contextlib.aclosing(merged):  # type: ignore[type-var]
        async for i, item in merged:
            finals[i] = item
    return [finals[i] for i in range(n)]


def merged_choices(
    tokenizer_manager: TokenizerManager, inputs: Sequence[GenerateReqInput]
) -> AsyncIterator[tuple[int, Any]]:
    """``merge_generations`` of one generation per input (the OpenAI routes' choices), every
    input validated before any is sent: a bad one fails the request with nothing running."""
    prepared = [tokenizer_manager.prepare_generate(obj) for obj in inputs]
    return merge_generations([tokenizer_manager.generate_request(p) for p in prepared])


_END = object()


async def merge_generations(gens: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several generations as ``(index, item)`` in arrival order.

    Each generation is pumped by its own task; an error in one is raised to the consumer, and
    closing the merged iterator cancels the pumps, which aborts every unfinished generation.
    """
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                async for item in gen:
                    queue.put_nowait((i, item, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))
        else:
            queue.put_nowait((i, _END, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _END:
                remaining -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (so its generation aborts) if the client disconnects.

    A plain response only notices a gone client when it writes, after the whole generation,
    so its receive channel is watched here. A stream gets this from Starlette once it has
    started, and from here (through ``prime``) while it waits for its first output.
    """
    work_task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            return work_task.result()
        work_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work_task
        raise APIError(499, "the client closed the connection")
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
