"""Ollama's API (``/api/...``) through the ``ollama`` Python client from PyPI, unchanged,
against real servers: the shared tiny-Llama server, a Llama 3-style tool server (with the
``llama3`` tool-call parser and the ``deepseek-r1`` reasoning parser) and an embedding server.

Greedy outputs are compared token for token with ``transformers``; streamed replies must add up
to the whole ones; every refusal is a ``ResponseError`` with its status and a message naming
the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest
import torch

from tests.checkpoints import build_checkpoint
from tests.server.conftest import CONSTRAINED_FLAGS, assert_no_leak, start_server
from tests.server.tool_templates import LLAMA3_JSON

CONTEXT_LEN = 1024  # the tiny checkpoints' max_position_embeddings
HIDDEN = 64
PROMPT = "The open() function returns"
GREEDY = {"temperature": 0, "num_predict": 8}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_PARAMS}}
# A Llama 3 JSON call of get_weather: under this format the model can only write a call.
CALL_FORMAT = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER_PARAMS},
    "required": ["name", "parameters"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def olm(server):
    return ollama.Client(host=server.base_url, timeout=60)


@pytest.fixture(scope="module")
def hf(llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_path, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(llama_path)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """What transformers generates greedily after ``ids``: up to ``n`` tokens, or to EOS."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=2, eos_token_id=1)
    new = out[0, len(ids):].tolist()
    return new[:new.index(1)] if 1 in new else new


