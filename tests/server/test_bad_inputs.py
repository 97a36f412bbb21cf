"""Bad requests get a 4xx OpenAI error object, and leave the server healthy with no leaked KV."""

from __future__ import annotations

from typing import Any

import pytest

from tests.server.bad_requests import NOT_FOUND, Case, assert_error_object, send
from tests.server.conftest import assert_no_leak

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MSGS, "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 4, **fields}


def generate(**fields: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 4}, **fields}


CASES = [
    # --- chat completions
    Case("chat_body_not_json", CHAT, b"{not json", message="JSON"),
    Case("chat_body_is_a_list", CHAT, [1, 2]),
    Case("chat_missing_messages", CHAT, {"max_tokens": 4}, message="messages"),
    Case("chat_empty_messages", CHAT, chat(messages=[]), message="messages"),
    Case("chat_unknown_role", CHAT, chat(messages=[{"role": "robot", "content": "x"}])),
    Case("chat_content_is_a_number", CHAT, chat(messages=[{"role": "user", "content": 5}])),
    Case("chat_image_content_part", CHAT,
         chat(messages=[{"role": "user",
                         "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         message="text content parts"),
    Case("chat_negative_temperature", CHAT, chat(temperature=-0.5), message="temperature"),
    Case("chat_temperature_not_a_number", CHAT, chat(temperature="hot"), message="temperature"),
    Case("chat_top_p_zero", CHAT, chat(top_p=0.0), message="top_p"),
    Case("chat_top_k_zero", CHAT, chat(top_k=0), message="top_k"),
    Case("chat_min_p_above_one", CHAT, chat(min_p=1.5), message="min_p"),
    Case("chat_n_zero", CHAT, chat(n=0), message="n"),
    Case("chat_max_tokens_zero", CHAT, chat(max_tokens=0), message="max_tokens"),
    Case("chat_max_tokens_past_context", CHAT, chat(max_tokens=5000), message="5000"),
    Case("chat_presence_penalty_too_big", CHAT, chat(presence_penalty=3),
         message="presence_penalty"),
    Case("chat_frequency_penalty_too_small", CHAT, chat(frequency_penalty=-3),
         message="frequency_penalty"),
    Case("chat_repetition_penalty_zero", CHAT, chat(repetition_penalty=0),
         message="repetition_penalty"),
    Case("chat_logit_bias_key_not_a_token", CHAT, chat(logit_bias={"abc": 1}),
         message="logit_bias"),
    Case("chat_logit_bias_out_of_vocab", CHAT, chat(logit_bias={"99999": 1}),
         message="logit_bias"),
    Case("chat_top_logprobs_without_logprobs", CHAT, chat(top_logprobs=2),
         message="logprobs"),
    Case("chat_top_logprobs_too_many", CHAT, chat(logprobs=True, top_logprobs=50),
         message="top_logprobs"),
    Case("chat_empty_stop_string", CHAT, chat(stop=[""]), message="stop"),
    Case("chat_min_tokens_over_max_tokens", CHAT, chat(min_tokens=10), message="min_new_tokens"),
    Case("chat_stream_options_without_stream", CHAT,
         chat(stream_options={"include_usage": True}), message="stream_options"),
    Case("chat_seed_not_an_integer", CHAT, chat(seed="abc"), message="seed"),
    Case("chat_invalid_value_while_streaming", CHAT, chat(stream=True, temperature=-1),
         message="temperature"),
    Case("chat_continue_final_message_after_a_user_message", CHAT,
         chat(continue_final_message=True), message="continue_final_message"),
    Case("chat_return_hidden_states", CHAT, chat(return_hidden_states=True),
         message="return_hidden_states"),
    Case("chat_separate_reasoning_not_a_bool", CHAT, chat(separate_reasoning=[1]),
         message="separate_reasoning"),
    Case("chat_stream_reasoning_off", CHAT, chat(stream_reasoning=False),
         message="stream_reasoning"),
    Case("chat_unknown_model", CHAT, chat(model="no-such-model"), NOT_FOUND, "no-such-model"),
    Case("chat_unknown_field", CHAT, chat(temprature=0.5), message="unknown parameter"),
    Case("chat_tools_auto_without_parser", CHAT,
         chat(tools=[{"type": "function", "function": {"name": "f"}}]),
         message="--tool-call-parser"),
    Case("chat_invalid_json_schema", CHAT,
         chat(response_format={"type": "json_schema",
                               "json_schema": {"name": "x", "schema": {"type": 5}}}),
         message="invalid json_schema"),
    Case("chat_schema_keyword_not_enforced", CHAT,
         chat(response_format={"type": "json_schema",
                               "json_schema": {"schema": {"type": "string", "format": "x"}}}),
         message="format"),
    Case("chat_response_format_and_regex", CHAT,
         chat(regex="a", response_format={"type": "json_object"}), message="at most one"),
    Case("chat_invalid_regex_while_streaming", CHAT, chat(stream=True, regex="("),
         message="invalid regex"),
    Case("chat_template_kwargs_reserved", CHAT, chat(chat_template_kwargs={"tokenize": True}),
         message="chat_template_kwargs"),
    Case("chat_message_unknown_field", CHAT,
         chat(messages=[{"role": "user", "content": "x", "function_call": {}}]),
         message="unknown parameter"),
    # --- completions
    Case("completion_missing_prompt", COMPLETIONS, {"max_tokens": 4}, message="prompt"),
    Case("completion_empty_prompt_list", COMPLETIONS, completion(prompt=[]), message="prompt"),
    Case("completion_empty_prompt_string", COMPLETIONS, completion(prompt=""), message="empty"),
    Case("completion_token_id_out_of_vocab", COMPLETIONS, completion(prompt=[99999]),
         message="vocabulary"),
    Case("completion_negative_token_id", COMPLETIONS, completion(prompt=[-1]),
         message="vocabulary"),
    Case("completion_prompt_is_an_object", COMPLETIONS, completion(prompt={"a": 1}),
         message="prompt"),
    Case("completion_mixed_prompt_list", COMPLETIONS, completion(prompt=[1, "a"]),
         message="prompt"),
    Case("completion_logprobs_too_many", COMPLETIONS, completion(logprobs=50),
         message="logprobs"),
    Case("completion_echo_of_a_negative_token_id", COMPLETIONS,
         completion(prompt=[5, -1], echo=True, logprobs=1), message="vocabulary"),
    Case("completion_prompt_longer_than_context", COMPLETIONS,
         completion(prompt=[5] * 1100), message="1100"),
    Case("completion_unknown_model", COMPLETIONS, completion(model="nope"), NOT_FOUND),
    Case("completion_best_of", COMPLETIONS, completion(best_of=2), message="best_of"),
    Case("completion_suffix", COMPLETIONS, completion(suffix="end"), message="suffix"),
    Case("completion_invalid_ebnf", COMPLETIONS, completion(ebnf="root ::= x"),
         message="invalid ebnf"),
    # --- native API
    Case("generate_without_prompt", "/generate", {"sampling_params": {}}, message="input_ids"),
    Case("generate_text_and_input_ids", "/generate", generate(input_ids=[1, 2]),
         message="exactly one"),
    Case("generate_unknown_sampling_param", "/generate",
         generate(sampling_params={"max_tokens": 3}), message="max_tokens"),
    Case("generate_unknown_field", "/generate", generate(prompt="x"), message="prompt"),
    Case("generate_text_is_a_number", "/generate", {"text": 5}, message="text"),
    Case("generate_negative_max_new_tokens", "/generate",
         generate(sampling_params={"max_new_tokens": -1}), message="max_new_tokens"),
    Case("generate_batch_params_length_mismatch", "/generate",
         {"text": ["a", "b"], "sampling_params": [{}, {}, {}]}, message="sampling_params"),
    Case("generate_duplicate_batch_rids", "/generate",
         {"text": ["a", "b"], "rid": ["same", "same"]}, message="unique"),
    Case("generate_prompt_plus_max_new_tokens_past_context", "/generate",
         {"input_ids": [5] * 1000, "sampling_params": {"max_new_tokens": 100}},
         message="1024"),
    Case("generate_invalid_while_streaming", "/generate",
         generate(stream=True, sampling_params={"top_p": 2}), message="top_p"),
    Case("generate_unknown_model", "/generate", generate(model="no-such-model"), NOT_FOUND,
         "no-such-model"),
    Case("generate_return_hidden_states", "/generate", generate(return_hidden_states=True),
         message="return_hidden_states"),
    Case("generate_invalid_json_schema", "/generate",
         generate(sampling_params={"json_schema": "{not json"}), message="invalid json_schema"),
    Case("generate_two_grammars", "/generate",
         generate(sampling_params={"regex": "a", "ebnf": 'root ::= "a"'}), message="at most one"),
    Case("generate_invalid_stop_regex", "/generate",
         generate(sampling_params={"stop_regex": "(("}), message="stop_regex"),
    Case("generate_beam_search", "/generate", generate(sampling_params={"beam_width": 4}),
         message="beam_width"),
    Case("generate_custom_params", "/generate",
         generate(sampling_params={"custom_params": {"a": 1}}), message="custom_params"),
    Case("generate_stream_interval_zero", "/generate",
         generate(sampling_params={"stream_interval": 0}), message="stream_interval"),
    Case("generate_n_differs_across_prompts", "/generate",
         {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, message="n must be"),
    Case("generate_logprob_start_len_beyond_prompt", "/generate",
         generate(return_logprob=True, logprob_start_len=50), message="logprob_start_len"),
    Case("generate_token_ids_logprob_out_of_vocab", "/generate",
         generate(return_logprob=True, token_ids_logprob=[99999]), message="token_ids_logprob"),
    Case("generate_image_data", "/generate", generate(image_data="cat.png"),
         message="multimodal"),
    Case("generate_negative_top_logprobs_num", "/generate", generate(top_logprobs_num=-1),
         message="top_logprobs_num"),
    Case("concate_and_append_without_rids", "/concate_and_append_request", {},
         message="src_rids"),
    Case("abort_without_rid_or_abort_all", "/abort_request", {}, message="rid"),
    Case("tokenize_without_prompt", "/tokenize", {}, message="prompt"),
    Case("detokenize_out_of_vocab", "/detokenize", {"tokens": [99999]}, message="vocabulary"),
    Case("detokenize_tokens_not_a_list", "/detokenize", {"tokens": "abc"}, message="tokens"),
    # --- routing
    Case("unknown_route", "/no/such/route", method="GET", expected=NOT_FOUND),
    Case("unknown_model_card", "/v1/models/no-such-model", method="GET", expected=NOT_FOUND),
    Case("wrong_method", CHAT, method="GET", expected=(405, "invalid_request_error")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_a_4xx_error_object_and_the_server_stays_healthy(case: Case, client):
    assert_error_object(send(client, case), case)
    assert client.get("/health").status_code == 200
    assert_no_leak(client)

