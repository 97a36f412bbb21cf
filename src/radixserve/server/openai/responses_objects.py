"""The objects ``/v1/responses`` returns, in the shapes of ``openai.types.responses``, and the
``Turn`` (one response being generated) they are made for.

A response's ``output`` lists, in order: a ``reasoning`` item (with ``--reasoning-parser``),
a ``message`` item with one ``output_text`` part (when the model wrote text, or wrote nothing
else), and a ``function_call`` item per call. ``status`` follows the generation's finish
reason: ``stop`` is ``completed``; ``length`` is ``incomplete`` with
``incomplete_details.reason: "max_output_tokens"``; an aborted generation is ``cancelled``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from radixserve.server.openai.chat_parsing import ChoiceParser, ParsedMessage
from radixserve.server.openai.protocol import ChatMessage, finish_reason_name
from radixserve.server.openai.responses_protocol import ResponsesRequest

Status = Literal["completed", "incomplete", "cancelled", "failed", "in_progress"]


def item_id(prefix: str) -> str:
    """OpenAI's id shape: ``resp_``, ``msg_``, ``fc_``, ``rs_`` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


class ReasoningPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningPart]
    status: Status


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    # The request's settings, echoed as OpenAI does.
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    tool_choice: Any
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: str
    store: bool
    user: str | None
    background: bool = False
    service_tier: str = "default"


def status_of(reason: dict[str, Any] | None) -> tuple[Status, IncompleteDetails | None]:
    name = finish_reason_name(reason)
    if name == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    if name == "abort":
        return "cancelled", None
    return "completed", None


def item_status(status: Status) -> Literal["completed", "incomplete"]:
    """An output item is ``completed``, or ``incomplete`` when its response was cut short."""
    return "completed" if status == "completed" else "incomplete"


def usage_of(meta: dict[str, Any], reasoning_tokens: int, cache_page: int | None
             ) -> ResponseUsage:
    """``cache_page``: the radix cache's page size (it keeps whole pages of the prompt it did
    not hold yet: the cache writes), ``None`` without a radix cache."""
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    cached = meta["cached_tokens"]
    written = max(prompt // cache_page * cache_page - cached, 0) if cache_page else 0
    return ResponseUsage(
        input_tokens=prompt,
        input_tokens_details=InputTokensDetails(cached_tokens=cached,
                                                cache_write_tokens=written),
        output_tokens=completion,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=prompt + completion,
    )


def output_items(parsed: ParsedMessage, status: Status) -> list[OutputItem]:
    """The output items of a finished generation (see the module docstring): the last one is
    ``incomplete`` when the response is (the generation stopped inside it), the others are
    ``completed``, as the stream closes them."""
    items: list[OutputItem] = []
    if parsed.reasoning:
        items.append(OutputReasoning(id=item_id("rs"), status="completed",
                                     content=[ReasoningPart(text=parsed.reasoning)]))
    if parsed.content or not (parsed.calls or parsed.reasoning):
        items.append(OutputMessage(id=item_id("msg"), status="completed",
                                   content=[OutputText(text=parsed.content or "")]))
    for call, call_id in zip(parsed.calls, parsed.ids, strict=True):
        items.append(OutputFunctionCall(id=item_id("fc"), call_id=call_id, name=call.name,
                                        arguments=call.arguments, status="completed"))
    items[-1].status = item_status(status)
    return items


@dataclass
class Turn:
    """One response being generated: what its prompt was built from, and what to store."""

    body: ResponsesRequest
    response_id: str
    created_at: int
    history: list[ChatMessage]  # the conversation before this turn's output, no instructions
    prompt_ids: list[int]
    prompt_text: str
    parser: ChoiceParser


def response_object(turn: Turn, model: str, status: Status, output: list[OutputItem],
                    incomplete: IncompleteDetails | None = None,
                    usage: ResponseUsage | None = None) -> ResponseObject:
    """``turn``'s response object as it stands: ``status`` and ``output`` so far, with the
    request's settings echoed."""
    body = turn.body
    choice = body.tool_choice
    text_format = body.text.format if body.text and body.text.format else None
    return ResponseObject(
        id=turn.response_id,
        created_at=turn.created_at,
        status=status,
        incomplete_details=incomplete,
        model=model,
        output=output,
        usage=usage,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        max_tool_calls=body.max_tool_calls,
        metadata=body.metadata or {},
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id,
        temperature=body.temperature,
        top_p=body.top_p,
        tool_choice=choice.model_dump() if isinstance(choice, BaseModel) else choice or "auto",
        tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
        text={"format": text_format.model_dump(by_alias=True, exclude_none=True)
              if text_format else {"type": "text"}},
        truncation=body.truncation,
        store=body.store,
        user=body.user,
    )
