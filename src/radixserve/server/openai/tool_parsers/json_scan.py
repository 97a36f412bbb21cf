"""Reading tool calls out of JSON that may still be arriving.

A stream hands the parsers an ever longer text; they re-read it from the start each time. These
helpers tell three states apart at every step: a call object that is complete, one that is a
valid beginning so far (its name may be known, its arguments may be partly written), and one that
can no longer become a call (``NotACall``). Arguments are kept as the exact text the model wrote
(``text[start:end]``), so the pieces a stream sends add up to the final arguments string.

A value that fails to decode is incomplete when the text ends where decoding failed (in an
unterminated string, a literal or a number being written), otherwise it is broken: a stream then
stops reading it as a call at once, although what it already sent of the call stays sent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from json import decoder as json_decoder

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"
# Keys a call object may carry ("parameters" is Llama 3's name for the arguments).
NAME_KEY = "name"
ARGUMENT_KEYS = ("arguments", "parameters")


class NotACall(Exception):
    """The text at this position cannot be (the start of) a tool call."""


@dataclass(frozen=True)
class PartialCall:
    """A call object read so far: ``end`` is None while it is incomplete."""

    name: str | None
    arguments: str  # the arguments' JSON text as written so far ("" before they start)
    end: int | None

    @property
    def complete(self) -> bool:
        return self.end is not None


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


# The end of a text that stops inside a number or a literal.
_UNFINISHED_ATOM = re.compile(
    r"(-?\d*(\.\d*)?([eE][-+]?\d*)?|t|tr|tru|f|fa|fal|fals|n|nu|nul)\Z"
)


class Broken(NotACall):
    """The JSON is invalid before the end of the text: no continuation can repair it."""


def decode_value(text: str, pos: int) -> tuple[object, int] | None:
    """The JSON value starting at ``pos`` and the index after it, or None while it is
    incomplete. Raises ``Broken`` when it cannot become valid JSON."""
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as e:
        if e.msg.startswith("Unterminated string") or e.pos >= len(text):
            return None
        start = _atom_start(text, e.pos)
        inside = start < e.pos or e.msg.startswith("Expecting value")
        if inside and _UNFINISHED_ATOM.match(text, start):
            return None
        raise Broken from None


def _atom_start(text: str, pos: int) -> int:
    """Where the number or literal around ``pos`` begins (decoding may fail inside one)."""
    while pos > 0 and (text[pos - 1].isalnum() or text[pos - 1] in "-+."):
        pos -= 1
    return pos


def _decode_string(text: str, pos: int) -> tuple[str, int] | None:
    """The JSON string whose opening quote is at ``pos``, or None while it is unterminated."""
    try:
        return json_decoder.scanstring(text, pos + 1)
    except json.JSONDecodeError:
        return None


def scan_call_object(text: str, pos: int, tool_names: frozenset[str]) -> PartialCall:
    """Read ``{"name": ..., "arguments": {...}}`` starting at ``pos`` (leading whitespace
    allowed). Raises ``NotACall`` for anything else: another shape, a key other than
    ``name``/``arguments``/``parameters``, a name that is not one of ``tool_names``, arguments
    that are not an object."""
    pos = skip_ws(text, pos)
    if pos == len(text):
        return PartialCall(None, "", None)
    if text[pos] != "{":
        raise NotACall
    pos += 1
    name: str | None = None
    arguments = ""
    while True:
        pos = skip_ws(text, pos)
        if pos == len(text):
            return PartialCall(name, arguments, None)
        if text[pos] == "}" and name is not None:
            return PartialCall(name, arguments or "{}", pos + 1)
        if text[pos] != '"':
            raise NotACall
        decoded = _decode_string(text, pos)
        if decoded is None:
            return PartialCall(name, arguments, None)
        key, pos = decoded
        if key != NAME_KEY and key not in ARGUMENT_KEYS:
            raise NotACall
        pos = skip_ws(text, pos)
        if pos == len(text):
            return PartialCall(name, arguments, None)
        if text[pos] != ":":
            raise NotACall
        start = skip_ws(text, pos + 1)
        value = decode_value(text, start)
        if value is None:
            # The last value, still being written. A name is only known once complete.
            if key != NAME_KEY and start < len(text):
                if text[start] != "{":
                    raise NotACall
                arguments = text[start:]
            elif key == NAME_KEY and start < len(text) and text[start] != '"':
                raise NotACall
            return PartialCall(name, arguments, None)
        obj, pos = value
        if key == NAME_KEY:
            if not isinstance(obj, str) or obj not in tool_names:
                raise NotACall
            name = obj
        else:
            if not isinstance(obj, dict):
                raise NotACall
            arguments = text[start:pos]
        pos = skip_ws(text, pos)
        if pos == len(text):
            return PartialCall(name, arguments, None)
        if text[pos] == ",":
            pos += 1
        elif text[pos] != "}":
            raise NotACall


def scan_call_sequence(
    text: str, pos: int, tool_names: frozenset[str], separator: str, close: str | None = None
) -> tuple[list[PartialCall], int | None]:
    """Call objects separated by ``separator`` from ``pos`` on, up to ``close`` if given; the
    calls and the index after the sequence, or None while the text ends inside it. Something
    else after a call ends the sequence there (it is text); a sequence whose first object is not
    a call raises ``NotACall``."""
    calls: list[PartialCall] = []
    while True:
        try:
            call = scan_call_object(text, pos, tool_names)
        except NotACall:
            if not calls:
                raise
            return calls, calls[-1].end
        calls.append(call)
        if call.end is None:
            return calls, None
        after = skip_ws(text, call.end)
        if after == len(text):
            return calls, None
        if close is not None and text[after] == close:
            return calls, after + 1
        if text[after] != separator:
            return calls, call.end
        pos = after + 1


def held_marker_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of one of ``markers``
    (a stream holds it back until it knows whether a marker is being written)."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest
