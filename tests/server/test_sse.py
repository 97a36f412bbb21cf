"""SSE framing: a chunk serialised by pydantic's encoder carries the same JSON as the dict path."""

from __future__ import annotations

import json

from radixserve.server.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionStreamResponse,
    UsageInfo,
)
from radixserve.server.sse import sse_event, sse_model


def test_sse_model_frames_the_same_json_as_sse_event():
    chunk = CompletionStreamResponse(
        id="cmpl-1",
        created=1700000000,
        model="m",
        choices=[CompletionChoice(
            index=1,
            text=" héllo ✓ \n\"quoted\"",
            logprobs=CompletionLogprobs(
                tokens=[" h"], token_logprobs=[-0.1234567], top_logprobs=[{" h": -0.5}],
                text_offset=[3],
            ),
            finish_reason="stop",
            matched_stop=7,
        )],
        usage=UsageInfo.build(5, 2, 1),
    )
    framed = sse_model(chunk)
    assert framed.startswith(b"data: ") and framed.endswith(b"\n\n")
    payload = framed[len(b"data: "):-2]
    assert b"\n" not in payload  # one event: the text's newline stays escaped
    assert json.loads(payload) == chunk.model_dump()
    assert framed == sse_event(chunk.model_dump())  # compact, unescaped UTF-8: byte for byte
