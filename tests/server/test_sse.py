"""SSE framing: a chunk serialised by pydantic's encoder carries the same JSON as the dict path."""

from __future__ import annotations

import json

from radixserve.server.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionStreamResponse,
    UsageInfo,
)
from radixserve.server.sse import sse_data, sse_event, sse_model


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


# Generated text can hold any character; these three stay raw in JSON, yet str.splitlines (and
# httpx's iter_lines, which follows it) break lines at them: a soak run read half an event.
LINE_BREAKS_JSON_LEAVES_RAW = "a\x85b\u2028c\u2029d"


def _one_line_events(framed: bytes) -> list[dict]:
    """The events of ``framed`` as a line reader of the splitlines kind sees them."""
    lines = [line for line in framed.decode().splitlines() if line.startswith("data: ")]
    return [json.loads(line.removeprefix("data: ")) for line in lines]


def test_no_event_is_split_by_a_line_reader_whatever_the_text():
    text = f"{LINE_BREAKS_JSON_LEAVES_RAW} \x1c\x0b\x0c\r\n é ✓"
    payload = {"text": text, "meta_info": {"id": "r"}}
    assert _one_line_events(sse_event(payload)) == [payload]
    chunk = CompletionStreamResponse(
        id="cmpl-1", created=1700000000, model="m",
        choices=[CompletionChoice(index=0, text=text, logprobs=None, finish_reason=None)],
    )
    assert _one_line_events(sse_model(chunk)) == [chunk.model_dump()]
    framed = sse_data(json.dumps({"delta": text}, ensure_ascii=False), "response.output_text.delta")
    assert framed.decode().splitlines()[0] == "event: response.output_text.delta"
    assert _one_line_events(framed) == [{"delta": text}]
