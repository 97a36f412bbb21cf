"""What a chat request asks of its output, and the per-choice parsing that delivers it.

``plan_tools`` reads ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` against the server's
``--tool-call-parser`` and decides, once per request:

- which tools the chat template renders (all of them, also for ``tool_choice: "none"``: the
  model sees what it may not call, as with OpenAI and vLLM; its text is then not parsed);
- the grammar that enforces ``required`` or a named function (``tool_parsers/enforced.py``);
- which parser reads each choice's calls: the model's format (``auto``) or the enforced JSON;
- whether special tokens stay in the text (when the format's marker is one, as Llama 3's
  ``<|python_tag|>`` and Mistral's ``[TOOL_CALLS]`` are, the text must keep it).

``ChoiceParser`` then reads one choice: the reasoning first (``--reasoning-parser``, unless the
request says ``separate_reasoning: false``), then tool calls in what remains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.errors import APIError
from radixserve.server.openai.protocol import ChatCompletionRequest, NamedToolChoice
from radixserve.server.openai.reasoning import ReasoningParser
from radixserve.server.openai.tool_parsers import (
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    tool_parser_class,
)
from radixserve.server.openai.tool_parsers.enforced import (
    NamedCallFormat,
    RequiredCallsFormat,
    grammar_for,
)


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict[str, Any]] | None  # ``tools=`` for the chat template
    sampling: dict[str, Any]  # sampling parameters the plan adds (grammar, special tokens)
    new_parser: Callable[[], ToolCallParser] | None  # one per choice; None: no tool parsing
    max_calls: int | None  # parallel_tool_calls false → 1


NO_TOOLS = ToolPlan(None, {}, None, None)


def plan_tools(body: ChatCompletionRequest, parser_name: str | None, tokenizer: Any) -> ToolPlan:
    """The request's tool plan; an inconsistent request is an ``APIError`` naming its field."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(body, name) not in (None, "none"):
                raise APIError(400, f"{name} is only allowed when tools are specified",
                               param=name)
        return NO_TOOLS
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    names = [f["name"] for f in functions]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise APIError(400, f"tools define {', '.join(duplicates)} more than once", param="tools")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolPlan(template_tools, {}, None, None)
    parallel = body.parallel_tool_calls is not False
    max_calls = None if parallel else 1
    parser_cls = tool_parser_class(parser_name) if parser_name else None
    if choice is None or choice == "auto":
        if parser_cls is None:
            raise APIError(
                400,
                'tool_choice "auto" needs the server to know the model\'s tool-call format: '
                'start it with --tool-call-parser (or ask for tool_choice "required" or a named '
                "function, which a grammar enforces)",
                param="tool_choice",
            )
        keep = _markers_are_special(parser_cls.markers, tokenizer)
        sampling = {"skip_special_tokens": False} if keep else {}
        return ToolPlan(template_tools, sampling, lambda: parser_cls(names), max_calls)
    if _other_grammar(body):
        raise APIError(
            400,
            f"tool_choice {_describe(choice)} is enforced with a grammar, so it cannot be "
            f"combined with {_other_grammar(body)}",
            param="tool_choice",
        )
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and named not in names:
        raise APIError(400, f"tool_choice names {named!r}, which is not among the tools",
                       param="tool_choice")
    try:
        schema = grammar_for(functions, named, parallel)
    except ValueError as e:
        raise APIError(400, str(e), param="tools") from e
    ids = parser_cls.new_call_id if parser_cls else ToolCallParser.new_call_id

    def new_parser() -> ToolCallParser:
        parser = NamedCallFormat(named) if named else RequiredCallsFormat(names)
        parser.new_call_id = ids  # type: ignore[method-assign]  # the model family's id shape
        return parser

    return ToolPlan(template_tools, {"json_schema": schema}, new_parser, max_calls)


def _describe(choice: Any) -> str:
    return f"{{function: {choice.function.name}}}" if isinstance(choice, NamedToolChoice) \
        else f'"{choice}"'


def _other_grammar(body: ChatCompletionRequest) -> str | None:
    if body.response_format is not None and body.response_format.type != "text":
        return "response_format"
    return next((n for n in ("json_schema", "regex", "ebnf") if getattr(body, n)), None)


def _markers_are_special(markers: tuple[str, ...], tokenizer: Any) -> bool:
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    special |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                if getattr(t, "special", False)}
    return any(m in special for m in markers)


@dataclass(frozen=True)
class ParsedMessage:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall]
    ids: list[str]


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ChoiceParser:
    """Reasoning, then tool calls, of one choice (either part may be absent)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None,
                 max_calls: int | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls
        self.calls_sent = 0

    def final(self, text: str) -> ParsedMessage:
        reasoning, content = (None, text) if self.reasoning is None \
            else self.reasoning.parse_final(text)
        calls: list[ToolCall] = []
        if self.tools is not None:
            result = self.tools.parse_final(content)
            content, calls = result.content, result.calls[:self.max_calls]
        ids = [self.tools.new_call_id() for _ in calls] if self.tools else []
        return ParsedMessage(reasoning, content or (None if calls else ""), calls, ids)

    def stream(self, new_text: str, done: bool) -> ParsedDelta:
        delta = ParsedDelta()
        content = new_text
        if self.reasoning is not None:
            delta.reasoning, content = self.reasoning.parse_streaming(new_text, done)
        if self.tools is None:
            delta.content = content
            return delta
        tools_delta = self.tools.parse_streaming(content, done)
        delta.content = tools_delta.content
        delta.calls = [c for c in tools_delta.calls
                       if self.max_calls is None or c.index < self.max_calls]
        self.calls_sent = min(self.tools.calls_sent, self.max_calls or self.tools.calls_sent)
        return delta
