"""The Responses API (``/v1/responses``) through the ``openai`` SDK against ``radixserve serve``.

On the shared tiny-Llama server: a plain response is the chat route's greedy generation in
another shape; streaming (``responses.stream`` and ``create(stream=True)``) delivers the same
output as numbered events; ``text.format`` constrains it; ``previous_response_id`` continues a
stored conversation whose whole previous turn the radix cache serves; ``max_output_tokens``
makes it ``incomplete``; stored responses are retrieved and deleted; bad ids and bad bodies are
400s (404 for an unknown stored id) and leak nothing.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from tests.server.conftest import assert_no_leak

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CITY_FORMAT = {"format": {"type": "json_schema", "name": "trip", "schema": CITY, "strict": True}}


class Trip(BaseModel):
    """``CITY`` as a model (the SDK derives the schema it sends from it)."""

    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=9)


def flush_cache(base_url: str) -> None:
    """Empty the radix cache, so that the next request computes its whole prompt: two greedy
    generations compared token for token must run the same kernels on the same inputs (a
    cached prefix changes the order of floating-point sums, and random weights have near
    ties)."""
    r = httpx.post(base_url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text


def same_prompt_as_chat(oai, server, response, messages: list[dict]):
    """Asserts that ``response``'s prompt was exactly the chat messages' (the chat request that
    follows it finds the whole prompt in the cache); returns the chat completion of those
    messages computed from an empty cache, to compare outputs with."""
    kwargs = dict(model=server.model, messages=messages,
                  max_tokens=response.max_output_tokens, temperature=0)
    chat = oai.chat.completions.create(**kwargs)
    assert chat.usage.prompt_tokens == response.usage.input_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens >= chat.usage.prompt_tokens - 1
    flush_cache(server.base_url)
    return oai.chat.completions.create(**kwargs)


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def test_plain_response_is_the_chat_generation(oai, server):
    flush_cache(server.base_url)
    r = oai.responses.create(model=server.model, input="Tell me about Paris.",
                             instructions="Be brief.", max_output_tokens=12, temperature=0)
    chat = same_prompt_as_chat(oai, server, r, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me about Paris."}])
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.model == server.model and r.instructions == "Be brief."
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    expected = "completed" if chat.choices[0].finish_reason == "stop" else "incomplete"
    assert r.status == expected and message.status == expected


def test_max_output_tokens_makes_it_incomplete(oai, server):
    flush_cache(server.base_url)
    r = oai.responses.create(model=server.model, input="Count to a hundred.",
                             max_output_tokens=3, temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    flush_cache(server.base_url)
    events = list(oai.responses.create(model=server.model, input="Count to a hundred.",
                                       max_output_tokens=3, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == r.output_text


def test_structured_output_follows_the_schema(oai, server):
    r = oai.responses.create(model=server.model, input="Plan a trip.", text=CITY_FORMAT,
                             max_output_tokens=64, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema" and r.text.format.name == "trip"
    parsed = oai.responses.parse(model=server.model, input="Plan a trip.", text_format=Trip,
                                 max_output_tokens=64, temperature=0)
    assert isinstance(parsed.output_parsed, Trip)
    obj = oai.responses.create(model=server.model, input="Any JSON object.",
                               text={"format": {"type": "json_object"}}, max_output_tokens=64,
                               temperature=0.8)
    assert obj.output_text.startswith("{")  # random weights may wander inside the object
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_streams_deliver_the_plain_output(oai, server):
    kwargs = dict(model=server.model, input="Plan a trip.", max_output_tokens=64, temperature=0)
    flush_cache(server.base_url)
    plain = oai.responses.create(text=CITY_FORMAT, **kwargs)
    flush_cache(server.base_url)
    with oai.responses.stream(text_format=Trip, **kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == plain.output_text
    assert final.output_parsed == Trip.model_validate_json(plain.output_text)
    assert final.usage.output_tokens == plain.usage.output_tokens

    flush_cache(server.base_url)
    events = list(oai.responses.create(text=CITY_FORMAT, stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    created, done = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == []
    assert done.id == created.id and done.status == "completed"
    item_id = events[2].item.id
    assert done.output[0].id == item_id
    assert all(e.item_id == item_id for e in events if e.type.startswith("response.output_text"))
    assert next(e for e in events if e.type == "response.output_text.done").text \
        == done.output_text == plain.output_text
    assert done.usage.input_tokens == plain.usage.input_tokens
    assert oai.responses.retrieve(done.id).output_text == plain.output_text


def test_previous_response_id_continues_from_the_cache(oai, server):
    """Three turns: each prompt starts with the whole previous turn (its prompt and its
    output), which the radix cache serves (the last output token was never run, so it is not
    cached)."""
    turns = []
    previous = None
    for question in ("Where is Paris?", "And Oslo?", "And Lima?"):
        r = oai.responses.create(model=server.model, input=question, instructions="Be brief.",
                                 previous_response_id=previous, max_output_tokens=6,
                                 temperature=0)
        assert r.previous_response_id == previous
        turns.append(r)
        previous = r.id
    for before, after in zip(turns, turns[1:], strict=False):
        whole_turn = before.usage.input_tokens + before.usage.output_tokens
        assert after.usage.input_tokens > whole_turn
        assert after.usage.input_tokens_details.cached_tokens >= whole_turn - 1
    stored = oai.responses.retrieve(turns[-1].id)
    assert stored.output_text == turns[-1].output_text
    assert stored.usage.input_tokens_details.cached_tokens \
        == turns[-1].usage.input_tokens_details.cached_tokens


def test_unstored_and_deleted_responses_cannot_be_continued(oai, server):
    kwargs = dict(model=server.model, max_output_tokens=2)
    unstored = oai.responses.create(input="Hi", store=False, **kwargs)
    stored = oai.responses.create(input="Hi", **kwargs)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    for gone in (unstored.id, "resp_" + "0" * 32):
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(input="Go on", previous_response_id=gone, **kwargs)
        assert e.value.body["param"] == "previous_response_id"
    oai.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(stored.id)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(input="Go on", previous_response_id=stored.id, **kwargs)


def test_get_and_delete_return_openai_shapes(client, server):
    r = client.post("/v1/responses", json={"model": server.model, "input": "Hi",
                                           "max_output_tokens": 2, "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["metadata"] == {"k": "v"} and body["store"] is True
    assert client.get(f"/v1/responses/{body['id']}").json() == body
    deleted = client.delete(f"/v1/responses/{body['id']}")
    assert deleted.json() == {"id": body["id"], "object": "response", "deleted": True}
    for path, status in ((f"/v1/responses/{body['id']}", 404), ("/v1/responses/nope", 400),
                         ("/v1/responses/resp_x.y", 400), ("/v1/responses/resp_" + "a" * 65, 400),
                         ("/v1/responses/resp_" + "a" * 48, 404)):
        for method in ("GET", "DELETE"):
            bad = client.request(method, path)
            assert bad.status_code == status, (method, path, bad.text)
            assert bad.json()["error"]["param"] == "response_id"


def test_input_items_render_like_chat_messages(oai, server):
    """A list of items (text parts, an assistant's output as a response returned it) is the
    same conversation as the chat messages."""
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Where is "},
                     {"type": "input_text", "text": "Paris?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "In France.", "annotations": []}]},
        {"role": "user", "content": "And Oslo?"},
    ]
    flush_cache(server.base_url)
    r = oai.responses.create(model=server.model, input=items, max_output_tokens=8,
                             temperature=0)
    chat = same_prompt_as_chat(oai, server, r, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is Paris?"},
        {"role": "assistant", "content": "In France."},
        {"role": "user", "content": "And Oslo?"}])
    assert r.output_text == chat.choices[0].message.content


def test_truncation_auto_drops_the_oldest_messages(client, oai, server):
    long = " ".join(["word"] * 150)  # about 450 tokens: two fit in the context, three not
    items = [{"role": "user", "content": long}, {"role": "assistant", "content": long},
             {"role": "user", "content": long}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "Short question?"}]
    body = {"model": server.model, "input": items, "max_output_tokens": 4}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    r = client.post("/v1/responses", json={**body, "truncation": "auto"})
    assert r.status_code == 200, r.text
    assert r.json()["truncation"] == "auto"
    # one message dropped, then the assistant's: the conversation starts with the user
    kept = oai.chat.completions.create(model=server.model, messages=items[2:], max_tokens=1)
    assert r.json()["usage"]["input_tokens"] == kept.usage.prompt_tokens


def test_truncation_auto_keeps_as_much_as_fits(client, oai, server):
    turn = " ".join(["word"] * 30)
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i} {turn}"}
             for i in range(61)]
    r = client.post("/v1/responses", json={"model": server.model, "input": items,
                                           "max_output_tokens": 4, "truncation": "auto"})
    assert r.status_code == 200, r.text
    pair = [oai.chat.completions.create(model=server.model, messages=items[:n], max_tokens=1)
            .usage.prompt_tokens for n in (1, 3)]
    used = r.json()["usage"]["input_tokens"] + 4
    assert 1024 - (pair[1] - pair[0]) < used <= 1024


BAD_BODIES = [
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "text", "schema": {}}}}, "text.format"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, None),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "previous_response_id": "chatcmpl-1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": "x", "model": "other-model"}, "model"),
    ({"input": "word " * 2000}, None),
    ({"input": "x", "stream": True, "temperature": -1}, None),
    ({"input": "x", "stream": True, "text": {"format": {"type": "json_schema",
                                                         "schema": {"type": "nonsense"}}}},
     None),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES, ids=[str(p) for _, p in BAD_BODIES])
def test_bad_bodies_are_openai_errors(client, body, param):
    r = client.post("/v1/responses", json={"max_output_tokens": 4, **body})
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] and error["param"].startswith(param), error
    assert client.post("/v1/responses", json={"input": "x", "max_output_tokens": 2}) \
        .status_code == 200


def test_bad_requests_leak_nothing(client):
    assert_no_leak(client)


def stream_lines(base_url: str, body: dict) -> list[str]:
    with httpx.stream("POST", base_url + "/v1/responses", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def assert_sdk_shapes(base_url: str, body: dict) -> None:
    """The response and every streamed event validate against ``openai.types.responses``
    (the SDK itself builds them without validation, so a missing field would pass unseen)."""
    r = httpx.post(base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    adapter = TypeAdapter(ResponseStreamEvent)
    for line in stream_lines(base_url, body):
        if line.startswith("data: "):
            adapter.validate_python(json.loads(line.removeprefix("data: ")))


def test_objects_have_the_sdk_types_shapes(server):
    assert_sdk_shapes(server.base_url, {"input": "Hi", "max_output_tokens": 4})
    assert_sdk_shapes(server.base_url, {"input": "Plan a trip.", "text": CITY_FORMAT,
                                        "instructions": "Be brief.", "max_output_tokens": 64,
                                        "metadata": {"k": "v"}})


def test_raw_stream_is_numbered_sse_without_done(server):
    body = {"model": server.model, "input": "Hi", "max_output_tokens": 3}
    lines = stream_lines(server.base_url, body)
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines
            if line.startswith("data: ")]
    assert [d["type"] for d in data] == events
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert events[0] == "response.created" and events[-1] == "response.incomplete"


def test_a_stream_closed_early_leaks_nothing(client, server):
    body = {"model": server.model, "input": "Count to a hundred.", "stream": True,
            "max_output_tokens": 400, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        first = [json.loads(next(lines).removeprefix("data: ")) for _ in range(3)]
    assert [e["type"] for e in first][:2] == ["response.created", "response.in_progress"]
    assert_no_leak(client)
    assert client.post("/v1/responses", json={"input": "x", "max_output_tokens": 2}) \
        .status_code == 200
