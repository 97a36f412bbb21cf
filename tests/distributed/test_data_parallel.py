"""A ``--dp-size 2`` server (``shortest_queue``): the API suites, session affinity, load spread.

The whole OpenAI and native suites run unchanged against the two replicas behind the
data-parallel controller (the one test that expects a repeat to find its prompt cached takes its
two-replica form). ``get_server_info`` lists one internal state per replica:
every request of a session (plain or streaming) lands on the replica that holds it, and
concurrent requests spread over both.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import start_server
from tests.server.test_native_api import (  # noqa: F401 - the whole suite, on two replicas
    test_abort_all_ends_every_request,
    test_abort_request_ends_a_running_stream_with_abort,
    test_flush_cache_empties_the_prefix_cache,
    test_form_encoded_body_is_read_as_json,
    test_generate_accepts_the_fields_sglang_router_forwards,
    test_generate_batch_keeps_input_order,
    test_generate_batch_stream_tags_chunks_with_index,
    test_generate_logprobs_match_output_ids,
    test_generate_single_returns_text_ids_and_meta,
    test_generate_stream_chunks_are_cumulative_and_end_equal_to_non_stream,
    test_metrics_are_404_without_the_flag,
    test_model_info_health_and_health_generate,
    test_newer_sglang_info_routes_answer_like_the_get_routes,
    test_server_info_reports_args_sizes_and_memory,
    test_session_routes_open_continue_and_close,
    test_tokenize_detokenize_round_trip,
)
from tests.server.test_openai_api import (  # noqa: F401
    # all but test_repeated_prompt_reports_cached_tokens, replaced by its two-replica form
    # below: a repeat may go to the replica that has not seen the prompt
    oai,
    test_chat_completion_has_openai_shape_and_usage,
    test_chat_content_parts_equal_plain_content,
    test_chat_logprobs_cover_every_token_with_sorted_alternatives,
    test_chat_n2_choice_zero_equals_single_request_with_same_seed,
    test_chat_stop_string_cuts_the_text_before_it,
    test_chat_stream_n2_has_one_finish_reason_per_choice,
    test_chat_stream_text_equals_non_stream_text,
    test_completion_logprobs_align_with_tokens,
    test_completion_prompts_times_n_are_ordered_and_echoed,
    test_completion_stream_equals_non_stream_with_usage_last,
    test_completion_token_id_prompt_equals_text_prompt,
    test_models_list_and_retrieve,
    test_no_leak_after_openai_tests,
    test_unknown_model_is_404_and_bad_value_is_400,
    test_user_is_accepted_and_unknown_fields_are_refused_by_name,
)
from tests.sessions.conftest import random_ids

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(llama_path: Path):
    srv = start_server(llama_path, "--dp-size", "2", "--load-balance-method", "shortest_queue",
                       "--enable-streaming-session")
    yield srv
    srv.check_clean_stop()


def states(http: httpx.Client) -> list[dict[str, Any]]:
    return http.get("/get_server_info").json()["internal_states"]


def wait_idle_and_accounted(http: httpx.Client, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Both replicas idle, every KV slot free, evictable or held by a session (its slot, or
    its first turn's prompt, locked in the tree while the session holds its slot)."""
    deadline = time.monotonic() + timeout
    while True:
        replicas = states(http)
        if all(s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0 for s in replicas):
            break
        assert time.monotonic() < deadline, f"not idle after {timeout}s: {replicas}"
        time.sleep(0.05)
    for s in replicas:
        m = s["memory"]
        assert m["available_kv_tokens"] + m["evictable_kv_tokens"] + m["protected_kv_tokens"] + m[
            "session_held_kv_tokens"] == m["total_kv_tokens"], m
        assert s["session_ids"] or m["protected_kv_tokens"] == 0, s
        assert s["last_leak_check"]["ok"], s
    return replicas


def test_server_info_has_one_internal_state_per_replica(client):
    info = client.get("/get_server_info").json()
    assert info["dp_size"] == 2
    assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1]
    assert set(info["processes"]) == {"scheduler dp0", "scheduler dp1", "detokenizer",
                                      "data parallel controller"}
    load = client.get("/get_load").json()
    assert [entry["dp_rank"] for entry in load] == [0, 1]


