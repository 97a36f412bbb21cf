"""SGLang's native HTTP API: ``/generate`` and the operational routes.

``/generate`` replies exactly what ``TokenizerManager.generate_request`` (and so the ``Engine``)
returns: ``{"text", "output_ids", "meta_info"}``, a list of those for a batch, or, with
``"stream": true``, SSE events carrying the cumulative dicts followed by ``data: [DONE]``.

Its body takes every field of SGLang's ``GenerateReqInput`` (the client of SGLang's frontend
language sends them, most as ``null``): ``null`` means the default; a field radixserve does not
implement is refused with a 400 naming it when it carries a value (``UNSUPPORTED_GENERATE``).
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
from pydantic import BaseModel, ConfigDict

from radixserve.managers.caller import ADMIN, current_caller
from radixserve.managers.io_struct import FlushCacheReq, OpenSessionReqInput
from radixserve.managers.tokenizer.generate_request import GenerateReqInput
from radixserve.server.admission import (
    admit,
    check_batch_size,
    check_priority,
    num_prompts,
    requested_n,
)
from radixserve.server.context import ServerContext, ServerState, get_ctx
from radixserve.server.errors import APIError, stream_error
from radixserve.server.generations import cancel_on_disconnect, first_item, prime
from radixserve.server.metrics import CONTENT_TYPE
from radixserve.server.off_loop import counts as off_loop_counts
from radixserve.server.off_loop import run_sized
from radixserve.server.parsed_body import ParsedBodyRoute
from radixserve.server.sse import DONE, sse_event, sse_response
from radixserve.server.strict_request import StrictRequest, Unsupported
from radixserve.version import __version__

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py

HEALTH_GENERATE_TIMEOUT_S = 20.0


class _StrictModel(BaseModel):
    # The native API rejects unknown fields: a misspelt field would otherwise be silently lost.
    model_config = ConfigDict(extra="forbid")


_MULTIMODAL = "multimodal input is not supported (text-only models)"
_DISAGG = "prefill/decode disaggregation is not supported"
_OUTPUT = "this output is not implemented"
# SGLang's GenerateReqInput fields radixserve does not implement, with the values that mean
# "unused" (SGLang's defaults).
UNSUPPORTED_GENERATE: Unsupported = {
    **{name: ((None, []), _MULTIMODAL) for name in (
        "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
        "mm_content_hashes", "modalities", "video_config", "max_dynamic_patch",
        "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
        "images_config", "mm_processor_kwargs", "need_wait_for_mm_inputs",
        "num_items_assigned", "encoder_urls", "positional_embed_overrides",
    )},
    "use_audio_in_video": ((None, False), _MULTIMODAL),
    **{name: ((None,), _DISAGG) for name in (
        "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
        "decode_tp_size", "disagg_prefill_dp_rank",
    )},
    **{name: ((None, False), _OUTPUT) for name in (
        "return_sampling_mask", "return_flat_raw_top_logprobs",
        "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64",
        "return_hidden_states", "return_routed_experts", "return_indexer_topk", "return_bytes",
        "return_entropy", "return_prompt_token_ids",
    )},
    "sampling_logprobs_mode": ((None,), _OUTPUT),
    "routed_experts_start_len": ((None, 0), _OUTPUT),
    "lora_id": ((None,), "an internal field of SGLang (name adapters with lora_path)"),
    "custom_logit_processor": ((None,), "custom logit processors are not supported"),
    "watermark": ((None,), "watermarking is not supported"),
    "routing_key": ((None,), "routing-key scheduling is not supported"),
    "session_id": ((None,), "session identity without session_params is not supported"),
    "background": ((None, False), "background requests are not supported"),
    "require_reasoning": ((None, False), "reasoning models are not supported"),
    "max_thinking_tokens": ((None,), "reasoning models are not supported"),
    "extra_key": ((None, ""), "cache namespaces are not supported"),
    "cache_salt": ((None, ""), "cache namespaces are not supported"),
    "kv_hints": ((None,), "KV hints are not supported"),
    "no_logs": ((None, False), "per-request log suppression is not supported"),
    "custom_labels": ((None,), "custom metric labels are not supported"),
    "conversation_id": ((None,), "conversation tracking is not supported"),
    "external_trace_header": ((None,), "tracing is not supported"),
    "received_time": ((None,), "an internal field of SGLang"),
    "http_worker_ipc": ((None,), "an internal field of SGLang"),
    "multi_item_delimiter_indices": ((None,), "multi-item scoring is not supported"),
    "token_indices_to_pool": ((None,), "pooled scoring is not supported"),
}


class GenerateRequest(StrictRequest):
    """The body of ``POST /generate``: the fields of SGLang's ``GenerateReqInput`` that
    radixserve implements (``null`` = default), plus ``UNSUPPORTED_GENERATE``."""

    UNSUPPORTED = UNSUPPORTED_GENERATE

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    rid: str | list[str] | None = None
    stream: bool | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool | None = None
    session_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    # The LoRA adapter by name, one for all prompts or one per prompt (docs/lora.md).
    lora_path: str | list[str | None] | None = None
    log_metrics: bool | None = None
    # Scheduling priority (--enable-priority-scheduling; docs/priority.md).
    priority: int | None = None
    # The data-parallel replica to run on (SGLang's two names for it).
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    # sglang-router sends ``model`` with every request (``null`` unless its client named one).
    model: str | None = None


class ConcateAndAppendRequest(_StrictModel):
    src_rids: list[str]
    dst_rid: str


class AbortRequest(_StrictModel):
    rid: str = ""
    abort_all: bool = False


class OpenSessionRequest(_StrictModel):
    capacity_of_str_len: int
    session_id: str | None = None
    streaming: bool = False
    timeout: float | None = None
    resume: bool = False


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
    ctx.check_model(body.model)
    prompt, field = (body.text, "text") if body.text is not None else (body.input_ids, "input_ids")
    admit(request, num_prompts(prompt), requested_n(body.sampling_params), prompt_param=field,
          priority=body.priority)
    _check_lora_path(ctx, body.lora_path)
    check_priority(ctx.server_args, body.priority)
    fields = body.model_dump(exclude_none=True, exclude={"model", "routed_dp_rank"})
    fields["data_parallel_rank"] = _dp_rank(body, ctx.server_args.dp_size)
    obj = GenerateReqInput(**fields)
    prepared = await run_sized(request, ctx.tokenizer_manager.prepare_generate, obj)
    agen = ctx.tokenizer_manager.generate_request(prepared)
    if not obj.stream:
        return JSONResponse(await cancel_on_disconnect(request, first_item(agen)))
    return sse_response(_stream_events(await prime(request, agen)))


def _check_lora_path(ctx: ServerContext, lora_path: str | list[str | None] | None) -> None:
    """400 naming ``lora_path`` for an adapter that is not loaded (or LoRA not enabled)."""
    names = lora_path if isinstance(lora_path, list) else [lora_path]
    if all(name is None for name in names):
        return
    if not ctx.server_args.enable_lora:
        raise APIError(400, "lora_path needs a server started with --enable-lora",
                       param="lora_path")
    loaded = ctx.tokenizer_manager.request_tokenizer.lora_adapters
    for name in names:
        if name is not None and name not in loaded:
            raise APIError(400, f"no LoRA adapter named {name!r} is loaded", param="lora_path")


def _dp_rank(body: GenerateRequest, dp_size: int) -> int | None:
    """The replica ``routed_dp_rank`` or ``data_parallel_rank`` names; 400 naming the field for
    one that does not exist (or when they disagree)."""
    given = {n: getattr(body, n) for n in ("routed_dp_rank", "data_parallel_rank")
             if getattr(body, n) is not None}
    if len(set(given.values())) > 1:
        raise APIError(400, f"routed_dp_rank and data_parallel_rank disagree: {given}",
                       param="routed_dp_rank")
    for name, rank in given.items():
        if not 0 <= rank < dp_size:
            raise APIError(400, f"{name} {rank} does not exist: there are {dp_size} "
                           f"data-parallel replicas (--dp-size)", param=name)
        return rank
    return None


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
        alive = await ctx.tokenizer_manager.control.check_health(timeout)
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
    """Generate one token (embedding models: embed one input) end to end, within a timeout;
    left out of metrics (``log_metrics`` false)."""
    tokenizer_manager = get_ctx(request).tokenizer_manager
    rid = f"health-generate-{uuid.uuid4().hex}"
    if tokenizer_manager.is_generation:
        obj = GenerateReqInput(
            text="Hello", sampling_params={"max_new_tokens": 1, "temperature": 0.0}, rid=rid,
            log_metrics=False,
        )
        work = first_item(tokenizer_manager.generate_request(obj))
    else:
        work = tokenizer_manager.encode_request(GenerateReqInput(text="Hello", rid=rid))
    what = "generation" if tokenizer_manager.is_generation else "embedding"
    try:
        out = await asyncio.wait_for(work, HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        raise APIError(
            503, f"health {what} failed: no output within {HEALTH_GENERATE_TIMEOUT_S:g}s (the "
            "scheduler is stuck, paused or overloaded)", headers={"Retry-After": "1"},
        ) from None
    except (RuntimeError, ValueError) as exc:  # the backend is gone, memory released, ...
        reason = str(exc) or type(exc).__name__
        raise APIError(503, f"health {what} failed: {reason}") from exc
    finish = out["meta_info"].get("finish_reason") or {}
    if finish.get("type") == "abort":
        raise APIError(503, f"health {what} failed: it was aborted ({finish.get('message')})")
    return Response(status_code=200)


@router.post("/concate_and_append_request")
async def concate_and_append_request(body: ConcateAndAppendRequest) -> Response:
    """SGLang's frontend calls this to join forked states; SGLang itself no longer serves it."""
    raise APIError(
        501,
        "/concate_and_append_request is not implemented: radixserve cannot join the KV of "
        f"requests {body.src_rids} into {body.dst_rid!r}; run the program without fork joins "
        "or resend the joined text as a new prompt",
    )


