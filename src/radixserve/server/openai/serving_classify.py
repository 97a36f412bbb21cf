"""``POST /v1/classify`` (vLLM's, also at ``/classify``): a sequence classifier's label for
each input text.

Each input runs through the classifier (``cross_encoder.classifier_logits``); ``probs`` is the
softmax of its logits (the sigmoid of the only logit for a one-label model, as vLLM), ``label``
the name (``id2label`` of config.json) of the most probable class.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import field_validator

from radixserve.server.admission import admit
from radixserve.server.context import get_ctx
from radixserve.server.openai.cross_encoder import (
    check_classifier,
    classifier_logits,
    sigmoid,
    softmax,
)
from radixserve.server.parsed_body import ParsedBodyRoute
from radixserve.server.strict_request import StrictRequest, non_empty_list

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py


class ClassificationRequest(StrictRequest):
    """vLLM's classification body: ``input`` is one text or a list of texts."""

    input: str | list[str]
    model: str | None = None
    user: str | None = None

    _non_empty = field_validator("input")(non_empty_list)


@router.post("/v1/classify")
@router.post("/classify")  # vLLM's path for the same route
async def classify(body: ClassificationRequest, request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    ctx.check_model(body.model)
    check_classifier(ctx)
    texts = [body.input] if isinstance(body.input, str) else body.input
    admit(request, len(texts), prompt_param="input")
    logits, tokens = await classifier_logits(ctx, request, list(texts))
    labels = ctx.tokenizer_manager.model_config.labels
    data = []
    for i, row in enumerate(logits):
        probs = [sigmoid(row[0])] if len(row) == 1 else softmax(row)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels[best], "probs": probs,
                     "num_classes": len(probs)})
    return {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": ctx.model_name,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }

