"""Structured outputs over HTTP: OpenAI ``response_format`` (SDK and plain JSON), SGLang's
``json_schema`` / ``regex`` / ``ebnf`` fields, and the 400s of grammars that cannot be used."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.constrained.schemas import EBNF, EBNF_LANGUAGE, assert_valid
from tests.server.conftest import assert_no_leak, parse_sse

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 10_000_000},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def response_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_with_the_openai_sdk(oai, server, temperature):
    r = oai.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, n=3, seed=5,
        temperature=temperature, response_format=response_format(),
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        assert_valid(choice.message.content, SCHEMA)


def test_chat_json_schema_streamed_equals_non_streamed(oai, server):
    kwargs = dict(model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                  response_format=response_format())
    full = oai.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in oai.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == full
    assert_valid(streamed, SCHEMA)


def test_json_object_mode_gives_an_object_on_chat_and_completions(oai, server, client):
    """Any JSON object is unbounded, so a random model would not close one by itself: a huge
    bias on "}" makes it close as soon as the grammar allows, and keeps it from starting there
    (unconstrained, "}" would be the whole first token)."""
    (brace,) = client.post("/tokenize", json={"prompt": "}"}).json()["tokens"]
    bias = {str(brace): 100}
    chat = oai.chat.completions.create(model=server.model, messages=MESSAGES,
                                       max_tokens=MAX_TOKENS, temperature=0, logit_bias=bias,
                                       response_format={"type": "json_object"})
    completion = oai.completions.create(model=server.model, prompt="JSON:", temperature=0,
                                        max_tokens=MAX_TOKENS, logit_bias=bias,
                                        extra_body={"response_format": {"type": "json_object"}})
    unconstrained = oai.completions.create(model=server.model, prompt="JSON:", temperature=0,
                                           max_tokens=1, logit_bias=bias)
    assert unconstrained.choices[0].text == "}"
    for text, reason in ((chat.choices[0].message.content, chat.choices[0].finish_reason),
                         (completion.choices[0].text, completion.choices[0].finish_reason)):
        assert reason == "stop" and json.loads(text) == {}


def test_text_format_is_unconstrained(oai, server):
    kwargs = dict(model=server.model, messages=MESSAGES, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    plain = oai.chat.completions.create(**kwargs).choices[0].message.content
    text = oai.chat.completions.create(response_format={"type": "text"}, **kwargs)
    assert text.choices[0].message.content == plain


def test_completions_take_sglang_regex_ebnf_and_json_schema(oai, server):
    def complete(**extra):
        return oai.completions.create(model=server.model, prompt="Answer:", max_tokens=64,
                                      temperature=1.0, seed=1, n=2, extra_body=extra).choices

    for choice in complete(regex=r"[0-9]{2,6}"):
        assert re.fullmatch(r"[0-9]{2,6}", choice.text) and choice.finish_reason == "stop"
    for choice in complete(ebnf=EBNF):
        assert EBNF_LANGUAGE.fullmatch(choice.text)
    for choice in complete(json_schema=json.dumps({"type": "integer", "minimum": 3,
                                                   "maximum": 9})):
        assert 3 <= json.loads(choice.text) <= 9


def test_structural_tag_response_format(client):
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<n>", "end": "</n>",
        "content": {"type": "json_schema", "json_schema": {"type": "integer", "minimum": 0,
                                                           "maximum": 99}}}}
    r = client.post("/v1/completions", json={"prompt": "Tag:", "max_tokens": 32, "n": 2,
                                             "temperature": 1.0, "response_format": tag})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        match = re.fullmatch(r"<n>\s*([0-9]+)\s*</n>", choice["text"])
        assert match and 0 <= int(match.group(1)) <= 99, choice["text"]


def test_native_generate_json_schema_and_stream(client):
    body = {"text": "JSON:", "sampling_params": {"json_schema": json.dumps(SCHEMA),
                                                 "max_new_tokens": MAX_TOKENS, "temperature": 0}}
    out = client.post("/generate", json=body).json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert_valid(out["text"], SCHEMA)
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        chunks = parse_sse(list(r.iter_lines()))
    assert chunks[-1]["text"] == out["text"]


def test_stop_regex_ends_a_regex_constrained_generation_and_is_cut(client):
    body = {"text": "Code:", "sampling_params": {
        "regex": "ab[0-9]cd", "stop_regex": "[0-9]", "max_new_tokens": 16, "temperature": 0}}
    out = client.post("/generate", json=body).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "[0-9]"}
    assert out["text"] == "ab"


def test_per_request_stream_interval_reaches_the_scheduler(client):
    """An interval longer than the output: only the first token and the end are sent. (The
    split of a stream is tested in the scheduler: over HTTP a slow reader may get two reports
    merged into one chunk, so only which lengths can appear is checked here.)"""
    body = {"text": "Go", "stream": True, "sampling_params": {
        "max_new_tokens": 9, "ignore_eos": True, "stream_interval": 100}}
    with client.stream("POST", "/generate", json=body) as r:
        chunks = parse_sse(list(r.iter_lines()))
    lengths = [len(c["output_ids"]) for c in chunks]
    assert set(lengths) <= {1, 9} and lengths[-1] == 9, lengths


def test_length_limit_mid_json_is_finish_reason_length(oai, server):
    r = oai.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=3,
                                    temperature=0, response_format=response_format())
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": response_format({"type": "objec"})}, None,
         'invalid json_schema: Unsupported type "objec"'),
        ({"response_format": response_format({"type": "array", "uniqueItems": True})}, None,
         "uniqueItems"),
        ({"response_format": {"type": "json_schema"}}, "response_format",
         "needs json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
        ({"regex": "[0-9"}, None, "invalid regex"),
        # a bound on a repeated part that can be empty: a second per token by the tenth
        ({"regex": "(([a-z]{0,30}){0,29}){0,31}"}, None, "can match the empty string"),
        ({"response_format": response_format({"anyOf": []})}, None, "no value matches it"),
        # xgrammar 0.2.8 compiles this schema and our own check finds no first token; 0.2.9
        # refuses it itself ("Circular $ref chain"): a 400 naming the schema either way.
        ({"response_format": response_format({"$ref": "#"})}, None, "invalid json_schema"),
        ({"ebnf": 'root ::= root "a"'}, None, "admits no output"),
        ({"regex": "a", "response_format": {"type": "json_object"}}, None, "at most one of"),
        ({"function_call": "auto"}, "function_call", "deprecated functions API"),
        ({"store": True}, "store", "stored completions"),
        ({"best_of": 3}, "best_of", "use n"),
        ({"audio": {"voice": "x"}}, "audio", "audio"),
    ],
)
def test_unusable_grammars_and_unsupported_fields_are_400_naming_them(client, body, param,
                                                                      message):
    path = "/v1/completions" if "best_of" in body else "/v1/chat/completions"
    base = {"prompt": "x"} if "best_of" in body else {"messages": MESSAGES}
    r = client.post(path, json={**base, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_dead_ends_mid_output_is_an_error_not_a_200(client, stream):
    """After "a" this grammar admits nothing (x has no finite derivation): the request fails
    with a 400 error object (an error event on a stream), never text outside the grammar."""
    body = {"text": "x", "stream": stream, "sampling_params": {
        "ebnf": 'root ::= "a" x\nx ::= x "b"', "max_new_tokens": 8, "temperature": 0}}
    r = client.post("/generate", json=body)
    if not stream or r.status_code != 200:  # a stream whose first output was the failure
        assert r.status_code == 400, r.text
        assert "dead end" in r.json()["error"]["message"]
        return
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert "error" in events[-1] and "dead end" in events[-1]["error"]["message"], events


def test_invalid_grammar_on_a_stream_fails_before_it_starts(client):
    body = {"messages": MESSAGES, "stream": True, "response_format": response_format({"not": {}})}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "'not'" in r.json()["error"]["message"]


def test_compiled_grammars_are_cached_and_the_server_does_not_leak(client, oai, server):
    schema = {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}
    before = client.get("/get_server_info").json()["internal_states"][0]["num_cached_grammars"]
    for _ in range(3):
        oai.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=40,
                                    response_format=response_format(schema))
    after = client.get("/get_server_info").json()["internal_states"][0]["num_cached_grammars"]
    assert after == before + 1
    assert_no_leak(client)
