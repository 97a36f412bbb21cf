"""``POST /v1/completions``: one or many prompts (text or token ids) → n generations each.

Prompts are tokenized here (as the TokenizerManager would) so that a request without
``max_tokens`` can be given the rest of the context. Choice ``p * n + j`` is prompt p's j-th
sample. ``echo`` prefixes the prompt text; ``logprobs=k`` returns the chosen tokens' logprobs and
the top k alternatives per position.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from radixserve.server.app import (
    ServerContext,
    cancel_on_disconnect,
    collect_final,
    get_ctx,
    merged_choices,
    prime,
)
from radixserve.server.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    UsageInfo,
    finish_reason_name,
    matched_stop,
    new_id,
    now,
)
from radixserve.server.openai.streaming import Delta, stream_choices
from radixserve.server.sse import sse_response

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    ctx.check_model(body.model)
    prompts = _prompt_ids(ctx, body.prompt)
    inputs = body.generate_inputs(prompts, ctx.context_len, body.logprobs)
    merged = merged_choices(ctx.tokenizer_manager, inputs)
    # Echo: the prompt text of each choice (an empty prefix without echo).
    echoes = [_prompt_text(ctx, body.prompt, p) if body.echo else "" for p in range(len(prompts))]
    prefixes = [echoes[k // body.n] for k in range(len(inputs))]
    response_id, created = new_id("cmpl"), now()
    if not body.stream:
        outputs = await cancel_on_disconnect(request, collect_final(merged, len(inputs)))
        return JSONResponse(
            _response(ctx, body, outputs, prefixes, response_id, created).model_dump()
        )
    events = _stream(ctx, body, await prime(merged), prefixes, response_id, created)
    return sse_response(events)


def _prompt_ids(ctx: ServerContext, prompt: Any) -> list[list[int]]:
    """Every prompt of the request as token ids (strings tokenized like the TokenizerManager)."""
    if isinstance(prompt, str):
        return [ctx.tokenizer.encode(prompt)]
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    return [ctx.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def _prompt_text(ctx: ServerContext, prompt: Any, index: int) -> str:
    """The text of prompt ``index`` for ``echo`` (token-id prompts are decoded)."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(x, int) for x in prompt):
        return ctx.tokenizer.decode(prompt)
    item = prompt[index]
    return item if isinstance(item, str) else ctx.tokenizer.decode(item)


def _logprobs(
    ctx: ServerContext, meta: dict[str, Any], start: int, offset: int
) -> CompletionLogprobs:
    """Legacy-completions logprobs of output tokens from ``start`` on; text offsets from
    ``offset`` (the characters of the choice's text before them)."""
    tok = ctx.tokenizer
    result = CompletionLogprobs()
    tokens = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs") or []
    for k, (lp, tid, _) in enumerate(tokens):
        text = tok.decode([tid])
        result.tokens.append(text)
        result.token_logprobs.append(lp)
        result.text_offset.append(offset)
        offset += len(text)
        top = (tops[start + k] if start + k < len(tops) else None) or []
        result.top_logprobs.append({tok.decode([t]): v for v, t, _ in top})
    return result


def _response(
    ctx: ServerContext,
    body: CompletionRequest,
    outputs: list[dict[str, Any]],
    prefixes: list[str],
    response_id: str,
    created: int,
) -> CompletionResponse:
    choices = []
    for i, out in enumerate(outputs):
        reason = out["meta_info"]["finish_reason"]
        logprobs = None
        if body.logprobs is not None:
            logprobs = _logprobs(ctx, out["meta_info"], 0, 0)
        choices.append(
            CompletionChoice(
                index=i,
                text=prefixes[i] + out["text"],
                logprobs=logprobs,
                finish_reason=finish_reason_name(reason),
                matched_stop=matched_stop(reason),
            )
        )
    return CompletionResponse(
        id=response_id,
        created=created,
        model=ctx.model_name,
        choices=choices,
        usage=UsageInfo.from_outputs(outputs, body.n),
    )


def _stream(
    ctx: ServerContext,
    body: CompletionRequest,
    merged: AsyncIterator[tuple[int, dict[str, Any]]],
    prefixes: list[str],
    response_id: str,
    created: int,
) -> AsyncIterator[bytes]:
    def frame(choices: list[Any], usage: UsageInfo | None) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=response_id, created=created, model=ctx.model_name, choices=choices, usage=usage
        )

    def to_choice(delta: Delta) -> CompletionChoice | None:
        reason = delta.finish_reason
        logprobs = None
        if body.logprobs is not None:
            meta = delta.out["meta_info"]
            logprobs = _logprobs(ctx, meta, delta.tokens_sent, delta.text_sent)
        if reason is None and not delta.new_text and not (logprobs and logprobs.tokens):
            return None
        return CompletionChoice(
            index=delta.index,
            text=delta.new_text,
            logprobs=logprobs,
            finish_reason=finish_reason_name(reason),
            matched_stop=matched_stop(reason),
        )

    # With echo, each choice's prompt text goes first.
    head = [CompletionChoice(index=i, text=p) for i, p in enumerate(prefixes) if p]
    usage_n = body.n if body.include_usage else None
    return stream_choices(merged, len(prefixes), to_choice, frame, usage_n, head)
