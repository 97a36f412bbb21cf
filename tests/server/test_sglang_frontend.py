"""SGLang's frontend language against radixserve: its HTTP client, request for request.

``Frontend`` sends exactly what ``sglang.lang.backend.runtime_endpoint.RuntimeEndpoint`` sends
(sglang 0.5.x): ``generate`` and ``generate_stream`` put every key of ``to_srt_kwargs()`` into
``sampling_params`` (defaults as the frontend has them: empty tuples and ``None``), ``select``
caches the common prefix with ``max_new_tokens: 0``, then scores each choice by its input
logprobs from ``logprob_start_len = prompt_tokens - 2`` (token healing) and picks the best
length-normalised one, ``cache_prefix`` and ``fork`` reuse one prefix, ``run_batch`` runs
programs concurrently. SGLang itself is not installed for the tests (it is a client-side
library; ``pip install --no-deps sglang`` runs the real thing against a server by hand).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from tests.constrained.schemas import assert_valid
from tests.server.conftest import assert_no_leak

REGEX_INT = r"[-+]?[0-9]+[ \n]*"  # the frontend's regex for gen(dtype=int)


def srt_kwargs(**overrides: Any) -> dict[str, Any]:
    """``SglSamplingParams().to_srt_kwargs()`` with the frontend's defaults, as JSON sends them."""
    params = {
        "max_new_tokens": 128, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [],
        "stop_regex": [], "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False, "regex": None,
        "json_schema": None,
    }
    return {**params, **overrides}


