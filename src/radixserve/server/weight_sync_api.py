"""SGLang's weight-sync routes for RL trainers (verl, OpenRLHF, slime): join a weights update
group, receive weights broadcast through it, leave it (docs/weight-sync.md).

Operator routes: with ``--admin-api-key`` they need that key. Each blocks until the trainer's
side has done its part (joined the group, broadcast every tensor), so a trainer posts them from
another thread or task than the one that broadcasts. A refusal is a 400 with the reason and the
weights stay as they were.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from radixserve.managers import io_struct
from radixserve.managers.tokenizer import weight_sync_client
from radixserve.model_executor.weight_sync import DEFAULT_GROUP
from radixserve.server.context import get_ctx
from radixserve.server.parsed_body import ParsedBodyRoute
from radixserve.server.strict_request import StrictRequest

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py


class InitWeightsUpdateGroupRequest(StrictRequest):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = DEFAULT_GROUP
    backend: str | None = None  # None: gloo on CPU, nccl on CUDA


class UpdateWeightsFromDistributedRequest(StrictRequest):
    UNSUPPORTED = {
        "weight_version": ((None,), "weight versions are not tracked"),
        "load_format": ((None, "auto"), "tensors are loaded by name as a checkpoint's"),
    }

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False


class DestroyWeightsUpdateGroupRequest(StrictRequest):
    group_name: str = DEFAULT_GROUP


@router.post("/init_weights_update_group")
async def init_weights_update_group(
    body: InitWeightsUpdateGroupRequest, request: Request
) -> dict[str, Any]:
    """Join the trainer's group as ranks ``rank_offset`` .. ``rank_offset + ranks - 1``."""
    req = io_struct.InitWeightsUpdateGroupReqInput(**body.model_dump())
    message = await weight_sync_client.init_weights_update_group(
        get_ctx(request).tokenizer_manager, req)
    return {"success": True, "message": message}


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(
    body: UpdateWeightsFromDistributedRequest, request: Request
) -> dict[str, Any]:
    """Receive one broadcast from rank 0 per (name, dtype, shape), in order, and load them."""
    req = io_struct.UpdateWeightsFromDistributedReqInput(
        names=body.names, dtypes=body.dtypes, shapes=body.shapes, group_name=body.group_name,
        flush_cache=body.flush_cache)
    message = await weight_sync_client.update_weights_from_distributed(
        get_ctx(request).tokenizer_manager, req, body.abort_all_requests)
    return {"success": True, "message": message}


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(
    body: DestroyWeightsUpdateGroupRequest, request: Request
) -> dict[str, Any]:
    message = await weight_sync_client.destroy_weights_update_group(
        get_ctx(request).tokenizer_manager, body.group_name)
    return {"success": True, "message": message}
