"""``POST /v1/rerank`` (SGLang's path, with vLLM's ``/rerank`` and ``/v2/rerank``): the
documents ordered by their relevance to the query, in vLLM's and Cohere's shape.

The model scores each (query, document) pair (``cross_encoder.py``): a one-label cross-encoder's
score is the sigmoid of its logit, a yes/no decoder reranker's is ``p(yes)`` over the two
answers. ``results`` are sorted by score, highest first, each with the document's ``index`` in
the request; ``top_n`` keeps the first n; ``return_documents`` (default true, as vLLM) adds each
document as ``{"text": ...}``.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from radixserve.server.admission import admit
from radixserve.server.context import get_ctx
from radixserve.server.openai.cross_encoder import (
    CLASSIFIER,
    check_query,
    classifier_logits,
    rerank_kind,
    sigmoid,
    yes_no_scores,
)
from radixserve.server.parsed_body import ParsedBodyRoute
from radixserve.server.strict_request import StrictRequest, non_empty_list

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py


class RerankDocument(BaseModel):
    """A document as an object (Cohere's v2 form): its text."""

    model_config = ConfigDict(extra="forbid")
    text: str


class RerankRequest(StrictRequest):
    """vLLM's / Cohere's rerank body; an unknown field is a 400 naming it."""

    UNSUPPORTED = {
        "max_chunks_per_doc": ((None,), "documents are never split into chunks"),
        "rank_fields": ((None,), "documents are texts, not records"),
    }

    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True
    model: str | None = None
    user: str | None = None

    _non_empty = field_validator("documents")(non_empty_list)


@router.post("/v1/rerank")
@router.post("/rerank")  # vLLM's path for the same route
@router.post("/v2/rerank")  # vLLM's Cohere-v2-compatible path
async def rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    ctx.check_model(body.model)
    kind = rerank_kind(ctx)
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    admit(request, len(texts), prompt_param="documents")
    await check_query(ctx, body.query)  # before it is joined to every document
    if kind == CLASSIFIER:
        logits, tokens = await classifier_logits(ctx, request, [(body.query, t) for t in texts])
        scores = [sigmoid(row[0]) for row in logits]
    else:
        scores, tokens = await yes_no_scores(ctx, request, body.query, texts)
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": ctx.model_name,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }

