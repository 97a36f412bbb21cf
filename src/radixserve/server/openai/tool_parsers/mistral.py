"""Mistral calls (``--tool-call-parser mistral``), in both shapes Mistral's models write::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The first is the v0.3 tokenizer's (Mistral 7B v0.3, Nemo), the second the later one's (Small 3.2
and newer). ``[TOOL_CALLS]`` is a special token: the server keeps special tokens in the text of
requests that use this parser. Call ids are 9 alphanumeric characters, the only shape Mistral's
chat templates accept back.
"""

from __future__ import annotations

import re

from radixserve.server.openai.tool_parsers.base import TaggedFormat, short_call_id
from radixserve.server.openai.tool_parsers.json_scan import (
    NotACall,
    PartialCall,
    decode_value,
    scan_call_sequence,
    skip_ws,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.-]*")


def scan_call_array(
    text: str, pos: int, tool_names: frozenset[str]
) -> tuple[list[PartialCall], int | None]:
    """``[call, call, ...]`` starting at ``pos`` (at the ``[``, after optional whitespace)."""
    pos = skip_ws(text, pos)
    if pos == len(text):
        return [], None
    if text[pos] != "[":
        raise NotACall
    return scan_call_sequence(text, pos + 1, tool_names, ",", "]")


class MistralFormat(TaggedFormat):
    markers = (TOOL_CALLS,)

    @classmethod
    def new_call_id(cls) -> str:
        return short_call_id()

    def scan_run(self, text: str, pos: int) -> tuple[list[PartialCall], int | None]:
        start = skip_ws(text, pos)
        if start == len(text):
            return [], None
        if text[start] == "[":
            return scan_call_array(text, start, self.tool_names)
        return self._scan_name_args(text, start)

    def _scan_name_args(self, text: str, pos: int) -> tuple[list[PartialCall], int | None]:
        """``name[ARGS]{...}``: one call per ``[TOOL_CALLS]``."""
        args_at = text.find(ARGS, pos)
        if args_at < 0:
            written = text[pos:]
            name_so_far = _NAME_CHARS.match(written)
            assert name_so_far is not None
            rest = written[name_so_far.end():]
            if rest and not ARGS.startswith(rest):
                raise NotACall
            return [], None
        name = text[pos:args_at]
        if name not in self.tool_names:
            raise NotACall
        start = skip_ws(text, args_at + len(ARGS))
        value = decode_value(text, start)
        if value is None:
            if start < len(text) and text[start] != "{":
                raise NotACall
            return [PartialCall(name, text[start:], None)], None
        obj, end = value
        if not isinstance(obj, dict):
            raise NotACall
        return [PartialCall(name, text[start:end], end)], end
