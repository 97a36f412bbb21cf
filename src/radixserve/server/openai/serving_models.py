"""``GET /v1/models`` and ``GET /v1/models/{id}``: the model this server serves, then each
loaded LoRA adapter (``id`` its name, ``root`` its folder, ``parent`` the base model's name, as
SGLang and vLLM list them).

The card names the model as clients name it: ``id`` and ``root`` are both the served model name
(``--served-model-name``, else the model path), as in SGLang; the path on disk is not shown.
``max_model_len`` is the context length.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from radixserve.server.context import ServerContext, get_ctx
from radixserve.server.openai.protocol import ModelCard, ModelList
from radixserve.server.parsed_body import ParsedBodyRoute

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py


def _card(ctx: ServerContext) -> ModelCard:
    return ModelCard(
        id=ctx.model_name,
        created=ctx.created,
        root=ctx.model_name,
        max_model_len=ctx.context_len,
    )


def _adapter_cards(ctx: ServerContext) -> list[ModelCard]:
    return [
        ModelCard(id=name, created=ctx.created, root=path, parent=ctx.model_name,
                  max_model_len=ctx.context_len)
        for name, path in sorted(ctx.tokenizer_manager.request_tokenizer.lora_adapters.items())
    ]


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    return ModelList(data=[_card(ctx), *_adapter_cards(ctx)]).model_dump()


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    """The model card; 404 for any other id (ids may contain slashes, like paths)."""
    ctx = get_ctx(request)
    adapter = ctx.lora_of_model(model_id)
    if adapter is not None:
        return next(c for c in _adapter_cards(ctx) if c.id == adapter).model_dump()
    return _card(ctx).model_dump()
