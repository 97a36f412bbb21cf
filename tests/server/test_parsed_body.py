"""Every route of the app reads the body the request guard parsed (``server/parsed_body.py``):
a router created without ``route_class=ParsedBodyRoute`` would parse large bodies again, and
validate them, on the event loop. Builds the app only (no server, no model)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi.routing import APIRoute

from radixserve.server.app import create_app
from radixserve.server.context import ServerContext
from radixserve.server.parsed_body import ParsedBodyRoute
from radixserve.server_args import ServerArgs


def test_every_route_is_a_parsed_body_route(tmp_path):
    args = ServerArgs(model_path="unused", batch_dir=str(tmp_path))
    app = create_app(ServerContext(server_args=args, tokenizer_manager=None, scheduler_info={}))
    routes = list(_api_routes(app.routes))
    assert any(r.path == "/generate" for r in routes) and len(routes) > 50
    plain = sorted(r.path for r in routes if not isinstance(r, ParsedBodyRoute))
    assert plain == [], f"routes without route_class=ParsedBodyRoute: {plain}"


def _api_routes(routes: list[Any]) -> Iterator[APIRoute]:
    """Every ``APIRoute``, through the routers the app includes (FastAPI keeps an included
    router as one entry that holds it)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        included = getattr(route, "original_router", None) or getattr(route, "routes", None)
        if included is not None:
            yield from _api_routes(getattr(included, "routes", included))