def test_every_request_of_a_session_lands_on_its_replica(client):
    rng = random.Random(7)
    before = wait_idle_and_accounted(client)
    sessions = []
    for streaming in (False, True, False, True):
        r = client.post("/open_session", json={"capacity_of_str_len": 4096,
                                               "streaming": streaming})
        assert r.status_code == 200, r.text
        sessions.append(r.json())
    turns = 3
    for session in sessions:
        rid = None
        for _ in range(turns):
            params = {"id": session, **({"rid": rid} if rid else {})}
            r = client.post("/generate", json={
                "input_ids": random_ids(rng, 5), "session_params": params,
                "sampling_params": {"max_new_tokens": 4, **GREEDY}})
            assert r.status_code == 200, r.text
            rid = r.json()["meta_info"]["id"]
    after = wait_idle_and_accounted(client)
    home = {}
    for session in sessions:
        holders = [s["dp_rank"] for s in after if session in s["session_ids"]]
        assert len(holders) == 1, (session, after)
        home[session] = holders[0]
    assert set(home.values()) == {0, 1}, "idle replicas take new sessions in turn"
    for replica in (0, 1):
        received = after[replica]["num_received_reqs"] - before[replica]["num_received_reqs"]
        assert received == turns * sum(1 for h in home.values() if h == replica)
    # A duplicate id goes to the replica holding it, which refuses it.
    r = client.post("/open_session", json={"capacity_of_str_len": 64, "session_id": sessions[0]})
    assert r.status_code == 400 and "already exists" in r.text
    for session in sessions:
        assert client.post("/close_session", json={"session_id": session}).status_code == 200
    closed = wait_idle_and_accounted(client)
    assert all(not s["session_ids"] for s in closed)
    assert all(s["memory"]["session_held_kv_tokens"] == 0 for s in closed)


def test_concurrent_requests_spread_over_both_replicas(client, server):
    before = wait_idle_and_accounted(client)
    n = 8
    codes: list[int] = []

    def run(i: int) -> None:
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            r = c.post("/generate", json={"text": f"request {i}",
                                          "sampling_params": {"max_new_tokens": 24, **GREEDY}})
            codes.append(r.status_code)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert codes == [200] * n
    after = wait_idle_and_accounted(client)
    spread = [a["num_received_reqs"] - b["num_received_reqs"] for a, b in zip(after, before,
                                                                              strict=True)]
    assert sum(spread) == n
    assert min(spread) >= n // 2 - 2, f"requests per replica: {spread}"


def test_a_request_naming_a_replica_runs_there(client):
    before = wait_idle_and_accounted(client)
    for name in ("routed_dp_rank", "data_parallel_rank"):
        r = client.post("/generate", json={"text": "pinned", name: 1,
                                           "sampling_params": {"max_new_tokens": 2, **GREEDY}})
        assert r.status_code == 200, r.text
    after = wait_idle_and_accounted(client)
    assert [a["num_received_reqs"] - b["num_received_reqs"]
            for a, b in zip(after, before, strict=True)] == [0, 2]
    for body, param in [({"routed_dp_rank": 2}, "routed_dp_rank"),
                        ({"data_parallel_rank": -1}, "data_parallel_rank"),
                        ({"routed_dp_rank": 0, "data_parallel_rank": 1}, "routed_dp_rank")]:
        r = client.post("/generate", json={"text": "x", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_flush_cache_empties_both_replicas(client):
    for i in range(4):  # at least one request on each replica
        client.post("/generate", json={"text": f"cache me {i} " * 8,
                                       "sampling_params": {"max_new_tokens": 2, **GREEDY}})
    assert all(s["memory"]["evictable_kv_tokens"] > 0 for s in wait_idle_and_accounted(client))
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    assert all(s["memory"]["evictable_kv_tokens"] == 0 for s in wait_idle_and_accounted(client))


def test_a_prompt_repeated_three_times_hits_the_cache_of_a_replica_that_ran_it(
    oai,  # noqa: F811 - the fixture imported above
    server,
):
    """Three requests on two replicas: whatever the policy, two of them meet on one replica, and
    the later one finds the prompt cached there."""
    prompt = "A long shared prefix about radix trees and data-parallel replicas. " * 4
    kwargs = dict(model=server.model, prompt=prompt, max_tokens=2, temperature=0.0)
    cached = [oai.completions.create(**kwargs).usage.prompt_tokens_details.cached_tokens
              for _ in range(3)]
    assert cached[0] == 0 and max(cached[1:]) > 0, cached
