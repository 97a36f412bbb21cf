"""OpenAI streaming shared by chat and completions: cumulative outputs in, SSE deltas out.

The TokenizerManager yields cumulative outputs per choice; each endpoint only says how a
``Delta`` becomes its own choice type. This module does the rest the same way for both: what is
new since the last event, skipping empty updates, one ``finish_reason`` per choice, an error
event if generation fails mid-stream, the usage chunk last, and ``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from radixserve.server.errors import stream_error
from radixserve.server.openai.protocol import UsageInfo
from radixserve.server.sse import DONE, sse_event, sse_model


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
