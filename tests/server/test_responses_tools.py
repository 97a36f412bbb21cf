"""Function tools and reasoning through ``/v1/responses``, against a server with the Hermes
tool format (``--tool-call-parser hermes``), a template that renders tools and tool results,
and ``--reasoning-parser deepseek-r1`` (an unconstrained output is reasoning until ``</think>``,
so on random weights it all is).

- ``required`` / named ``tool_choice`` (a grammar and the chat route's parsers): ``function_call``
  items whose arguments follow the schema, plain and streamed;
- the round trip: the calls and a ``function_call_output`` sent back, as items or with
  ``previous_response_id``, make the same prompt as the chat messages with ``tool_calls`` and a
  ``tool`` message;
- reasoning becomes a ``reasoning`` item, streamed as ``response.reasoning_text`` events;
- ``--responses-store-size`` bounds the store.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.checkpoints import build_checkpoint
from tests.server.conftest import CONSTRAINED_FLAGS, assert_no_leak, start_server
from tests.server.test_responses_api import assert_sdk_shapes, flush_cache
from tests.server.tool_templates import HERMES_THINKING

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city.",
     "parameters": WEATHER},
    {"type": "function", "name": "ping", "description": "No arguments."},
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
              for t in TOOLS]
QUESTION = "What is the weather in Paris?"
STORE_SIZE = 3


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt-responses-hermes"), "llama",
                            chat_template=HERMES_THINKING, max_position_embeddings=2048)
    srv = start_server(path, *CONSTRAINED_FLAGS, "--tool-call-parser", "hermes",
                       "--reasoning-parser", "deepseek-r1",
                       "--responses-store-size", str(STORE_SIZE))
    yield srv
    srv.check_clean_stop()


@pytest.fixture
def oai(hermes):
    with openai.OpenAI(base_url=hermes.base_url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def assert_weather_call(item) -> None:
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.id.startswith("fc_") and item.call_id and item.status == "completed"
    jsonschema.validate(json.loads(item.arguments), WEATHER)


def test_required_tool_choice_calls_a_function(oai, hermes):
    r = oai.responses.create(model=hermes.model, input=QUESTION, tools=TOOLS,
                             tool_choice={"type": "function", "name": "get_weather"},
                             max_output_tokens=100, temperature=0)
    assert r.status == "completed" and r.tool_choice.name == "get_weather"
    [call] = r.output
    assert_weather_call(call)
    assert r.output_text == ""
    capped = oai.responses.create(model=hermes.model, input=QUESTION, tools=TOOLS,
                                  tool_choice="required", max_tool_calls=1,
                                  max_output_tokens=200, temperature=1.0,
                                  extra_body={"top_k": 8})
    assert [item.type for item in capped.output] == ["function_call"]
    assert capped.max_tool_calls == 1


def test_function_call_round_trip_matches_chat(oai, hermes):
    """The call and its result sent back (with previous_response_id, or as items) are the chat
    conversation with ``tool_calls`` and a ``tool`` message: token for token the same prompt
    (each request finds the previous one's whole prompt in the cache), the same answer."""
    first = oai.responses.create(model=hermes.model, input=QUESTION, tools=TOOLS,
                                 tool_choice="required", parallel_tool_calls=False,
                                 max_output_tokens=100, temperature=0)
    [call] = first.output
    assert call.type == "function_call"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    items = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result]
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]

    def as_items():
        return oai.responses.create(model=hermes.model, tools=TOOLS, max_output_tokens=8,
                                    temperature=0, input=items)

    def as_chat():
        return oai.chat.completions.create(model=hermes.model, tools=CHAT_TOOLS, max_tokens=8,
                                           temperature=0, messages=messages)

    chained = oai.responses.create(model=hermes.model, tools=TOOLS, max_output_tokens=8,
                                   temperature=0, input=[result],
                                   previous_response_id=first.id)
    assert chained.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    listed, chat = as_items(), as_chat()
    assert listed.usage.input_tokens == chat.usage.prompt_tokens == chained.usage.input_tokens
    assert listed.usage.input_tokens_details.cached_tokens >= listed.usage.input_tokens - 1
    assert chat.usage.prompt_tokens_details.cached_tokens >= chat.usage.prompt_tokens - 1
    flush_cache(hermes.base_url)
    listed = as_items()
    flush_cache(hermes.base_url)
    chat = as_chat()
    # deepseek-r1: the unconstrained answer is reasoning until </think>
    assert listed.output[0].type == "reasoning"
    assert listed.output[0].content[0].text == chat.choices[0].message.reasoning_content


