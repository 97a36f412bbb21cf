"""``POST /api/chat`` and ``POST /api/generate``: Ollama's two generation routes, on the same
path as ``/v1/chat/completions``.

A chat request becomes the OpenAI route's ``ChatCompletionRequest`` (its messages, tools and
``think`` as the template's ``enable_thinking``), so the conversation is rendered, tool calls
are parsed (``--tool-call-parser``) and reasoning is split out (``--reasoning-parser``) by the
same code. Ollama has no call ids: each call of an assistant message gets one, and a ``tool``
message answers the first unanswered call of its ``tool_name`` (or, without a name, the first
unanswered call).

``/api/generate`` renders ``system`` and ``prompt`` as a conversation with the chat template,
or sends the prompt as it is with ``raw`` (or when the model has no template); ``context`` (the
token ids a previous reply returned) goes before it. An empty request (no messages, no prompt)
is Ollama's "load the model" call: it is answered at once with ``done_reason: "load"``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from radixserve.managers.tokenizer.generate_request import GenerateReqInput
from radixserve.sampling.sampling_params import GRAMMAR_FIELDS
from radixserve.server.admission import admit
from radixserve.server.context import ServerContext, get_ctx
from radixserve.server.errors import APIError
from radixserve.server.generations import merged_choices
from radixserve.server.off_loop import run_sized
from radixserve.server.ollama.protocol import ChatRequest, GenerateRequest, GenerationRequest
from radixserve.server.ollama.protocol import Message as OllamaMessage
from radixserve.server.ollama.replies import Turn, done_reply
from radixserve.server.ollama.route import OllamaRoute, check_model
from radixserve.server.openai.chat_parsing import NO_TOOLS, ToolPlan, plan_tools
from radixserve.server.openai.protocol import ChatCompletionRequest
from radixserve.server.openai.serving_chat import choice_parser, render_chat

router = APIRouter(route_class=OllamaRoute)


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request) -> Response:
    started = time.perf_counter_ns()
    ctx = get_ctx(request)
    check_model(ctx, body.model)
    if not body.messages:
        return JSONResponse(done_reply(ctx, "chat", "load"))
    admit(request, 1, prompt_param="messages")
    if body.tools and not ctx.server_args.tool_call_parser:
        raise APIError(400, "tools need the server to know the model's tool-call format: start "
                       "it with --tool-call-parser", param="tools")
    chat_body = _chat_request(_messages(body.messages), body, body.tools)
    plan = plan_tools(chat_body, ctx.server_args.tool_call_parser, ctx.tokenizer)
    prompt_text, prompt_ids = await run_sized(request, _render_and_encode, ctx, chat_body,
                                              plan.template_tools)  # off_loop.py
    return await _run(request, ctx, body, "chat", prompt_text, prompt_ids, plan, started)


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    started = time.perf_counter_ns()
    ctx = get_ctx(request)
    check_model(ctx, body.model)
    if not body.prompt and not body.context:
        return JSONResponse(done_reply(ctx, "generate", "load"))
    admit(request, 1)
    tok = ctx.tokenizer
    templated = not body.raw and (ctx.chat_template is not None
                                  or bool(getattr(tok, "chat_template", None)))
    if templated:
        messages = [{"role": "system", "content": body.system}] if body.system else []
        messages.append({"role": "user", "content": body.prompt or ""})
        prompt_text, ids = await run_sized(request, _render_and_encode, ctx,
                                           _chat_request(messages, body, None), None)
    else:
        why = "raw is true" if body.raw else "the model has no chat template"
        if body.system:
            raise APIError(400, f"system is written by the chat template, which is not used "
                           f"({why})", param="system")
        if body.thinking_switch() is False:
            raise APIError(400, f"think false is applied by the chat template, which is not "
                           f"used ({why})", param="think")
        prompt_text = body.prompt or ""
        ids = await run_sized(request, lambda: tok.encode(
            prompt_text, add_special_tokens=not body.context)) if prompt_text else []
    prompt_ids = [*(body.context or []), *ids]
    return await _run(request, ctx, body, "generate", prompt_text, prompt_ids, NO_TOOLS, started)


def _render_and_encode(ctx: ServerContext, chat_body: ChatCompletionRequest,
                       tools: list[dict[str, Any]] | None) -> tuple[str, list[int]]:
    """The prompt's text and ids (off the event loop for a large body: ``off_loop.py``)."""
    text = render_chat(ctx, chat_body, tools)
    return text, ctx.tokenizer.encode(text, add_special_tokens=False)