# ---------------------------------------------------------------------------- information
@router.get("/get_model_info")
@router.get("/model_info")  # SGLang's newer name, which sglang-router asks first
async def get_model_info(request: Request) -> dict[str, Any]:
    """What SGLang's ``/get_model_info`` returns (its client reads ``model_path``), plus the
    context length and vocabulary size."""
    ctx = get_ctx(request)
    config = ctx.tokenizer_manager.model_config
    return {
        "model_path": ctx.server_args.model_path,
        "served_model_name": ctx.model_name,
        "tokenizer_path": ctx.server_args.tokenizer,
        "is_generation": ctx.tokenizer_manager.is_generation,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.hf_config.get("model_type"),
        "architectures": config.hf_config.get("architectures"),
        "architecture": config.architecture,
        "context_length": ctx.context_len,
        "vocab_size": ctx.vocab_size,
    }


@router.get("/get_server_info")
@router.get("/server_info")  # SGLang's newer name, which sglang-router asks first
async def get_server_info(request: Request) -> dict[str, Any]:
    """The server arguments, the sizes the scheduler chose, the live internal state of each
    data-parallel replica, the requests this process still holds state for (0 when idle: a
    request that leaked its state would stay), and the worker processes (name → pid)."""
    ctx = get_ctx(request)
    info = dataclasses.asdict(ctx.server_args)
    info.pop("api_key")  # never echo the secrets
    info.pop("admin_api_key")
    info.update(
        context_length=ctx.context_len,
        max_total_num_tokens=ctx.scheduler_info.get("max_total_num_tokens"),
        max_running_requests=ctx.scheduler_info.get("max_running_requests"),
        page_size=ctx.scheduler_info.get("page_size", ctx.server_args.page_size),
        internal_states=await ctx.tokenizer_manager.control.internal_states(),
        num_inflight_requests=ctx.tokenizer_manager.num_inflight,
        queued_generations=ctx.queued_generations,  # admitted, counted against the limit
        **off_loop_counts(),  # inputs and bodies prepared off the event loop (off_loop.py)
        processes=ctx.scheduler_info.get("processes", {}),
        version=__version__,
    )
    return info


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx = get_ctx(request)
    if ctx.metrics is None:
        raise APIError(404, "Metrics are disabled; start the server with --enable-metrics.")
    ctx.metrics.update_scheduler_state(await ctx.tokenizer_manager.control.internal_states())
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


