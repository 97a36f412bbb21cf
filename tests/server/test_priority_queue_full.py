"""A full queue with priority scheduling (issue 36, docs/priority.md): once
``--max-queued-requests`` generations are in flight, a newcomer more important than the least
important waiting request evicts it (that one ends with SGLang's 503) and is served; a newcomer
no more important than every waiting one gets the 429 any request gets.

Generation is paused while the queue fills, so which requests wait is not a race: a request is
in the scheduler's queue once ``num_waiting_reqs`` counts it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import assert_no_leak, internal_state, paused, start_server
from tests.sync import STATE_TIMEOUT_S, in_background, wait_for

EVICTED = "The request is aborted by a higher priority request."


@pytest.fixture(scope="module")
def server(llama_path: Path):
    srv = start_server(llama_path, "--enable-priority-scheduling", "--max-running-requests", "1",
                       "--max-queued-requests", "3")
    yield srv
    srv.check_clean_stop()


def _generate(base_url: str, priority: int) -> httpx.Response:
    body = {"text": "Hello", "priority": priority,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    return httpx.post(f"{base_url}/generate", json=body, timeout=STATE_TIMEOUT_S)


def _queue(client: httpx.Client, base_url: str, priority: int, waiting: int):
    """Send a request and wait until the scheduler's queue holds ``waiting`` requests."""
    future = in_background(_generate, base_url, priority)
    wait_for(lambda: internal_state(client), lambda s: s["num_waiting_reqs"] == waiting,
             f"{waiting} requests waiting")
    return future


def test_a_more_important_request_evicts_the_least_important_waiting_one(server):
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S) as client:
        with paused(client):
            first = _queue(client, server.base_url, 0, 1)
            least = _queue(client, server.base_url, -5, 2)
            newest = _queue(client, server.base_url, 0, 3)
            # Full, and no more important than the least important waiting one: refused.
            r = client.post("/generate", json={"text": "Hi", "priority": -5})
            assert r.status_code == 429, r.text
            high = in_background(sdk.completions.create, model=server.model, prompt="Hi",
                                 max_tokens=3, temperature=0, extra_body={"priority": 10})
            evicted = least.result(STATE_TIMEOUT_S)
            assert evicted.status_code == 503, evicted.text
            assert evicted.json()["error"]["message"] == EVICTED
            # Equal priorities: the newest of them goes first; an equal newcomer is refused.
            wait_for(lambda: internal_state(client), lambda s: s["num_waiting_reqs"] == 3,
                     "the important request waiting")
            r = client.post("/generate", json={"text": "Hi", "priority": 0})
            assert r.status_code == 429, r.text
            second = in_background(sdk.completions.create, model=server.model, prompt="Hi",
                                   max_tokens=3, temperature=0, extra_body={"priority": 5})
            r = newest.result(STATE_TIMEOUT_S)
            assert r.status_code == 503 and r.json()["error"]["message"] == EVICTED, r.text
            assert not first.done()
        assert high.result(STATE_TIMEOUT_S).usage.completion_tokens == 3
        assert second.result(STATE_TIMEOUT_S).usage.completion_tokens == 3
        r = first.result(STATE_TIMEOUT_S)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3, r.text
        assert internal_state(client)["num_aborted_reqs"] == 2
        assert_no_leak(client)
