"""Streaming ``/v1/responses``: the events ``client.responses.stream(...)`` accumulates.

Every event is ``event: <type>`` + ``data: <json>`` and carries ``sequence_number`` (0, 1, ...):

    response.created, response.in_progress            (the response, in_progress, no output)
    per output item, in the order the model writes them:
      response.output_item.added                      (the item, empty, in_progress)
      reasoning: response.reasoning_text.delta ... / .done
      message:   response.content_part.added, response.output_text.delta ... / .done,
                 response.content_part.done
      call:      response.function_call_arguments.delta ... / .done
      response.output_item.done                       (the item, whole)
    response.completed | response.incomplete          (the response, with output and usage)

An item is opened when the chat parser (``ChoiceParser.stream``) first yields its kind of text
and closed when another kind starts or the generation ends; the final response lists exactly
the streamed items, with their ids. A generation that fails mid-stream ends with an ``error``
event and ``response.failed``. No ``data: [DONE]``: OpenAI's Responses stream has none.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from radixserve.server.errors import stream_error
from radixserve.server.openai.chat_parsing import ParsedDelta, ParsedMessage
from radixserve.server.openai.responses_objects import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningPart,
    Status,
    Turn,
    item_id,
    item_status,
    response_object,
    status_of,
)
from radixserve.server.openai.tool_parsers import ToolCall
from radixserve.server.sse import sse_event

Finish = Callable[[dict[str, Any], ParsedMessage, list[OutputItem]], dict[str, Any]]


class _Events:
    """Numbers and frames the events of one stream."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse_event(payload, kind)


class _OpenItem:
    def __init__(self, kind: str, index: int, item: OutputItem) -> None:
        self.kind = kind  # "reasoning", "message" or "call:<parser index>"
        self.index = index  # output_index
        self.item = item
        self.text = ""


class _Items:
    """The output items of a streamed response, opened and closed as deltas arrive."""

    def __init__(self, event: _Events) -> None:
        self.event = event
        self.items: list[OutputItem] = []
        self.open: _OpenItem | None = None
        self.reasoning = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self.call_ids: list[str] = []

    def feed(self, delta: ParsedDelta) -> list[bytes]:
        events = []
        if delta.reasoning:
            events += self._switch("reasoning")
            events.append(self._text_delta("response.reasoning_text.delta", delta.reasoning))
            self.reasoning += delta.reasoning
        if delta.content:
            events += self._switch("message")
            events.append(self._text_delta("response.output_text.delta", delta.content,
                                           logprobs=[]))
            self.content += delta.content
        for call in delta.calls:
            events += self._switch(f"call:{call.index}", call.name, call.id)
            if call.arguments:
                assert self.open is not None
                self.open.text += call.arguments
                events.append(self.event("response.function_call_arguments.delta",
                                         item_id=self.open.item.id,
                                         output_index=self.open.index, delta=call.arguments))
        return events

    def close(self, status: Status) -> list[bytes]:
        """Close the open item; a response with no output at all gets an empty message."""
        events = [] if self.items or self.open else self._switch("message")
        return events + self._close(item_status(status))

    def parsed(self) -> ParsedMessage:
        content = self.content or (None if self.calls else "")
        return ParsedMessage(self.reasoning or None, content, self.calls, self.call_ids)

    def _text_delta(self, kind: str, text: str, **extra: Any) -> bytes:
        assert self.open is not None
        self.open.text += text
        return self.event(kind, item_id=self.open.item.id, output_index=self.open.index,
                          content_index=0, delta=text, **extra)

    def _switch(self, kind: str, name: str | None = None, call_id: str | None = None
                ) -> list[bytes]:
        if self.open is not None and self.open.kind == kind:
            return []
        events = self._close("completed")
        index = len(self.items)
        item: OutputItem
        if kind == "reasoning":
            item = OutputReasoning(id=item_id("rs"), content=[], status="in_progress")
        elif kind == "message":
            item = OutputMessage(id=item_id("msg"), content=[], status="in_progress")
        else:
            call_id = call_id or item_id("call")
            item = OutputFunctionCall(id=item_id("fc"), call_id=call_id, name=name or "",
                                      arguments="", status="in_progress")
        self.open = _OpenItem(kind, index, item)
        events.append(self.event("response.output_item.added", output_index=index,
                                 item=item.model_dump()))
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=item.id,
                                     output_index=index, content_index=0,
                                     part=OutputText(text="").model_dump()))
        return events

    def _close(self, status: str) -> list[bytes]:
        current, self.open = self.open, None
        if current is None:
            return []
        where = {"item_id": current.item.id, "output_index": current.index}
        events = []
        item = current.item
        if isinstance(item, OutputReasoning):
            events.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                     text=current.text))
            item = item.model_copy(update={"content": [ReasoningPart(text=current.text)]})
        elif isinstance(item, OutputMessage):
            part = OutputText(text=current.text)
            events.append(self.event("response.output_text.done", **where, content_index=0,
                                     text=current.text, logprobs=[]))
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=part.model_dump()))
            item = item.model_copy(update={"content": [part]})
        else:
            assert isinstance(item, OutputFunctionCall)
            events.append(self.event("response.function_call_arguments.done", **where,
                                     name=item.name, arguments=current.text))
            item = item.model_copy(update={"arguments": current.text})
            self.calls.append(ToolCall(item.name, current.text))
            self.call_ids.append(item.call_id)
            if not _is_json(current.text):  # cut by the length limit, then text followed
                status = "incomplete"
        item = item.model_copy(update={"status": status})
        self.items.append(item)
        events.append(self.event("response.output_item.done", output_index=current.index,
                                 item=item.model_dump()))
        return events


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class ResponseStream:
    """The events of one streamed response (see the module docstring)."""

    def __init__(self, turn: Turn, model: str, finish: Finish) -> None:
        self.turn = turn
        self.model = model
        self.finish = finish

    async def events(self, outs: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        turn, event = self.turn, _Events()
        started = response_object(turn, self.model, "in_progress", []).model_dump()
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        items = _Items(event)
        text_sent, final = 0, None
        async with contextlib.aclosing(outs):  # type: ignore[type-var]
            try:
                async for out in outs:
                    new_text, text_sent = out["text"][text_sent:], len(out["text"])
                    done = out["meta_info"]["finish_reason"] is not None
                    for frame in items.feed(turn.parser.stream(new_text, done)):
                        yield frame
                    if done:
                        final = out
                if final is None:
                    raise RuntimeError("the generation ended without a finish reason")
                status, _ = status_of(final["meta_info"]["finish_reason"])
                for frame in items.close(status):
                    yield frame
                response = self.finish(final, items.parsed(), items.items)
            except Exception as exc:
                error = stream_error(exc)["error"]
                yield event("error", code=error["type"], message=error["message"],
                            param=error["param"])
                failed = {**started, "status": "failed",
                          "error": {"code": "server_error", "message": error["message"]}}
                yield event("response.failed", response=failed)
                return
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield event(kind, response=response)
