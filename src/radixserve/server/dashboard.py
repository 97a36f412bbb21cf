"""``/dashboard``: a live inspector page (plain HTML and JS, no build step) and the JSON it polls.

``GET /dashboard`` serves ``dashboard.html`` (beside this module); the page polls
``GET /dashboard/state`` twice a second: the scheduler's inspector state (memory, the running
batch and the queue, the radix tree, sessions, a history of recent steps) plus what the HTTP
server knows (its state, requests in flight). Both routes are control routes
(``--admin-api-key`` when set). A browser cannot send a header when it opens a page, so these
two routes also take the key as ``?key=...``; the page passes it on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from radixserve.managers.io_struct import GetInspectorStateReq
from radixserve.server.context import get_ctx
from radixserve.server.parsed_body import ParsedBodyRoute

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py

_PAGE = Path(__file__).with_name("dashboard.html")


@router.get("/dashboard")
async def dashboard() -> HTMLResponse:
    return HTMLResponse(_PAGE.read_text(), headers={"Cache-Control": "no-store"})


@router.get("/dashboard/state")
async def dashboard_state(request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    reply = await ctx.tokenizer_manager.control.call(GetInspectorStateReq())
    state = reply.state
    return {
        **state,
        "model": ctx.model_name,
        "server_state": ctx.state.value,
        "http_in_flight": ctx.in_flight,
    }
