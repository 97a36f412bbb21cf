"""Servers with ``--speculative-algorithm NGRAM`` and STANDALONE over real HTTP: streamed
``/generate`` and OpenAI completions with ``n > 1`` (and logprobs) give the plain server's greedy
tokens; the acceptance figures
appear in ``/get_server_info`` and ``/metrics`` under SGLang's names; no KV is leaked."""

from __future__ import annotations

import httpx
import pytest

from tests.managers.speculative_helpers import repetitive_prompts
from tests.server.conftest import (
    CONSTRAINED_FLAGS,
    assert_no_leak,
    internal_state,
    parse_sse,
    start_server,
)

GREEDY = {"temperature": 0.0, "max_new_tokens": 40}


@pytest.fixture(scope="module")
def spec_client(llama_path):
    srv = start_server(
        llama_path, *CONSTRAINED_FLAGS, "--speculative-algorithm", "NGRAM",
        "--speculative-num-draft-tokens", "6", "--enable-metrics", "--page-size", "4",
    )
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        yield c
    srv.check_clean_stop()


def _stream_ids(client: httpx.Client, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": GREEDY, "stream": True}
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        chunks = parse_sse(list(r.iter_lines()))
    for prev, nxt in zip(chunks, chunks[1:], strict=False):
        assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    return chunks[-1]["output_ids"]


def test_streams_and_n_completions_equal_the_plain_server(client, spec_client):
    prompts = repetitive_prompts()
    for ids in prompts:
        assert _stream_ids(spec_client, ids) == _stream_ids(client, ids)
    model = client.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompts[5], "n": 2, "temperature": 0.0, "max_tokens": 30}
    plain = client.post("/v1/completions", json=body).json()
    spec = spec_client.post("/v1/completions", json=body).json()
    assert "choices" in spec, spec
    texts = [c["text"] for c in spec["choices"]]
    assert texts == [c["text"] for c in plain["choices"]] and texts[0] == texts[1]
    state = internal_state(spec_client)
    assert state["spec_num_accepted_drafts"] > 0
    assert state["avg_spec_accept_length"] > 1.0
    metrics = spec_client.get("/metrics").text
    assert "sglang:spec_accept_length{" in metrics
    assert_no_leak(spec_client)


@pytest.fixture(scope="module")
def draft_client(llama_path):
    """STANDALONE with the target's own int8 copy as the draft model."""
    srv = start_server(
        llama_path, "--speculative-algorithm", "STANDALONE",
        "--speculative-draft-model-path", str(llama_path),
        "--speculative-draft-model-quantization", "int8", "--speculative-num-steps", "4",
        "--page-size", "4", "--cpu-kernel-autotune", "off",  # no kernel timing for two models
    )
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        yield c
    srv.check_clean_stop()


def test_draft_model_streams_and_n_completions_with_logprobs_equal_the_plain_server(
    client, draft_client
):
    prompts = repetitive_prompts()
    for ids in prompts[:4]:
        assert _stream_ids(draft_client, ids) == _stream_ids(client, ids)
    model = client.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompts[5], "n": 2, "temperature": 0.0, "max_tokens": 30,
            "logprobs": 0}
    plain = client.post("/v1/completions", json=body).json()
    spec = draft_client.post("/v1/completions", json=body).json()
    assert "choices" in spec, spec
    for got, want in zip(spec["choices"], plain["choices"], strict=True):
        assert got["text"] == want["text"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(
            want["logprobs"]["token_logprobs"], abs=1e-4)
    state = internal_state(draft_client)
    assert state["spec_num_accepted_drafts"] > 0
    assert_no_leak(draft_client)
    state = internal_state(draft_client)
    assert state["spec_draft_used_kv_tokens"] == 0 and state["spec_draft_reqs"] == 0
