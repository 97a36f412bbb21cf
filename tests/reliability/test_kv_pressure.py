"""KV pressure: a pool a quarter the size of what 64 concurrent requests need.

The scheduler must admit what fits, retract running requests when decode runs out of KV, re-run
them later, and still give every request exactly the greedy output (fp32) it gets alone on an
idle server: zero failures, outputs identical token for token, retractions observed in the
scheduler's own counters, no KV leaked.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import assert_no_leak, internal_state, paused, start_server
from tests.sync import wait_for

NUM_REQUESTS = 64
NEW_TOKENS = 24
# Prompts of 8 to 23 tokens, each its own (no shared prefix that the cache could keep).
PROMPTS = [[(7 * i + 13 * j) % 400 + 10 for j in range(8 + i % 16)] for i in range(NUM_REQUESTS)]
WORKING_SET = sum(len(p) + NEW_TOKENS for p in PROMPTS)
POOL_TOKENS = WORKING_SET // 4


@pytest.fixture(scope="module")
def small_pool_server(llama_path):
    # The memory invariant is checked after every step, through every retraction.
    srv = start_server(llama_path, "--max-total-tokens", str(POOL_TOKENS),
                       env={"RADIXSERVE_STRICT_MEM_CHECK": "busy"})
    yield srv
    srv.check_clean_stop()


def _generate(client: httpx.Client, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS,
                                                  "temperature": 0, "ignore_eos": True}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_64_requests_in_a_quarter_of_their_kv_match_the_one_at_a_time_outputs(
        small_pool_server):
    assert max(len(p) for p in PROMPTS) + NEW_TOKENS < POOL_TOKENS < WORKING_SET // 3
    with httpx.Client(base_url=small_pool_server.base_url, timeout=300) as c:
        alone = [_generate(c, ids)["output_ids"] for ids in PROMPTS]
        assert c.post("/flush_cache").status_code == 200
        before = internal_state(c)
        assert before["max_total_num_tokens"] == POOL_TOKENS

        # All 64 arrive while generation is paused, so the scheduler faces them at once.
        limits = httpx.Limits(max_connections=NUM_REQUESTS)
        with httpx.Client(base_url=small_pool_server.base_url, timeout=300,
                          limits=limits) as many, ThreadPoolExecutor(NUM_REQUESTS) as pool:
            with paused(c):
                futures = [pool.submit(_generate, many, ids) for ids in PROMPTS]
                wait_for(lambda: internal_state(c),
                         lambda s: s["num_waiting_reqs"] == NUM_REQUESTS,
                         "all 64 requests queued in the paused scheduler")
            together = [f.result() for f in futures]

        after = internal_state(c)
        assert after["num_retracted_reqs"] > before["num_retracted_reqs"], after
        assert after["num_aborted_reqs"] == before["num_aborted_reqs"]
        for i, out in enumerate(together):
            assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
            assert out["output_ids"] == alone[i], f"request {i} differs from its run alone"
        assert_no_leak(c)
