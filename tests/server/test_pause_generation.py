"""``/pause_generation`` and ``/continue_generation`` over HTTP, on both schedules.

Each mode on a real server: what happens to the running and the waiting requests, what
``get_server_info`` reports meanwhile, that flush_cache is refused while paused requests hold KV,
that a request held by a pause gives the greedy output of an uninterrupted run, and that no KV
leaks. (Token-for-token equality after a pause that cut a decode short, in every mode, is checked
step by step against transformers in ``tests/managers/test_pause_generation.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import assert_no_leak, internal_state, paused, start_server
from tests.sync import UNTIL_ABORTED, in_background, wait_for

GREEDY = {"temperature": 0.0, "ignore_eos": True}
SHORT = 12


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlap"])
def server(request, llama_path: Path):
    flags = ["--enable-overlap-schedule"] if request.param else []
    srv = start_server(llama_path, *flags)
    yield srv
    srv.check_clean_stop()


@pytest.fixture(autouse=True)
def no_leak_and_not_paused(client):
    yield
    assert internal_state(client)["paused"] is False
    assert_no_leak(client)


def generate(base_url: str, prompt: str, max_new_tokens: int) -> dict:
    """A plain greedy ``/generate`` on a connection of its own (callable from any thread)."""
    r = httpx.post(f"{base_url}/generate", timeout=120, json={
        "text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, **GREEDY}})
    assert r.status_code == 200, r.text
    return r.json()


def events(lines) -> list[dict]:
    """The payloads of the rest of a native stream (without ``[DONE]``)."""
    return [json.loads(line[6:]) for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"]


def first_event(lines) -> dict:
    return json.loads(next(line for line in lines if line.startswith("data: "))[6:])


def stream_body(prompt: str) -> dict:
    return {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": UNTIL_ABORTED, **GREEDY}}


def test_in_place_pause_queues_new_requests_until_the_continue(client, server):
    reference = generate(server.base_url, "queued while paused", SHORT)
    with paused(client):
        assert internal_state(client)["paused"] is True
        held = in_background(generate, server.base_url, "queued while paused", SHORT)
        state = wait_for(lambda: internal_state(client), lambda s: s["num_waiting_reqs"] == 1,
                         "the request queued in the paused scheduler")
        assert state["num_running_reqs"] == 0 and not held.done()
        refused = client.post("/flush_cache")
        assert refused.status_code == 400 and "1 waiting" in refused.json()["error"]["message"]
    assert held.result(timeout=120)["output_ids"] == reference["output_ids"]


def assert_ran_to_the_end(first: dict, final: dict) -> None:
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert final["meta_info"]["completion_tokens"] == UNTIL_ABORTED
    assert final["output_ids"][: len(first["output_ids"])] == first["output_ids"]


def test_in_place_pause_freezes_a_running_stream_with_its_kv(client, server):
    prompt = "frozen in place"
    with httpx.Client(base_url=server.base_url, timeout=120) as sc, \
            sc.stream("POST", "/generate", json=stream_body(prompt)) as r:
        lines = r.iter_lines()
        first = first_event(lines)
        with paused(client):
            state = internal_state(client)
            assert state["num_running_reqs"] == 1, "the stream finished before the pause"
            memory = state["memory"]
            held = memory["total_kv_tokens"] - memory["available_kv_tokens"] - memory[
                "evictable_kv_tokens"]
            assert held >= first["meta_info"]["prompt_tokens"], "the paused request keeps its KV"
            refused = client.post("/flush_cache")
            assert refused.status_code == 400 and "1 running" in refused.text
        final = events(lines)[-1]
    assert_ran_to_the_end(first, final)


def test_retract_pause_sends_running_requests_back_to_the_queue(client, server):
    retracted = internal_state(client)["num_retracted_reqs"]
    with httpx.Client(base_url=server.base_url, timeout=120) as sc, \
            sc.stream("POST", "/generate", json=stream_body("retracted and resumed")) as r:
        lines = r.iter_lines()
        first = first_event(lines)
        with paused(client, "retract"):
            state = internal_state(client)
            assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 1
            assert state["num_retracted_reqs"] == retracted + 1
            memory = state["memory"]
            assert memory["protected_kv_tokens"] == 0
            assert memory["free_req_slots"] == memory["total_req_slots"]
            assert (memory["available_kv_tokens"] + memory["evictable_kv_tokens"]
                    == memory["total_kv_tokens"]), "its KV went to the prefix cache"
        final = events(lines)[-1]
    assert_ran_to_the_end(first, final)


def test_abort_pause_returns_every_request_and_the_cache_can_be_flushed(client, server):
    with httpx.Client(base_url=server.base_url, timeout=120) as sc, \
            sc.stream("POST", "/generate", json=stream_body("aborted by a pause")) as r:
        lines = r.iter_lines()
        first_event(lines)
        with paused(client):
            waiting = in_background(generate, server.base_url, "waits, then is aborted", SHORT)
            wait_for(lambda: internal_state(client), lambda s: s["num_waiting_reqs"] == 1,
                     "the second request queued")
            aborted = internal_state(client)["num_aborted_reqs"]
            r2 = client.post("/pause_generation", json={"mode": "abort"})
            assert r2.status_code == 200 and r2.json()["status"] == "ok"
            state = internal_state(client)
            assert state["paused"] is True and state["num_aborted_reqs"] == aborted + 2
            assert state["num_running_reqs"] == state["num_waiting_reqs"] == 0
            assert waiting.result(timeout=120)["meta_info"]["finish_reason"]["type"] == "abort"
            assert client.post("/flush_cache").status_code == 200
            later = in_background(generate, server.base_url, "sent after the abort", SHORT)
            wait_for(lambda: internal_state(client), lambda s: s["num_waiting_reqs"] == 1,
                     "a request sent while paused queued")
        final = events(lines)[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert later.result(timeout=120)["meta_info"]["completion_tokens"] == SHORT


def test_an_empty_body_pauses_with_abort_and_continue_is_idempotent(client):
    r = client.post("/pause_generation")
    assert r.status_code == 200 and r.json() == {
        "status": "ok", "message": "Generation paused successfully."}
    assert internal_state(client)["paused"] is True
    for _ in range(2):
        r = client.post("/continue_generation")
        assert r.status_code == 200 and r.json()["status"] == "ok"
    assert internal_state(client)["paused"] is False


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/pause_generation", {"mode": "bogus"}, "mode"),
    ("/pause_generation", {"mode": None}, "mode"),
    ("/pause_generation", {"mode": "abort", "wait": True}, "wait"),
    ("/continue_generation", {"mode": "abort"}, "mode"),
])
def test_bad_bodies_are_400_naming_the_field_and_change_nothing(client, server, path, body,
                                                               param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert internal_state(client)["paused"] is False
    assert generate(server.base_url, "still serving", 2)["meta_info"]["completion_tokens"] == 2


def test_pause_and_continue_are_post_only(client):
    for path in ("/pause_generation", "/continue_generation"):
        assert client.get(path).status_code == 405
