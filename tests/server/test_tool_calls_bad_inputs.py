"""Tool-calling and reasoning fields that cannot be honoured are a 400 naming the field, on
the shared server (no --tool-call-parser, no --reasoning-parser); enforced tool_choice works
there anyway (a grammar needs no parser)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import assert_no_leak

FUNCTION = {"name": "get_time", "parameters": {
    "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": FUNCTION}]
MESSAGES = [{"role": "user", "content": "What time is it?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time",
                                                        "arguments": '{"hour": 3}'}}


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": TOOLS}, "tool_choice", "--tool-call-parser"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are specified"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls", "only allowed when tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "'nope', which is not among the tools"),
        ({"tools": TOOLS * 2, "tool_choice": "required"}, "tools", "get_time more than once"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "cannot be combined with response_format"),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "tool_choice",
         "cannot be combined with regex"),
        ({"tools": [{"type": "function", "function": {"name": "two words"}}]},
         "tools.0.function.name", "should match pattern"),
        ({"tools": [{"type": "retrieval", "function": FUNCTION}]}, "tools.0.type", "'function'"),
        ({"tools": [{"type": "function", "function": {**FUNCTION, "returns": {}}}]},
         "tools.0.function.returns", "unknown parameter"),
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice",
         None),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}],
          "tool_choice": "required"}, None, "'not'"),
        ({"functions": [FUNCTION]}, "functions", "use tools and tool_choice"),
        ({"messages": [{"role": "tool", "content": "3"}]}, "messages.0", "needs tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages.0",
         "only allowed on assistant messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {**CALL, "function": {"name": "get_time", "arguments": "{hour: 3"}}]}]},
         "messages.0", "arguments are not valid JSON"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role", None),
    ],
)
def test_tool_fields_that_cannot_be_honoured_are_400_naming_them(client, body, param, message):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if message is not None:
        assert message in error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("field", ["tools", "tool_choice", "parallel_tool_calls"])
def test_tools_on_text_completions_are_400(client, field):
    value = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": True}[field]
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert "only supported on /v1/chat/completions" in r.json()["error"]["message"]


def test_enforced_tool_choice_needs_no_parser_and_the_server_keeps_serving(server, client):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0) as oai:
        r = oai.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS,
                                        tool_choice="required", max_tokens=200, n=2, seed=4,
                                        temperature=1.0)
        none = oai.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="none", max_tokens=4,
                                           extra_body={"ignore_eos": True})
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), FUNCTION["parameters"])
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason == "length"
    assert_no_leak(client)
