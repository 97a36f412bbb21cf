"""SGLang's native HTTP API: ``/generate`` and the operational routes.

``/generate`` replies exactly what ``TokenizerManager.generate_request`` (and so the ``Engine``)
returns: ``{"text", "output_ids", "meta_info"}``, a list of those for a batch, or, with
``"stream": true``, SSE events carrying the cumulative dicts followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from radixserve import __version__
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.io_struct import OpenSessionReqInput
from radixserve.server.app import (
    ServerState,
    cancel_on_disconnect,
    first_item,
    get_ctx,
    prime,
)
from radixserve.server.errors import APIError, stream_error
from radixserve.server.metrics import CONTENT_TYPE
from radixserve.server.sse import DONE, sse_event, sse_response

router = APIRouter()

HEALTH_GENERATE_TIMEOUT_S = 20.0


class _StrictModel(BaseModel):
    # The native API rejects unknown fields: a misspelt field would otherwise be silently lost.
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(_StrictModel):
    """The body of ``POST /generate`` (the fields of ``GenerateReqInput``)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0)
    session_params: dict[str, Any] | list[dict[str, Any] | None] | None = None


class AbortRequest(_StrictModel):
    rid: str = ""
    abort_all: bool = False


class OpenSessionRequest(_StrictModel):
    capacity_of_str_len: int
    session_id: str | None = None
    streaming: bool = False
    timeout: float | None = None


class CloseSessionRequest(_StrictModel):
    session_id: str


class TokenizeRequest(_StrictModel):
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(_StrictModel):
    tokens: list[int]
    skip_special_tokens: bool = True


# ---------------------------------------------------------------------------- generation
@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    obj = GenerateReqInput(**body.model_dump(exclude_unset=True))
    agen = ctx.tokenizer_manager.generate_request(obj)
    if not obj.stream:
        return JSONResponse(await cancel_on_disconnect(request, first_item(agen)))
    return sse_response(_stream_events(await prime(agen)))


async def _stream_events(outputs: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """SSE events of a native stream; a failure after the first event becomes an error event."""
    async with contextlib.aclosing(outputs):  # type: ignore[type-var]
        try:
            async for out in outputs:
                yield sse_event(out)
        except Exception as exc:
            yield sse_event(stream_error(exc))
        yield DONE


# ---------------------------------------------------------------------------- health
@router.get("/health")
async def health(request: Request) -> Response:
    """200 once warmed up and while the scheduler answers a liveness ping within
    ``--health-timeout``; 503 while starting or draining, or when the scheduler is stuck in a
    step (load balancers stop sending)."""
    ctx = get_ctx(request)
    if ctx.state is not ServerState.READY:
        raise APIError(503, f"The server is {ctx.state.value}.", headers={"Retry-After": "1"})
    timeout = ctx.server_args.health_timeout
    try:
        alive = await ctx.tokenizer_manager.check_health(timeout)
    except RuntimeError as exc:  # the scheduler is gone
        raise APIError(503, f"The scheduler is not running: {exc}") from exc
    if not alive:
        raise APIError(
            503, f"The scheduler did not answer a liveness ping within {timeout:g}s.",
            headers={"Retry-After": "1"},
        )
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Generate one token (embedding models: embed one input) end to end, within a timeout."""
    tm = get_ctx(request).tokenizer_manager
    rid = f"health-generate-{uuid.uuid4().hex}"
    if tm.is_generation:
        obj = GenerateReqInput(
            text="Hello", sampling_params={"max_new_tokens": 1, "temperature": 0.0}, rid=rid
        )
        work = first_item(tm.generate_request(obj))
    else:
        work = tm.encode_request(text="Hello", rid=rid)
    try:
        await asyncio.wait_for(work, HEALTH_GENERATE_TIMEOUT_S)
    except (asyncio.TimeoutError, RuntimeError) as exc:
        raise APIError(503, f"health generation failed: {exc or 'timeout'}") from exc
    return Response(status_code=200)


# ---------------------------------------------------------------------------- information
@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    config = ctx.tokenizer_manager.model_config
    return {
        "model_path": ctx.server_args.model_path,
        "tokenizer_path": ctx.server_args.tokenizer,
        "served_model_name": ctx.model_name,
        "architecture": config.architecture,
        "context_length": ctx.context_len,
        "vocab_size": ctx.vocab_size,
        "is_generation": ctx.tokenizer_manager.is_generation,
    }


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    """The server arguments, the sizes the scheduler chose, and its live internal state."""
    ctx = get_ctx(request)
    info = dataclasses.asdict(ctx.server_args)
    info.pop("api_key")  # never echo the secret
    info.update(
        context_length=ctx.context_len,
        max_total_num_tokens=ctx.scheduler_info.get("max_total_num_tokens"),
        max_running_requests=ctx.scheduler_info.get("max_running_requests"),
        page_size=ctx.scheduler_info.get("page_size", ctx.server_args.page_size),
        internal_states=[await ctx.tokenizer_manager.get_internal_state()],
        version=__version__,
    )
    return info


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx = get_ctx(request)
    if ctx.metrics is None:
        raise APIError(404, "Metrics are disabled; start the server with --enable-metrics.")
    ctx.metrics.update_scheduler_state(await ctx.tokenizer_manager.get_internal_state())
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


# ---------------------------------------------------------------------------- control
@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> dict[str, Any]:
    """Drop the prefix cache; refused (400) while requests are running."""
    reply = await get_ctx(request).tokenizer_manager.flush_cache()
    if not reply.success:
        raise APIError(400, reply.message or "The cache cannot be flushed while requests run.")
    return {"success": True, "message": reply.message or "Cache flushed."}


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> dict[str, Any]:
    """Abort one request by ``rid`` or every request; they finish with finish_reason abort."""
    if not body.rid and not body.abort_all:
        raise APIError(400, "Give a non-empty 'rid' or 'abort_all': true.", param="rid")
    get_ctx(request).tokenizer_manager.abort_request(rid=body.rid, abort_all=body.abort_all)
    return {"success": True}


# ---------------------------------------------------------------------------- sessions
@router.post("/open_session")
async def open_session(body: OpenSessionRequest, request: Request) -> str:
    """Open a session (DESIGN section 5) and return its id; 400 with the scheduler's reason."""
    req = OpenSessionReqInput(**body.model_dump())
    return await get_ctx(request).tokenizer_manager.open_session(req)


@router.post("/close_session")
async def close_session(body: CloseSessionRequest, request: Request) -> dict[str, Any]:
    await get_ctx(request).tokenizer_manager.close_session(body.session_id)
    return {"success": True}


# ---------------------------------------------------------------------------- tokenizer
@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    tok = ctx.tokenizer
    if isinstance(body.prompt, str):
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.context_len}
    rows = [tok.encode(p, add_special_tokens=body.add_special_tokens) for p in body.prompt]
    return {"tokens": rows, "count": [len(r) for r in rows], "max_model_len": ctx.context_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    bad = sorted({t for t in body.tokens if not 0 <= t < ctx.vocab_size})
    if bad:
        raise APIError(
            400, f"token ids outside the vocabulary [0, {ctx.vocab_size}): {bad[:10]}",
            param="tokens",
        )
    text = ctx.tokenizer.decode(body.tokens, skip_special_tokens=body.skip_special_tokens)
    return {"text": text}
