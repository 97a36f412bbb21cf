"""``POST /v1/embeddings`` (OpenAI) and SGLang's native ``POST /encode``.

Both need an embedding model: an encoder checkpoint (BERT family) or a decoder served with
``--is-embedding``; a generation server answers 400. Embeddings are L2-normalised float32
vectors; OpenAI's ``encoding_format: "base64"`` (the openai SDK's default) sends the little-endian
float32 bytes in base64. ``dimensions`` is accepted only when it equals the model's embedding size:
these models were not trained to be truncated.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, field_validator

from radixserve.managers.tokenizer.generate_request import GenerateReqInput
from radixserve.server.admission import admit, num_prompts
from radixserve.server.context import get_ctx
from radixserve.server.errors import APIError
from radixserve.server.generations import cancel_on_disconnect
from radixserve.server.off_loop import run_sized
from radixserve.server.parsed_body import ParsedBodyRoute
from radixserve.server.strict_request import StrictRequest, non_empty_list

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py


class EmbeddingRequest(StrictRequest):
    """OpenAI's embeddings body; as OpenAI, an unknown field is a 400 (nothing is dropped)."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    _non_empty = field_validator("input")(non_empty_list)


class EncodeRequest(BaseModel):
    """The body of ``POST /encode``: ``text`` or ``input_ids``, single or batch."""

    model_config = ConfigDict(extra="forbid")  # native API: a misspelt field is an error

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode()


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    ctx.check_model(body.model)
    if ctx.tokenizer_manager.model_config.is_classifier:
        raise APIError(400, "this model is a sequence classifier (cross-encoder), not an "
                       "embedding model: use /v1/classify or /v1/rerank")
    admit(request, num_prompts(body.input), prompt_param="input")
    size = int(ctx.tokenizer_manager.model_config.hidden_size)
    if body.dimensions is not None and body.dimensions != size:
        raise APIError(
            400,
            f"dimensions={body.dimensions} is not supported: this model's embeddings have "
            f"{size} dimensions and cannot be shortened",
            param="dimensions",
        )
    inputs = body.input
    token_ids = isinstance(inputs, list) and all(isinstance(x, (int, list)) for x in inputs)
    obj = GenerateReqInput(input_ids=inputs) if token_ids else GenerateReqInput(text=inputs)
    prepared = await run_sized(request, ctx.tokenizer_manager.prepare_embedding, obj)
    outputs = await cancel_on_disconnect(request, ctx.tokenizer_manager.encode_request(prepared))
    if isinstance(outputs, dict):
        outputs = [outputs]
    prompt_tokens = sum(out["meta_info"]["prompt_tokens"] for out in outputs)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i,
             "embedding": _encoded(out["embedding"], body.encoding_format)}
            for i, out in enumerate(outputs)
        ],
        "model": ctx.model_name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


@router.post("/encode")
async def encode(body: EncodeRequest, request: Request) -> Any:
    """SGLang's native embedding route; the reply is what ``Engine.encode`` returns."""
    tokenizer_manager = get_ctx(request).tokenizer_manager
    prompt, field = (body.text, "text") if body.text is not None else (body.input_ids, "input_ids")
    admit(request, num_prompts(prompt), prompt_param=field)
    obj = GenerateReqInput(text=body.text, input_ids=body.input_ids, rid=body.rid)
    prepared = await run_sized(request, tokenizer_manager.prepare_embedding, obj)  # off_loop.py
    work = tokenizer_manager.encode_request(prepared)
    return await cancel_on_disconnect(request, work)
