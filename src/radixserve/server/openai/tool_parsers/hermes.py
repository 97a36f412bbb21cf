"""Hermes-style calls, as Qwen2.5 and Qwen3 write them (``--tool-call-parser hermes``)::

    Some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {}}
    </tool_call>

One JSON object per block, any number of blocks anywhere in the text. A block whose closing tag
is missing still counts when its object is complete; what follows it is text.
"""

from __future__ import annotations

from radixserve.server.openai.tool_parsers.base import TaggedFormat
from radixserve.server.openai.tool_parsers.json_scan import PartialCall, scan_call_object, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesFormat(TaggedFormat):
    markers = (START,)

    def scan_run(self, text: str, pos: int) -> tuple[list[PartialCall], int | None]:
        call = scan_call_object(text, pos, self.tool_names)
        if not call.complete:
            return [call], None
        assert call.end is not None
        after = skip_ws(text, call.end)
        if text.startswith(END, after):
            return [call], after + len(END)
        if END.startswith(text[after:]):  # the closing tag is (maybe) still being written
            return [call], None
        return [call], call.end
