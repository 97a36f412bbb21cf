"""Hostile requests, as an attacker would send them: wrong types, huge sizes, broken encodings,
deep nesting, numbers at and past every bound, NaN and infinities, huge n / logprobs / stop
lists, path-traversal model names.

Every one gets the documented 4xx (docs/reliability.md) with the OpenAI error object; those the
HTTP edge can refuse never reach the scheduler (its ``num_received_reqs`` does not move), and
after all of them the server is healthy and holds no KV. Bodies are encoded here with Python's
``json`` (which writes big integers, ``NaN``, ``Infinity`` and escaped lone surrogates as a
hostile client would), or sent as raw bytes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.server.bad_requests import NOT_FOUND, Case, assert_error_object, send
from tests.server.conftest import assert_no_leak, internal_state

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
MSGS = [{"role": "user", "content": "hi"}]
BIG = 2**128  # past 64 bits
INT64_MAX = 2**63 - 1
NAN, INF = float("nan"), float("inf")
SURROGATE = "\ud800"

TOO_LARGE = (413, "request_too_large")
NOT_ALLOWED = (405, "invalid_request_error")


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MSGS, "max_tokens": 2, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


def generate(sampling: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2, **(sampling or {})}, **fields}


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def overflow(param: str, path: str, body: Any) -> Case:
    return Case(f"int_past_64_bits_{param}_{path.strip('/').replace('/', '_')}", path, body,
                param=param, message="64 bits")


def surrogate(name: str, path: str, body: Any, param: str) -> Case:
    return Case(f"lone_surrogate_{name}", path, body, param=param, message="surrogate")


CASES = [
    # --- integers past 64 bits, in every integer field of both APIs: 400 naming the field
    overflow("seed", CHAT, chat(seed=BIG)),
    overflow("seed", COMPLETIONS, completion(seed=-BIG)),
    overflow("top_k", CHAT, chat(top_k=BIG)),
    overflow("max_tokens", CHAT, chat(max_tokens=BIG)),
    overflow("max_completion_tokens", CHAT, chat(max_completion_tokens=BIG)),
    overflow("min_tokens", COMPLETIONS, completion(min_tokens=BIG)),
    overflow("n", CHAT, chat(n=BIG)),
    overflow("top_logprobs", CHAT, chat(logprobs=True, top_logprobs=BIG)),
    overflow("logprobs", COMPLETIONS, completion(logprobs=BIG)),
    overflow("stop_token_ids.1", CHAT, chat(stop_token_ids=[1, BIG])),
    overflow("prompt.0", COMPLETIONS, completion(prompt=[BIG])),
    overflow("logit_bias.5", CHAT, chat(logit_bias={"5": BIG})),
    overflow("sampling_params.sampling_seed", GENERATE, generate({"sampling_seed": BIG})),
    overflow("sampling_params.top_k", GENERATE, generate({"top_k": BIG})),
    overflow("sampling_params.max_new_tokens", GENERATE, generate({"max_new_tokens": BIG})),
    overflow("sampling_params.n", GENERATE, generate({"n": BIG})),
    overflow("sampling_params.1.sampling_seed", GENERATE,
             {"text": ["a", "b"], "sampling_params": [{}, {"sampling_seed": BIG}]}),
    overflow("top_logprobs_num", GENERATE, generate(return_logprob=True, top_logprobs_num=BIG)),
    overflow("logprob_start_len", GENERATE, generate(return_logprob=True, logprob_start_len=BIG)),
    overflow("token_ids_logprob.0", GENERATE,
             generate(return_logprob=True, token_ids_logprob=[BIG])),
    overflow("input_ids.2", GENERATE, {"input_ids": [1, 2, -BIG]}),
    overflow("session_params.offset", GENERATE,
             generate(session_params={"id": "s", "offset": BIG})),
    overflow("data_parallel_rank", GENERATE, generate(data_parallel_rank=BIG)),
    overflow("capacity_of_str_len", "/open_session", {"capacity_of_str_len": BIG}),
    overflow("tokens.0", "/detokenize", {"tokens": [BIG]}),
    overflow("truncate_size", "/get_weights_by_name",
             {"name": "model.embed_tokens.weight", "truncate_size": BIG}),
    Case("int_of_5000_digits", CHAT, b'{"messages": [], "seed": ' + b"9" * 5000 + b"}",
         message="digits"),
    # --- numbers just past a bound (the bound itself is accepted: test_bounds_are_inclusive)
    Case("n_past_max", CHAT, chat(n=65), param="n", message="64"),
    Case("top_logprobs_past_max", CHAT, chat(logprobs=True, top_logprobs=21),
         param="top_logprobs", message="20"),
    Case("completion_logprobs_past_max", COMPLETIONS, completion(logprobs=21), param="logprobs"),
    Case("max_tokens_past_context", CHAT, chat(max_tokens=1024), message="context length"),
    Case("top_p_past_one", GENERATE, generate({"top_p": 1.0000001}), message="top_p"),
    Case("presence_penalty_past_two", CHAT, chat(presence_penalty=2.001),
         message="presence_penalty"),
    Case("negative_max_new_tokens", GENERATE, generate({"max_new_tokens": -1}),
         message="max_new_tokens"),
    Case("logprob_start_len_below_minus_one", GENERATE,
         generate(return_logprob=True, logprob_start_len=-2), message="logprob_start_len"),
    Case("token_id_past_vocabulary", GENERATE, {"input_ids": [512]}, message="vocabulary"),
    Case("negative_dp_rank", GENERATE, generate(data_parallel_rank=-1),
         message="data_parallel_rank"),
    Case("dp_rank_past_replicas", GENERATE, generate(routed_dp_rank=1), param="routed_dp_rank"),
    # --- NaN and infinities (Python's json reads them; standard JSON has none)
    Case("nan_temperature", CHAT, chat(temperature=NAN), param="temperature", message="finite"),
    Case("infinite_top_p", GENERATE, generate({"top_p": INF}), param="sampling_params.top_p"),
    Case("minus_infinity_logit_bias", CHAT, chat(logit_bias={"5": -INF}),
         param="logit_bias.5"),
    Case("nan_session_timeout", "/open_session", {"capacity_of_str_len": 8, "timeout": NAN},
         param="timeout"),
    Case("overflowing_float_literal", GENERATE,
         b'{"text": "hi", "sampling_params": {"temperature": 1e999}}',
         param="sampling_params.temperature", message="finite"),
    Case("infinite_forward_sleep", "/slow_down", {"forward_sleep_time": INF},
         param="forward_sleep_time"),
    # --- text that is not Unicode: 400, never a 500 from the tokenizer
    surrogate("chat_content", CHAT, chat(messages=[{"role": "user", "content": SURROGATE}]),
              "messages.0.content"),
    surrogate("chat_content_part", CHAT,
              chat(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]),
              "messages.0.content.0.text"),
    surrogate("completion_echo", COMPLETIONS, completion(prompt=SURROGATE, echo=True), "prompt"),
    surrogate("completion_prompt_list", COMPLETIONS, completion(prompt=["ok", "a" + SURROGATE]),
              "prompt.1"),
    surrogate("stop_string", CHAT, chat(stop=[SURROGATE]), "stop.0"),
    surrogate("tokenize", "/tokenize", {"prompt": SURROGATE}, "prompt"),
    surrogate("tokenize_list", "/tokenize", {"prompt": ["ok", SURROGATE]}, "prompt.1"),
    surrogate("generate_text", GENERATE, {"text": "x" + SURROGATE}, "text"),
    surrogate("rid", GENERATE, generate(rid=SURROGATE), "rid"),
    surrogate("model_name", CHAT, chat(model=SURROGATE), "model"),
    surrogate("logit_bias_key", CHAT, chat(logit_bias={SURROGATE: 1}), "logit_bias"),
    surrogate("regex", GENERATE, generate({"regex": SURROGATE}), "sampling_params.regex"),
    surrogate("session_id", "/open_session", {"capacity_of_str_len": 8, "session_id": SURROGATE},
              "session_id"),
    Case("utf8_encoded_surrogate", COMPLETIONS, b'{"prompt": "\xed\xa0\x80"}', param="prompt",
         message="surrogate"),
    Case("bytes_that_are_not_utf8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', message="utf-8"),
    Case("body_in_utf16", COMPLETIONS, '{"prompt": "hi"'.encode("utf-16"), message="JSON"),
    # --- types
    Case("body_is_a_string", CHAT, "hello"),
    Case("body_is_a_number", GENERATE, 5),
    Case("body_is_null", COMPLETIONS, b"null", message="object"),
    Case("body_is_truncated_json", GENERATE, b'{"text": "hi", "sampling_params": {',
         message="JSON"),
    Case("messages_is_a_string", CHAT, chat(messages="hi"), message="messages"),
    Case("max_tokens_is_a_word", CHAT, chat(max_tokens="ten"), param="max_tokens"),
    Case("max_tokens_is_fractional", CHAT, chat(max_tokens=1.5), param="max_tokens"),
    Case("stream_is_a_word", COMPLETIONS, completion(stream="maybe"), param="stream"),
    Case("stop_is_a_number", CHAT, chat(stop=5), message="stop"),
    Case("input_ids_are_floats", GENERATE, {"input_ids": [1.5, 2]}, message="input_ids"),
    Case("sampling_params_is_a_string", GENERATE, {"text": "hi", "sampling_params": "fast"},
         message="sampling_params"),
    Case("rid_is_a_number", GENERATE, generate(rid=5), message="rid"),
    Case("chat_template_kwargs_overrides_messages", CHAT,
         chat(chat_template_kwargs={"messages": 1}), param="chat_template_kwargs"),
    # --- sizes
    Case("body_past_8_mib", COMPLETIONS, completion(prompt="a" * (8 * 1024 * 1024)),
         expected=TOO_LARGE),
    Case("twenty_thousand_messages", CHAT, chat(messages=MSGS * 20_000), message="too long"),
    Case("prompt_past_the_context", COMPLETIONS, completion(prompt=[5] * 1025), message="1025"),
    Case("stop_list_of_ten_thousand", CHAT, chat(stop=[f"s{i}" for i in range(10_000)]),
         message="at most 128 stop strings"),
    Case("stop_string_of_a_megabyte", GENERATE, generate({"stop": ["x" * 2**20]}),
         message="4096 characters"),
    Case("stop_token_ids_past_vocabulary", CHAT, chat(stop_token_ids=list(range(100_000))),
         message="vocabulary"),
    Case("logit_bias_past_vocabulary", CHAT, chat(logit_bias={str(i): 1 for i in range(50_000)}),
         message="vocabulary"),
    Case("huge_n", COMPLETIONS, completion(n=1_000_000), param="n"),
    Case("huge_native_n", GENERATE, generate({"n": 1_000_000}), message="n"),
    Case("batch_of_a_hundred_thousand_prompts", GENERATE, {"text": ["a"] * 100_000},
         message="batch"),
    Case("tokenize_a_hundred_thousand_prompts", "/tokenize", {"prompt": ["a"] * 100_000},
         param="prompt", message="--max-batch-size"),
    Case("huge_top_logprobs", CHAT, chat(logprobs=True, top_logprobs=1_000_000),
         param="top_logprobs"),
    Case("token_ids_logprob_past_the_top_logprobs_bound", GENERATE,
         generate(return_logprob=True, token_ids_logprob=list(range(21))),
         message="--max-top-logprobs-num"),
    Case("rid_of_a_megabyte", GENERATE, generate(rid="r" * 2**20), message="1048576 characters"),
    Case("rid_forging_a_log_line", GENERATE, generate(rid="a\nINFO forged"),
         message="printable"),
    Case("batch_rid_past_the_bound", GENERATE, {"text": ["a", "b"], "rid": ["x", "y" * 257]},
         message="rid[1]"),
    # --- nesting
    Case("body_nested_five_thousand_deep", COMPLETIONS, b"[" * 5000 + b"]" * 5000,
         message="nested"),
    Case("template_kwargs_nested_past_the_bound", CHAT,
         chat(chat_template_kwargs={"x": nested(100)}), param="chat_template_kwargs",
         message="nested more than 64"),
    Case("sampling_params_nested", GENERATE, generate({"stop": nested(70)}),
         param="sampling_params", message="nested"),
    # --- path traversal and other names
    Case("model_path_traversal", CHAT, chat(model="../../../../etc/passwd"), NOT_FOUND,
         param="model"),
    Case("model_path_that_normalises_to_the_served_one", COMPLETIONS,
         completion(model="/./tmp/../tmp/x"), NOT_FOUND, param="model"),
    Case("model_name_of_a_megabyte", CHAT, chat(model="m" * 2**20), NOT_FOUND, param="model"),
    Case("model_card_path_traversal", "/v1/models/..%2F..%2Fetc%2Fpasswd", method="GET",
         expected=NOT_FOUND),
    Case("model_card_nul_byte", "/v1/models/a%00b", method="GET", expected=NOT_FOUND),
    Case("route_path_traversal", "/v1/../../etc/passwd", method="GET", expected=NOT_FOUND),
    Case("weights_from_a_traversal_path", "/update_weights_from_disk",
         {"model_path": "../../../../etc"}, message="etc"),
    Case("weights_by_a_traversal_name", "/get_weights_by_name", {"name": "../../etc/passwd"},
         message="passwd"),
    # --- OpenAI's ranges, one token limit, one value per key, UTF-8 only (issue 37 items 8, 9)
    Case("temperature_past_two", CHAT, chat(temperature=1e308), param="temperature"),
    Case("responses_temperature_past_two", "/v1/responses",
         {"input": "hi", "max_output_tokens": 2, "temperature": 2.5}, param="temperature"),
    Case("logit_bias_past_a_hundred", CHAT, chat(logit_bias={"5": 101}), param="logit_bias",
         message="between -100 and 100"),
    Case("max_tokens_and_max_completion_tokens", CHAT, chat(max_completion_tokens=3),
         message="not both"),
    Case("duplicate_json_key", CHAT,
         b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "max_tokens": 2}',
         param="max_tokens", message="repeats the key"),
    Case("body_in_utf16_with_a_bom", CHAT, json.dumps(chat()).encode("utf-16"),
         message="not UTF-8"),
    Case("body_in_utf32_without_a_bom", CHAT, json.dumps(chat()).encode("utf-32-le"),
         message="not UTF-8"),
    Case("body_in_utf16_without_a_bom", CHAT, json.dumps(chat()).encode("utf-16-le"),
         message="not UTF-8"),
    Case("body_with_a_utf8_bom", CHAT, b"\xef\xbb\xbf" + json.dumps(chat()).encode(),
         message="byte order mark"),
    # --- the default bound on generations in flight (4096): the largest batch times the largest n
    Case("max_prompts_times_max_n", GENERATE,
         {"text": ["a"] * 2048, "sampling_params": {"max_new_tokens": 1, "n": 64}},
         message="--max-queued-requests"),
    # --- the scheduler's own refusals still come back as 400
    Case("generate_in_an_unknown_session", GENERATE, generate(session_params={"id": "nope"}),
         message="nope", reaches_scheduler=True),
    # --- routing
    Case("wrong_method", GENERATE, method="PUT", expected=NOT_ALLOWED),
    Case("unknown_route", "/v2/chat/completions", chat(), expected=NOT_FOUND),
]


def test_the_table_has_sixty_hostile_requests_with_unique_names():
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_hostile_request_gets_its_documented_4xx_and_reaches_no_further(case: Case, client):
    received = internal_state(client)["num_received_reqs"]
    r = send(client, case)
    assert_error_object(r, case)
    assert len(r.content) < 4096, "an error message must not echo a huge input"
    if not case.reaches_scheduler:
        assert internal_state(client)["num_received_reqs"] == received


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, chat(seed=INT64_MAX, top_k=INT64_MAX)),
        (GENERATE, generate({"sampling_seed": -(2**63)})),
        (COMPLETIONS, completion(n=64, max_tokens=1)),
        (CHAT, chat(logprobs=True, top_logprobs=20, max_tokens=1)),
        (CHAT, chat(stop=[f"s{i}" for i in range(128)])),
        (GENERATE, generate({"stop": ["x" * 4096]})),
        (CHAT, chat(presence_penalty=2.0, top_p=1.0)),
        (CHAT, chat(chat_template_kwargs={"x": nested(60)})),
        (COMPLETIONS, completion(prompt="\ud83d\ude00")),  # a surrogate pair is one character
        (GENERATE, generate(return_logprob=True, token_ids_logprob=list(range(20)))),
        (GENERATE, generate(rid="r" * 256)),
        ("/tokenize", {"prompt": ["a"] * 2048}),
    ],
    ids=["int64_max", "int64_min", "n_64", "top_logprobs_20", "stop_128", "stop_4096_chars",
         "penalty_2_top_p_1", "nested_61_deep", "surrogate_pair", "token_ids_logprob_20",
         "rid_256_chars", "tokenize_2048_prompts"],
)
def test_values_at_each_bound_are_accepted(client, path, body):
    r = client.post(path, content=json.dumps(body).encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text[:2000]


@pytest.mark.parametrize(("headers", "message"), [
    ({"x-big": "a" * 100_000}, "bytes long"),
    ({f"x-h{i}": "1" for i in range(2000)}, "header fields"),
], ids=["a_100_kb_header", "two_thousand_headers"])
def test_an_oversized_request_head_is_431(client, headers, message):
    r = client.post(GENERATE, json=generate(), headers=headers)
    assert r.status_code == 431, r.text[:2000]
    assert message in r.json()["error"]["message"]


def test_a_head_at_the_limits_is_served(client):
    headers = {f"x-h{i}": "1" for i in range(90)}
    headers["x-big"] = "a" * 12_000
    assert client.post(GENERATE, json=generate(), headers=headers).status_code == 200


def test_the_server_is_healthy_and_leak_free_after_the_hostile_requests(client):
    for case in CASES:  # again, back to back
        assert 400 <= send(client, case).status_code < 500, case.name
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    assert_no_leak(client)
    state = internal_state(client)
    assert state["last_leak_check"]["ok"], state["last_leak_check"]
