"""The HTTP server on the GPU with its defaults there (triton attention, CUDA graphs, the
overlap schedule) under KV pressure: 48 concurrent fp32 greedy requests in a pool a quarter of
their working set, all arriving at once (so decode retracts), chunked prefill of 64 tokens, then
follow-ups that extend earlier prompts (radix hits); every output equal to transformers' greedy
output on the same GPU."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.cuda.helpers import DEVICE, ON_CUDA, requires_device
from tests.server.conftest import assert_no_leak, internal_state, paused, start_server
from tests.sync import wait_for

pytestmark = requires_device
NUM_REQUESTS = 48
NEW_TOKENS = 24
# Prompts of 8 to 23 tokens, each its own (as tests/reliability/test_kv_pressure.py).
PROMPTS = [[(7 * i + 13 * j) % 400 + 10 for j in range(8 + i % 16)] for i in range(NUM_REQUESTS)]
WORKING_SET = sum(len(p) + NEW_TOKENS for p in PROMPTS)
POOL_TOKENS = WORKING_SET // 4
# Sent one at a time afterwards, each after the prompt it extends (so that prompt is cached): the
# last one is longer than two prefill chunks.
BASES = [PROMPTS[0], PROMPTS[5], [(3 * j) % 300 + 40 for j in range(150)]]
FOLLOW_UPS = [p + [17, 3 + i] for i, p in enumerate(BASES)]


@pytest.fixture(scope="module")
def gpu_server(llama64_path):
    srv = start_server(llama64_path, "--device", DEVICE, "--dtype", "float32",
                       "--max-total-tokens", str(POOL_TOKENS), "--max-running-requests", "48",
                       "--chunked-prefill-size", "64", "--enable-metrics")
    yield srv
    srv.check_clean_stop()


def _generate(client: httpx.Client, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS,
                                                  "temperature": 0, "ignore_eos": True}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_greedy_under_kv_pressure_equals_transformers(gpu_server, llama64_path,
                                                                 hf_on_device):
    limits = httpx.Limits(max_connections=len(PROMPTS))
    with httpx.Client(base_url=gpu_server.base_url, timeout=300) as c, \
            httpx.Client(base_url=gpu_server.base_url, timeout=300, limits=limits) as many, \
            ThreadPoolExecutor(len(PROMPTS)) as pool:
        with paused(c):  # all arrive before the scheduler admits any
            futures = [pool.submit(_generate, many, ids) for ids in PROMPTS]
            wait_for(lambda: internal_state(c),
                     lambda s: s["num_waiting_reqs"] == len(PROMPTS),
                     "every request queued in the paused scheduler")
        outs = [f.result() for f in futures]
        follow_ups = []
        for base, ids in zip(BASES, FOLLOW_UPS, strict=True):
            _generate(c, base)
            follow_ups.append(_generate(c, ids))
        state = internal_state(c)
        assert_no_leak(c)
        metrics = c.get("/metrics")
        assert metrics.status_code == 200
    assert state["num_retracted_reqs"] > 0, state
    if ON_CUDA:
        assert state["num_overlapped_steps"] > 0, state  # the default on CUDA
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in follow_ups)  # radix hits
    hf = hf_on_device(llama64_path)
    for ids, out in zip(PROMPTS + FOLLOW_UPS, outs + follow_ups, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids], device=DEVICE), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
        assert out["output_ids"] == ref[0, len(ids):].tolist(), ids


def test_openai_completions_and_streaming_on_the_gpu(gpu_server):
    with httpx.Client(base_url=gpu_server.base_url, timeout=120) as c:
        r = c.post("/v1/completions", json={"model": gpu_server.model, "prompt": "hello world",
                                            "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        with c.stream("POST", "/generate", json={
                "text": "hello", "stream": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                    "ignore_eos": True}}) as s:
            chunks = [json.loads(line.removeprefix("data: ")) for line in s.iter_lines()
                      if line.startswith("data: {")]
        assert chunks and chunks[-1]["meta_info"]["completion_tokens"] == 4
