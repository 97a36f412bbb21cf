"""``POST /v1/chat/completions``: messages → chat template → token ids → n generations → parsed
messages.

The conversation (tool calls and tool results included) is rendered with the checkpoint's chat
template or the one given with ``--chat-template``, with the request's tools and
``chat_template_kwargs``, tokenized without adding special tokens again (the template writes
them), and sent as ``n`` single-prompt generations. Each choice's text is then parsed
(``chat_parsing.py``): reasoning apart (``--reasoning-parser``), tool calls out of the content
(``--tool-call-parser``, or the enforced JSON of ``required`` / named ``tool_choice``). A choice
that calls tools finishes with ``tool_calls``.

``continue_final_message`` (vLLM's and SGLang's) renders the last message, an assistant's, open:
the model continues it instead of closing it and starting a new one (``add_generation_prompt``
is then off; asking for both is a 400, as in vLLM). ``echo`` (vLLM's) starts each choice's
content with that last assistant message; logprobs cover only the generated tokens.

Streaming sends, per choice, a first chunk with the role, then reasoning, content and tool-call
deltas (a call's id and name first, its arguments in pieces, under a stable ``index``), exactly
one chunk carrying ``finish_reason``, then a usage chunk (``stream_options.include_usage``) and
``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any

import jinja2
from fastapi import APIRouter, Request, Response

from radixserve.sampling.sampling_params import GRAMMAR_FIELDS
from radixserve.server.admission import admit, check_priority
from radixserve.server.context import ServerContext, get_ctx
from radixserve.server.errors import APIError
from radixserve.server.generations import merged_choices
from radixserve.server.off_loop import run_sized
from radixserve.server.openai.chat_parsing import ChoiceParser, ParsedMessage, ToolPlan, plan_tools
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
    DeltaToolCall,
    FunctionCallOut,
    ResponseIds,
    ToolCallOut,
    TopLogprob,
    finish_reason_name,
    matched_stop,
)
from radixserve.server.openai.reasoning import create_reasoning_parser
from radixserve.server.openai.streaming import Delta, Reply
from radixserve.server.parsed_body import ParsedBodyRoute

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py

# Arguments of ``apply_chat_template`` (and variables of the template) the server sets itself.
_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "chat_template", "tokenize", "add_generation_prompt", "tools",
    "documents", "continue_final_message", "return_dict", "return_tensors",
})


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    lora = ctx.lora_of_model(body.model)
    admit(request, 1, body.n, priority=body.priority)
    check_priority(ctx.server_args, body.priority)
    plan = plan_tools(body, ctx.server_args.tool_call_parser, ctx.tokenizer)
    reasoning_parser = reasoning_parser_name(ctx, body)
    prompt_text, prompt_ids = await run_sized(request, _render_and_encode, ctx, body,
                                              plan.template_tools)
    echo = _echo_text(body)
    top_logprobs_num = (body.top_logprobs or 0) if body.logprobs else None
    inputs = body.generate_inputs([prompt_ids], ctx.context_len, top_logprobs_num, plan.sampling,
                                  max_completion_tokens=ctx.server_args.max_completion_tokens)
    for obj in inputs:
        obj.lora_path = lora
    constrained = any(k in GRAMMAR_FIELDS for k in inputs[0].sampling_params)
    parsers = [choice_parser(plan, reasoning_parser, prompt_text, constrained) for _ in inputs]
    reply = _ChatReply(ctx, body, ResponseIds.new("chatcmpl", ctx.model_name), parsers, echo)
    return await reply.send(request, merged_choices(ctx.tokenizer_manager, inputs))


def reasoning_parser_name(ctx: ServerContext, body: ChatCompletionRequest) -> str | None:
    """The parser that splits reasoning out; ``separate_reasoning`` without one has nothing to
    split (SGLang's behaviour, and what sglang-router sends with every request)."""
    return ctx.server_args.reasoning_parser if body.separate_reasoning else None


def choice_parser(plan: ToolPlan, reasoning: str | None, prompt_text: str,
                   constrained: bool) -> ChoiceParser:
    return ChoiceParser(
        create_reasoning_parser(reasoning, prompt_text, constrained) if reasoning else None,
        plan.new_parser() if plan.new_parser else None,
        plan.max_calls,
    )


def _generation_prompt(body: ChatCompletionRequest) -> bool:
    """Whether the template opens a new assistant message after the conversation; refuses
    what cannot be continued (vLLM's checks, with its messages)."""
    if not body.continue_final_message:
        return body.add_generation_prompt is not False
    if body.add_generation_prompt:
        raise APIError(
            400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    last = body.messages[-1]
    if last.role != "assistant":
        raise APIError(
            400, "Cannot set `continue_final_message` to True when the last message is not "
            f"from the assistant (it is from the {last.role}).",
            param="continue_final_message",
        )
    if last.tool_calls:
        raise APIError(
            400, "continue_final_message cannot continue an assistant message with tool_calls",
            param="continue_final_message",
        )
    return False


def _echo_text(body: ChatCompletionRequest) -> str:
    """What ``echo`` puts before each choice's content: the last message's text when the
    assistant wrote it (vLLM's rule, the reply being the assistant's)."""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""


def _render_and_encode(ctx: ServerContext, body: ChatCompletionRequest,
                       tools: list[dict[str, Any]] | None) -> tuple[str, list[int]]:
    """The prompt's text and ids (off the event loop for a large body: ``off_loop.py``)."""
    text = render_chat(ctx, body, tools)
    return text, ctx.tokenizer.encode(text, add_special_tokens=False)


def render_chat(
    ctx: ServerContext, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None
) -> str:
    """The prompt text of the conversation: with the generation prompt, without it, or
    ending inside the last message (``continue_final_message``)."""
    add_generation_prompt = _generation_prompt(body)
    tok = ctx.tokenizer
    if ctx.chat_template is None and not getattr(tok, "chat_template", None):
        raise APIError(
            400,
            "This model has no chat template; use /v1/completions or start the server with "
            "--chat-template.",
        )
    extra = body.chat_template_kwargs or {}
    reserved = sorted(set(extra) & _TEMPLATE_ARGUMENTS)
    if reserved:
        raise APIError(
            400, f"chat_template_kwargs may not set {', '.join(reserved)}",
            param="chat_template_kwargs",
        )
    try:
        return tok.apply_chat_template(
            [m.for_template() for m in body.messages],
            chat_template=ctx.chat_template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **extra,
        )
    except (jinja2.TemplateError, ValueError, TypeError) as e:  # TypeError: a kwarg's type
        raise APIError(
            400, f"the chat template rejected the messages: {e}", param="messages"
        ) from e


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


def _finish_reason(reason: dict[str, Any] | None, calls: bool) -> str | None:
    """``tool_calls`` for a choice that stopped having called tools."""
    name = finish_reason_name(reason)
    return "tool_calls" if calls and name == "stop" else name


def _message(parsed: ParsedMessage, echo: str) -> ChatMessageOut:
    calls = [
        ToolCallOut(id=call_id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c, call_id in zip(parsed.calls, parsed.ids, strict=True)
    ]
    content = echo + (parsed.content or "") if echo else parsed.content
    return ChatMessageOut(content=content, reasoning_content=parsed.reasoning,
                          tool_calls=calls or None)


class _ChatReply(Reply[ChatCompletionRequest]):
    """Chat choices: each choice's text parsed into a message (``parsers``, one per choice),
    starting with ``echo``."""

    response_type = ChatCompletionResponse
    chunk_type = ChatCompletionStreamResponse

    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest, ids: ResponseIds,
                 parsers: list[ChoiceParser], echo: str) -> None:
        super().__init__(body, ids, len(parsers))
        self.ctx = ctx
        self.parsers = parsers
        self.echo = echo

    def choice(self, index: int, out: dict[str, Any]) -> ChatCompletionChoice:
        reason = out["meta_info"]["finish_reason"]
        parsed = self.parsers[index].final(out["text"])
        return ChatCompletionChoice(
            index=index,
            message=_message(parsed, self.echo),
            logprobs=_logprobs(self.ctx, out["meta_info"]) if self.body.logprobs else None,
            finish_reason=_finish_reason(reason, bool(parsed.calls)),
            matched_stop=matched_stop(reason),
        )

    def delta_choice(self, delta: Delta) -> ChatCompletionStreamChoice | None:
        reason = delta.finish_reason
        parser = self.parsers[delta.index]
        parsed = parser.stream(delta.new_text, reason is not None)
        meta = delta.out["meta_info"]
        logprobs = _logprobs(self.ctx, meta, delta.tokens_sent) if self.body.logprobs else None
        calls = [
            DeltaToolCall(index=c.index, id=c.id, type="function" if c.name else None,
                          function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in parsed.calls
        ]
        if (reason is None and not parsed.content and not parsed.reasoning and not calls
                and not (logprobs and logprobs.content)):
            return None
        message = DeltaMessage(content=parsed.content or None,
                               reasoning_content=parsed.reasoning or None,
                               tool_calls=calls or None)
        return ChatCompletionStreamChoice(
            index=delta.index,
            delta=message,
            logprobs=logprobs,
            finish_reason=_finish_reason(reason, parser.calls_sent > 0),
            matched_stop=matched_stop(reason),
        )

    def head(self) -> list[ChatCompletionStreamChoice]:
        """The first chunk of every choice carries the role, and the echo (vLLM's order)."""
        return [
            ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                   content=self.echo))
            for i in range(self.num_choices)
        ]
