"""Tool-call parsers on fixed model texts, for every format: complete calls, several calls, text
around calls, broken JSON (stays text), unknown functions (stay text); and streams, cut at every
character and at random places, that add up to exactly the final parse."""

from __future__ import annotations

import json
import random

import pytest
from jsonschema import Draft202012Validator

from radixserve.server.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    ToolCall,
    create_tool_parser,
)
from radixserve.server.openai.tool_parsers.enforced import (
    NamedCallFormat,
    RequiredCallsFormat,
    required_schema,
)

TOOLS = ["get_weather", "get_time"]
WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"where": {"city": "Oslo", "tags": ["a}", "\\"b"]}, "n": 3}'


def hermes_block(name, args, key="arguments"):
    return f'<tool_call>\n{{"name": "{name}", "{key}": {args}}}\n</tool_call>'


# (parser, text, expected content, expected calls)
CASES = [
    # Hermes / Qwen
    ("hermes", hermes_block("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    ("hermes", "Let me check.\n\n" + hermes_block("get_weather", WEATHER) + "\n"
     + hermes_block("get_time", "{}"), "Let me check.",
     [("get_weather", WEATHER), ("get_time", "{}")]),
    ("hermes", hermes_block("get_time", NESTED) + "\nDone.", "Done.", [("get_time", NESTED)]),
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.",
     []),
    ("hermes", 'A <tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
     'A <tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>', []),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    ("hermes", 'x <tool_call>{"name": "get_time", "arguments": {"a": 1', 'x <tool_call>'
     '{"name": "get_time", "arguments": {"a": 1', []),
    ("hermes", hermes_block("get_time", "{}").replace("\n</tool_call>", ""), "",
     [("get_time", "{}")]),
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', "", [("get_time", "{}")]),
    ("hermes", hermes_block("get_time", '"now"'), hermes_block("get_time", '"now"'), []),
    ("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "get_time"}</tool_call>', "",
     [("get_time", '{"x": 1}')]),
    # Llama 3.x JSON
    ("llama3", '{"name": "get_weather", "parameters": ' + WEATHER + "}", "",
     [("get_weather", WEATHER)]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": ' + WEATHER
     + '}; {"name": "get_time", "parameters": {}}', "",
     [("get_weather", WEATHER), ("get_time", "{}")]),
    ("llama3", 'I will call it. <|python_tag|>{"name": "get_time", "arguments": ' + NESTED + "}",
     "I will call it.", [("get_time", NESTED)]),
    ("llama3", '{"name": "get_time", "parameters": {}} and then some words', "and then some words",
     [("get_time", "{}")]),
    ("llama3", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("llama3", '{"name": "Bob", "parameters": {}}', '{"name": "Bob", "parameters": {}}', []),
    ("llama3", '{"name": "get_time", "parameters": {"a": tru}}',
     '{"name": "get_time", "parameters": {"a": tru}}', []),
    ("llama3", "The answer is 42.", "The answer is 42.", []),
    # Mistral
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER + "}]", "",
     [("get_weather", WEATHER)]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": ' + WEATHER
     + '}, {"name": "get_time", "arguments": ' + NESTED + "}]", "Sure.",
     [("get_weather", WEATHER), ("get_time", NESTED)]),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]" + WEATHER + "[TOOL_CALLS]get_time[ARGS]{}", "",
     [("get_weather", WEATHER), ("get_time", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"x": [1, 2}}]',
     '[TOOL_CALLS][{"name": "get_time", "arguments": {"x": [1, 2}}]', []),
    ("mistral", "[TOOL_CALLS]launch[ARGS]{}", "[TOOL_CALLS]launch[ARGS]{}", []),
    ("mistral", "Arrays like [1, 2] and [TOOL_ are text.",
     "Arrays like [1, 2] and [TOOL_ are text.", []),
]


def stream(parser, pieces):
    content, calls, ids = "", {}, {}
    for k, piece in enumerate(pieces):
        delta = parser.parse_streaming(piece, k == len(pieces) - 1)
        content += delta.content
        for c in delta.calls:
            if c.name is not None:
                assert c.index == len(calls) and c.id, "a call's first delta names it"
                calls[c.index], ids[c.index] = [c.name, ""], c.id
            else:
                assert c.id is None
            calls[c.index][1] += c.arguments
    return content, [ToolCall(n, a) for n, a in calls.values()]


def cuts(text, seed):
    rng = random.Random(seed)
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_final_parse_of_fixed_texts(name, text, content, calls):
    result = create_tool_parser(name, TOOLS).parse_final(text)
    assert result.content == content
    assert result.calls == [ToolCall(n, a) for n, a in calls]
    for call in result.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streams_add_up_to_the_final_parse(name, text, content, calls):
    """Where the JSON breaks after the name went out, the stream cannot take the call back: it
    stops its arguments where the JSON broke, and the content is the final parse's."""
    expected = create_tool_parser(name, TOOLS).parse_final(text)
    broken_after_name = not calls and any(f'"{t}", "' in text for t in TOOLS)
    splits = [list(text), [text], *(cuts(text, seed) for seed in range(20))]
    for pieces in splits:
        content, streamed = stream(create_tool_parser(name, TOOLS), pieces)
        assert content == expected.content, pieces
        if broken_after_name:
            assert len(streamed) <= 1
            for call in streamed:
                assert call.arguments in text and "</" not in call.arguments
        else:
            assert streamed == expected.calls, pieces


