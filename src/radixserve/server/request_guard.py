"""What a request passes before its route runs (``RequestGuard``), and then in the route.

In order:

1. ``RequestGuard`` (pure ASGI, before any parsing): the header count and size (431 past
   ``MAX_HEADERS`` or ``MAX_HEADER_BYTES``), the API key (every route but ``/health``;
   ``CONTROL_PATHS`` need ``--admin-api-key`` instead when it is set),
   the server state (503 while starting or draining), the in-flight count of generation requests
   (the drain waits on it) with an admission ``Ticket`` each, the body size (413 past
   ``MAX_BODY_BYTES``, from ``Content-Length`` or counted while reading) and the time to read it
   (408 past ``--request-read-timeout``; the headers have the same time, ``http_protocol.py``),
   the values in a JSON body (400 naming an integer past 64 bits, NaN, a lone surrogate or
   nesting too deep: ``managers/tokenizer/request_values.py``), a body that is not UTF-8 (a
   byte order mark, UTF-16 or UTF-32) and a key repeated in one JSON object (400); POST bodies
   are read as JSON whatever their Content-Type says. The body is parsed once, here (off the
   event loop when large), and the route reads that value (``parsed_body.py``).
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
import hmac
import json
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.managers.caller import ADMIN, ANONYMOUS, API_KEY, current_caller
from radixserve.managers.tokenizer.request_values import MAX_DEPTH, describe, find_unrepresentable
from radixserve.server.admission import RETRY_AFTER_S, TICKET_KEY, Ticket
from radixserve.server.context import ServerContext, ServerState
from radixserve.server.errors import APIError, send_error
from radixserve.server.off_loop import BODY_SIZE_KEY, run_body
from radixserve.server.parsed_body import PARSED_BODY_KEY

MAX_BODY_BYTES = 8 * 1024 * 1024
# The request head: past these, 431.
MAX_HEADERS = 100
MAX_HEADER_BYTES = 16 * 1024
# h11's bound on a head still arriving (uvicorn's ``h11_max_incomplete_event_size``): room above
# any head the guard accepts (separators, the request line), so that only heads the guard would
# refuse anyway can meet it; past it, ``http_protocol`` answers 431 too.
MAX_HEAD_BUFFER = 2 * MAX_HEADER_BYTES
# Routes that run the model: they count as in flight (drain) and get an admission ticket.
GENERATION_PATHS = frozenset(
    {"/generate", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/encode",
     "/v1/embeddings", "/v1/score", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/classify",
     "/classify",
     "/api/chat", "/api/generate", "/api/embed"}  # Ollama's
)
OLLAMA_PREFIX = "/api/"  # Ollama's routes: errors are {"error": message} there
# Operator routes: they need --admin-api-key when it is set (else --api-key, like the rest).
CONTROL_PATHS = frozenset({
    "/flush_cache", "/update_weights_from_disk", "/get_weights_by_name",
    "/release_memory_occupation", "/resume_memory_occupation", "/start_profile", "/stop_profile",
    "/set_internal_state", "/slow_down", "/freeze_gc", "/pause_generation",
    "/continue_generation", "/dashboard", "/dashboard/state", "/load_lora_adapter",
    "/unload_lora_adapter", "/init_weights_update_group", "/update_weights_from_distributed",
    "/destroy_weights_update_group",
})
# A browser opens these without headers: they also take the key as ``?key=``.
DASHBOARD_PATHS = frozenset({"/dashboard", "/dashboard/state"})
# Multipart uploads (docs/batch.md): their Content-Type is kept.
UPLOAD_PATHS = frozenset({"/v1/files"})
# Reachable without an API key and in every state (it reports the state itself).
HEALTH_PATH = "/health"


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
        caller = None
        try:
            _check_headers(scope)
            if path != HEALTH_PATH:
                caller = self._check_api_key(scope)
                self._check_state()
            body, receive = await self._read_body(scope, receive)
            # Off the event loop for a large body: 8 MiB of small values take seconds.
            parsed = await run_body(len(body), _check_values, body)
        except APIError as err:
            await send_error(send, err, message_only=path.startswith(OLLAMA_PREFIX))
            return
        if scope["method"] == "POST":
            scope = _as_json(scope)
        scope = {**scope, BODY_SIZE_KEY: len(body)}
        if parsed is not _NOT_JSON and path not in UPLOAD_PATHS:  # the route reads it
            scope[PARSED_BODY_KEY] = parsed
        current_caller.set(caller)  # this task's; what the request creates is the caller's
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

    def _check_api_key(self, scope: Scope) -> str | None:
        """Raise 401 unless the request carries a key that opens its route; return who it is
        (``managers/caller.py``: None when no key is configured)."""
        control = scope["path"] in CONTROL_PATHS
        # The admin key opens every route; the API key all but the control routes.
        accepted = [self._expected_admin_auth]
        if not control:
            accepted.append(self._expected_auth)
        if self._expected_auth is None and not (control and self._expected_admin_auth):
            return self._caller(scope)
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
        return self._caller(scope)

    def _caller(self, scope: Scope) -> str | None:
        """Who an admitted request is: None without keys (everyone is the same caller), else
        the key it carries, or ``ANONYMOUS`` on a route no key guards."""
        args = self.ctx.server_args
        if args.api_key is None and args.admin_api_key is None:
            return None
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if args.admin_api_key is not None and hmac.compare_digest(
                given, f"Bearer {args.admin_api_key}".encode()):
            return ADMIN
        if args.api_key is not None and hmac.compare_digest(
                given, f"Bearer {args.api_key}".encode()):
            return API_KEY
        return ANONYMOUS

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
            except TimeoutError:
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


def _check_headers(scope: Scope) -> None:
    """431 past ``MAX_HEADERS`` header fields or ``MAX_HEADER_BYTES`` of names and values."""
    headers = scope["headers"]
    if len(headers) > MAX_HEADERS:
        raise APIError(431, f"The request has {len(headers)} header fields; at most "
                       f"{MAX_HEADERS} are accepted.", headers={"Connection": "close"})
    size = sum(len(name) + len(value) for name, value in headers)
    if size > MAX_HEADER_BYTES:
        raise APIError(431, f"The request headers are {size} bytes long; at most "
                       f"{MAX_HEADER_BYTES} are accepted.", headers={"Connection": "close"})


_NOT_JSON = object()  # ``_check_values``' answer for an empty body or one that is not JSON


def _check_values(body: bytes) -> object:
    """The JSON value of ``body``; 400 naming the first value that the server cannot carry (an
    integer past 64 bits, NaN, a lone surrogate, deep nesting: ``request_values``), before
    any route reads it. A body that is not JSON (``_NOT_JSON``) is left to the route, which
    says so."""
    if not body:
        return _NOT_JSON
    try:
        # surrogatepass: an encoded lone surrogate is refused below, naming where it is.
        text = body.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise APIError(400, f"The request body is not UTF-8 (byte {e.start}); JSON must be "
                       "sent as UTF-8.") from None
    if text.startswith("\ufeff"):
        raise APIError(400, "The request body starts with a byte order mark; send UTF-8 JSON "
                       "without one.")
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except RecursionError:
        raise APIError(
            400, f"The request body is nested more than {MAX_DEPTH} levels deep."
        ) from None
    except json.JSONDecodeError:
        if _other_encoding(body):  # UTF-16/32 without a byte order mark: NULs are UTF-8
            raise APIError(400, "The request body is not UTF-8 JSON (it reads as UTF-16 or "
                           "UTF-32); JSON must be sent as UTF-8.") from None
        return _NOT_JSON
    except _DuplicateKeyError as e:
        raise APIError(400, f"The request body repeats the key {e.key[:100]!r} in one object: "
                       "each key may appear once.", param=e.key[:100]) from None
    except ValueError as e:  # an integer of more than 4300 digits, bytes that are not UTF-8
        raise APIError(400, f"The request body is not valid JSON: {e}") from None
    found = find_unrepresentable(data)
    if found is not None:
        path, why = found
        raise APIError(400, describe(path, why), param=path or None)
    return data


class _DuplicateKeyError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads``' object hook: a repeated key is an error, not "the last one wins" (which
    value a client meant, and which one a proxy in front checked, would differ)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKeyError(key)
            seen.add(key)
    return obj


def _other_encoding(body: bytes) -> bool:
    """Whether ``body`` is JSON in another encoding that a route's ``json.loads(bytes)`` would
    detect and read (UTF-16 or UTF-32, which it sniffs from the NUL bytes)."""
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def _as_json(scope: Scope) -> Scope:
    """Every POST body is JSON: a missing or other Content-Type (``curl -d`` sends a form
    type) is read as JSON rather than failing with a confusing validation error. The one
    exception is a file upload (``POST /v1/files``, multipart)."""
    if scope["path"] in UPLOAD_PATHS:
        return scope
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
