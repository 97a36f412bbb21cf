"""A request body is parsed once, and a large one is parsed and validated off the event loop.

``RequestGuard`` (``request_guard.py``) parses every JSON body to check its values before any
route runs, on the thread pool of ``off_loop.py`` when the body is larger than
``OFF_LOOP_BYTES`` (8 MiB of small JSON values take seconds to parse and check), and leaves
what it parsed in the ASGI scope under ``PARSED_BODY_KEY``. Every route is a
``ParsedBodyRoute``: FastAPI's ``request.json()`` returns that value instead of parsing the
body again on the loop, and a large body (past ``OFF_LOOP_BYTES``) is also validated against
the route's pydantic model on the pool (a chat of 100,000 messages takes seconds to
validate), so that FastAPI's own validation on the loop only meets the finished model
instance, which it accepts as it is.

A body the guard could not parse as JSON is not in the scope: FastAPI parses it and answers
its usual 400. A validation error found on the pool is raised as the ``RequestValidationError``
FastAPI would have raised, so the answer is the same 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from radixserve.server.off_loop import OFF_LOOP_BYTES, body_size, run_body

PARSED_BODY_KEY = "radixserve.parsed_body"


class ParsedBodyRequest(Request):
    """A ``Request`` whose JSON body was parsed already (by the guard, maybe validated)."""

    def __init__(self, request: Request, value: Any) -> None:
        super().__init__(request.scope, request.receive)
        self._parsed = value

    async def json(self) -> Any:
        return self._parsed


class ParsedBodyRoute(APIRoute):
    """An ``APIRoute`` that reads the body the guard parsed (see the module doc)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        # Only a body that is one pydantic model (not fields embedded in an object) can be
        # handed over already validated: FastAPI then validates the instance, not a dict.
        field = self.body_field
        validated = field is not None and not getattr(self, "_embed_body_fields", True)

        async def route(request: Request) -> Response:
            if PARSED_BODY_KEY not in request.scope:
                return await handler(request)
            value = request.scope[PARSED_BODY_KEY]
            size = body_size(request)
            if validated and size >= OFF_LOOP_BYTES:  # a small one FastAPI validates, inline
                value = await run_body(size, _validate, field, value)
            return await handler(ParsedBodyRequest(request, value))

        return route


def _validate(field: Any, value: Any) -> Any:
    """``value`` validated as FastAPI validates a body (``ModelField.validate``), or the
    ``RequestValidationError`` FastAPI raises for it."""
    result, errors = field.validate(value, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=value)
    return result
