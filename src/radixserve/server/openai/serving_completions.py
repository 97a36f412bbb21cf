"""``POST /v1/completions``: one or many prompts (text or token ids) → n generations each.

Prompts are tokenized here (as the TokenizerManager would) so that a request without
``max_tokens`` can be given the rest of the context. Choice ``p * n + j`` is prompt p's j-th
sample. ``echo`` prefixes the prompt text; ``logprobs=k`` returns the chosen tokens' logprobs and
the top k alternatives per position.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from radixserve.server.app import (
    ServerContext,
    cancel_on_disconnect,
    collect_final,
    get_ctx,
    merge_generations,
    prime,
)
from radixserve.server.errors import stream_error
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
from radixserve.server.sse import DONE, sse_event, sse_response

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    ctx.check_model(body.model)
    prompts = _prompt_ids(ctx, body.prompt)
    inputs = body.generate_inputs(prompts, ctx.context_len, body.logprobs)
    merged = merge_generations([ctx.tokenizer_manager.generate_request(obj) for obj in inputs])
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
    for k, (lp, tid) in enumerate(tokens):
        text = tok.decode([tid])
        result.tokens.append(text)
        result.token_logprobs.append(lp)
        result.text_offset.append(offset)
        offset += len(text)
        top = tops[start + k] if start + k < len(tops) else []
        result.top_logprobs.append({tok.decode([t]): v for v, t in top})
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


async def _stream(
    ctx: ServerContext,
    body: CompletionRequest,
    merged: AsyncIterator[tuple[int, dict[str, Any]]],
    prefixes: list[str],
    response_id: str,
    created: int,
) -> AsyncIterator[bytes]:
    def chunk(choice: CompletionChoice) -> bytes:
        return sse_event(
            CompletionStreamResponse(
                id=response_id, created=created, model=ctx.model_name, choices=[choice]
            ).model_dump()
        )

    num_choices = len(prefixes)
    text_sent = [0] * num_choices
    tokens_sent = [0] * num_choices
    finals: dict[int, dict[str, Any]] = {}
    async with contextlib.aclosing(merged):  # type: ignore[type-var]
        for i, prefix in enumerate(prefixes):
            if prefix:
                yield chunk(CompletionChoice(index=i, text=prefix))
        try:
            async for i, out in merged:
                meta = out["meta_info"]
                reason = meta["finish_reason"]
                new_text = out["text"][text_sent[i]:]
                logprobs = None
                if body.logprobs is not None:
                    logprobs = _logprobs(ctx, meta, tokens_sent[i], text_sent[i])
                text_sent[i] = len(out["text"])
                tokens_sent[i] = len(out["output_ids"])
                if reason is not None:
                    finals[i] = out
                elif not new_text and not (logprobs and logprobs.tokens):
                    continue
                yield chunk(
                    CompletionChoice(
                        index=i,
                        text=new_text,
                        logprobs=logprobs,
                        finish_reason=finish_reason_name(reason),
                        matched_stop=matched_stop(reason),
                    )
                )
        except Exception as exc:
            yield sse_event(stream_error(exc))
            yield DONE
            return
    if body.include_usage:
        usage = UsageInfo.from_outputs([finals[i] for i in range(num_choices)], body.n)
        yield sse_event(
            CompletionStreamResponse(
                id=response_id, created=created, model=ctx.model_name, choices=[], usage=usage
            ).model_dump()
        )
    yield DONE