class Frontend:
    """The requests of ``RuntimeEndpoint``, over httpx."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=120)
        self.model_info = self._ok(self.http.get("/get_model_info"))

    @staticmethod
    def _ok(r: httpx.Response) -> Any:
        assert r.status_code == 200, r.text  # the frontend raises on anything else
        return r.json()

    def _body(self, text: str, params: dict[str, Any], **logprob_options: Any) -> dict:
        body = {"text": text, "sampling_params": {
            "skip_special_tokens": True, "spaces_between_special_tokens": True, **params}}
        body.update({k: v for k, v in logprob_options.items() if v is not None})
        return body

    def generate(self, text: str, params: dict[str, Any], **logprob_options: Any):
        out = self._ok(self.http.post("/generate", json=self._body(text, params,
                                                                   **logprob_options)))
        return out["text"], out["meta_info"]

    def generate_stream(self, text: str, params: dict[str, Any]):
        body = {**self._body(text, params), "stream": True}
        pos = 0
        with self.http.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                if line == "data: [DONE]":
                    break
                data = json.loads(line[5:].strip("\n"))
                chunk = data["text"][pos:]
                pos += len(chunk)
                yield chunk, data["meta_info"]

    def cache_prefix(self, prefix: str) -> dict:
        return self._ok(self.http.post("/generate", json={
            "text": prefix, "sampling_params": {"max_new_tokens": 0}}))

    def select(self, text: str, choices: list[str]) -> tuple[int, list[float]]:
        """The index the frontend picks (token_length_normalized) and the scores it used."""
        prompt_len = self.cache_prefix(text)["meta_info"]["prompt_tokens"]
        logprob_start_len = max(prompt_len - 2, 0)
        outs = self._ok(self.http.post("/generate", json={
            "text": [text + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True,
            "logprob_start_len": logprob_start_len,
        }))
        scores = []
        for out in outs:
            entries = out["meta_info"]["input_token_logprobs"]
            values = [e[0] for e in entries if e[0]]
            normalized = sum(values) / len(values)
            healed_text = entries[0][-1]
            if text.endswith(healed_text):  # no token healing: drop the extra token
                normalized = (normalized * len(entries) - entries[0][0]) / (len(entries) - 1)
            scores.append(normalized)
        return max(range(len(choices)), key=lambda i: scores[i]), scores

    def concatenate_and_append(self, src_rids: list[str], dst_rid: str) -> httpx.Response:
        return self.http.post("/concate_and_append_request",
                              json={"src_rids": src_rids, "dst_rid": dst_rid})


@pytest.fixture(scope="module")
def frontend(server):
    client = Frontend(server.base_url)
    yield client
    client.http.close()


@pytest.fixture(scope="module")
def hf_model(llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(llama_path)


def test_model_info_is_what_the_frontend_reads(frontend, server):
    info = frontend.model_info
    assert info["model_path"] == server.model and info["tokenizer_path"] == server.model
    assert info["is_generation"] is True and info["architectures"] == ["LlamaForCausalLM"]
    assert frontend.http.get("/model_info").json() == info
    assert frontend.http.get("/server_info").json()["model_path"] == server.model


def test_gen_sends_every_srt_key_and_is_served(frontend):
    text, meta = frontend.generate("Q: say something\nA:",
                                   srt_kwargs(max_new_tokens=6, temperature=0, ignore_eos=True))
    assert meta["completion_tokens"] == 6 and meta["finish_reason"]["type"] == "length"
    # The same request with keys left out gives the same text: null and [] mean defaults.
    again = frontend.http.post("/generate", json={
        "text": "Q: say something\nA:",
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    assert again["text"] == text


def test_gen_with_dtype_int_uses_the_int_regex_and_its_stops(frontend):
    params = srt_kwargs(max_new_tokens=16, regex=REGEX_INT, stop=[" ", "\n"], temperature=0.7)
    for seed in range(3):
        text, meta = frontend.generate(f"Number {seed}:", params)
        # What the frontend then does with it: int(text).
        assert re.fullmatch(REGEX_INT, text) and isinstance(int(text), int), text


def test_gen_with_json_schema_and_logprob_options(frontend):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    text, meta = frontend.generate(
        "JSON:", srt_kwargs(max_new_tokens=64, json_schema=json.dumps(schema), temperature=0),
        return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True,
    )
    assert_valid(text, schema)
    entries = meta["output_token_logprobs"]
    assert len(entries) == meta["completion_tokens"]
    decoded = "".join(e[2] for e in entries)
    assert decoded.startswith(text)  # entries carry each token's text (then EOS)
    assert all(len(tops) == 2 for tops in meta["output_top_logprobs"])


def test_gen_stream_chunks_add_up_to_the_generated_text(frontend):
    params = srt_kwargs(max_new_tokens=10, temperature=0, ignore_eos=True)
    chunks = list(frontend.generate_stream("Stream:", params))
    full, meta = frontend.generate("Stream:", params)
    assert "".join(c for c, _ in chunks) == full
    assert chunks[-1][1]["finish_reason"]["type"] == "length"


def test_n_samples_natively(frontend):
    out = frontend.http.post("/generate", json={
        "text": ["a", "b"], "rid": "nat",
        "sampling_params": {"n": 3, "max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True},
    }).json()
    assert len(out) == 6
    assert [o["meta_info"]["id"] for o in out] == [
        "nat_0_0", "nat_1_0", "nat_0_1", "nat_1_1", "nat_0_2", "nat_1_2"]
    assert len({tuple(o["output_ids"]) for o in out}) > 2  # samples differ


def test_select_picks_the_choice_transformers_logprobs_prefer(frontend, hf_model):
    model, tok = hf_model
    prompt = "Q: which animal barks?\nA: the"
    choices = [" dog", " elephant in the room", " cat"]
    picked, scores = frontend.select(prompt, choices)

    # The same decision from transformers' log-softmax, following the frontend's arithmetic.
    prompt_len = len(tok.encode(prompt))
    start = max(prompt_len - 2, 0)
    expected = []
    for choice in choices:
        ids = tok.encode(prompt + choice)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
        values = [float(logprobs[p - 1, ids[p]]) for p in range(start, len(ids))]
        normalized = sum(values) / len(values)
        if prompt.endswith(tok.decode([ids[start]])):
            normalized = (normalized * len(values) - values[0]) / (len(values) - 1)
        expected.append(normalized)
    assert scores == pytest.approx(expected, abs=1e-4)
    assert picked == max(range(3), key=lambda i: expected[i])
    assert sorted(expected)[-1] - sorted(expected)[-2] > 1e-3, "the decision is not a tie"


def test_cache_prefix_and_fork_reuse_the_prefix(frontend):
    prefix = "A long shared system prompt that every fork of this program starts with. " * 3
    cached = frontend.cache_prefix(prefix)
    assert cached["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert cached["text"] == "" and cached["output_ids"] == []
    params = srt_kwargs(max_new_tokens=4, temperature=0.9)
    with ThreadPoolExecutor(3) as pool:  # fork(3) / run_batch: concurrent requests
        metas = list(pool.map(lambda i: frontend.generate(prefix + f"Branch {i}:", params)[1],
                              range(3)))
    prefix_tokens = cached["meta_info"]["prompt_tokens"]
    assert all(m["cached_tokens"] >= prefix_tokens - 2 for m in metas)


def test_concatenate_and_append_is_a_clear_501(frontend):
    r = frontend.concatenate_and_append(["a", "b"], "c")
    assert r.status_code == 501
    assert "not implemented" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("image_data", "http://x/cat.png"), ("lora_path", "adapter"), ("bootstrap_host", "h"),
     ("return_hidden_states", True), ("priority", 1), ("routed_dp_rank", 1)],
)
def test_unimplemented_generate_fields_with_a_value_are_400_naming_them(frontend, field, value):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, field: value}
    r = frontend.http.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    # At their defaults (null, false, 0, []) they are accepted.
    unused = {"image_data": None, "lora_path": None, "bootstrap_host": None,
              "return_hidden_states": False, "priority": None, "routed_dp_rank": 0}[field]
    assert frontend.http.post("/generate", json={**body, field: unused}).status_code == 200


def test_no_leak_after_the_frontend(client):
    assert_no_leak(client)