def test_streamed_function_call(oai, hermes):
    kwargs = dict(model=hermes.model, input=QUESTION, tools=TOOLS,
                  tool_choice={"type": "function", "name": "get_weather"},
                  max_output_tokens=100, temperature=0)
    flush_cache(hermes.base_url)
    plain = oai.responses.create(**kwargs)
    flush_cache(hermes.base_url)
    with oai.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert events[2].item.name == "get_weather" and events[2].item.arguments == ""
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments == plain.output[0].arguments
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    [call] = final.output
    assert_weather_call(call)
    assert call.id == events[2].item.id and call.arguments == done.arguments


def test_reasoning_is_an_output_item(oai, hermes):
    kwargs = dict(model=hermes.model, input="Think about Oslo.", max_output_tokens=10,
                  temperature=0)
    flush_cache(hermes.base_url)
    plain = oai.responses.create(**kwargs)
    flush_cache(hermes.base_url)
    chat = oai.chat.completions.create(model=hermes.model, max_tokens=10, temperature=0,
                                       messages=[{"role": "user", "content": "Think about Oslo."}])
    [reasoning] = plain.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].text == chat.choices[0].message.reasoning_content
    assert plain.usage.output_tokens_details.reasoning_tokens > 0
    flush_cache(hermes.base_url)
    events = list(oai.responses.create(stream=True, **kwargs))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert "".join(deltas) == done.text == reasoning.content[0].text
    assert events[-1].type == "response.incomplete"
    assert [item.type for item in events[-1].response.output] == ["reasoning"]


def test_a_call_cut_short_is_incomplete_and_can_be_continued(oai, hermes):
    kwargs = dict(model=hermes.model, input=QUESTION, tools=TOOLS, max_output_tokens=5,
                  tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    flush_cache(hermes.base_url)
    cut = oai.responses.create(**kwargs)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[-1].status == "incomplete"
    flush_cache(hermes.base_url)
    events = list(oai.responses.create(stream=True, **kwargs))
    assert events[-1].type == "response.incomplete"
    streamed = events[-1].response
    assert streamed.output[-1].status == "incomplete"
    for call in (i for i in streamed.output if i.type == "function_call"):
        # streamed as a call before the limit cut it (the final parse of the whole text
        # finds no call in it: the plain response has its text as a message)
        assert call.status == "incomplete"
        with pytest.raises(json.JSONDecodeError):
            json.loads(call.arguments)
    follow = oai.responses.create(model=hermes.model, input="Go on.", max_output_tokens=4,
                                  tools=TOOLS, previous_response_id=streamed.id)
    assert follow.status == "incomplete"
    assert follow.usage.input_tokens_details.cached_tokens >= streamed.usage.input_tokens


def test_calls_and_reasoning_have_the_sdk_types_shapes(hermes):
    assert_sdk_shapes(hermes.base_url, {"input": QUESTION, "tools": TOOLS,
                                        "tool_choice": "required", "max_output_tokens": 100})
    assert_sdk_shapes(hermes.base_url, {"input": "Think.", "max_output_tokens": 6})


def test_the_store_keeps_the_newest(oai, hermes):
    ids = [oai.responses.create(model=hermes.model, input="Hi", max_output_tokens=1).id
           for _ in range(STORE_SIZE + 1)]
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(ids[0])
    assert [oai.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required", "tools": TOOLS, "text": {"format": {"type": "json_object"}}},
     "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": {"type": "file_search"}, "tools": TOOLS}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}],
      "tool_choice": "required"}, None),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_image", "image_url": "u"}]}]}, "input"),
])
def test_inconsistent_tool_requests_are_400s(hermes, body, param):
    with httpx.Client(base_url=hermes.base_url, timeout=60) as client:
        r = client.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 4,
                                               **body})
        assert r.status_code == 400, r.text
        if param is not None:
            assert r.json()["error"]["param"].startswith(param), r.json()
        assert_no_leak(client)