def chat_ids(tok, messages: list[dict], **kwargs) -> list[int]:
    """The prompt ids of ``messages`` as the server builds them: the template's text, tokenized
    without adding special tokens again."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return tok.encode(text, add_special_tokens=False)


def error_of(call, status: int) -> str:
    with pytest.raises(ollama.ResponseError) as e:
        result = call()
        if not isinstance(result, ollama.ChatResponse | ollama.GenerateResponse):
            list(result)  # a stream fails on its first line
    assert e.value.status_code == status, e.value
    return e.value.error


# ---------------------------------------------------------------------------- generate
def test_raw_generate_equals_transformers_greedy_and_returns_its_context(olm, server, hf):
    model, tok = hf
    ids = tok.encode(PROMPT)
    r = olm.generate(model=server.model, prompt=PROMPT, raw=True, options=GREEDY)
    expected = hf_greedy(model, ids, 8)
    assert r.done and r.done_reason == ("length" if len(expected) == 8 else "stop")
    assert list(r.context) == ids + expected
    assert r.response == tok.decode(expected)
    assert r.prompt_eval_count == len(ids) and r.eval_count == len(expected)
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration > 0
    assert r.model == server.model and r.created_at.endswith("Z")
    # The context continues the conversation: the next reply extends it.
    more = olm.generate(model=server.model, prompt=" and", raw=True, context=r.context,
                        options=GREEDY)
    cont = list(r.context) + tok.encode(" and", add_special_tokens=False)
    assert list(more.context) == cont + hf_greedy(model, cont, 8)


def test_generate_renders_the_chat_template_with_system(olm, server, hf):
    model, tok = hf
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    ids = chat_ids(tok, messages)
    r = olm.generate(model=server.model, prompt=PROMPT, system="Be brief.", options=GREEDY)
    assert list(r.context) == ids + hf_greedy(model, ids, 8)


def test_generate_stream_adds_up_to_the_whole_reply(olm, server):
    kwargs = dict(model=server.model, prompt=PROMPT, options={"temperature": 0,
                                                               "num_predict": 24})
    whole = olm.generate(**kwargs)
    parts = list(olm.generate(stream=True, **kwargs))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert len(parts) > 2
    assert "".join(p.response for p in parts) == whole.response
    last = parts[-1]
    assert last.done_reason == whole.done_reason and last.eval_count == whole.eval_count
    assert list(last.context) == list(whole.context)


def test_empty_prompt_loads_the_model(olm, server):
    r = olm.generate(model=server.model, keep_alive="10m")
    assert r.done and r.done_reason == "load" and r.response == ""
    c = olm.chat(model=server.model, messages=[], keep_alive=0)
    assert c.done and c.done_reason == "load"


# ---------------------------------------------------------------------------- chat
def test_chat_equals_transformers_greedy_stream_and_whole(olm, server, hf):
    model, tok = hf
    messages = [{"role": "user", "content": "Name a built-in function."},
                {"role": "assistant", "content": "len"},
                {"role": "user", "content": "Another one?"}]
    ids = chat_ids(tok, messages)
    expected = hf_greedy(model, ids, 16)
    options = {"temperature": 0, "num_predict": 16}
    r = olm.chat(model=server.model, messages=messages, options=options, keep_alive=-1)
    assert r.message.role == "assistant"
    assert r.message.content == tok.decode(expected, skip_special_tokens=True)
    assert r.prompt_eval_count == len(ids) and r.eval_count == len(expected)
    parts = list(olm.chat(model=server.model, messages=messages, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].done and parts[-1].eval_count == r.eval_count
    assert not any(p.done for p in parts[:-1])


def test_chat_logprobs_are_the_greedy_tokens_with_sorted_alternatives(olm, server):
    r = olm.chat(model=server.model, messages=[{"role": "user", "content": PROMPT}],
                 options=GREEDY, logprobs=True, top_logprobs=3)
    assert len(r.logprobs) == r.eval_count > 0
    assert "".join(lp.token for lp in r.logprobs) == r.message.content
    for lp in r.logprobs:
        tops = [t.logprob for t in lp.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert lp.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy: the top token
    parts = list(olm.chat(model=server.model, messages=[{"role": "user", "content": PROMPT}],
                          options=GREEDY, logprobs=True, top_logprobs=3, stream=True))
    streamed = [lp for p in parts for lp in (p.logprobs or [])]
    assert [lp.token for lp in streamed] == [lp.token for lp in r.logprobs]


# ---------------------------------------------------------------------------- options
def test_options_stop_seed_and_num_predict(olm, server):
    base = olm.generate(model=server.model, prompt=PROMPT, raw=True,
                        options={"temperature": 0, "num_predict": 24})
    cut = base.response[len(base.response) // 2:][:3]
    stopped = olm.generate(model=server.model, prompt=PROMPT, raw=True,
                           options={"temperature": 0, "num_predict": 24, "stop": [cut]})
    assert stopped.done_reason == "stop"
    assert stopped.response == base.response[:base.response.index(cut)]
    sampled = [olm.generate(model=server.model, prompt=PROMPT, raw=True,
                            options={"temperature": 1.0, "seed": s, "num_predict": 16,
                                     "top_k": 50, "top_p": 0.95, "repeat_penalty": 1.1})
               for s in (7, 7, 8)]
    assert sampled[0].context == sampled[1].context != sampled[2].context
    # top_k 0 is the whole vocabulary (llama.cpp's meaning): the same as leaving it out.
    whole_vocab = [olm.generate(model=server.model, prompt=PROMPT, raw=True,
                                options={"temperature": 1.0, "seed": 7, "num_predict": 16, **k})
                   for k in ({"top_k": 0}, {})]
    assert whole_vocab[0].context == whole_vocab[1].context
    one = olm.generate(model=server.model, prompt=PROMPT, raw=True,
                       options={"temperature": 0, "num_predict": 1})
    assert one.eval_count == 1 and one.done_reason in ("length", "stop")


def test_num_ctx_bounds_the_generation_and_is_checked_against_the_context(olm, server, hf):
    _, tok = hf
    prompt_len = len(tok.encode(PROMPT))
    r = olm.generate(model=server.model, prompt=PROMPT, raw=True,
                     options={"num_ctx": prompt_len + 3, "temperature": 0,
                              "repeat_penalty": 1.0})
    if r.done_reason == "length":
        assert r.eval_count == 3
    else:
        assert r.eval_count < 3
    too_big = error_of(lambda: olm.generate(model=server.model, prompt=PROMPT, raw=True,
                                            options={"num_ctx": CONTEXT_LEN + 1}), 400)
    assert "num_ctx" in too_big and str(CONTEXT_LEN) in too_big
    too_small = error_of(lambda: olm.generate(model=server.model, prompt=PROMPT, raw=True,
                                              options={"num_ctx": 2}), 400)
    assert "num_ctx" in too_small


def test_format_json_schema_and_json_go_through_the_grammar(olm, server):
    messages = [{"role": "user", "content": "Weather as JSON."}]
    r = olm.chat(model=server.model, messages=messages, format=WEATHER_PARAMS,
                 options={"temperature": 0, "num_predict": 200})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), WEATHER_PARAMS)
    streamed = "".join(p.message.content for p in olm.chat(
        model=server.model, messages=messages, format=WEATHER_PARAMS, stream=True,
        options={"temperature": 0, "num_predict": 200}))
    assert streamed == r.message.content
    plain = olm.generate(model=server.model, prompt="JSON:", raw=True,
                         options={"temperature": 0, "num_predict": 1})
    as_json = olm.generate(model=server.model, prompt="JSON:", raw=True, format="json",
                           options={"temperature": 0, "num_predict": 1})
    assert not plain.response.lstrip().startswith("{")
    assert as_json.response.lstrip().startswith("{")


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"options": {"mirostat": 2}}, "mirostat"),
    ({"options": {"num_thread": 4}}, "num_thread"),
    ({"options": {"repeat_last_n": 64}}, "repeat_last_n"),
    ({"options": {"tfs_z": 0.5}}, "tfs_z"),
    ({"options": {"frobnicate": 1}}, "frobnicate"),
    ({"options": {"num_predict": -3}}, "num_predict"),
    ({"think": "high"}, "think"),
    ({"think": True}, "--reasoning-parser"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [WEATHER_TOOL]}, "--tool-call-parser"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
    ({"messages": [{"role": "user", "content": "hi", "thinking": "hm"}]}, "thinking"),
    ({"keep_alive": "xyz"}, "keep_alive"),  # Ollama: "time: invalid duration"
    ({"keep_alive": "300"}, "keep_alive"),  # a string needs its unit, as in Go
])
def test_what_cannot_be_honoured_is_a_400_naming_it(olm, server, kwargs, needle):
    args = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], **kwargs}
    assert needle in error_of(lambda: olm.chat(**args), 400)
    assert needle in error_of(lambda: olm.chat(stream=True, **args), 400)


def test_generate_refusals_and_an_unknown_model(olm, server):
    for kwargs, needle in (({"suffix": "x"}, "suffix"), ({"template": "{{ .Prompt }}"},
                                                         "template"),
                           ({"raw": True, "system": "s"}, "system")):
        assert needle in error_of(
            lambda kw=kwargs: olm.generate(model=server.model, prompt="hi", **kw), 400)
    missing = error_of(lambda: olm.chat(model="llama3.2:1b", messages=[
        {"role": "user", "content": "hi"}]), 404)
    assert "llama3.2:1b" in missing
    assert olm.generate(model=f"{server.model}:latest", prompt="hi",
                        options={"num_predict": 1}).done
    assert "--is-embedding" in error_of(lambda: olm.embed(model=server.model, input="hi"), 400)


def test_raw_http_default_stream_and_error_shape(server):
    """What the client cannot send or hides: Ollama streams when ``stream`` is left out, and
    every error body is ``{"error": message}``."""
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        body = {"model": server.model, "prompt": PROMPT, "options": {"num_predict": 4}}
        with http.stream("POST", "/api/generate", json=body) as r:
            assert r.headers["content-type"] == "application/x-ndjson"
            lines = [json.loads(line) for line in r.iter_lines()]
        assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 4 or \
            lines[-1]["done_reason"] == "stop"
        for bad, param in (({**body, "format": "yaml"}, "format"),
                           ({**body, "stream": False, "options": {"num_ctx": 10**6}},
                            "num_ctx")):
            r = http.post("/api/generate", json=bad)
            assert r.status_code == 400 and list(r.json()) == ["error"], r.text
            assert param in r.json()["error"]
        # Refused by the request guard, before any route: the same shape.
        for content, needle in ((b"{not json", "JSON"),
                                (b'{"model": "m", "options": {"seed": 99999999999999999999999}}',
                                 "64 bits")):
            r = http.post("/api/chat", content=content,
                          headers={"content-type": "application/json"})
            assert r.status_code == 400 and needle in r.json()["error"], r.text


# ---------------------------------------------------------------------------- model routes
def test_tags_show_ps_and_version(olm, server):
    (entry,) = olm.list().models
    assert entry.model == server.model and entry.details.family == "llama"
    weights = sum(p.stat().st_size for p in Path(server.model).glob("*.safetensors"))
    assert entry.size == weights and len(entry.digest) == 64
    shown = olm.show(server.model)
    assert shown.capabilities == ["completion"]
    assert shown.modelinfo["llama.context_length"] == CONTEXT_LEN
    assert shown.modelinfo["llama.embedding_length"] == HIDDEN
    assert shown.template and shown.details.quantization_level == "F32"
    # float32 weights: 4 bytes a parameter (the safetensors headers are small).
    params = shown.modelinfo["general.parameter_count"]
    assert 4 * params < weights < 4 * params + 64 * 1024
    (loaded,) = olm.ps().models
    assert loaded.model == server.model and loaded.context_length == CONTEXT_LEN
    version = httpx.get(server.base_url + "/api/version").json()["version"]
    assert [int(x) for x in version.split(".")] >= [0, 5, 0]
    pull = error_of(lambda: olm.pull("llama3.2"), 501)
    assert "/api/pull" in pull


def test_no_leak_after_ollama_tests(client):
    assert_no_leak(client)


# ---------------------------------------------------------------------------- tools, thinking
@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt-ollama-tools"), "llama",
                            chat_template=LLAMA3_JSON, extra_special_tokens=("<|python_tag|>",),
                            max_position_embeddings=2048)
    srv = start_server(path, *CONSTRAINED_FLAGS, "--tool-call-parser", "llama3",
                       "--reasoning-parser", "deepseek-r1")
    yield srv
    srv.check_clean_stop()


def test_tool_calls_round_trip(tools_server):
    from transformers import AutoTokenizer

    olm = ollama.Client(host=tools_server.base_url, timeout=60)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs = dict(model=tools_server.model, tools=[WEATHER_TOOL], format=CALL_FORMAT,
                  options={"temperature": 0, "num_predict": 200})
    r = olm.chat(messages=messages, **kwargs)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and r.message.content == ""
    jsonschema.validate(dict(call.function.arguments), WEATHER_PARAMS)
    parts = list(olm.chat(messages=messages, stream=True, **kwargs))
    streamed = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == \
        [(call.function.name, dict(call.function.arguments))]
    # The call and its result go back in Ollama's shape (no ids); the template renders them.
    history = [*messages, r.message, {"role": "tool", "content": "18 degrees",
                                      "tool_name": "get_weather"}]
    after = olm.chat(model=tools_server.model, messages=history, tools=[WEATHER_TOOL],
                     options={"num_predict": 1})
    tok = AutoTokenizer.from_pretrained(tools_server.model)
    openai_history = [*messages, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call00000", "type": "function", "function": {
            "name": "get_weather", "arguments": dict(call.function.arguments)}}]},
        {"role": "tool", "content": "18 degrees", "tool_call_id": "call00000",
         "name": "get_weather"}]
    # The tool as the client sends it (its Tool model keeps only the fields it knows).
    sent_tool = ollama.Tool.model_validate(WEATHER_TOOL).model_dump(exclude_none=True)
    ids = chat_ids(tok, openai_history, tools=[sent_tool])
    assert after.prompt_eval_count == len(ids)
    shown = olm.show(tools_server.model)
    assert shown.capabilities == ["completion", "tools", "thinking"]


def test_thinking_is_split_out_whole_and_streamed(tools_server):
    olm = ollama.Client(host=tools_server.base_url, timeout=60)
    kwargs = dict(model=tools_server.model, messages=[{"role": "user", "content": "Think."}],
                  think=True, options={"temperature": 0, "num_predict": 12})
    r = olm.chat(**kwargs)
    # deepseek-r1: the output starts inside the reasoning block; without </think> it is all
    # reasoning.
    assert r.message.thinking and r.message.content == ""
    parts = list(olm.chat(stream=True, **kwargs))
    assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
    g = olm.generate(model=tools_server.model, prompt="Think.", think=True,
                     options={"temperature": 0, "num_predict": 12})
    assert g.thinking == r.message.thinking and g.response == ""


# ---------------------------------------------------------------------------- embeddings
@pytest.fixture(scope="module")
def emb_server(llama_path):
    srv = start_server(llama_path, "--is-embedding")
    yield srv
    srv.check_clean_stop()


def test_embed_equals_the_openai_route_and_truncates(emb_server):
    olm = ollama.Client(host=emb_server.base_url, timeout=60)
    texts = ["The open() function", "a dict maps keys to values"]
    r = olm.embed(model=emb_server.model, input=texts, keep_alive="5m")
    with httpx.Client(base_url=emb_server.base_url, timeout=60) as http:
        ref = http.post("/v1/embeddings", json={"input": texts}).json()
        assert [len(e) for e in r.embeddings] == [HIDDEN, HIDDEN]
        for got, want in zip(r.embeddings, ref["data"], strict=True):
            assert list(got) == pytest.approx(want["embedding"], abs=1e-6)
        assert r.prompt_eval_count == ref["usage"]["prompt_tokens"]
        single = olm.embed(model=emb_server.model, input=texts[0], dimensions=HIDDEN)
        assert list(single.embeddings[0]) == pytest.approx(ref["data"][0]["embedding"],
                                                           abs=1e-6)
        long_ids = [7] * (CONTEXT_LEN + 50)
        text = http.post("/detokenize", json={"tokens": long_ids}).json()["text"]
        ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
        assert len(ids) > CONTEXT_LEN
        cut = olm.embed(model=emb_server.model, input=text)
        want = http.post("/encode", json={"input_ids": ids[:CONTEXT_LEN]}).json()
        assert list(cut.embeddings[0]) == pytest.approx(want["embedding"], abs=1e-6)
        assert cut.prompt_eval_count == CONTEXT_LEN
        small = olm.embed(model=emb_server.model, input=text, options={"num_ctx": 10})
        assert small.prompt_eval_count == 10
    assert "truncate" in error_of(
        lambda: olm.embed(model=emb_server.model, input=text, truncate=False), 400)
    assert "temperature" in error_of(
        lambda: olm.embed(model=emb_server.model, input="x", options={"temperature": 1}), 400)
    assert "dimensions" in error_of(
        lambda: olm.embed(model=emb_server.model, input="x", dimensions=8), 400)
    assert olm.show(emb_server.model).capabilities == ["embedding"]
