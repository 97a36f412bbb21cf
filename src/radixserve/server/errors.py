"""One error shape for every route: the OpenAI error object.

Every failure the server reports, on OpenAI routes and native routes alike, is a JSON body
``{"error": {"message", "type", "param", "code"}}`` with a meaningful status code. Bad input is
always a 4xx: FastAPI's 422 validation errors become 400, a ``ValueError`` raised by the
TokenizerManager (its validation) becomes 400, unknown routes become 404. A 500 means a bug.

Handlers raise ``APIError`` to fail a request; middlewares, which run outside FastAPI's exception
handling, call ``send_error`` on the raw ASGI ``send``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from radixserve.managers.tokenizer.request_state import (
    CapacityError,
    SchedulerError,
    ServiceUnavailableError,
)

logger = logging.getLogger(__name__)

# Status code -> error "type" (the OpenAI SDK maps the status code to its exception class; the
# type tells a human or a client what kind of failure it was).
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "request_timeout",
    413: "request_too_large",
    431: "request_too_large",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """A request failure with its HTTP status; rendered as the OpenAI error object."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


# Messages and params quote the request (a model name, a field path): an error never echoes
# more than this of it, however large the input.
MAX_MESSAGE_CHARS = 2000
MAX_PARAM_CHARS = 200


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": _clip(message, MAX_MESSAGE_CHARS),
            "type": ERROR_TYPES.get(status_code, "invalid_request_error"),
            "param": None if param is None else _clip(param, MAX_PARAM_CHARS),
            "code": code,
        }
    }


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status_code, err.message, err.param, err.code),
        status_code=err.status_code,
        headers=err.headers,
    )


async def send_error(send: Send, err: APIError, *, message_only: bool = False) -> None:
    """Answer with ``err`` directly on an ASGI ``send`` (for middlewares). ``message_only``:
    Ollama's shape, ``{"error": message}``, for its routes (``server/ollama/route.py``)."""
    payload = ({"error": _clip(err.message, MAX_MESSAGE_CHARS)} if message_only
               else error_body(err.status_code, err.message, err.param, err.code))
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def stream_error(exc: Exception) -> dict[str, Any]:
    """The error object sent as a last SSE event when a stream fails after it started."""
    if isinstance(exc, ValueError):
        return error_body(400, str(exc))
    if isinstance(exc, ServiceUnavailableError):
        return error_body(503, str(exc))
    if isinstance(exc, SchedulerError):
        return error_body(500, str(exc))
    logger.error("stream failed: %r", exc)
    return error_body(500, f"internal server error: {type(exc).__name__}: {exc}")


def _describe_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """Turn pydantic's error list into one readable message and the first bad field's path."""
    parts = []
    first_param = None
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"The request body is not valid JSON: {detail}".rstrip(": "), None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # Drop pydantic's union-member tags ("str", "list[int]") from the path.
        loc = [x for x in loc if "[" not in x and x not in ("str", "int", "float", "bool")]
        if err.get("type") == "unsupported_parameter":  # raised naming its field
            loc = [*loc, str(err["ctx"]["field"])]
        where = ".".join(loc) or "request body"
        if first_param is None and loc:
            first_param = where
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown parameter (it would be ignored, so it is refused)"
        parts.append(f"{where}: {msg}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request", first_param


def install_error_handlers(app: FastAPI) -> None:
    """Make every error an OpenAI error object with the right status code."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_errors(exc.errors())
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(
            APIError(exc.status_code, str(exc.detail), headers=exc.headers or None)
        )

    @app.exception_handler(ServiceUnavailableError)
    async def _unavailable(_: Request, exc: ServiceUnavailableError) -> JSONResponse:
        return error_response(APIError(503, str(exc), headers={"Retry-After": "1"}))

    @app.exception_handler(CapacityError)
    async def _capacity(_: Request, exc: CapacityError) -> JSONResponse:
        return error_response(APIError(429, str(exc), code="rate_limit_exceeded",
                                       headers={"Retry-After": "1"}))

    @app.exception_handler(SchedulerError)
    async def _scheduler_error(_: Request, exc: SchedulerError) -> JSONResponse:
        return error_response(APIError(500, str(exc)))

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(APIError(400, str(exc)))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while handling a request")
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}"))
