"""``POST /v1/score`` (SGLang's): how likely each label token is to come next after query + item,
for each item.

Each item makes one prompt, ``query + item`` (``item + query`` with ``item_first``): texts are
joined as text and tokenized like a completion prompt, token-id lists are joined as lists (query
and items must be both texts or both ids). Each prompt runs as a one-token generation that asks
for the logprobs of ``label_token_ids`` at its first output position (``token_ids_logprob``), so
it is batched and prefix-cached like any generation: a shared query is computed once. Those
logprobs come from the raw logits (``layers/sampler.py``), so a score is the model's own
next-token probability, whatever the sampling parameters; the generated token is thrown away.

``scores[i][j]`` is the probability of label j after item i: the whole-vocabulary softmax, or
with ``apply_softmax`` the softmax over the labels only (each row then sums to 1).
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from radixserve.managers.tokenizer.generate_request import GenerateReqInput
from radixserve.server.admission import admit, check_batch_size
from radixserve.server.context import ServerContext, get_ctx
from radixserve.server.errors import APIError
from radixserve.server.generations import cancel_on_disconnect, collect_final, merged_choices
from radixserve.server.off_loop import run_for_size
from radixserve.server.parsed_body import ParsedBodyRoute
from radixserve.server.strict_request import StrictRequest

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py


class ScoringRequest(StrictRequest):
    """SGLang's scoring body."""

    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] = Field(min_length=1)
    apply_softmax: bool = False
    item_first: bool = False
    model: str | None = None


@router.post("/v1/score")
async def score(body: ScoringRequest, request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    ctx.check_model(body.model)
    prompts = await _prompts(ctx, body)
    admit(request, len(prompts), prompt_param="items")
    inputs = [
        GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                         return_logprob=True, token_ids_logprob=body.label_token_ids)
        for ids in prompts
    ]
    merged = merged_choices(ctx.tokenizer_manager, inputs)
    outputs = await cancel_on_disconnect(request, collect_final(merged, len(inputs)))
    scores = [_label_scores(out["meta_info"], body) for out in outputs]
    prompt_tokens = sum(out["meta_info"]["prompt_tokens"] for out in outputs)
    return {
        "object": "scoring",
        "model": ctx.model_name,
        "scores": scores,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                  "total_tokens": prompt_tokens},
    }


async def _prompts(ctx: ServerContext, body: ScoringRequest) -> list[list[int]]:
    """Every item's prompt as token ids: the query is joined to each item, so the text to
    tokenize can be many times the body (off the event loop once large: ``off_loop.py``)."""
    if body.query is None or body.items is None:
        missing = "query" if body.query is None else "items"
        raise APIError(400, f"{missing} is required", param=missing)
    items = [body.items] if isinstance(body.items, str) else body.items
    if not items:
        raise APIError(400, "items must not be empty", param="items")
    text_query = isinstance(body.query, str)
    if any(isinstance(item, str) != text_query for item in items):
        raise APIError(400, "query and items must be both text or both token ids",
                       param="items")
    check_batch_size(ctx.server_args, len(items), "items")  # before the work it multiplies
    # The query is joined to every item: one longer than the context alone is refused before
    # that multiplies it (2,048 copies of an 8 MB query would not fit in memory).
    query_len = len(await run_for_size(len(body.query), ctx.tokenizer.encode, body.query)
                    if text_query else body.query)
    if query_len > ctx.context_len:
        raise APIError(400, f"query has {query_len} tokens: more than the context of "
                       f"{ctx.context_len}", param="query")
    joined = [[item, body.query] if body.item_first else [body.query, item] for item in items]
    if text_query:
        size = sum(len(a) + len(b) for a, b in joined)  # type: ignore[arg-type]
        return await run_for_size(size, lambda: [
            ctx.tokenizer.encode(a + b) for a, b in joined])  # type: ignore[operator]
    return [[*a, *b] for a, b in joined]  # type: ignore[misc]


def _label_scores(meta: dict[str, Any], body: ScoringRequest) -> list[float]:
    """The labels' probabilities at the first output position."""
    (by_id,) = meta["output_token_ids_logprobs"][:1]
    logprob = {int(tid): lp for lp, tid, _ in by_id}
    values = [logprob[t] for t in body.label_token_ids]
    if not body.apply_softmax:
        return [math.exp(v) for v in values]
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    total = sum(weights)
    return [w / total for w in weights]
