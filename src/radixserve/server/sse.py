"""Server-sent events: ``data: <json>`` lines, ending with ``data: [DONE]``.

Both APIs stream the same way (OpenAI's format, which SGLang's native ``/generate`` also uses).
The response object only frames events; producing them, and closing the generation when the
client goes away, is the caller's generator's job (Starlette cancels it on disconnect).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"

_HEADERS = {
    "Cache-Control": "no-cache",
    # Tell reverse proxies (nginx) not to buffer the stream.
    "X-Accel-Buffering": "no",
}


def sse_event(payload: dict[str, Any] | list[Any]) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


def sse_model(model: BaseModel) -> bytes:
    """One SSE event carrying ``model``: pydantic's own JSON encoder, the same compact JSON as
    ``sse_event(model.model_dump())`` in a quarter of the time (it runs once per streamed token)."""
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    """Stream already-framed events (``sse_event`` / ``DONE``) to the client."""
    return StreamingResponse(events, media_type="text/event-stream", headers=_HEADERS)
