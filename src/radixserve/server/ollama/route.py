"""Ollama's error shape for the Ollama routes, and how they name the model.

Ollama answers a failure with ``{"error": "<message>"}`` and its status code, and its clients
read exactly that (``ollama.ResponseError.error``). ``OllamaRoute`` runs a route and, when it
fails, asks the app's own error handlers (``server/errors.py``) for the response, so the status
code and message are the ones every other route gives, then reshapes the body. Headers that
matter to a client (``Retry-After``) are kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from radixserve.server.context import ServerContext
from radixserve.server.parsed_body import ParsedBodyRoute

_KEPT_HEADERS = ("retry-after",)


class OllamaRoute(ParsedBodyRoute):
    """An ``APIRoute`` whose errors have Ollama's body (and whose body the guard parsed:
    ``parsed_body.py``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return await ollama_error(request, exc)

        return route


async def ollama_error(request: Request, exc: Exception) -> Response:
    """The app's response to ``exc``, with ``{"error": message}`` as its body."""
    handlers = request.app.exception_handlers
    handler = next((handlers[c] for c in type(exc).__mro__ if c in handlers), None)
    if handler is None:
        raise exc
    response = await handler(request, exc)
    message = json.loads(response.body)["error"]["message"]
    headers = {k: v for k, v in response.headers.items() if k in _KEPT_HEADERS}
    return JSONResponse({"error": message}, status_code=response.status_code, headers=headers)


def check_model(ctx: ServerContext, name: str) -> None:
    """404 unless ``name`` is the served model, with or without Ollama's default tag."""
    served = (ctx.model_name, ctx.server_args.model_path)
    ctx.check_model(name if name in served else name.removesuffix(":latest"))
