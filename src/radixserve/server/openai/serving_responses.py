"""``/v1/responses``: OpenAI's Responses API over the chat route's pieces.

``POST /v1/responses`` translates its body into a chat request (``responses_protocol.py``),
then renders, plans tools, generates and parses exactly as ``/v1/chat/completions`` does, with
one choice. ``store`` keeps the response (``responses_store.py``) for ``GET`` / ``DELETE
/v1/responses/{id}`` and for ``previous_response_id``, which continues the stored conversation.

The continued conversation's prompt starts with the stored turn's own tokens (its prompt and
what the model wrote) whenever the re-rendered conversation starts with their text, which the
chat template guarantees unless it rewrites past turns (say, dropping old reasoning): the radix
cache then serves the whole stored turn, and ``usage.input_tokens_details.cached_tokens`` shows
it. Otherwise the conversation is tokenized afresh and the cache serves the common prefix.

``truncation: "auto"`` drops the oldest messages (after the system ones) until the prompt fits
the context; ``"disabled"`` (the default) refuses a prompt that does not fit with a 400.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from radixserve.managers.caller import current_caller
from radixserve.sampling.sampling_params import GRAMMAR_FIELDS
from radixserve.server.admission import admit
from radixserve.server.context import ServerContext, get_ctx
from radixserve.server.errors import APIError
from radixserve.server.generations import (
    cancel_on_disconnect,
    collect_final,
    merge_generations,
    prime,
)
from radixserve.server.off_loop import body_size, run_for_size
from radixserve.server.openai.chat_parsing import (
    ParsedMessage,
    ToolPlan,
    plan_tools,
)
from radixserve.server.openai.protocol import ChatCompletionRequest, ChatMessage, now
from radixserve.server.openai.responses_objects import (
    OutputItem,
    Turn,
    item_id,
    output_items,
    response_object,
    status_of,
    usage_of,
)
from radixserve.server.openai.responses_protocol import (
    BAD_RESPONSE_ID,
    RESPONSE_ID,
    ResponsesRequest,
)
from radixserve.server.openai.responses_store import ResponseStore, StoredResponse
from radixserve.server.openai.responses_stream import ResponseStream
from radixserve.server.openai.serving_chat import choice_parser, reasoning_parser_name, render_chat
from radixserve.server.parsed_body import ParsedBodyRoute
from radixserve.server.sse import sse_response

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py


def response_store(request: Request) -> ResponseStore:
    return request.app.state.response_store


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    ctx.check_model(body.model)
    admit(request, 1)
    store = response_store(request)
    previous = _previous(store, body.previous_response_id)
    history = [*(previous.messages if previous else []), *_input_messages(body)]
    if not history:
        raise APIError(400, "input is required (or previous_response_id to continue)",
                       param="input")
    chat = _chat_request(body, history)
    plan = plan_tools(chat, ctx.server_args.tool_call_parser, ctx.tokenizer)
    if body.max_tool_calls is not None:
        plan = dataclasses.replace(plan, max_calls=min(plan.max_calls or body.max_tool_calls,
                                                       body.max_tool_calls))
    # The stored conversation counts too: a small body may continue a long one (off_loop.py).
    size = body_size(request) + (len(previous.text) if previous else 0)
    chat, prompt_text, prompt_ids = await run_for_size(size, _prompt, ctx, body, chat, plan,
                                                       previous)
    obj = chat.generate_inputs([prompt_ids], ctx.context_len, None, plan.sampling,
                               max_completion_tokens=ctx.server_args.max_completion_tokens)[0]
    constrained = any(k in GRAMMAR_FIELDS for k in obj.sampling_params)
    parser = choice_parser(plan, reasoning_parser_name(ctx, chat), prompt_text, constrained)
    turn = Turn(body, item_id("resp"), now(), chat.messages[len(_instructions(body)):],
                prompt_ids, prompt_text, parser)
    merged = merge_generations([ctx.tokenizer_manager.generate_request(obj)])
    if not body.stream:
        out = (await cancel_on_disconnect(request, collect_final(merged, 1)))[0]
        parsed = parser.final(out["text"])
        items = output_items(parsed, status_of(out["meta_info"]["finish_reason"])[0])
        return JSONResponse(_finish(ctx, store, turn, out, parsed, items))

    def finish(out: dict[str, Any], parsed: ParsedMessage, items: list[OutputItem]
               ) -> dict[str, Any]:
        return _finish(ctx, store, turn, out, parsed, items)

    stream = ResponseStream(turn, ctx.model_name, finish)
    return sse_response(stream.events(await prime(request, _outputs(merged))))


async def _outputs(merged: AsyncIterator[tuple[int, dict[str, Any]]]
                   ) -> AsyncIterator[dict[str, Any]]:
    async for _, out in merged:
        yield out


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    return _stored(response_store(request), response_id).body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    store = response_store(request)
    _stored(store, response_id)
    store.delete(response_id, current_caller.get())
    return {"id": response_id, "object": "response", "deleted": True}


def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    if not RESPONSE_ID.match(response_id):
        raise APIError(400, f"{response_id!r} {BAD_RESPONSE_ID}",
                       param="response_id")
    stored = store.get(response_id, current_caller.get())
    if stored is None:
        raise APIError(404, f"No response with id {response_id!r} is stored (it was not "
                       "stored, was deleted, or expired).", param="response_id")
    return stored


def _previous(store: ResponseStore, response_id: str | None) -> StoredResponse | None:
    if response_id is None:
        return None
    stored = store.get(response_id, current_caller.get())
    if stored is None:
        raise APIError(400, f"Previous response with id {response_id!r} not found (it was not "
                       "stored, was deleted, or expired).", param="previous_response_id")
    return stored


def _input_messages(body: ResponsesRequest) -> list[ChatMessage]:
    try:
        return body.input_messages()
    except ValidationError as e:  # an inconsistent item (say, arguments that are not JSON)
        raise APIError(400, f"input: {e.errors()[0]['msg']}", param="input") from None


def _instructions(body: ResponsesRequest) -> list[ChatMessage]:
    return [ChatMessage(role="system", content=body.instructions)] if body.instructions else []


def _chat_request(body: ResponsesRequest, history: list[ChatMessage]) -> ChatCompletionRequest:
    try:
        return body.chat_request([*_instructions(body), *history])
    except ValidationError as e:
        raise APIError(400, str(e.errors()[0]["msg"]).removeprefix("Value error, ")) from None


def _prompt(ctx: ServerContext, body: ResponsesRequest, chat: ChatCompletionRequest,
            plan: ToolPlan, previous: StoredResponse | None
            ) -> tuple[ChatCompletionRequest, str, list[int]]:
    """The rendered prompt and its ids. ``truncation: "auto"`` drops the fewest oldest messages
    that make it fit (found by bisection: a few renderings, however long the conversation)."""
    first = len(_instructions(body))
    system, conversation = chat.messages[:first], chat.messages[first:]

    def attempt(drop: int) -> tuple[ChatCompletionRequest, str, list[int], bool]:
        kept = conversation[drop:]
        while drop and len(kept) > 1 and kept[0].role != "user":  # cut: start with the user
            kept = kept[1:]
        request = chat.model_copy(update={"messages": [*system, *kept]})
        text = render_chat(ctx, request, plan.template_tools)
        ids = _token_ids(ctx, text, previous)
        return request, text, ids, len(ids) + (body.max_output_tokens or 1) <= ctx.context_len

    best = attempt(0)
    if best[3] or body.truncation != "auto" or len(conversation) == 1:
        return best[:3]
    low, high = 1, len(conversation) - 1
    best = attempt(high)  # the last message alone; if even that is too long, the 400 follows
    while best[3] and low < high:
        middle = (low + high) // 2
        result = attempt(middle)
        if result[3]:
            high, best = middle, result
        else:
            low = middle + 1
    return best[:3]


def _token_ids(ctx: ServerContext, text: str, previous: StoredResponse | None) -> list[int]:
    """``text``'s ids, starting with the stored turn's own tokens when it starts with them."""
    if previous is not None and previous.text and text.startswith(previous.text):
        rest = text[len(previous.text):]
        return [*previous.token_ids, *ctx.tokenizer.encode(rest, add_special_tokens=False)]
    return ctx.tokenizer.encode(text, add_special_tokens=False)


def _finish(ctx: ServerContext, store: ResponseStore, turn: Turn, out: dict[str, Any],
            parsed: ParsedMessage, items: list[OutputItem]) -> dict[str, Any]:
    """The response object of a finished generation; stored when the request asks."""
    meta = out["meta_info"]
    status, incomplete = status_of(meta["finish_reason"])
    reasoning_tokens = len(ctx.tokenizer.encode(parsed.reasoning, add_special_tokens=False)) \
        if parsed.reasoning else 0
    response = response_object(
        turn, ctx.model_name, status, items, incomplete,
        usage_of(meta, reasoning_tokens, _cache_page(ctx)),
    ).model_dump()
    if turn.body.store:
        output_ids = _written_ids(ctx, out)
        text = turn.prompt_text + (out["text"] if output_ids is not None else "")
        store.put(turn.response_id, response, [*turn.history, _reply(parsed, out["text"])],
                  [*turn.prompt_ids, *(output_ids or [])], text, current_caller.get())
    return response


def _reply(parsed: ParsedMessage, text: str) -> ChatMessage:
    """The assistant's turn as the conversation continues it. A call cut short by the length
    limit has arguments that are not JSON, which no chat template can render as a call: such
    a turn continues as the text the model wrote."""
    calls = [{"id": call_id, "type": "function",
              "function": {"name": c.name, "arguments": c.arguments}}
             for c, call_id in zip(parsed.calls, parsed.ids, strict=True)]
    try:
        return ChatMessage(role="assistant", content=parsed.content,
                           reasoning_content=parsed.reasoning, tool_calls=calls or None)
    except ValidationError:
        return ChatMessage(role="assistant", content=text)


def _cache_page(ctx: ServerContext) -> int | None:
    args = ctx.server_args
    return None if args.disable_radix_cache else args.page_size


def _written_ids(ctx: ServerContext, out: dict[str, Any]) -> list[int] | None:
    """The output tokens that decode exactly to the output text (without the stop token that
    ended it), or ``None`` when none do (a trimmed stop string, a skipped special token)."""
    ids = list(out["output_ids"])
    for keep in (len(ids), len(ids) - 1):
        if keep >= 0 and ctx.tokenizer.decode(ids[:keep], skip_special_tokens=False) \
                == out["text"]:
            return ids[:keep]
    return None
