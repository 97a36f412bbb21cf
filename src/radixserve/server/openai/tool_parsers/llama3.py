"""Llama 3.1/3.2/3.3 JSON calls (``--tool-call-parser llama3``)::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

The model answers with a call instead of text (the output starts with ``{``), or writes
``<|python_tag|>`` before its calls (a special token: the server keeps special tokens in the
text of requests that use this parser). Several calls are separated by ``;``. ``parameters``
and ``arguments`` are both read as the arguments.
"""

from __future__ import annotations

from radixserve.server.openai.tool_parsers.base import TaggedFormat
from radixserve.server.openai.tool_parsers.json_scan import PartialCall, scan_call_sequence

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
        return scan_call_sequence(text, pos, self.tool_names, SEPARATOR)
