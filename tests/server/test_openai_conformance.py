"""Details of the OpenAI routes that SGLang's and vLLM's clients rely on, through the ``openai``
SDK and httpx against a real server serving the model under a name of its own:

- ``echo`` of a token-id prompt is its text without special tokens; ``echo`` with ``logprobs``
  puts the prompt tokens' logprobs first (checked against ``transformers``);
- the model card's ``id`` and ``root`` are the served name, ``max_model_len`` is on both routes;
- chat ``continue_final_message`` / ``add_generation_prompt``: the prompt is the one
  ``transformers``' ``apply_chat_template`` builds, the greedy output token for token the same;
  chat ``echo`` starts the content with the continued message.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.server.conftest import assert_no_leak, start_server

SERVED = "conform-model"
GREEDY = {"temperature": 0.0}
EXACT = {"extra_body": {"ignore_eos": True}}
TEXT = "Once upon a time"
CONVERSATION = [
    {"role": "user", "content": "Write a line."},
    {"role": "assistant", "content": "Once upon a"},
]


@pytest.fixture(scope="module")
def conform(llama_path):
    srv = start_server(llama_path, "--served-model-name", SERVED)
    srv.model = SERVED  # the ready line names the served model
    yield srv
    srv.check_clean_stop()


@pytest.fixture(scope="module")
def oai(conform):
    with openai.OpenAI(base_url=conform.base_url + "/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture
def http(conform):
    with httpx.Client(base_url=conform.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf(llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(llama_path)


def bos_prompt(tok) -> list[int]:
    """TEXT's ids after a BOS, as clients that tokenize themselves send them."""
    return [tok.bos_token_id, *tok.encode(TEXT)]


# ---------------------------------------------------------------------------- completions echo
def test_echo_of_token_ids_is_their_text_without_special_tokens(oai, hf):
    _, tok = hf
    ids = bos_prompt(tok)
    kwargs = dict(model=SERVED, max_tokens=3, **GREEDY, **EXACT)
    plain = oai.completions.create(prompt=ids, **kwargs).choices[0].text
    single = oai.completions.create(prompt=ids, echo=True, **kwargs).choices[0].text
    assert single == TEXT + plain
    batch = oai.completions.create(prompt=[ids, tok.encode("The sky")], echo=True, n=2,
                                   **kwargs)
    texts = [c.text for c in batch.choices]
    assert texts[:2] == [single, single] and all(t.startswith("The sky") for t in texts[2:])
    chunks = list(oai.completions.create(prompt=ids, echo=True, stream=True, **kwargs))
    assert chunks[0].choices[0].text.startswith(TEXT)
    assert "".join(c.choices[0].text for c in chunks) == single


def _reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Row p: transformers' log-distribution of the token after ids[:p + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_puts_the_prompt_logprobs_first(oai, hf):
    model, tok = hf
    ids = bos_prompt(tok)
    n_prompt, n_out = len(ids), 4
    kwargs = dict(model=SERVED, prompt=ids, max_tokens=n_out, logprobs=3, **GREEDY, **EXACT)
    plain = oai.completions.create(**kwargs).choices[0]
    echoed = oai.completions.create(echo=True, **kwargs).choices[0]
    assert echoed.text == TEXT + plain.text
    lp = echoed.logprobs
    sizes = {len(lp.tokens), len(lp.token_logprobs), len(lp.top_logprobs), len(lp.text_offset)}
    assert sizes == {n_prompt + n_out}
    assert lp.tokens[:n_prompt] == [tok.decode([t]) for t in ids]
    # The first token has nothing before it; the others are scored as transformers scores them.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _reference_logprobs(model, ids)
    expected = [ref[p - 1, ids[p]].item() for p in range(1, n_prompt)]
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(expected, abs=1e-3)
    for p in range(1, n_prompt):
        # The three most likely (tokens that decode alike share a key: fewer entries).
        best = torch.topk(ref[p - 1], 3).values.tolist()
        values = lp.top_logprobs[p].values()
        assert values and all(any(v == pytest.approx(b, abs=1e-3) for b in best) for v in values)
    # The generated part is the plain request's, its offsets shifted by the echoed text.
    assert lp.tokens[n_prompt:] == plain.logprobs.tokens
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.logprobs.token_logprobs,
                                                         abs=1e-4)
    # Offsets index the choice's text: the BOS adds no character to it.
    assert lp.text_offset[:2] == [0, 0]
    assert [o - len(TEXT) for o in lp.text_offset[n_prompt:]] == plain.logprobs.text_offset
    for tid, offset in zip(ids[1:], lp.text_offset[1:n_prompt], strict=True):
        assert echoed.text[offset:].startswith(tok.decode([tid]))


def test_streamed_echo_with_logprobs_equals_the_whole_response(oai, hf):
    _, tok = hf
    kwargs = dict(model=SERVED, prompt=bos_prompt(tok), max_tokens=4, logprobs=2, echo=True,
                  **GREEDY, **EXACT)
    whole = oai.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in oai.completions.create(stream=True, **kwargs) if c.choices]
    # The echo and the prompt's logprobs come with the first chunk; every chunk has logprobs.
    assert chunks[0].text.startswith(TEXT) and chunks[0].logprobs.token_logprobs[0] is None
    assert all(c.logprobs.tokens for c in chunks)
    assert "".join(c.text for c in chunks) == whole.text
    for field in ("tokens", "text_offset", "top_logprobs"):
        assert sum((getattr(c.logprobs, field) for c in chunks), []) == \
            getattr(whole.logprobs, field)


