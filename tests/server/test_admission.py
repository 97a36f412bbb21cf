"""Admission control and amplification bounds, through the real server.

``--max-queued-requests`` counts generations (prompts × n) once the body is parsed: a slow
body takes no place before it has arrived, and ``n`` or a batch cannot multiply one request.
``--max-n`` and ``--max-batch-size`` bound one request (400 naming the field);
``--max-top-logprobs-num`` bounds the native ``top_logprobs_num``; ``--max-completion-tokens``
caps a request without ``max_tokens`` and refuses one asking for more.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import (
    assert_no_leak,
    continue_generation,
    internal_state,
    pause_generation,
    paused,
    start_server,
)
from tests.sync import in_background, wait_for

QUEUE, MAX_N, MAX_BATCH, MAX_TOP, MAX_TOKENS = 4, 3, 5, 5, 12
TEMPLATE = "{{ messages[-1]['content'] }}"


@pytest.fixture(scope="module")
def server(llama_path):
    srv = start_server(
        llama_path, "--max-queued-requests", str(QUEUE), "--max-n", str(MAX_N),
        "--max-batch-size", str(MAX_BATCH), "--max-top-logprobs-num", str(MAX_TOP),
        "--max-completion-tokens", str(MAX_TOKENS), "--chat-template", TEMPLATE,
    )
    yield srv
    srv.check_clean_stop()


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c
        assert_no_leak(c)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_server_info_reports_the_limits(http):
    info = http.get("/get_server_info").json()
    assert (info["max_queued_requests"], info["max_n"], info["max_batch_size"],
            info["max_top_logprobs_num"], info["max_completion_tokens"]) == (
        QUEUE, MAX_N, MAX_BATCH, MAX_TOP, MAX_TOKENS)


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"text": "hi", "sampling_params": {"n": MAX_N + 1, "max_new_tokens": 1}}),
    ("/v1/completions", {"prompt": "hi", "n": MAX_N + 1, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "n": MAX_N + 1, "max_tokens": 1}),
], ids=["generate", "completions", "chat"])
def test_n_past_max_n_is_400_naming_n(http, path, body):
    error = error_of(http.post(path, json=body), 400)
    assert error["param"] == "n" and "--max-n" in error["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/generate", {"text": ["a"] * (MAX_BATCH + 1)}, "text"),
    ("/generate", {"input_ids": [[5, 6]] * (MAX_BATCH + 1)}, "input_ids"),
    ("/v1/completions", {"prompt": ["a"] * (MAX_BATCH + 1), "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6]] * (MAX_BATCH + 1), "max_tokens": 1}, "prompt"),
    ("/encode", {"text": ["a"] * (MAX_BATCH + 1)}, "text"),
    ("/v1/embeddings", {"input": ["a"] * (MAX_BATCH + 1)}, "input"),
], ids=["generate-text", "generate-ids", "completions-text", "completions-ids", "encode",
        "embeddings"])
def test_more_prompts_than_max_batch_size_is_400_naming_the_field(http, path, body, param):
    error = error_of(http.post(path, json=body), 400)
    assert error["param"] == param and "--max-batch-size" in error["message"]


def test_a_request_asking_more_generations_than_the_queue_holds_is_400(http):
    # 2 prompts × n 3 = 6 generations: more than --max-queued-requests 4 could ever admit.
    body = {"text": ["a", "b"], "sampling_params": {"n": 3, "max_new_tokens": 1}}
    error = error_of(http.post("/generate", json=body), 400)
    assert "6 generations" in error["message"] and "--max-queued-requests" in error["message"]
    r = http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4  # exactly the limit


def test_the_queue_counts_generations_not_requests(http, server):
    def post(body: dict) -> int:
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            return c.post("/v1/completions", json=body).status_code

    def waiting() -> dict:
        return internal_state(http)

    with paused(http):  # admitted requests stay queued until the continue
        three = in_background(post, {"prompt": "x", "n": 3, "max_tokens": 1})
        wait_for(waiting, lambda s: s["num_waiting_reqs"] == 3, "n=3 queued")
        assert http.get("/get_server_info").json()["queued_generations"] == 3
        error = error_of(http.post("/v1/completions", json={"prompt": "x", "n": 2,
                                                           "max_tokens": 1}), 429)
        assert error["type"] == "rate_limit_error" and "limit is 4" in error["message"]
        one = in_background(post, {"prompt": "y", "max_tokens": 1})
        wait_for(waiting, lambda s: s["num_waiting_reqs"] == 4, "the fourth generation queued")
        r = http.post("/generate", json={"text": "z", "sampling_params": {"max_new_tokens": 1}})
        assert error_of(r, 429)["code"] == "rate_limit_exceeded"
        assert int(r.headers["Retry-After"]) >= 1
    assert three.result(timeout=120) == one.result(timeout=120) == 200

    def attempt() -> dict:  # the server counts them out a moment after their replies
        body = {"prompt": "again", "n": 3, "max_tokens": 1}
        return {"status": http.post("/v1/completions", json=body).status_code}

    assert wait_for(attempt, lambda s: s["status"] != 429, "admission reopened")["status"] == 200


def _send_head(port: int, body: bytes) -> socket.socket:
    """A /generate whose headers and first half of body are sent; the rest is up to the test."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    head = (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    sock.sendall(head + body[: len(body) // 2])
    return sock


