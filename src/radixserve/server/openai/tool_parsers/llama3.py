"""Llama 3.1/3.2/3.3 JSON calls (``--tool-call-parser llama3``)::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

The model answers with a call instead of text (the output starts with ``{``), or writes
``<|python_tag|>`` before its calls (a special token: the server keeps special tokens in the
text of requests that use this parser). Several calls are separated by ``;``. ``parameters``
and ``arguments`` are both read as the arguments.
"""

from __future__ import annotations

from radixserve.server.openai.tool_parsers.base import TaggedFormat
from radixserve.server.openai.tool_parsers.json_scan import (
    NotACall,
    PartialCall,
    scan_call_object,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonFormat(TaggedFormat):
    markers = (PYTHON_TAG,)

    def detect(self, text: str) -> bool:
        return super().detect(text) or text.lstrip().startswith("{")

    def leading_run(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else None

    def scan_run(self, text: str, pos: int) -> tuple[list[PartialCall], int | None]:
        calls: list[PartialCall] = []
        while True:
            try:
                call = scan_call_object(text, pos, self.tool_names)
            except NotACall:
                if not calls:
                    raise
                return calls, calls[-1].end  # the calls so far; the rest is text
            calls.append(call)
            if call.end is None:
                return calls, None
            after = skip_ws(text, call.end)
            if after == len(text):
                return calls, None
            if text[after] != SEPARATOR:
                return calls, call.end
            pos = after + 1
