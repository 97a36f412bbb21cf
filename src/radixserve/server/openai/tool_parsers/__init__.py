"""Tool-call parsers: one module per model format behind ``ToolCallParser`` (``base.py``).

``--tool-call-parser NAME`` picks the format the served model writes; ``create_tool_parser``
builds one parser per choice (a parser keeps the state of its choice's stream).
``enforced.py`` holds the grammar side of ``tool_choice: "required"`` and named functions.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from radixserve.server.openai.tool_parsers.base import (
    ParseResult,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
)

__all__ = [
    "TOOL_CALL_PARSERS",
    "ParseResult",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "create_tool_parser",
    "tool_parser_class",
]

# --tool-call-parser name → "module:class" (imported when used). Aliases follow SGLang and vLLM.
TOOL_CALL_PARSERS = {
    "hermes": "hermes:HermesFormat",
    "qwen25": "hermes:HermesFormat",
    "qwen": "hermes:HermesFormat",
    "llama3": "llama3:Llama3JsonFormat",
    "llama3_json": "llama3:Llama3JsonFormat",
    "mistral": "mistral:MistralFormat",
}


def tool_parser_class(name: str) -> type[ToolCallParser]:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}"
        )
    module, cls = TOOL_CALL_PARSERS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def create_tool_parser(name: str, tool_names: Iterable[str]) -> ToolCallParser:
    return tool_parser_class(name)(tool_names)
