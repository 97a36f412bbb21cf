"""Operator routes (SGLang's names): pause, weights, memory, profiling, internal state, load.

All but ``/get_load`` are in ``app.CONTROL_PATHS``: with ``--admin-api-key`` they need that key.
Each sends its control request through the tokenizer manager's ``ControlClient``
(``managers/tokenizer/control_client.py``), or calls the ``TokenizerManager`` method of the same
name where the request needs its state (pause, weights, memory); a refusal (``ValueError``) is a
400 with the scheduler's reason, while memory is released generation gets 503.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from radixserve.managers import io_struct
from radixserve.managers.io_struct import MAX_PROFILE_STEPS, PauseMode, ProfileReq
from radixserve.managers.tokenizer import lora_client
from radixserve.managers.tokenizer.tokenizer_manager import TokenizerManager
from radixserve.server.context import get_ctx
from radixserve.server.parsed_body import ParsedBodyRoute

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py


class _StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 400, never ignored


class PauseGenerationRequest(_StrictModel):
    mode: PauseMode = "abort"


class UpdateWeightsFromDiskRequest(_StrictModel):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False


class LoadLoRAAdapterRequest(_StrictModel):
    lora_name: str
    lora_path: str
    pinned: bool = False  # SGLang's: keep it in its slot; every loaded adapter is, here


class UnloadLoRAAdapterRequest(_StrictModel):
    lora_name: str


class GetWeightsByNameRequest(_StrictModel):
    name: str
    truncate_size: int = Field(default=100, ge=1)


class MemoryRequest(_StrictModel):
    tags: list[str] | None = None


class StartProfileRequest(_StrictModel):
    output_dir: str | None = None
    num_steps: int | None = Field(default=None, ge=1, le=MAX_PROFILE_STEPS)
    activities: list[str] | None = None
    record_shapes: bool = False
    with_stack: bool = False


class SetInternalStateRequest(_StrictModel):
    server_args: dict[str, Any]


class SlowDownRequest(_StrictModel):
    forward_sleep_time: float | None = Field(ge=0)


class EmptyRequest(_StrictModel):
    pass


@router.post("/pause_generation")
async def pause_generation(
    request: Request, body: PauseGenerationRequest | None = None
) -> dict[str, Any]:
    """Stop running batches until /continue_generation (``mode``: abort, retract, in_place).

    Returns once the pause holds; generation requests sent meanwhile wait in the queue.
    """
    mode = (body or PauseGenerationRequest()).mode
    await get_ctx(request).tokenizer_manager.pause_generation(mode)
    return {"status": "ok", "message": "Generation paused successfully."}


@router.post("/continue_generation")
async def continue_generation(
    request: Request, body: EmptyRequest | None = None
) -> dict[str, Any]:
    await get_ctx(request).tokenizer_manager.control.call(io_struct.ContinueGenerationReqInput())
    return {"status": "ok", "message": "Generation continued successfully."}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(
    body: UpdateWeightsFromDiskRequest, request: Request
) -> dict[str, Any]:
    """Swap the weights in place (same architecture and shapes); 400 keeps the old ones."""
    message = await get_ctx(request).tokenizer_manager.update_weights_from_disk(
        body.model_path, body.load_format, body.abort_all_requests
    )
    return {"success": True, "message": message}


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> dict[str, Any]:
    """Load a PEFT adapter folder while serving; 400 with the reason when refused."""
    loaded = await lora_client.load_lora_adapter(
        get_ctx(request).tokenizer_manager, body.lora_name, body.lora_path
    )
    return {"success": True, "loaded_adapters": loaded}


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request
) -> dict[str, Any]:
    """Unload an adapter; 400 while a running or waiting request uses it (retry after)."""
    loaded = await lora_client.unload_lora_adapter(
        get_ctx(request).tokenizer_manager, body.lora_name
    )
    return {"success": True, "loaded_adapters": loaded}


# SGLang takes both methods; each gets an OpenAPI operation id of its own.
@router.get("/get_weights_by_name", operation_id="get_weights_by_name_get")
@router.post("/get_weights_by_name", operation_id="get_weights_by_name")
async def get_weights_by_name(body: GetWeightsByNameRequest, request: Request) -> list[Any]:
    """The first ``truncate_size`` rows of a checkpoint tensor, as the server holds it."""
    req = io_struct.GetWeightsByNameReqInput(name=body.name, truncate_size=body.truncate_size)
    reply = await get_ctx(request).tokenizer_manager.control.call(req)
    return reply.parameter


def _memory_route(change: Callable[[TokenizerManager, list[str] | None], Awaitable[str]]) -> None:
    """Serve ``POST /<name of change>``: ``change`` (release or resume) of the memory the body's
    ``tags`` name (no body, or no tags: all of it). The two routes differ only in the method."""

    async def route(request: Request, body: MemoryRequest | None = None) -> dict[str, Any]:
        tags = body.tags if body is not None else None
        message = await change(get_ctx(request).tokenizer_manager, tags)
        return {"success": True, "message": message}

    router.post(f"/{change.__name__}", name=change.__name__)(route)


_memory_route(TokenizerManager.release_memory_occupation)
_memory_route(TokenizerManager.resume_memory_occupation)


@router.post("/start_profile")
async def start_profile(
    request: Request, body: StartProfileRequest | None = None
) -> dict[str, Any]:
    """Record a torch.profiler trace of the scheduler's steps (Chrome trace JSON)."""
    options = (body or StartProfileRequest()).model_dump()
    req = ProfileReq(action="start", **options)
    reply = await get_ctx(request).tokenizer_manager.control.call(req)
    return {"success": True, "message": reply.message, "trace_path": reply.trace_path}


@router.post("/stop_profile")
async def stop_profile(request: Request, body: EmptyRequest | None = None) -> dict[str, Any]:
    reply = await get_ctx(request).tokenizer_manager.control.call(ProfileReq(action="stop"))
    return {"success": True, "message": reply.message, "trace_path": reply.trace_path}


@router.post("/set_internal_state")
async def set_internal_state(body: SetInternalStateRequest, request: Request) -> dict[str, Any]:
    req = io_struct.SetInternalStateReq(server_args=body.server_args)
    reply = await get_ctx(request).tokenizer_manager.control.call(req)
    return {"updated": True, "server_args": reply.server_args}


@router.post("/slow_down")
async def slow_down(body: SlowDownRequest, request: Request) -> dict[str, Any]:
    """A test hook (as in SGLang): every forward step sleeps ``forward_sleep_time`` seconds."""
    req = io_struct.SlowDownReqInput(forward_sleep_time=body.forward_sleep_time)
    reply = await get_ctx(request).tokenizer_manager.control.call(req)
    return {"success": True, "forward_sleep_time": reply.forward_sleep_time}


@router.post("/freeze_gc")
async def freeze_gc(request: Request, body: EmptyRequest | None = None) -> dict[str, Any]:
    frozen = await get_ctx(request).tokenizer_manager.control.freeze_gc()
    return {"success": True, "frozen_objects": frozen}


@router.get("/get_load")
async def get_load(request: Request) -> list[dict[str, Any]]:
    """Running and queued requests and KV usage per replica: what routers poll."""
    return await get_ctx(request).tokenizer_manager.control.load()
