"""The FastAPI application: shared server state, the request guard, and the routers.

A request passes, in order:

1. ``RequestGuard`` (pure ASGI, before any parsing): the API key (every route but ``/health``;
   ``CONTROL_PATHS`` need ``--admin-api-key`` instead when it is set),
   the server state (503 while starting or draining), the in-flight count of generation requests
   (the drain waits on it) with an admission ``Ticket`` each, the body size (413 past
   ``MAX_BODY_BYTES``, from ``Content-Length`` or counted while reading) and the time to read it
   (408 past ``--request-read-timeout``; the headers have the same time, ``http_protocol.py``),
   the values in a JSON body (400 naming an integer past 64 bits, NaN, a lone surrogate or
   nesting too deep: ``managers/request_values.py``); POST bodies are read as JSON whatever their
   Content-Type says.
2. The route (``native_api``, ``openai/*``), which validates its body with pydantic (errors → 400),
   admits the generations it asks for (``admission.py``: 400 past ``--max-n`` or
   ``--max-batch-size``, 429 past ``--max-queued-requests``) and calls the ``TokenizerManager``
   (``ValueError`` → 400).

Generation is driven by async generators from ``TokenizerManager.generate_request``; closing or
cancelling one aborts its request in the scheduler. Streaming responses are cancelled by Starlette
when the client disconnects; non-streaming ones are watched with ``cancel_on_disconnect``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve import __version__
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.request_values import MAX_DEPTH, describe, find_unrepresentable
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.server.admission import RETRY_AFTER_S, TICKET_KEY, Ticket
from radixserve.server.errors import APIError, install_error_handlers, send_error
from radixserve.server.metrics import ServerMetrics
from radixserve.server.openai.responses_store import ResponseStore
from radixserve.server_args import ServerArgs

T = TypeVar("T")

MAX_BODY_BYTES = 8 * 1024 * 1024
# Routes that run the model: they count as in flight (drain) and get an admission ticket.
GENERATION_PATHS = frozenset(
    {"/generate", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/encode",
     "/v1/embeddings"}
)
# Operator routes: they need --admin-api-key when it is set (else --api-key, like the rest).
CONTROL_PATHS = frozenset({
    "/flush_cache", "/update_weights_from_disk", "/get_weights_by_name",
    "/release_memory_occupation", "/resume_memory_occupation", "/start_profile", "/stop_profile",
    "/set_internal_state", "/slow_down", "/freeze_gc", "/pause_generation",
    "/continue_generation", "/dashboard", "/dashboard/state",
})
# A browser opens these without headers: they also take the key as ``?key=``.
DASHBOARD_PATHS = frozenset({"/dashboard", "/dashboard/state"})
# Reachable without an API key and in every state (it reports the state itself).
HEALTH_PATH = "/health"


class ServerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


@dataclass
class ServerContext:
    """What every route needs: the configuration, the TokenizerManager and the server state."""

    server_args: ServerArgs
    tokenizer_manager: TokenizerManager
    scheduler_info: dict[str, Any]
    metrics: ServerMetrics | None = None
    chat_template: str | None = None
    state: ServerState = ServerState.STARTING
    in_flight: int = 0  # generation requests
    queued_generations: int = 0  # what they were admitted with (``admission.py``)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.server_args.model_name

    @property
    def context_len(self) -> int:
        return int(self.tokenizer_manager.model_config.context_len)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer_manager.model_config.vocab_size)

    @property
    def tokenizer(self) -> Any:
        return self.tokenizer_manager.tokenizer

    def check_model(self, name: str | None) -> None:
        """404 for a ``model`` field naming a model this server does not serve."""
        if name is not None and name not in (self.model_name, self.server_args.model_path):
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.model_name}'.",
                param="model",
                code="model_not_found",
            )


async def first_item(agen: AsyncIterator[T]) -> T:
    """The first item of ``agen`` (for a non-stream generation: its only one), closing it."""
    async with contextlib.aclosing(agen):  # type: ignore[type-var]
        async for item in agen:
            return item
    raise RuntimeError("the generation ended without output")


async def prime(agen: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first item, so that validation errors fail the request before it streams.

    Returns an iterator over every item, the first included; closing it closes ``agen``. On an
    error ``agen`` is closed (aborting its request) and the error propagates to the route.
    """
    try:
        first = await agen.__anext__()
    except StopAsyncIteration:
        raise RuntimeError("the generation ended without output") from None
    except BaseException:
        await agen.aclose()  # type: ignore[attr-defined]
        raise

    async def chained() -> AsyncIterator[T]:
        async with contextlib.aclosing(agen):  # type: ignore[type-var]
            yield first
            async for item in agen:
                yield item

    return chained()