def test_a_stream_sends_the_name_before_the_arguments_are_complete():
    parser = create_tool_parser("hermes", TOOLS)
    first = parser.parse_streaming('Hi <tool_call>{"name": "get_weather", "arguments": {"ci',
                                   False)
    assert first.content == "Hi"
    (call,) = first.calls
    assert (call.index, call.name, call.arguments) == (0, "get_weather", '{"ci')
    second = parser.parse_streaming('ty": "Rome"}}</tool_call>', True)
    assert [(c.index, c.name, c.arguments) for c in second.calls] == [(0, None, 'ty": "Rome"}')]


def test_text_that_may_open_a_call_is_held_back_until_it_is_known():
    parser = create_tool_parser("hermes", TOOLS)
    assert parser.parse_streaming("Use <tool_", False).content == "Use"
    assert parser.parse_streaming("kit> please", True).content == " <tool_kit> please"


def test_detect():
    assert create_tool_parser("hermes", TOOLS).detect("a <tool_call>")
    assert not create_tool_parser("hermes", TOOLS).detect("plain")
    assert create_tool_parser("llama3", TOOLS).detect(' {"name"')
    assert create_tool_parser("mistral", TOOLS).detect("x[TOOL_CALLS]")


def test_ids_are_unique_and_mistral_ids_have_its_shape():
    ids = {create_tool_parser("hermes", TOOLS).new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("call_") for i in ids)
    mistral = create_tool_parser("mistral", TOOLS).new_call_id()
    assert len(mistral) == 9 and mistral.isalnum()


def test_every_registered_parser_builds():
    for name in TOOL_CALL_PARSERS:
        assert create_tool_parser(name, TOOLS).markers
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'"):
        create_tool_parser("xml", TOOLS)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": '
         + WEATHER + "}]", "", [("get_time", "{}"), ("get_weather", WEATHER)]),
        ('[{"name": "get_time", "parameters": {"a": 1}}, {"name": "get_weather", "param',
         ', {"name": "get_weather", "param', [("get_time", '{"a": 1}')]),
        ('[{"name": "get_time", "para', '[{"name": "get_time", "para', []),
    ],
)
def test_required_output_parses_and_a_cut_keeps_finished_calls(text, content, calls):
    expected = [ToolCall(n, a) for n, a in calls]
    result = RequiredCallsFormat(TOOLS).parse_final(text)
    assert (result.content, result.calls) == (content, expected)
    for seed in range(10):
        # A stream cut short may have sent the name of the call it was writing.
        streamed_content, streamed = stream(RequiredCallsFormat(TOOLS), cuts(text, seed))
        assert streamed_content == content and streamed[:len(expected)] == expected
        assert all(c.arguments in text for c in streamed[len(expected):])


def test_named_output_is_the_arguments():
    assert NamedCallFormat("get_time").parse_final(NESTED).calls == [ToolCall("get_time", NESTED)]
    assert stream(NamedCallFormat("get_time"), list(NESTED)) == ("", [ToolCall("get_time",
                                                                               NESTED)])
    cut = NamedCallFormat("get_time").parse_final('{"where": {"ci')
    assert cut.calls == [] and cut.content == '{"where": {"ci'


def test_required_schema_lifts_definitions_and_refuses_clashes():
    ref = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
           "$defs": {"P": {"type": "integer"}}}
    schema = required_schema([{"name": "a", "parameters": ref},
                              {"name": "b", "parameters": ref}, {"name": "c"}], parallel=False)
    assert schema["$defs"] == {"P": {"type": "integer"}} and schema["maxItems"] == 1
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    clash = {**ref, "$defs": {"P": {"type": "string"}}}
    with pytest.raises(ValueError, match=r"\$defs/P differently"):
        required_schema([{"name": "a", "parameters": ref}, {"name": "b", "parameters": clash}],
                        parallel=True)


RECURSIVE = {"type": "object",
             "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
             "required": ["child"], "additionalProperties": False}
SIBLING = {"type": "object", "properties": {"a": {"$ref": "#/properties/b"},
                                            "b": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("parameters", "good", "bad"), [
    (RECURSIVE, {"child": {"child": None}},
     {"child": [{"name": "f", "parameters": {"child": None}}]}),  # '#' read as the array
    (SIBLING, {"a": 3}, {"a": "x"}),
])
def test_required_schema_keeps_refs_into_the_parameters_pointing_there(parameters, good, bad):
    """A ``$ref`` to ``#`` or ``#/properties/...`` means the function's parameters: nested in
    the array, they move to the root's ``$defs`` with those refs rewritten."""
    schema = required_schema([{"name": "f", "parameters": parameters}], parallel=True)
    assert schema["$defs"]["parameters_of_f"]["properties"] != parameters["properties"]
    validator = Draft202012Validator(schema)
    assert validator.is_valid([{"name": "f", "parameters": good}])
    assert not validator.is_valid([{"name": "f", "parameters": bad}])
