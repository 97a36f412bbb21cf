"""API key (401), body limit (413), admission limit (429) and Prometheus metrics."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import assert_no_leak, internal_state, paused, start_server
from tests.sync import in_background, wait_for

KEY = "test-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
# --chat-template given as a string: the prompt is the last message's text alone.
LAST_MESSAGE_TEMPLATE = "{{ messages[-1]['content'] }}"


@pytest.fixture(scope="module")
def limited(llama_path):
    srv = start_server(llama_path, "--api-key", KEY, "--enable-metrics",
                       "--max-queued-requests", "1", "--served-model-name", "tiny",
                       "--chat-template", LAST_MESSAGE_TEMPLATE)
    # The ready line names the served model, not the path.
    srv.model = "tiny"
    yield srv
    srv.check_clean_stop()


@pytest.fixture
def authed(limited):
    with httpx.Client(base_url=limited.base_url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
    {"Authorization": f"Basic {KEY}"},
], ids=["missing", "wrong-key", "no-scheme", "basic-scheme"])
@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/generate"),
    ("GET", "/get_server_info"), ("GET", "/metrics"), ("GET", "/no/such/route"),
])
def test_every_route_but_health_needs_the_api_key(limited, headers, method, path):
    r = httpx.request(method, limited.base_url + path, headers=headers, json={}, timeout=30)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"


def test_health_needs_no_key_and_the_right_key_works(limited, authed):
    assert httpx.get(limited.base_url + "/health").status_code == 200
    assert authed.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_openai_sdk_with_wrong_and_right_key(limited):
    url = limited.base_url + "/v1"
    with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0) as good:
        r = good.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens <= 2


def test_chat_template_flag_replaces_the_tokenizer_template(authed):
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    chat = authed.post("/v1/chat/completions", json={
        **body, "messages": [{"role": "system", "content": "ignored"},
                             {"role": "user", "content": "Once upon a time"}]}).json()
    plain = authed.post("/v1/completions", json={**body, "prompt": "Once upon a time"}).json()
    assert chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]


def test_body_over_the_limit_is_413_before_parsing(limited, authed):
    big = b'{"text": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    r = authed.post("/generate", content=big)
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: the size is counted while reading
        for _ in range(9):
            yield b"a" * (1024 * 1024)

    r = authed.post("/v1/completions", content=chunks())
    assert r.status_code == 413
    assert authed.get("/health").status_code == 200
    assert_no_leak(authed)


def test_request_past_max_queued_requests_is_429_with_retry_after(limited, authed):
    def hold() -> int:
        body = {"text": "hold", "sampling_params": {"max_new_tokens": 4}}
        with httpx.Client(base_url=limited.base_url, headers=AUTH, timeout=120) as holder:
            return holder.post("/generate", json=body).status_code

    with paused(authed):  # the held request stays in flight until the continue
        held = in_background(hold)
        wait_for(lambda: internal_state(authed), lambda s: s["num_waiting_reqs"] == 1,
                 "the held request queued")
        r = authed.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        # Non-generation routes are not limited.
        assert authed.get("/get_model_info").status_code == 200
    assert held.result(timeout=120) == 200
    # Admission opens again once the server has counted the held request out (a moment after
    # its reply was sent): a refused attempt changes nothing, so retrying until then is safe.
    def attempt() -> dict:
        body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
        return {"status": authed.post("/generate", json=body).status_code}

    assert wait_for(attempt, lambda s: s["status"] != 429, "admission reopened")["status"] == 200
    assert_no_leak(authed)


def _metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    assert values, f"{name} not in metrics"
    return sum(values)


def test_metrics_count_tokens_and_latencies(authed):
    before = authed.get("/metrics").text
    body = {"text": "measure me", "stream": True,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    with authed.stream("POST", "/generate", json=body) as r:
        list(r.iter_lines())
    authed.post("/generate", json={"text": "measure me", "sampling_params": {"max_new_tokens": 3}})
    r = authed.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = r.text
    for name in ("radixserve:num_running_reqs", "radixserve:num_queued_reqs",
                 "radixserve:token_usage", "radixserve:cache_hit_rate"):
        _metric(after, name)
    assert (_metric(after, "radixserve:generation_tokens_total")
            - _metric(before, "radixserve:generation_tokens_total")) >= 8
    assert _metric(after, "radixserve:prompt_tokens_total") > 0
    assert _metric(after, "radixserve:cached_tokens_total") > 0  # the second shared a prefix
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds"):
        name = f"radixserve:{hist}_count"
        assert _metric(after, name) > _metric(before, name)