async def collect_final(merged: AsyncIterator[tuple[int, T]], n: int) -> list[T]:
    """The last item of each of ``n`` merged generations, in index order."""
    finals: dict[int, T] = {}
    async with contextlib.aclosing(merged):  # type: ignore[type-var]
        async for i, item in merged:
            finals[i] = item
    return [finals[i] for i in range(n)]


def merged_choices(
    tm: TokenizerManager, inputs: Sequence[GenerateReqInput]
) -> AsyncIterator[tuple[int, Any]]:
    """``merge_generations`` of one generation per input (the OpenAI routes' choices), every
    input validated before any is sent: a bad one fails the request with nothing running."""
    prepared = [tm.prepare_generate(obj) for obj in inputs]
    return merge_generations([tm.generate_request(p) for p in prepared])


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

    Streaming responses get this from Starlette; a plain response only notices a gone client
    when it writes, after the whole generation, so its receive channel is watched here.
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


class RequestGuard:
    """Pure ASGI middleware: API key, server state, in-flight count, body size (see module
    doc)."""

    def __init__(self, app: ASGIApp, ctx: ServerContext, max_body_bytes: int) -> None:
        self.app = app
        self.ctx = ctx
        self.max_body_bytes = max_body_bytes
        key, admin = ctx.server_args.api_key, ctx.server_args.admin_api_key
        self._expected_auth = f"Bearer {key}".encode() if key else None
        self._expected_admin_auth = f"Bearer {admin}".encode() if admin else self._expected_auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        generation = path in GENERATION_PATHS and scope["method"] == "POST"
        try:
            if path != HEALTH_PATH:
                self._check_api_key(scope)
                self._check_state()
            body, receive = await self._read_body(scope, receive)
            _check_values(body)
        except APIError as err:
            await send_error(send, err)
            return
        if scope["method"] == "POST":
            scope = _as_json(scope)
        if not generation:
            await self.app(scope, receive, send)
            return
        ticket = Ticket()
        self.ctx.in_flight += 1
        try:
            await self.app({**scope, TICKET_KEY: ticket}, receive, send)
        finally:
            self.ctx.in_flight -= 1
            self.ctx.queued_generations -= ticket.generations

    def _check_api_key(self, scope: Scope) -> None:
        control = scope["path"] in CONTROL_PATHS
        # The admin key opens every route; the API key all but the control routes.
        accepted = [self._expected_admin_auth]
        if not control:
            accepted.append(self._expected_auth)
        if self._expected_auth is None and not (control and self._expected_admin_auth):
            return
        headers = [value for name, value in scope["headers"] if name == b"authorization"]
        given = headers[0] if headers else b""
        if scope["path"] in DASHBOARD_PATHS and not given:  # a browser opening the page
            keys = parse_qs(scope.get("query_string", b"").decode()).get("key", [""])
            headers = keys
            given = f"Bearer {keys[0]}".encode()
        if len(headers) > 1:  # which one counts would depend on the proxy in front: none
            raise APIError(
                401, "More than one Authorization header (or key): send exactly one.",
                code="invalid_api_key",
            )
        if not any(key and hmac.compare_digest(given, key) for key in accepted):
            which = "admin API key" if control and self.ctx.server_args.admin_api_key else "API key"
            raise APIError(
                401,
                f"Missing or invalid {which}: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )

    def _check_state(self) -> None:
        state = self.ctx.state
        if state is not ServerState.READY:
            raise APIError(
                503,
                f"The server is {state.value}; try again later.",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, Receive]:
        """Read the whole body within the limit; return it and a ``receive`` that replays it."""
        limit = self.max_body_bytes
        too_large = APIError(413, f"The request body is larger than {limit} bytes.")
        length = dict(scope["headers"]).get(b"content-length")
        declared = 0
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                raise APIError(400, "Invalid Content-Length header.") from None
            if declared > limit:
                raise too_large
        chunks: list[bytes] = []
        size = 0
        timeout = self.ctx.server_args.request_read_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                of = f" of {declared}" if length is not None else ""
                raise APIError(
                    408,
                    f"The request body did not arrive within {timeout:g}s "
                    f"(--request-read-timeout): {size}{of} bytes were received.",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] != "http.request":  # the client went away while sending
                return b"", _replay([], message, receive)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        return body, _replay([body], None, receive)


def _check_values(body: bytes) -> None:
    """400 naming the first value of a JSON body that the server cannot carry (an integer past
    64 bits, NaN, a lone surrogate, deep nesting: ``request_values``), before any route reads
    it. A body that is not JSON is left to the route, which says so."""
    if not body:
        return
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(
            400, f"The request body is nested more than {MAX_DEPTH} levels deep."
        ) from None
    except json.JSONDecodeError:
        return
    except ValueError as e:  # an integer of more than 4300 digits, bytes that are not UTF-8
        raise APIError(400, f"The request body is not valid JSON: {e}") from None
    found = find_unrepresentable(data)
    if found is not None:
        path, why = found
        raise APIError(400, describe(path, why), param=path or None)


def _as_json(scope: Scope) -> Scope:
    """Every POST body is JSON: a missing or other Content-Type (``curl -d`` sends a form
    type) is read as JSON rather than failing with a confusing validation error."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def _replay(chunks: list[bytes], pending: Message | None, receive: Receive) -> Receive:
    """A ``receive`` that yields the buffered body once, then defers to the real one."""
    replayed = False

    async def replay_receive() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            if pending is not None:
                return pending
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await receive()

    return replay_receive


def create_app(ctx: ServerContext, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """Build the app for one running server (routes read ``app.state.ctx``)."""
    from radixserve.server.control_api import router as control_router
    from radixserve.server.dashboard import router as dashboard_router
    from radixserve.server.native_api import router as native_router
    from radixserve.server.openai.serving_chat import router as chat_router
    from radixserve.server.openai.serving_completions import router as completions_router
    from radixserve.server.openai.serving_embedding import router as embedding_router
    from radixserve.server.openai.serving_models import router as models_router
    from radixserve.server.openai.serving_responses import router as responses_router

    # /openapi.json describes every route and body (what API clients and the fuzz suite read);
    # the interactive docs pages are left out: they load their scripts from a CDN.
    app = FastAPI(title="radixserve", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.ctx = ctx
    app.state.response_store = ResponseStore(ctx.server_args.responses_store_size,
                                             ctx.server_args.responses_store_ttl)
    install_error_handlers(app)
    app.include_router(native_router)
    app.include_router(control_router)
    app.include_router(dashboard_router)
    app.include_router(chat_router)
    app.include_router(completions_router)
    app.include_router(embedding_router)
    app.include_router(models_router)
    app.include_router(responses_router)
    app.add_middleware(RequestGuard, ctx=ctx, max_body_bytes=max_body_bytes)
    return app


def get_ctx(request: Request) -> ServerContext:
    """The ``ServerContext`` of the app serving ``request``."""
    return request.app.state.ctx
