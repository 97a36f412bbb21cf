"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model this server serves.

The card names the model as clients name it: ``id`` and ``root`` are both the served model name
(``--served-model-name``, else the model path), as in SGLang; the path on disk is not shown.
``max_model_len`` is the context length.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from radixserve.server.context import ServerContext, get_ctx
from radixserve.server.openai.protocol import ModelCard, ModelList

router = APIRouter()


def _card(ctx: ServerContext) -> ModelCard:
    return ModelCard(
        id=ctx.model_name,
        created=ctx.created,
        root=ctx.model_name,
        max_model_len=ctx.context_len,
    )


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return ModelList(data=[_card(get_ctx(request))]).model_dump()


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    """The model card; 404 for any other id (ids may contain slashes, like paths)."""
    ctx = get_ctx(request)
    ctx.check_model(model_id)
    return _card(ctx).model_dump()
