"""Pydantic models of the OpenAI-compatible API (requests and responses).

Nothing a client sends is silently ignored. Every request field is one of:

- honoured: type-checked here (failures become 400 errors), value ranges checked by
  ``SamplingParams`` downstream, so the native and the OpenAI API reject the same values with
  the same messages. SGLang's extensions (``top_k``, ``min_p``, ``repetition_penalty``,
  ``min_tokens``, ``ignore_eos``, ``regex``, ``ebnf``, ``json_schema``, ...) are among them;
- accepted without effect on the output, as OpenAI itself treats them (``user``,
  ``safety_identifier``, ``prompt_cache_key``: our prefix cache needs no key);
- known but not implemented (``UNSUPPORTED``): refused with a 400 naming the field when it
  carries anything but a value meaning "unused";
- unknown: refused with a 400 naming it (OpenAI does the same).

docs/api.md ("Fields: honoured or refused") has the table.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field, field_validator, model_serializer, model_validator

from radixserve.managers.tokenizer.generate_request import GenerateReqInput
from radixserve.server.openai.structured_outputs import ResponseFormat, grammar_params
from radixserve.server.strict_request import StrictRequest, Unsupported, non_empty_list

_M = TypeVar("_M", bound=BaseModel)

MAX_TOP_LOGPROBS = 20


# Fields of OpenAI's API that radixserve does not implement, with the values that mean "unused".
_FUNCTIONS = "the deprecated functions API is not supported; use tools and tool_choice"
_COMPLETION_TOOLS = "tool calling is only supported on /v1/chat/completions"
UNSUPPORTED_SHARED: Unsupported = {
    "functions": ((None, []), _FUNCTIONS),
    "function_call": ((None, "none"), _FUNCTIONS),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "reasoning effort is not supported"),
    "verbosity": ((None,), "verbosity is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "metadata": ((None, {}), "metadata is kept only with store, which is not supported"),
    "service_tier": ((None, "auto", "default"), "there is one service tier ('default')"),
    # SGLang's extensions (sglang-router forwards them at these defaults with every request)
    "return_hidden_states": ((None, False), "hidden states are not returned"),
}
UNSUPPORTED_CHAT: Unsupported = {
    "stream_reasoning": ((None, True), "reasoning is always streamed as it is parsed"),
}
UNSUPPORTED_COMPLETIONS: Unsupported = {
    "tools": ((None, []), _COMPLETION_TOOLS),
    "tool_choice": ((None, "none"), _COMPLETION_TOOLS),
    "parallel_tool_calls": ((None,), _COMPLETION_TOOLS),
    "best_of": ((None, 1), "best_of is not supported (use n)"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
}


class StreamOptions(StrictRequest):
    include_usage: bool = False


class SamplingRequest(StrictRequest):
    """Fields shared by chat and text completions."""

    model: str | None = None
    n: int = Field(default=1, ge=1)  # at most --max-n (server/admission.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)  # OpenAI's range
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # Constrained output: OpenAI's response_format, or SGLang's fields (at most one in all).
    response_format: ResponseFormat | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Accepted without effect on the output (see the module docstring).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # SGLang's extra field: the scheduling priority (--enable-priority-scheduling;
    # docs/priority.md).
    priority: int | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_in_range(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        bad = next((k for k, v in (bias or {}).items() if not -100 <= v <= 100), None)
        if bad is not None:  # OpenAI's range; NaN and infinities fail it too
            raise ValueError(f"logit_bias values must be between -100 and 100, got "
                             f"{bias[bad]} for token {bad[:20]}")
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingRequest:
        given = [n for n in ("json_schema", "regex", "ebnf") if getattr(self, n)]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(
                "at most one of response_format, json_schema, regex and ebnf may constrain the "
                f"output, got {', '.join(given)}"
            )
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, max_new_tokens: int, choice: int) -> dict[str, Any]:
        """The ``SamplingParams`` dict of choice number ``choice`` (0-based).

        With a ``seed``, choice i uses ``seed + i``: the n choices differ, and choice 0 equals
        the single-choice request with the same seed.
        """
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            **grammar_params(self.response_format),
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "json_schema": self.json_schema,
            "regex": self.regex,
            "ebnf": self.ebnf,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        if self.seed is not None:
            params["sampling_seed"] = self.seed + choice
        return params

    def generate_inputs(
        self,
        prompts: list[list[int]],
        context_len: int,
        top_logprobs_num: int | None,
        extra_params: dict[str, Any] | None = None,
        prompt_logprobs: bool = False,
        *,
        max_completion_tokens: int,
    ) -> list[GenerateReqInput]:
        """One single-prompt request per choice: prompt p's choice j is at ``p * n + j``.

        Without ``max_tokens`` a choice may generate up to the end of the context (as OpenAI),
        at most ``max_completion_tokens`` (``--max-completion-tokens``; a larger ``max_tokens`` is
        refused by the TokenizerManager); ``top_logprobs_num`` None means no logprobs;
        ``extra_params`` are sampling parameters the route adds (a tool grammar, say);
        ``prompt_logprobs`` asks for the logprobs of the prompt's tokens too. The
        TokenizerManager validates the rest.
        """
        requested = self.requested_max_tokens()
        inputs = []
        for ids in prompts:
            rest = min(max(context_len - len(ids), 0), max_completion_tokens)
            max_new = requested if requested is not None else rest
            for j in range(self.n):
                inputs.append(
                    GenerateReqInput(
                        input_ids=ids,
                        sampling_params={**self.sampling_params(max_new, j),
                                         **(extra_params or {})},
                        stream=self.stream,
                        return_logprob=top_logprobs_num is not None,
                        logprob_start_len=0 if prompt_logprobs else -1,
                        top_logprobs_num=top_logprobs_num or 0,
                        priority=self.priority,
                    )
                )
        return inputs


# ---------------------------------------------------------------------------- chat requests
class FunctionDefinition(StrictRequest):
    # OpenAI's rule for function names.
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    # Enforced with required / named tool_choice; in auto mode the model writes freely.
    strict: bool | None = None


class Tool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(StrictRequest):
    name: str
    arguments: str  # JSON text, as the API returned it

    def arguments_object(self) -> Any:
        """The arguments decoded (chat templates render them as JSON themselves)."""
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call arguments are not valid JSON: {e}") from None


class MessageToolCall(StrictRequest):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this result answers
    reasoning_content: str | None = None  # assistant messages (templates may render it)

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(
                        "only text content parts ({'type': 'text', 'text': ...}) are supported, "
                        f"got type {part.get('type')!r}"
                    )
        return content

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("tool_call_id is only allowed on tool messages")
        for name in ("tool_calls", "reasoning_content"):
            if self.role != "assistant" and getattr(self, name) is not None:
                raise ValueError(f"{name} is only allowed on assistant messages")
        for call in self.tool_calls or []:
            call.function.arguments_object()
        return self

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: ``developer`` is ``system``, tool-call
        arguments are objects (templates write them with ``tojson``)."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.name:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": c.function.arguments_object()}}
                for c in self.tool_calls
            ]
        return message


class ChatCompletionRequest(SamplingRequest):
    UNSUPPORTED = {**UNSUPPORTED_SHARED, **UNSUPPORTED_CHAT}

    messages: list[ChatMessage] = Field(min_length=1)
    # Extra keyword arguments of the chat template (say, {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # SGLang's switch: False keeps a thinking model's reasoning inline in the content (no
    # effect without --reasoning-parser, as in SGLang: sglang-router always sends true).
    separate_reasoning: bool = True
    # vLLM's and SGLang's prompt controls: open a new assistant message (the default unless
    # continue_final_message), or continue the last (assistant) message where it stops.
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    # vLLM's: the reply's content starts with the last message's when that is the assistant's.
    echo: bool = False

    @model_validator(mode="after")
    def _one_token_limit(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_completion_tokens or the deprecated max_tokens, not both")
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---------------------------------------------------------------------------- completion requests
class CompletionRequest(SamplingRequest):
    UNSUPPORTED = {**UNSUPPORTED_SHARED, **UNSUPPORTED_COMPLETIONS}

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    _non_empty = field_validator("prompt")(non_empty_list)


# ---------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


@dataclass(frozen=True)
class ResponseIds:
    """What every object of one chat or completion response carries (the response, or each
    chunk of its stream): its id, creation time and model."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseIds:
        return cls(new_id(prefix), now(), model)

    def wrap(self, cls: type[_M], choices: list[Any], usage: UsageInfo | None) -> _M:
        """``cls`` (a response or a stream chunk type) around ``choices`` and ``usage``."""
        return cls(id=self.id, created=self.created, model=self.model, choices=choices,
                   usage=usage)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def build(cls, prompt: int, completion: int, cached: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    @classmethod
    def from_outputs(cls, outputs: list[dict[str, Any]], n: int) -> UsageInfo:
        """Usage of ``len(outputs) // n`` prompts with n choices each (a prompt counts once)."""
        metas = [out["meta_info"] for out in outputs]
        firsts = metas[::n]
        return cls.build(
            prompt=sum(m["prompt_tokens"] for m in firsts),
            completion=sum(m["completion_tokens"] for m in metas),
            cached=sum(m["cached_tokens"] for m in firsts),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class _WithoutNulls(BaseModel):
    """Leaves out unset (None) fields, as OpenAI's tool-call deltas do: the SDK's stream
    accumulator overwrites ``type`` with every delta's value, so a later ``"type": null`` would
    erase the first delta's ``"function"``."""

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallOut(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class _Choice(BaseModel):
    """What every chat and completion choice carries, whole or as a stream chunk's piece
    (``finish_reason`` only in a choice's last chunk). These come first in its JSON."""

    index: int
    finish_reason: str | None = None
    matched_stop: int | str | None = None  # SGLang's: the stop token id or string that matched


_C = TypeVar("_C", bound=_Choice)


class _Response(BaseModel, Generic[_C]):
    """A chat or completion response, or one chunk of its stream (``ResponseIds.wrap`` makes
    both); a subclass names its choice type and gives ``object`` its one value. ``usage`` is
    always set on a whole response, and on a stream only in the last chunk, when asked for."""

    id: str
    object: str
    created: int
    model: str
    choices: list[_C]
    usage: UsageInfo | None = None


class _ChatChoice(_Choice):
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionChoice(_ChatChoice):
    message: ChatMessageOut


class ChatCompletionResponse(_Response[ChatCompletionChoice]):
    object: Literal["chat.completion"] = "chat.completion"


class DeltaToolCall(_WithoutNulls):
    """A piece of one call: ``id``, ``type`` and ``function.name`` come with its first piece."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(_ChatChoice):
    delta: DeltaMessage


class ChatCompletionStreamResponse(_Response[ChatCompletionStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionLogprobs(BaseModel):
    """Per token; with ``echo`` the prompt's tokens come first, the very first of them with a
    ``null`` logprob and ``null`` alternatives (nothing precedes it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Response[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class CompletionStreamResponse(_Response[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "radixserve"
    root: str
    parent: str | None = None  # a LoRA adapter's base model (SGLang's field)
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def finish_reason_name(reason: dict[str, Any] | None) -> str | None:
    """OpenAI's finish_reason from the engine's ``{"type": ...}`` dict (stop/length/abort)."""
    return None if reason is None else str(reason.get("type"))


def matched_stop(reason: dict[str, Any] | None) -> int | str | None:
    """The stop token id or string that ended the generation (SGLang's ``matched_stop``)."""
    if reason is None or reason.get("type") != "stop":
        return None
    return reason.get("matched")