# ---------------------------------------------------------------------------- control
# SGLang takes both methods; each gets an OpenAPI operation id of its own.
@router.get("/flush_cache", operation_id="flush_cache_get")
@router.post("/flush_cache", operation_id="flush_cache")
async def flush_cache(request: Request) -> dict[str, Any]:
    """Drop the prefix cache; refused (400) while requests are running."""
    reply = await get_ctx(request).tokenizer_manager.control.call(FlushCacheReq())
    if not reply.success:
        raise APIError(400, reply.message or "The cache cannot be flushed while requests run.")
    return {"success": True, "message": reply.message or "Cache flushed."}


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> dict[str, Any]:
    """Abort one request by ``rid`` or every request; they finish with finish_reason abort."""
    if not body.rid and not body.abort_all:
        raise APIError(400, "Give a non-empty 'rid' or 'abort_all': true.", param="rid")
    if (body.abort_all and get_ctx(request).server_args.admin_api_key is not None
            and current_caller.get() != ADMIN):
        raise APIError(403, "abort_all needs the admin API key (--admin-api-key); with this key "
                       "abort the requests you sent by rid.", param="abort_all",
                       code="permission_denied")
    get_ctx(request).tokenizer_manager.abort_request(rid=body.rid, abort_all=body.abort_all)
    return {"success": True}


# ---------------------------------------------------------------------------- sessions
@router.post("/open_session")
async def open_session(body: OpenSessionRequest, request: Request) -> str:
    """Open a session (docs/architecture.md §5) and return its id; 400 with the scheduler's
    reason."""
    req = OpenSessionReqInput(**body.model_dump())
    return await get_ctx(request).tokenizer_manager.open_session(req)


@router.post("/close_session")
async def close_session(body: CloseSessionRequest, request: Request) -> dict[str, Any]:
    await get_ctx(request).tokenizer_manager.close_session(body.session_id)
    return {"success": True}


# ---------------------------------------------------------------------------- tokenizer
@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """Token ids of one prompt or of a batch of at most ``--max-batch-size`` prompts (a large
    body is tokenized off the event loop: ``off_loop.py``)."""
    ctx = get_ctx(request)
    tok = ctx.tokenizer
    if isinstance(body.prompt, str):
        ids = await run_sized(request, lambda: tok.encode(
            body.prompt, add_special_tokens=body.add_special_tokens))
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.context_len}
    check_batch_size(ctx.server_args, len(body.prompt), "prompt")
    rows = await run_sized(request, lambda: [
        tok.encode(p, add_special_tokens=body.add_special_tokens) for p in body.prompt])
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