async def _run(request: Request, ctx: ServerContext, body: GenerationRequest,
               kind: Literal["chat", "generate"], prompt_text: str, prompt_ids: list[int],
               plan: ToolPlan, started: int) -> Response:
    """Generate for ``prompt_ids`` and answer in Ollama's shape (``replies.py``)."""
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    reasoning = ctx.server_args.reasoning_parser
    if body.think is True and reasoning is None:
        raise APIError(400, "think needs the server to know how the model writes its reasoning: "
                       "start it with --reasoning-parser", param="think")
    params = body.sampling_params(len(prompt_ids), ctx.context_len,
                                  ctx.server_args.max_completion_tokens)
    params.update(plan.sampling)
    constrained = any(k in GRAMMAR_FIELDS for k in params)
    # Streamed internally also for a whole reply: the time of the first output is measured.
    obj = GenerateReqInput(input_ids=prompt_ids, sampling_params=params, stream=True,
                           return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0)
    turn = Turn(ctx, kind, choice_parser(plan, reasoning, prompt_text, constrained), prompt_ids,
                body.logprobs, started_ns=started)
    return await turn.send(request, merged_choices(ctx.tokenizer_manager, [obj]), body.stream)


def _chat_request(messages: list[dict[str, Any]], body: GenerationRequest,
                  tools: list[dict[str, Any]] | None) -> ChatCompletionRequest:
    """The OpenAI route's request for ``messages`` (its validation errors are 400s naming the
    Ollama field)."""
    thinking = body.thinking_switch()
    kwargs = {"enable_thinking": thinking} if thinking is not None else None
    try:
        return ChatCompletionRequest(messages=messages, tools=tools, chat_template_kwargs=kwargs)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"] if x not in ("function",)) or "messages"
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise APIError(400, f"{where}: {msg}", param=where) from None


def _messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's messages as the OpenAI route's, with call ids (9 alphanumerics, which some
    models' templates demand) pairing each tool result with its call."""
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (id, function name), in call order
    num_calls = 0
    for i, m in enumerate(messages):
        for name, allowed in (("thinking", "assistant"), ("tool_calls", "assistant"),
                              ("tool_name", "tool"), ("tool_call_id", "tool")):
            if getattr(m, name) is not None and m.role != allowed:
                raise APIError(400, f"{name} is only allowed on {allowed} messages",
                               param=f"messages.{i}.{name}")
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.role == "assistant":
            if m.thinking is not None:
                message["reasoning_content"] = m.thinking
            if m.tool_calls:
                calls = []
                for c in m.tool_calls:
                    call_id = c.id or f"call{num_calls:05d}"
                    num_calls += 1
                    unanswered.append((call_id, c.function.name))
                    calls.append({"id": call_id, "type": "function", "function": {
                        "name": c.function.name, "arguments": json.dumps(c.function.arguments)}})
                message["tool_calls"] = calls
        elif m.role == "tool":
            message["tool_call_id"] = _answered_call(m, unanswered, len(out))
            if m.tool_name:
                message["name"] = m.tool_name
        out.append(message)
    return out


def _answered_call(m: OllamaMessage, unanswered: list[tuple[str, str]], position: int) -> str:
    """The id of the call a tool message answers (removed from ``unanswered``)."""
    for k, (call_id, name) in enumerate(unanswered):
        if m.tool_call_id == call_id or (m.tool_call_id is None
                                         and m.tool_name in (None, name)):
            del unanswered[k]
            return call_id
    return m.tool_call_id or f"tool{position:05d}"
