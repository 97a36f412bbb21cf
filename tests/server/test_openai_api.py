"""The OpenAI-compatible API, driven by the official ``openai`` SDK against a real server."""

from __future__ import annotations

import math

import openai
import pytest

from tests.server.conftest import assert_no_leak

GREEDY = {"temperature": 0.0}
# The tiny random model rarely samples EOS; ignore_eos makes lengths exact anyway.
EXACT = {"extra_body": {"ignore_eos": True}}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def _collect_chat_stream(stream) -> tuple[dict[int, str], dict[int, list[str]], list]:
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes, chunks


def test_chat_completion_has_openai_shape_and_usage(oai, server):
    r = oai.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=6,
                                    **GREEDY, **EXACT)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert isinstance(r.created, int) and r.model == server.model
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason == "length"
    u = r.usage
    assert u.completion_tokens == 6 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_text_equals_non_stream_text(oai, server):
    kwargs = dict(model=server.model, messages=MESSAGES, max_tokens=10, **GREEDY, **EXACT)
    full = oai.chat.completions.create(**kwargs).choices[0].message.content
    stream = oai.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    texts, finishes, chunks = _collect_chat_stream(stream)
    assert texts == {0: full}
    assert finishes == {0: ["length"]}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_n2_has_one_finish_reason_per_choice(oai, server):
    stream = oai.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=5, n=2, seed=3, stream=True, **EXACT
    )
    texts, finishes, _ = _collect_chat_stream(stream)
    assert sorted(texts) == [0, 1]
    assert finishes == {0: ["length"], 1: ["length"]}


def test_chat_n2_choice_zero_equals_single_request_with_same_seed(oai, server):
    kwargs = dict(model=server.model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11,
                  **EXACT)
    two = oai.chat.completions.create(**kwargs, n=2)
    one = oai.chat.completions.create(**kwargs)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == one.choices[0].message.content
    assert two.usage.completion_tokens == 16


def test_chat_logprobs_cover_every_token_with_sorted_alternatives(oai, server):
    r = oai.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4,
                                    logprobs=True, top_logprobs=3, **GREEDY, **EXACT)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for tok in content:
        tops = [t.logprob for t in tok.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(tok.logprob, tops[0], rel_tol=1e-4, abs_tol=1e-4)
        assert tok.logprob <= 0.0 and tok.bytes == list(tok.token.encode())


def test_chat_content_parts_equal_plain_content(oai, server):
    kwargs = dict(model=server.model, max_tokens=5, **GREEDY, **EXACT)
    plain = oai.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kwargs)
    parts = oai.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], **kwargs
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_chat_stop_string_cuts_the_text_before_it(oai, server):
    kwargs = dict(model=server.model, messages=MESSAGES, **GREEDY, **EXACT)
    text = oai.chat.completions.create(max_tokens=16, **kwargs).choices[0].message.content
    stop = text[4:6]
    assert stop.strip(), f"output too short or blank to pick a stop string: {text!r}"
    r = oai.chat.completions.create(max_tokens=16, stop=[stop], **kwargs)
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_completion_prompts_times_n_are_ordered_and_echoed(oai, server):
    prompts = ["The sky is", "Numbers: 1 2 3"]
    r = oai.completions.create(model=server.model, prompt=prompts, n=2, max_tokens=3,
                               echo=True, **GREEDY, **EXACT)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert c.text.startswith(prompts[c.index // 2]) and c.finish_reason == "length"
    assert r.usage.completion_tokens == 12


def test_completion_token_id_prompt_equals_text_prompt(oai, server, client):
    ids = client.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    kwargs = dict(model=server.model, max_tokens=5, **GREEDY, **EXACT)
    by_text = oai.completions.create(prompt="Once upon a time", **kwargs)
    by_ids = oai.completions.create(prompt=ids, **kwargs)
    batch = oai.completions.create(prompt=[ids, ids], **kwargs)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.text for c in batch.choices] == [by_text.choices[0].text] * 2


def test_completion_stream_equals_non_stream_with_usage_last(oai, server):
    kwargs = dict(model=server.model, prompt="def main():", max_tokens=8, **GREEDY, **EXACT)
    full = oai.completions.create(**kwargs).choices[0].text
    chunks = list(oai.completions.create(**kwargs, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes.count("length") == 1 and finishes[-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_completion_logprobs_align_with_tokens(oai, server):
    r = oai.completions.create(model=server.model, prompt="Hello", max_tokens=4, logprobs=2,
                               **GREEDY, **EXACT)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_repeated_prompt_reports_cached_tokens(oai, server):
    prompt = "A long shared prefix about radix trees and caches. " * 4
    kwargs = dict(model=server.model, prompt=prompt, max_tokens=2, **GREEDY)
    oai.completions.create(**kwargs)
    second = oai.completions.create(**kwargs)
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_user_is_accepted_and_unknown_fields_are_refused_by_name(oai, server):
    r = oai.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=2,
                                    user="someone", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=2,
                                    extra_body={"not_a_field": 1})
    assert e.value.body["param"] == "not_a_field"
    assert "unknown parameter" in e.value.body["message"]


def test_models_list_and_retrieve(oai, server):
    (card,) = oai.models.list().data
    assert card.id == server.model and card.model_extra["max_model_len"] == 1024
    assert oai.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_unknown_model_is_404_and_bad_value_is_400(oai, server):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-nope", messages=MESSAGES, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=2,
                                    temperature=-1)
    assert "temperature" in e.value.body["message"]


def test_no_leak_after_openai_tests(client):
    assert_no_leak(client)
