"""The request body of ``POST /v1/responses``, and its translation into a chat request.

The Responses API asks for the same generation as chat completions in another shape, so a
request is translated once (``chat_request``) into a ``ChatCompletionRequest`` and the chat
route's pieces do the rest: the chat template, ``plan_tools`` and the tool-call parsers,
``response_format``'s grammars, the sampling parameters. What the translation reads:

- ``input``: a string (one user message) or a list of items: messages (``input_text`` /
  ``output_text`` parts or a string), ``function_call`` items (an assistant's calls, as a
  response's output returns them), ``function_call_output`` items (tool results) and
  ``reasoning`` items (the reasoning of the assistant message that follows);
- ``instructions``: a system message in front (not carried over ``previous_response_id``,
  as OpenAI does);
- ``tools`` (function tools, flat: ``{"type": "function", "name", "parameters", ...}``),
  ``tool_choice``, ``parallel_tool_calls``; ``text.format`` → ``response_format``;
- SGLang's sampling extensions (``top_k``, ``min_p``, ``repetition_penalty``,
  ``frequency_penalty``, ``presence_penalty``, ``stop``), as SGLang's Responses API takes them.

Fields follow ``protocol.py``'s rule: honoured, accepted without effect on the output (``user``,
``safety_identifier``, ``prompt_cache_key``, ``metadata``: stored and returned), refused with a
400 naming them (``UNSUPPORTED``), or unknown (a 400 as well).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from radixserve.server.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    Tool,
)
from radixserve.server.openai.structured_outputs import JsonSchemaFormat, ResponseFormat
from radixserve.server.sampling_fields import SamplingFields
from radixserve.server.strict_request import StrictRequest

# What a response id looks like (ours are resp_ and 32 hex digits; OpenAI's are longer): an
# id of another shape is a 400, one of this shape that is not stored a 404 (OpenAI's answers).
RESPONSE_ID = re.compile(r"^resp_[0-9A-Za-z]{1,64}$")
BAD_RESPONSE_ID = "is not a response id (resp_ and up to 64 letters or digits)"
MAX_METADATA_KEYS = 16

_UNSUPPORTED_RESPONSES = {
    "background": ((None, False), "background responses are not supported"),
    "conversation": ((None,), "conversation objects are not supported; use previous_response_id"),
    "include": ((None, []), "no additional output data can be included"),
    "prompt": ((None,), "stored prompt templates are not supported"),
    "reasoning": ((None, {}), "reasoning configuration is not supported"),
    "top_logprobs": ((None, 0), "logprobs are not returned by the Responses API"),
    "service_tier": ((None, "auto", "default"), "there is one service tier ('default')"),
    "prompt_cache_retention": ((None, "in_memory"), "the prefix cache is in memory only"),
    "stream_options": ((None, {}, {"include_obfuscation": False}),
                       "stream obfuscation is not supported"),
}


_SGLANG_SAMPLING = ("top_k", "min_p", "repetition_penalty", "frequency_penalty",
                    "presence_penalty", "stop")


class TextPart(StrictRequest):
    """A text content part: ``input_text`` (any role) or ``output_text`` (an assistant's, as a
    response returned it; its annotations and logprobs are output-only information)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _text_parts_only(parts: Any) -> Any:
    if isinstance(parts, list):
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text"):
                raise ValueError(f"only text content parts (input_text, output_text) are "
                                 f"supported, got type {kind!r}")
    return parts


def _text_of(content: str | list[TextPart]) -> str:
    """The text of a message's content or of a call's output: given as a string, or as text
    parts joined with nothing between them."""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


class InputMessage(StrictRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # OpenAI models' hint

    _parts = field_validator("content", mode="before")(_text_parts_only)


class FunctionCallItem(StrictRequest):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictRequest):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    _parts = field_validator("output", mode="before")(_text_parts_only)


class ReasoningText(StrictRequest):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(StrictRequest):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: str | None = None


def _item_type(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(StrictRequest):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> Tool:
        return Tool(type="function", function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters,
            strict=self.strict))


class FunctionToolChoice(StrictRequest):
    type: Literal["function"]
    name: str


class TextFormat(StrictRequest):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its members flat."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _members_match_type(self) -> TextFormat:
        given = [n for n in ("name", "schema_", "description", "strict")
                 if getattr(self, n) is not None]
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs schema")
        if self.type != "json_schema" and given:
            raise ValueError(f"text.format of type {self.type} takes no "
                             f"{', '.join(g.rstrip('_') for g in given)}")
        return self

    def as_response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=self.name or "response", description=self.description,
            schema=self.schema_, strict=self.strict))


class TextConfig(StrictRequest):
    UNSUPPORTED = {"verbosity": ((None, "medium"), "verbosity is not supported")}

    format: TextFormat | None = None


class ResponsesRequest(SamplingFields):
    UNSUPPORTED = _UNSUPPORTED_RESPONSES

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    max_tool_calls: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)  # OpenAI's range
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    # SGLang's sampling extensions of the Responses API (top_k, min_p, the presence and
    # frequency penalties and stop come with top_p from SamplingFields).
    repetition_penalty: float | None = None
    # Accepted without effect on the output (see the module docstring).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"only function tools are supported, got type {kind!r}")
        return tools

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_KEYS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_KEYS} keys")
        for key, value in metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return metadata

    @field_validator("previous_response_id")
    @classmethod
    def _response_id_shape(cls, value: str | None) -> str | None:
        if value is not None and not RESPONSE_ID.match(value):
            raise ValueError(f"{value!r} {BAD_RESPONSE_ID}")
        return value

    def input_messages(self) -> list[ChatMessage]:
        """``input`` as chat messages (see the module docstring)."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        messages: list[ChatMessage] = []
        reasoning: str | None = None
        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning = "".join(part.text for part in item.content or [])
                continue
            if isinstance(item, InputMessage):
                message = ChatMessage(role=item.role, content=_text_of(item.content))
            elif isinstance(item, FunctionCallOutputItem):
                message = ChatMessage(role="tool", content=_text_of(item.output),
                                      tool_call_id=item.call_id)
            else:
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant" and reasoning is None:
                    # calls after an assistant's text (or its other calls): the same turn
                    calls = [*(last.tool_calls or []), call]
                    messages[-1] = ChatMessage.model_validate(
                        {**last.model_dump(exclude_none=True), "tool_calls": calls})
                    continue
                message = ChatMessage(role="assistant", tool_calls=[call])
            if message.role == "assistant" and reasoning is not None:
                message.reasoning_content = reasoning
            reasoning = None
            messages.append(message)
        return messages

    def chat_request(self, messages: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request generating this response from the conversation ``messages``."""
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        text_format = self.text.format if self.text else None
        return ChatCompletionRequest.model_validate({
            "messages": messages,
            "tools": [t.as_chat_tool() for t in self.tools] if self.tools else None,
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": text_format.as_response_format() if text_format else None,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            **{name: getattr(self, name) for name in _SGLANG_SAMPLING},
            "stream": self.stream,
        })