def _status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    sock.close()
    return int(data.split(b" ", 2)[1])


def test_slow_bodies_are_admitted_only_once_parsed(http, server):
    """Five requests start sending their body while nothing is in flight; only four of them
    fit once their bodies have arrived (checking before reading admitted all five)."""
    body = json.dumps({"text": "slow", "sampling_params": {"max_new_tokens": 1}}).encode()
    pause_generation(http)
    try:
        socks = [_send_head(server.port, body) for _ in range(QUEUE + 1)]
        for sock in socks:
            sock.sendall(body[len(body) // 2:])
        wait_for(lambda: internal_state(http), lambda s: s["num_waiting_reqs"] == QUEUE,
                 "four slow requests queued")
        statuses = [in_background(_status, sock) for sock in socks]
        refused = wait_for(lambda: {"done": [f for f in statuses if f.done()]},
                           lambda s: len(s["done"]) == 1, "one refused")["done"][0]
        assert refused.result() == 429
    finally:
        continue_generation(http)
    assert sorted(f.result(timeout=120) for f in statuses) == [200] * QUEUE + [429]


def test_top_logprobs_num_past_the_bound_is_400(http):
    body = {"text": "hi", "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    error = error_of(http.post("/generate", json={**body, "top_logprobs_num": MAX_TOP + 1}), 400)
    assert "top_logprobs_num" in error["message"] and "--max-top-logprobs-num" in error["message"]
    out = http.post("/generate", json={**body, "top_logprobs_num": MAX_TOP}).json()
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == 2 and all(len(top) == MAX_TOP for top in tops)


def test_max_completion_tokens_caps_requests_without_max_tokens(http):
    plain = {"temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json={"prompt": "Once", **plain}).json()
    assert r["usage"]["completion_tokens"] == MAX_TOKENS
    assert r["choices"][0]["finish_reason"] == "length"
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Once"}], **plain}).json()
    assert chat["usage"]["completion_tokens"] == MAX_TOKENS
    # The native default (128 new tokens) is clamped to the cap, not refused by it.
    native = http.post("/generate", json={"text": "Once", "sampling_params": plain})
    assert native.status_code == 200, native.text
    assert native.json()["meta_info"]["completion_tokens"] == MAX_TOKENS


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": MAX_TOKENS + 1}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_TOKENS + 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": MAX_TOKENS + 1}),
], ids=["generate", "completions", "chat"])
def test_asking_for_more_than_max_completion_tokens_is_400(http, path, body):
    error = error_of(http.post(path, json=body), 400)
    assert "--max-completion-tokens" in error["message"]
