"""The contract of a tool-call format: one ``scan`` per format, the rest shared.

A format module (``hermes.py``, ``llama3.py``, ``mistral.py``, ...) implements ``scan(text,
final)``: it splits a model's text into the text outside calls and the calls (``PartialCall``),
and the base class turns that into the three operations the OpenAI routes use:

- ``detect(text)``: does the text contain (the start of) a call;
- ``parse_final(text)``: the finished text → ``ParseResult`` (content outside the calls, calls);
- ``parse_streaming(new_text, done)``: text as it arrives → ``StreamDelta`` (content to send now,
  call deltas: a call's name first, then its arguments in pieces, each call with a stable index).

Rules every ``scan`` keeps, so that a stream adds up to the final parse:

- with ``final=False`` the content returned only grows from call to call: text that might still
  turn out to start a call (a beginning of a marker, an unfinished block) is held back, and so is
  trailing whitespace (whitespace next to a call is not content);
- with ``final=True`` nothing is held back: a block that is not a complete, valid call to a listed
  function is content ("broken JSON stays text");
- arguments are the exact JSON text the model wrote.

A stream cannot take back what it sent: a call whose name went out and whose JSON then breaks
stays as sent, while the text after the break is content (the non-streamed answer would show the
whole block as text).
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from radixserve.server.openai.tool_parsers.json_scan import (
    NotACall,
    PartialCall,
    held_marker_prefix,
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass(frozen=True)
class ParseResult:
    content: str  # the text outside the calls
    calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # the call's position among the choice's calls (stable over the stream)
    name: str | None  # only on the call's first delta
    arguments: str  # the next piece of the arguments text
    id: str | None = None  # only on the call's first delta


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class Scan:
    """What ``scan`` found: content and calls in the order they appear."""

    content: list[str] = field(default_factory=list)
    calls: list[PartialCall] = field(default_factory=list)

    def add_content(self, text: str) -> None:
        if text:
            self.content.append(text)


class ToolCallParser(ABC):
    """One tool-call format. An instance parses one choice (``parse_streaming`` keeps state)."""

    # The strings that open a call in this format (held back while they may be starting).
    markers: ClassVar[tuple[str, ...]]

    def __init__(self, tool_names: Iterable[str]) -> None:
        self.tool_names = frozenset(tool_names)
        self._text = ""
        self._content_sent = 0
        self._args_sent: list[int] = []  # per call whose name went out: argument chars sent

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """Split ``text`` into content and calls (see the module docstring for the rules)."""

    @classmethod
    def new_call_id(cls) -> str:
        """A fresh id for a parsed call (OpenAI's ``call_...`` shape)."""
        return "call_" + secrets.token_hex(12)

    def detect(self, text: str) -> bool:
        return any(marker in text for marker in self.markers)

    def parse_final(self, text: str) -> ParseResult:
        if not self.detect(text):  # most answers: no call, nothing to scan
            return ParseResult(text, [])
        scan = self.scan(text, final=True)
        calls = [ToolCall(c.name, c.arguments) for c in scan.calls if c.complete and c.name]
        return ParseResult("".join(scan.content), calls)

    def parse_streaming(self, new_text: str, done: bool) -> StreamDelta:
        """Feed the next piece of the choice's text; ``done`` on its last piece."""
        self._text += new_text
        scan = self.scan(self._text, final=done)
        content = "".join(scan.content)
        delta = StreamDelta(content=content[self._content_sent:])
        self._content_sent = max(self._content_sent, len(content))
        for index, call in enumerate(scan.calls):
            if call.name is None or (done and not call.complete):
                break
            if index == len(self._args_sent):
                self._args_sent.append(len(call.arguments))
                delta.calls.append(ToolCallDelta(index, call.name, call.arguments,
                                                 self.new_call_id()))
            elif len(call.arguments) > self._args_sent[index]:
                delta.calls.append(
                    ToolCallDelta(index, None, call.arguments[self._args_sent[index]:])
                )
                self._args_sent[index] = len(call.arguments)
        return delta

    @property
    def calls_sent(self) -> int:
        return len(self._args_sent)


class TaggedFormat(ToolCallParser):
    """Formats where a marker opens a run of calls somewhere in free text.

    Subclasses say how the run after the marker reads (``scan_run``); this class finds markers,
    keeps the text between runs as content and holds back what a stream must not send yet.
    """

    @abstractmethod
    def scan_run(self, text: str, pos: int) -> tuple[list[PartialCall], int | None]:
        """The calls of the run starting at ``pos`` (just after the marker) and the index after
        the run, or None when the text ends before the run does (then the last call may be
        incomplete). Raises ``NotACall`` when the run is not made of calls."""

    def leading_run(self, text: str) -> int | None:
        """Where a run starts without a marker at the very beginning of the text (if the format
        has such runs)."""
        return None

    def scan(self, text: str, final: bool) -> Scan:
        scan = Scan()
        pos, after_call = 0, False
        run_start = self.leading_run(text)
        marker = ""
        while True:
            if run_start is None:
                found = [(i, m) for m in self.markers if (i := text.find(m, pos)) >= 0]
                if not found:
                    break
                run_start, marker = min(found)
            before = _trim(text[pos:run_start], after_call, True)
            try:
                calls, end = self.scan_run(text, run_start + len(marker))
            except NotACall:
                # Not calls: the marker is plain text; look for the next one after it.
                scan.add_content(_trim(text[pos:run_start + len(marker)], after_call, False))
                pos, after_call, run_start = run_start + len(marker), False, None
                if not marker:  # a leading run that is not one: all of it is text so far
                    break
                continue
            if end is None:
                done = [c for c in calls if c.complete]
                if not final:
                    scan.add_content(before)
                    scan.calls.extend(calls)
                elif done:  # the calls that were finished count, the rest is text
                    scan.add_content(before)
                    scan.calls.extend(done)
                    scan.add_content(text[done[-1].end:].lstrip())
                else:
                    scan.add_content(_trim(text[pos:], after_call, False))
                return scan
            scan.add_content(before)
            scan.calls.extend(calls)
            pos, after_call, run_start = end, True, None
        tail = _trim(text[pos:], after_call, not final)
        if not final:
            tail = tail[:len(tail) - held_marker_prefix(tail, self.markers)].rstrip()
        scan.add_content(tail)
        return scan


def _trim(text: str, after_call: bool, before_unknown: bool) -> str:
    """Content without the whitespace that touches a call (before an unknown continuation
    trailing whitespace is held back)."""
    if after_call:
        text = text.lstrip()
    return text.rstrip() if before_unknown else text


ALPHANUMERIC = string.ascii_letters + string.digits


def short_call_id(length: int = 9) -> str:
    """Mistral's templates accept only 9-character alphanumeric tool-call ids."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(length))
