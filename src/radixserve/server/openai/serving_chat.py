"""``POST /v1/chat/completions``: messages → chat template → token ids → n generations.

The conversation is rendered with the checkpoint's chat template (``tokenizer_config.json``) or
the one given with ``--chat-template`` (with the request's ``chat_template_kwargs``), tokenized
without adding special tokens again (the template writes them), and sent as ``n`` single-prompt
generations. Streaming sends, per choice, a
first chunk with the role, content deltas, exactly one chunk carrying ``finish_reason``, then a
usage chunk (``stream_options.include_usage``) and ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import jinja2
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
from radixserve.server.errors import APIError
from radixserve.server.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
    finish_reason_name,
    matched_stop,
    new_id,
    now,
)
from radixserve.server.openai.streaming import Delta, stream_choices
from radixserve.server.sse import sse_response

router = APIRouter()

# Arguments of ``apply_chat_template`` that the server sets itself.
_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "chat_template", "tokenize", "add_generation_prompt", "tools", "documents",
    "continue_final_message", "return_dict", "return_tensors",
})


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    ctx.check_model(body.model)
    prompt_ids = render_chat(ctx, body)
    top_logprobs_num = (body.top_logprobs or 0) if body.logprobs else None
    inputs = body.generate_inputs([prompt_ids], ctx.context_len, top_logprobs_num)
    merged = merge_generations([ctx.tokenizer_manager.generate_request(obj) for obj in inputs])
    response_id, created = new_id("chatcmpl"), now()
    if not body.stream:
        outputs = await cancel_on_disconnect(request, collect_final(merged, len(inputs)))
        return JSONResponse(_response(ctx, body, outputs, response_id, created).model_dump())
    events = _stream(ctx, body, await prime(merged), len(inputs), response_id, created)
    return sse_response(events)


def render_chat(ctx: ServerContext, body: ChatCompletionRequest) -> list[int]:
    """The prompt token ids of the conversation, generation prompt included."""
    tok = ctx.tokenizer
    if ctx.chat_template is None and not getattr(tok, "chat_template", None):
        raise APIError(
            400,
            "This model has no chat template; use /v1/completions or start the server with "
            "--chat-template.",
        )
    conversation = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text(),
         **({"name": m.name} if m.name else {})}
        for m in body.messages
    ]
    extra = body.chat_template_kwargs or {}
    reserved = sorted(set(extra) & _TEMPLATE_ARGUMENTS)
    if reserved:
        raise APIError(
            400, f"chat_template_kwargs may not set {', '.join(reserved)}",
            param="chat_template_kwargs",
        )
    try:
        text = tok.apply_chat_template(
            conversation,
            chat_template=ctx.chat_template,
            tokenize=False,
            add_generation_prompt=True,
            **extra,
        )
    except (jinja2.TemplateError, ValueError) as e:
        raise APIError(
            400, f"the chat template rejected the messages: {e}", param="messages"
        ) from e
    return tok.encode(text, add_special_tokens=False)


def _logprobs(ctx: ServerContext, meta: dict[str, Any], start: int = 0) -> ChatChoiceLogprobs:
    """OpenAI chat logprobs of the output tokens from index ``start`` on."""
    tok = ctx.tokenizer

    def entry(lp: float, tid: int) -> TopLogprob:
        text = tok.decode([tid])
        return TopLogprob(token=text, logprob=lp, bytes=list(text.encode()))

    tokens = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs") or []
    content = []
    for k, (lp, tid, _) in enumerate(tokens):
        top = (tops[start + k] if start + k < len(tops) else None) or []
        base = entry(lp, tid)
        content.append(
            ChatTokenLogprob(**base.model_dump(), top_logprobs=[entry(lp, t) for lp, t, _ in top])
        )
    return ChatChoiceLogprobs(content=content)


def _response(
    ctx: ServerContext,
    body: ChatCompletionRequest,
    outputs: list[dict[str, Any]],
    response_id: str,
    created: int,
) -> ChatCompletionResponse:
    choices = []
    for i, out in enumerate(outputs):
        reason = out["meta_info"]["finish_reason"]
        choices.append(
            ChatCompletionChoice(
                index=i,
                message=ChatMessageOut(content=out["text"]),
                logprobs=_logprobs(ctx, out["meta_info"]) if body.logprobs else None,
                finish_reason=finish_reason_name(reason),
                matched_stop=matched_stop(reason),
            )
        )
    return ChatCompletionResponse(
        id=response_id,
        created=created,
        model=ctx.model_name,
        choices=choices,
        usage=UsageInfo.from_outputs(outputs, body.n),
    )


def _stream(
    ctx: ServerContext,
    body: ChatCompletionRequest,
    merged: AsyncIterator[tuple[int, dict[str, Any]]],
    num_choices: int,
    response_id: str,
    created: int,
) -> AsyncIterator[bytes]:
    def frame(choices: list[Any], usage: UsageInfo | None) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=response_id, created=created, model=ctx.model_name, choices=choices, usage=usage
        )

    def to_choice(delta: Delta) -> ChatCompletionStreamChoice | None:
        reason = delta.finish_reason
        meta = delta.out["meta_info"]
        logprobs = _logprobs(ctx, meta, delta.tokens_sent) if body.logprobs else None
        if reason is None and not delta.new_text and not (logprobs and logprobs.content):
            return None
        return ChatCompletionStreamChoice(
            index=delta.index,
            delta=DeltaMessage(content=delta.new_text),
            logprobs=logprobs,
            finish_reason=finish_reason_name(reason),
            matched_stop=matched_stop(reason),
        )

    # The first chunk of every choice carries the role.
    head = [
        ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
        for i in range(num_choices)
    ]
    usage_n = body.n if body.include_usage else None
    return stream_choices(merged, num_choices, to_choice, frame, usage_n, head)