# ---------------------------------------------------------------------------- models
def test_model_card_names_the_served_model(oai, http):
    (card,) = oai.models.list().data
    retrieved = oai.models.retrieve(SERVED)
    for c in (card, retrieved):
        assert c.id == SERVED and c.object == "model"
        assert c.model_extra["root"] == SERVED and c.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    for path in ("/v1/models/no-such-model", "/v1/models/org/no-such-model"):
        r = http.get(path)
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["type"] == "not_found_error" and "no-such-model" in error["message"]


# ---------------------------------------------------------------------------- chat prompts
def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n argmax steps (EOS may come, as with ignore_eos)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@pytest.mark.parametrize("fields,template_kwargs", [
    ({"continue_final_message": True}, {"continue_final_message": True}),
    ({"continue_final_message": True, "add_generation_prompt": False},
     {"continue_final_message": True}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
    ({}, {"add_generation_prompt": True}),
], ids=["continue", "continue-no-generation-prompt", "no-generation-prompt", "default"])
def test_chat_prompt_and_greedy_output_are_transformers(oai, http, hf, fields, template_kwargs):
    model, tok = hf
    ids = tok.apply_chat_template(CONVERSATION, return_dict=True,
                                  **template_kwargs)["input_ids"]
    expected = _hf_greedy(model, ids, 6)
    # The prompt's ids, cached by a generation, are all the chat prompt reuses (not its last).
    r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text
    r = oai.chat.completions.create(model=SERVED, messages=CONVERSATION, max_tokens=6,
                                    logprobs=True, **GREEDY,
                                    extra_body={"ignore_eos": True, **fields})
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    assert [t.token for t in r.choices[0].logprobs.content] == [tok.decode([t]) for t in expected]


def test_continuing_differs_from_answering(hf):
    """The prompts above are not all the same one (the test above can tell them apart)."""
    _, tok = hf
    continued, closed, answered = (
        tok.apply_chat_template(CONVERSATION, return_dict=True, **kwargs)["input_ids"]
        for kwargs in ({"continue_final_message": True}, {"add_generation_prompt": False},
                       {"add_generation_prompt": True})
    )
    assert tok.decode(continued).endswith("Once upon a")
    assert len({tuple(continued), tuple(closed), tuple(answered)}) == 3


def test_chat_echo_starts_the_content_with_the_continued_message(oai):
    kwargs = dict(model=SERVED, messages=CONVERSATION, max_tokens=5, logprobs=True, **GREEDY)
    body = {"ignore_eos": True, "continue_final_message": True}
    plain = oai.chat.completions.create(**kwargs, extra_body=body).choices[0]
    echoed = oai.chat.completions.create(**kwargs, extra_body={**body, "echo": True}).choices[0]
    assert echoed.message.content == "Once upon a" + plain.message.content
    # Logprobs are the generated tokens' only.
    assert [t.token for t in echoed.logprobs.content] == \
        [t.token for t in plain.logprobs.content]
    chunks = [c.choices[0] for c in oai.chat.completions.create(
        **kwargs, stream=True, extra_body={**body, "echo": True}) if c.choices]
    assert chunks[0].delta.role == "assistant" and chunks[0].delta.content == "Once upon a"
    assert "".join(c.delta.content or "" for c in chunks) == echoed.message.content
    # Without an assistant message last, there is nothing to echo.
    user_last = oai.chat.completions.create(model=SERVED, messages=CONVERSATION[:1],
                                            max_tokens=3, **GREEDY,
                                            extra_body={"ignore_eos": True})
    echo_user_last = oai.chat.completions.create(model=SERVED, messages=CONVERSATION[:1],
                                                 max_tokens=3, **GREEDY,
                                                 extra_body={"ignore_eos": True, "echo": True})
    assert echo_user_last.choices[0].message.content == user_last.choices[0].message.content


# ---------------------------------------------------------------------------- bad inputs
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD_CHAT = [
    ({"continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message", "Cannot set both"),
    ({"continue_final_message": True, "messages": CONVERSATION[:1]},
     "continue_final_message", "not from the assistant"),
    ({"continue_final_message": True,
      "messages": [*CONVERSATION[:1], {"role": "assistant", "content": "", "tool_calls": [CALL]}]},
     "continue_final_message", "tool_calls"),
    ({"continue_final_message": "sure"}, "continue_final_message", "continue_final_message"),
    ({"add_generation_prompt": [1]}, "add_generation_prompt", "add_generation_prompt"),
    ({"echo": {"on": 1}}, "echo", "echo"),
    ({"chat_template_kwargs": {"continue_final_message": True}}, "chat_template_kwargs",
     "continue_final_message"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fields,param,message", BAD_CHAT)
def test_bad_chat_prompt_controls_are_400_naming_the_field(http, fields, param, message, stream):
    body = {"model": SERVED, "messages": CONVERSATION, "max_tokens": 2, "stream": stream,
            **fields}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"]


@pytest.mark.parametrize("prompt,stream", [
    ([5, -1], False), ([5, -1], True), ([2**40], False), ([2**40], True),
    ([[5, 6], [7, 10**9]], False),
], ids=["negative", "negative-stream", "overflowing", "overflowing-stream", "second-prompt"])
def test_echo_of_token_ids_outside_the_vocabulary_is_400(http, prompt, stream):
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1,
            "stream": stream}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert "vocabulary" in r.json()["error"]["message"]


def test_no_leak_and_still_serving(http, oai):
    assert_no_leak(http)
    assert oai.completions.create(model=SERVED, prompt="hi", max_tokens=2,
                                  **EXACT).usage.completion_tokens == 2
