"""Tool calling and reasoning output through the ``openai`` SDK against ``radixserve serve``.

Three test checkpoints whose chat templates render tools (``tool_templates.py``), one per call
format, each served with its ``--tool-call-parser``. On random weights:

- ``required`` and named ``tool_choice`` are enforced with a grammar: every call parses and its
  arguments validate against the function's schema, plain and streamed (the SDK's stream
  helper accumulates the deltas into the same message);
- ``auto`` parses what the model writes; the model is made to write fixed texts with an EBNF
  grammar of one string, so the whole path (detokenizer, parser, response, SSE deltas) runs on
  known text;
- reasoning (``--reasoning-parser qwen3``) and ``chat_template_kwargs`` likewise;
- a scripted agent loop: two tool rounds, then an answer.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.checkpoints import build_checkpoint
from tests.server.conftest import CONSTRAINED_FLAGS, assert_no_leak, start_server
from tests.server.tool_templates import HERMES_THINKING, LLAMA3_JSON, MISTRAL

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 8},
                       "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
PING = {"name": "ping", "description": "No arguments."}
FUNCTIONS = {f["name"]: f for f in (WEATHER, TIME, PING)}
TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS.values()]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def forced(text: str) -> dict:
    """``extra_body`` that makes the model write exactly ``text``."""
    return {"ebnf": f"root ::= {json.dumps(text)}"}


def assert_valid_call(call) -> None:
    assert call.type == "function" and call.id
    schema = FUNCTIONS[call.function.name].get("parameters", NO_ARGUMENTS)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def tokenize(server, text: str) -> list[int]:
    r = httpx.post(server.base_url + "/tokenize",
                   json={"prompt": text, "add_special_tokens": False}, timeout=60)
    return r.json()["tokens"]


def client_for(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def serve(tmp_path_factory, name, arch, template, special, *flags):
    """A server of a checkpoint with ``template``; tool definitions make long prompts, so these
    checkpoints take 2048 positions."""
    path = build_checkpoint(tmp_path_factory.mktemp(f"ckpt-tools-{name}"), arch,
                            chat_template=template, extra_special_tokens=special,
                            max_position_embeddings=2048)
    return start_server(path, *CONSTRAINED_FLAGS, "--tool-call-parser", name, *flags)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    srv = serve(tmp_path_factory, "hermes", "qwen3", HERMES_THINKING, (),
                "--reasoning-parser", "qwen3")
    yield srv
    srv.check_clean_stop()


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    srv = serve(tmp_path_factory, "llama3", "llama", LLAMA3_JSON, ("<|python_tag|>",))
    yield srv
    srv.check_clean_stop()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    srv = serve(tmp_path_factory, "mistral", "mistral", MISTRAL, ("[TOOL_CALLS]",))
    yield srv
    srv.check_clean_stop()


@pytest.fixture(params=["hermes", "llama3", "mistral"])
def any_server(request):
    return request.getfixturevalue(request.param)


# ---------------------------------------------------------------- enforced tool_choice
def test_required_calls_always_parse_and_validate(any_server):
    with client_for(any_server) as oai:
        r = oai.chat.completions.create(model=any_server.model, messages=MESSAGES, tools=TOOLS,
                                        tool_choice="required", n=4, temperature=1.0, seed=3,
                                        max_tokens=300)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert_valid_call(call)
    ids = [c.id for ch in r.choices for c in ch.message.tool_calls]
    assert len(set(ids)) == len(ids)


def test_named_tool_choice_calls_that_function_once(any_server):
    with client_for(any_server) as oai:
        r = oai.chat.completions.create(
            model=any_server.model, messages=MESSAGES, tools=TOOLS, n=3, seed=1,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=200,
        )
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        assert_valid_call(call)


def test_parallel_tool_calls_false_makes_one_call(hermes):
    with client_for(hermes) as oai:
        r = oai.chat.completions.create(model=hermes.model, messages=MESSAGES, tools=TOOLS,
                                        tool_choice="required", parallel_tool_calls=False,
                                        n=4, temperature=1.0, seed=7, max_tokens=200)
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert_valid_call(call)


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_weather"}}])
def test_enforced_calls_stream_into_the_same_message(hermes, tool_choice):
    kwargs = dict(model=hermes.model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                  temperature=0, max_tokens=300)
    with client_for(hermes) as oai:
        plain = oai.chat.completions.create(**kwargs).choices[0]
        with oai.chat.completions.stream(**kwargs) as stream:
            events = list(stream)
            streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == plain.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]
    # The call is named from its first delta on, and its argument deltas add up to the final
    # arguments. How many deltas there are depends on how fast this client reads (outputs that
    # wait for it are sent together): under load all of them came as one.
    pieces = [e for e in events
              if e.type == "tool_calls.function.arguments.delta" and e.index == 0]
    assert pieces and all(e.name == streamed.message.tool_calls[0].function.name for e in pieces)
    assert "".join(e.arguments_delta for e in pieces) == \
        streamed.message.tool_calls[0].function.arguments


def test_required_with_logprobs(mistral):
    with client_for(mistral) as oai:
        r = oai.chat.completions.create(model=mistral.model, messages=MESSAGES, tools=TOOLS,
                                        tool_choice="required", logprobs=True, top_logprobs=2,
                                        temperature=0, max_tokens=300)
    choice = r.choices[0]
    assert len(choice.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    text = "".join(t.token for t in choice.logprobs.content)
    assert all(f'"{c.function.name}"' in text for c in choice.message.tool_calls)


# ---------------------------------------------------------------- auto: fixed model texts
HERMES_TEXT = ('Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Oslo", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "ping", '
               '"arguments": {}}\n</tool_call>')
LLAMA3_TEXT = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "unit": '
               '"fahrenheit"}}; {"name": "get_time", "parameters": {"zone": "UTC"}}')
MISTRAL_TEXT = ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET", "hour": 9}}, '
                '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]')
AUTO_CASES = {
    "hermes": (HERMES_TEXT, "Checking both.",
               [("get_weather", '{"city": "Oslo", "unit": "celsius"}'), ("ping", "{}")]),
    "llama3": (LLAMA3_TEXT, None, [("get_weather", '{"city": "Lima", "unit": "fahrenheit"}'),
                                   ("get_time", '{"zone": "UTC"}')]),
    "mistral": (MISTRAL_TEXT, None, [("get_time", '{"zone": "CET", "hour": 9}'),
                                     ("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
}


@pytest.mark.parametrize("fmt", list(AUTO_CASES))
def test_auto_parses_the_model_format_plain_and_streamed(request, fmt):
    server = request.getfixturevalue(fmt)
    text, content, calls = AUTO_CASES[fmt]
    kwargs = dict(model=server.model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                  extra_body=forced(text))
    with client_for(server) as oai:
        plain = oai.chat.completions.create(**kwargs).choices[0]
        with oai.chat.completions.stream(**kwargs) as stream:
            for _ in stream:
                pass
            streamed = stream.get_final_completion().choices[0]
    for choice in (plain, streamed):
        assert choice.finish_reason == "tool_calls"
        assert (choice.message.content or None) == content
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] \
            == calls
        for call in choice.message.tool_calls:
            assert_valid_call(call)
    if fmt == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in plain.message.tool_calls)


@pytest.mark.parametrize(
    "text",
    ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo",}}\n</tool_call>',
     'I would call <tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>',
     "Plain answer, no tools."],
)
def test_auto_leaves_broken_or_unknown_calls_as_text(hermes, text):
    with client_for(hermes) as oai:
        r = oai.chat.completions.create(model=hermes.model, messages=MESSAGES, tools=TOOLS,
                                        tool_choice="auto", max_tokens=200,
                                        extra_body=forced(text))
    choice = r.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (text, None)
    assert choice.finish_reason == "stop"


def test_special_token_markers_are_kept_for_the_parser(llama3):
    """<|python_tag|> is a special token: written by the model as that one token, it is
    dropped from the text of a request without tools, and kept when the parser needs it (after
    some words, only the tag tells a call from text)."""
    (tag,) = tokenize(llama3, "<|python_tag|>")
    call = '{"name": "ping", "parameters": {}}'
    kwargs = dict(model=llama3.model, messages=MESSAGES, temperature=0, logit_bias={str(tag): 100})
    with client_for(llama3) as oai:
        without = oai.chat.completions.create(max_tokens=1, **kwargs)
        with_tools = oai.chat.completions.create(
            tools=TOOLS, max_tokens=200,
            extra_body={"regex": _escape("Calling: ") + "<\\|python_tag\\|>" + _escape(call)},
            **kwargs,
        )
    assert without.choices[0].message.content == "" and without.usage.completion_tokens == 1
    message = with_tools.choices[0].message
    assert message.content == "Calling:"
    (parsed,) = message.tool_calls
    assert (parsed.function.name, parsed.function.arguments) == ("ping", "{}")


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in "{}[]()|.*+?^$\\" else ch for ch in text)


def test_n_choices_with_tools_and_response_format(hermes):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with client_for(hermes) as oai:
        r = oai.chat.completions.create(
            model=hermes.model, messages=MESSAGES, tools=TOOLS, n=3, seed=2, temperature=1.0,
            max_tokens=100,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    for choice in r.choices:
        assert choice.message.tool_calls is None and choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


# ---------------------------------------------------------------- reasoning
THINKING = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."


def test_reasoning_is_separated_plain_and_streamed(hermes):
    kwargs = dict(model=hermes.model, messages=MESSAGES, max_tokens=100,
                  extra_body=forced(THINKING))
    with client_for(hermes) as oai:
        plain = oai.chat.completions.create(**kwargs).choices[0].message
        reasoning = content = ""
        for chunk in oai.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
        inline = oai.chat.completions.create(
            **{**kwargs, "extra_body": {**forced(THINKING), "separate_reasoning": False}}
        ).choices[0].message
    assert (plain.reasoning_content, plain.content) == ("The user wants weather.", "It is sunny.")
    assert (reasoning, content) == ("The user wants weather.", "It is sunny.")
    assert inline.content == THINKING and getattr(inline, "reasoning_content", None) is None


def test_reasoning_then_tool_call(hermes):
    text = "<think>\nI need the tool.\n</think>\n\n" + HERMES_TEXT
    with client_for(hermes) as oai:
        r = oai.chat.completions.create(model=hermes.model, messages=MESSAGES, tools=TOOLS,
                                        max_tokens=200, extra_body=forced(text))
    message = r.choices[0].message
    assert message.reasoning_content == "I need the tool."
    assert message.content == "Checking both."
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "ping"]


def test_chat_template_kwargs_reach_the_template(hermes):
    """enable_thinking false makes the template close an empty think block in the prompt."""
    with client_for(hermes) as oai:
        def prompt_tokens(**extra):
            return oai.chat.completions.create(model=hermes.model, messages=MESSAGES,
                                               max_tokens=1, extra_body=extra).usage.prompt_tokens

        thinking = prompt_tokens()
        not_thinking = prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    block = tokenize(hermes, "<think>\n\n</think>\n\n")
    assert not_thinking == thinking + len(block)


# ---------------------------------------------------------------- conversation rendering
def history(call_id: str) -> list[dict]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"},
    ]


@pytest.mark.parametrize(
    ("fmt", "call_id", "expected"),
    [
        ("hermes", "call_1",
         "<|system|>Be brief.\n\n# Tools\n<tools>\n"
         + "".join(json.dumps(t) + "\n" for t in TOOLS)
         + '</tools>\nCall a function with <tool_call>\n{"name": <name>, "arguments": <args>}\n'
         "</tool_call><|eos|><|user|>Weather in Oslo?<|eos|><|assistant|><tool_call>\n"
         '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
         "</tool_call><|eos|><|user|><tool_response>\nsunny, 21 C\n</tool_response><|eos|>"
         "<|assistant|>"),
        ("llama3", "call_1",
         '<|bos|><|system|>Answer with a JSON function call {"name": function name, '
         '"parameters": its arguments}, or in words.\n'
         + "".join(json.dumps(t) + "\n" for t in TOOLS)
         + "<|eos|><|system|>Be brief.<|eos|><|user|>Weather in Oslo?<|eos|><|assistant|>"
         '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": '
         '"celsius"}}<|eos|><|tool|>sunny, 21 C<|eos|><|assistant|>'),
        ("mistral", "a1B2c3D4e",
         "<|bos|>Be brief.\n\n[AVAILABLE_TOOLS]" + json.dumps(TOOLS) + "[/AVAILABLE_TOOLS]"
         '[INST]Weather in Oslo?[/INST][TOOL_CALLS][{"name": "get_weather", "arguments": '
         '{"city": "Oslo", "unit": "celsius"}, "id": "a1B2c3D4e"}]<|eos|>[TOOL_RESULTS]'
         '{"content": "sunny, 21 C", "call_id": "a1B2c3D4e"}[/TOOL_RESULTS]'),
    ],
)
def test_tool_results_render_through_the_template(request, fmt, call_id, expected):
    server = request.getfixturevalue(fmt)
    with client_for(server) as oai:
        r = oai.chat.completions.create(model=server.model, messages=history(call_id),
                                        tools=TOOLS, max_tokens=1, tool_choice="none")
    assert r.usage.prompt_tokens == len(tokenize(server, expected))


# ---------------------------------------------------------------- an agent loop
def get_weather(city: str, unit: str) -> dict:
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "sky": "clear"}


def get_time(zone: str, hour: int = 12) -> dict:
    return {"zone": zone, "time": f"{hour:02d}:00"}


def ping() -> str:
    return "pong"


IMPLEMENTATIONS = {"get_weather": get_weather, "get_time": get_time, "ping": ping}


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_scripted_agent_loop_two_tool_rounds_then_an_answer(request, fmt):
    """What an agent framework does: call, run the tools, send their results back, twice; then
    the answer. Each round's prompt carries the previous rounds (the tool results included)."""
    server = request.getfixturevalue(fmt)
    messages: list[dict] = [{"role": "system", "content": "You plan trips."},
                            {"role": "user", "content": "Should I fly to Oslo today?"}]
    rounds = [{"type": "function", "function": {"name": "get_weather"}}, "required", "none"]
    prompt_tokens = []
    with client_for(server) as oai:
        for tool_choice in rounds:
            r = oai.chat.completions.create(model=server.model, messages=messages, tools=TOOLS,
                                            tool_choice=tool_choice, temperature=0,
                                            max_tokens=200)
            prompt_tokens.append(r.usage.prompt_tokens)
            message = r.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            results = []
            for call in message.tool_calls or []:
                assert_valid_call(call)
                result = IMPLEMENTATIONS[call.function.name](**json.loads(call.function.arguments))
                results.append(json.dumps(result))
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": results[-1]})
            if tool_choice != "none":
                assert r.choices[0].finish_reason == "tool_calls" and results
                added = sum(len(tokenize(server, text)) for text in results)
    answer = r.choices[0]
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)
    assert answer.finish_reason in ("stop", "length")
    assert prompt_tokens[0] < prompt_tokens[1] < prompt_tokens[2]
    assert prompt_tokens[2] - prompt_tokens[1] > added  # the last results, and the call itself
    assert_no_leak(httpx.Client(base_url=server.base_url, timeout=60))
