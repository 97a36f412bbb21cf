"""OpenAI replies shared by chat and completions: cumulative outputs in, one response or SSE
deltas out.

The TokenizerManager yields cumulative outputs per choice; each endpoint only says how a
finished output, or a ``Delta`` of a streamed one, becomes its own choice type (a ``Reply``
subclass). ``Reply.send`` does the rest the same way for both: waiting for every choice, or
streaming what is new since the last event, skipping empty updates, one ``finish_reason`` per
choice, an error event if generation fails mid-stream, the usage chunk last, and
``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Generic, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from radixserve.server.errors import stream_error
from radixserve.server.generations import cancel_on_disconnect, collect_final, prime
from radixserve.server.openai.protocol import ResponseIds, SamplingRequest, UsageInfo
from radixserve.server.sse import DONE, sse_event, sse_model, sse_response

_B = TypeVar("_B", bound=SamplingRequest)


@dataclass
class Delta:
    """What one cumulative output of choice ``index`` adds to what was already streamed."""

    index: int
    out: dict[str, Any]  # the cumulative output (``text``, ``output_ids``, ``meta_info``)
    new_text: str
    text_sent: int  # characters streamed before this delta
    tokens_sent: int  # output tokens streamed before this delta

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        return self.out["meta_info"]["finish_reason"]


async def stream_choices(
    merged: AsyncIterator[tuple[int, dict[str, Any]]],
    num_choices: int,
    to_choice: Callable[[Delta], BaseModel | None],
    frame: Callable[[list[BaseModel], UsageInfo | None], BaseModel],
    usage_n: int | None,
    head: Iterable[BaseModel] = (),
) -> AsyncIterator[bytes]:
    """SSE events for ``merged`` (``(choice index, cumulative output)`` pairs).

    ``to_choice`` returns ``None`` for a delta that carries nothing to send (a finishing delta is
    always sent). ``frame(choices, usage)`` wraps choices in the endpoint's chunk object.
    ``usage_n`` is the request's ``n`` when the usage chunk was asked for, else ``None``.
    """
    text_sent = [0] * num_choices
    tokens_sent = [0] * num_choices
    finals: dict[int, dict[str, Any]] = {}
    async with contextlib.aclosing(merged):  # type: ignore[type-var]
        for choice in head:
            yield sse_model(frame([choice], None))
        try:
            async for i, out in merged:
                delta = Delta(i, out, out["text"][text_sent[i]:], text_sent[i], tokens_sent[i])
                text_sent[i] = len(out["text"])
                tokens_sent[i] = len(out["output_ids"])
                if delta.finish_reason is not None:
                    finals[i] = out
                choice = to_choice(delta)
                if choice is not None:
                    yield sse_model(frame([choice], None))
        except Exception as exc:
            yield sse_event(stream_error(exc))
            yield DONE
            return
    if usage_n is not None:
        usage = UsageInfo.from_outputs([finals[i] for i in range(num_choices)], usage_n)
        yield sse_model(frame([], usage))
    yield DONE


class Reply(ABC, Generic[_B]):
    """The reply to one chat or completions request (``body``) whose ``num_choices``
    generations ``merged`` yields: a subclass makes the endpoint's choices and names its
    response and chunk types; ``send`` answers with the whole response or its stream."""

    response_type: ClassVar[type[BaseModel]]
    chunk_type: ClassVar[type[BaseModel]]

    def __init__(self, body: _B, ids: ResponseIds, num_choices: int) -> None:
        self.body = body
        self.ids = ids
        self.num_choices = num_choices

    @abstractmethod
    def choice(self, index: int, out: dict[str, Any]) -> BaseModel:
        """Choice ``index`` of the whole response, from its finished output."""

    @abstractmethod
    def delta_choice(self, delta: Delta) -> BaseModel | None:
        """A stream chunk's choice, or ``None`` when ``delta`` carries nothing to send
        (``stream_choices``)."""

    def head(self) -> list[BaseModel]:
        """Choices sent before any output (none unless the endpoint says so)."""
        return []

    async def send(self, request: Request, merged: AsyncIterator[tuple[int, dict[str, Any]]]
                   ) -> Response:
        """The whole response once every choice finished, or (``stream``) the SSE stream,
        primed so that a request the TokenizerManager refuses fails before it starts."""
        body, ids = self.body, self.ids
        if not body.stream:
            outputs = await cancel_on_disconnect(request, collect_final(merged, self.num_choices))
            choices = [self.choice(i, out) for i, out in enumerate(outputs)]
            usage = UsageInfo.from_outputs(outputs, body.n)
            return JSONResponse(ids.wrap(self.response_type, choices, usage).model_dump())
        first = await prime(request, merged)
        usage_n = body.n if body.include_usage else None
        frame = partial(ids.wrap, self.chunk_type)
        return sse_response(stream_choices(first, self.num_choices, self.delta_choice, frame,
                                           usage_n, self.head()))
