"""The operator routes through real HTTP on one server (tiny Llama A, --api-key and
--admin-api-key, metrics on, fault injection on for rids starting with ``inject-fault-``):
weights, memory, profiling, internal state, slow-down, GC, load, metrics, and the scheduler
surviving a request that fails inside it."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from tests.checkpoints import build_checkpoint
from tests.server.conftest import (
    assert_no_leak,
    continue_generation,
    internal_state,
    parse_sse,
    pause_generation,
    paused,
    start_server,
)
from tests.sync import UNTIL_ABORTED, in_background, wait_for

USER = {"Authorization": "Bearer user-key"}
ADMIN = {"Authorization": "Bearer admin-key"}
PROMPT_IDS = [17, 99, 203, 45, 310, 77]


@pytest.fixture(scope="module")
def ops_server(llama_path):
    os.environ["RADIXSERVE_TEST_INJECT_FAULTS"] = "1"
    try:
        srv = start_server(llama_path, "--api-key", "user-key", "--admin-api-key", "admin-key",
                           "--enable-metrics")
    finally:
        del os.environ["RADIXSERVE_TEST_INJECT_FAULTS"]
    yield srv
    srv.check_clean_stop()


@pytest.fixture
def ops(ops_server):
    with httpx.Client(base_url=ops_server.base_url, timeout=120, headers=ADMIN) as c:
        yield c


@pytest.fixture(scope="module")
def llama_b(tmp_path_factory) -> Path:
    """Model B: the same architecture and shapes as A, other weights."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt-llama-b"), "llama", seed=1)


def greedy(client: httpx.Client, n: int = 8) -> list[int]:
    body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                         "ignore_eos": True}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def hf_greedy(path: Path, n: int = 8) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n, pad_token_id=2)
    return out[0, len(PROMPT_IDS):].tolist()


def error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


# ---------------------------------------------------------------------------- weights
def test_update_weights_from_disk_serves_b_then_a_and_refusals_keep_serving(
    ops, llama_path, llama_b, checkpoint_factory
):
    assert greedy(ops) == hf_greedy(llama_path)
    r = ops.post("/update_weights_from_disk", json={"model_path": str(llama_b)})
    assert r.status_code == 200 and r.json()["success"], r.text
    expected_b = hf_greedy(llama_b)
    assert expected_b != hf_greedy(llama_path)
    assert greedy(ops) == expected_b
    # Refusals: the weights of B keep serving.
    assert "not found" in error(ops.post("/update_weights_from_disk",
                                         json={"model_path": "/no/such/dir"}), 400)
    qwen3 = checkpoint_factory("qwen3")
    assert "does not match" in error(ops.post("/update_weights_from_disk",
                                              json={"model_path": str(qwen3)}), 400)
    assert "load_format" in error(ops.post("/update_weights_from_disk", json={
        "model_path": str(llama_path), "load_format": "gguf"}), 400)
    assert "model_path" in error(ops.post("/update_weights_from_disk", json={}), 400)
    assert greedy(ops) == expected_b
    r = ops.post("/update_weights_from_disk", json={"model_path": str(llama_path)})
    assert r.status_code == 200
    assert greedy(ops) == hf_greedy(llama_path)
    assert_no_leak(ops)


@pytest.mark.parametrize("abort", [False, True])
def test_update_waits_for_or_aborts_a_running_request(ops, llama_path, abort):
    first = threading.Event()
    result: dict = {}

    def stream() -> None:
        # Long enough that the update reaches the scheduler before it ends (tests/sync.py).
        body = {"input_ids": PROMPT_IDS, "stream": True,
                "sampling_params": {"max_new_tokens": UNTIL_ABORTED, "ignore_eos": True}}
        with httpx.Client(base_url=str(ops.base_url), headers=ADMIN, timeout=120) as c, \
                c.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            head = next(lines)
            first.set()
            result["last"] = parse_sse([head, *lines])[-1]["meta_info"]

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    r = ops.post("/update_weights_from_disk",
                 json={"model_path": str(llama_path), "abort_all_requests": abort})
    assert r.status_code == 200, r.text
    t.join(120)
    reason = result["last"]["finish_reason"]["type"]
    assert reason == ("abort" if abort else "length")
    if not abort:
        assert result["last"]["completion_tokens"] == UNTIL_ABORTED
    assert_no_leak(ops)


def test_get_weights_by_name_returns_the_served_tensors(ops, llama_path):
    with safe_open(next(llama_path.glob("*.safetensors")), framework="pt") as f:
        for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
                     "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            r = ops.post("/get_weights_by_name", json={"name": name, "truncate_size": 3})
            assert r.status_code == 200, r.text
            expected = f.get_tensor(name)[:3].tolist()
            assert torch.allclose(torch.tensor(r.json()), torch.tensor(expected)), name
    assert "no parameter" in error(ops.post("/get_weights_by_name", json={"name": "nope"}), 400)
    assert "truncate_size" in error(ops.post("/get_weights_by_name", json={
        "name": "model.norm.weight", "truncate_size": 0}), 400)


# ---------------------------------------------------------------------------- memory
def test_release_and_resume_memory_occupation(ops):
    before = greedy(ops)
    r = ops.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]})
    assert r.status_code == 200, r.text
    message = error(ops.post("/generate", json={"text": "hi"}), 503)
    assert "released" in message
    error(ops.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503)
    assert "released" in error(ops.post("/get_weights_by_name", json={
        "name": "model.norm.weight"}), 400)
    assert ops.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    error(ops.post("/generate", json={"text": "hi"}), 503)  # the KV pool is still released
    assert ops.post("/resume_memory_occupation", json={}).status_code == 200
    assert greedy(ops) == before
    assert "tags" in error(ops.post("/release_memory_occupation", json={"tags": ["gpu"]}), 400)
    assert "tags" in error(ops.post("/resume_memory_occupation", json={"tags": []}), 400)
    assert_no_leak(ops)


# ---------------------------------------------------------------------------- profiling
def test_profile_writes_a_chrome_trace(ops, tmp_path):
    r = ops.post("/start_profile", json={"output_dir": str(tmp_path)})
    assert r.status_code == 200, r.text
    assert "already" in error(ops.post("/start_profile", json={}), 400)
    greedy(ops, 4)
    r = ops.post("/stop_profile")
    assert r.status_code == 200, r.text
    path = Path(r.json()["trace_path"])
    assert path.parent == tmp_path
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)  # complete events: the ops that ran
    assert "no profile" in error(ops.post("/stop_profile"), 400)
    # num_steps: it stops by itself, the trace is written before that step's outputs go out.
    r = ops.post("/start_profile", json={"output_dir": str(tmp_path / "n"), "num_steps": 2})
    greedy(ops, 6)
    assert json.loads(Path(r.json()["trace_path"]).read_text())["traceEvents"]
    assert "no profile" in error(ops.post("/stop_profile"), 400)
    assert "activities" in error(ops.post("/start_profile", json={"activities": ["TPU"]}), 400)
    assert "num_steps" in error(ops.post("/start_profile", json={"num_steps": 0}), 400)
    assert "num_steps" in error(ops.post("/start_profile", json={"num_steps": 201}), 400)
    assert "bogus" in error(ops.post("/start_profile", json={"bogus": 1}), 400)


# ---------------------------------------------------------------------------- knobs and load
def finish_type(base_url: str, max_new_tokens: int) -> str:
    """A greedy request on a connection of its own; its finish reason's type."""
    body = {"input_ids": PROMPT_IDS, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{base_url}/generate", json=body, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["finish_reason"]["type"]


def test_set_internal_state_limits_the_running_batch(ops):
    r = ops.post("/set_internal_state", json={"server_args": {"max_running_requests": 1}})
    assert r.status_code == 200 and r.json()["server_args"]["max_running_requests"] == 1
    try:
        with paused(ops):  # three requests queue up ...
            pending = [in_background(finish_type, str(ops.base_url), UNTIL_ABORTED)
                       for _ in range(3)]
            wait_for(lambda: internal_state(ops), lambda s: s["num_waiting_reqs"] == 3,
                     "three requests queued")
        # ... and the steps after the continue admitted one: the others wait for its row.
        pause_generation(ops)
        load = ops.get("/get_load").json()[0]
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (1, 2), load
        ops.post("/abort_request", json={"abort_all": True})
    finally:
        continue_generation(ops)
    assert [p.result(timeout=120) for p in pending] == ["abort"] * 3
    r = ops.post("/set_internal_state", json={"server_args": {"max_running_requests": 256}})
    assert r.status_code == 200
    for bad, needle in [({"bogus": 1}, "settable"), ({"max_running_requests": 0}, "integer"),
                        ({"max_prefill_tokens": "8"}, "integer"),
                        ({"max_running_requests": 10**6}, "slots")]:
        assert needle in error(ops.post("/set_internal_state", json={"server_args": bad}), 400)
    assert_no_leak(ops)


def test_slow_down_and_get_load_show_a_running_request(ops):
    assert ops.post("/slow_down", json={"forward_sleep_time": 0.1}).json()["forward_sleep_time"]
    start = time.monotonic()
    greedy(ops, 12)
    # Every step sleeps after it ran, so the reply can leave before the 12th step's sleep: 11
    # sleeps are a lower bound only, which no machine's speed can break.
    assert time.monotonic() - start >= 11 * 0.1
    assert ops.post("/slow_down", json={"forward_sleep_time": None}).json()[
        "forward_sleep_time"] is None
    held = in_background(finish_type, str(ops.base_url), UNTIL_ABORTED)
    try:
        wait_for(lambda: internal_state(ops), lambda s: s["num_running_reqs"] == 1,
                 "the request running")
        pause_generation(ops)  # it keeps running, with its KV, until the abort
        load = ops.get("/get_load").json()
        assert len(load) == 1 and load[0]["dp_rank"] == 0
        assert load[0]["num_running_reqs"] == 1, "finished before the pause"
        assert load[0]["num_tokens"] > 0 and 0 < load[0]["token_usage"] < 1
        ops.post("/abort_request", json={"abort_all": True})
    finally:
        continue_generation(ops)
    assert held.result(timeout=120) == "abort"
    assert "forward_sleep_time" in error(ops.post("/slow_down", json={
        "forward_sleep_time": -1}), 400)
    assert_no_leak(ops)
    assert ops.get("/get_load").json()[0]["num_reqs"] == 0


def test_freeze_gc_and_sglang_metric_names(ops):
    frozen = ops.post("/freeze_gc").json()["frozen_objects"]
    assert frozen["scheduler"] > 0 and frozen["tokenizer_manager"] > 0
    assert "generation" in error(ops.post("/freeze_gc", json={"generation": 2}), 400)
    greedy(ops, 4)
    text = ops.get("/metrics").text
    for name in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "token_usage",
                 "gen_throughput", "cache_hit_rate", "prompt_tokens_total",
                 "generation_tokens_total", "num_requests_total", "e2e_request_latency_seconds"):
        assert f"\nsglang:{name}" in text, name
    assert "\nradixserve:num_queued_reqs" in text


# ---------------------------------------------------------------------------- fault isolation
@pytest.mark.parametrize("rid", ["inject-fault-handle", "inject-fault-output-x"])
def test_a_request_failing_inside_the_scheduler_gets_500_and_others_go_on(ops, rid):
    def boom() -> httpx.Response:
        return httpx.post(f"{ops.base_url}/generate", headers=ADMIN, timeout=120, json={
            "text": "boom", "rid": rid, "sampling_params": {"max_new_tokens": 4}})

    # Both requests wait in the paused scheduler, so they run (and fail) side by side.
    with paused(ops):
        other = in_background(finish_type, str(ops.base_url), 120)
        wait_for(lambda: internal_state(ops), lambda s: s["num_waiting_reqs"] == 1,
                 "the other request queued")
        failing = in_background(boom)
        # It fails as the scheduler handles it, or (queued) when its output is processed.
        wait_for(lambda: {"failed": failing.done(), **internal_state(ops)},
                 lambda s: s["failed"] or s["num_waiting_reqs"] == 2, "the failing request in")
    assert "injected fault" in error(failing.result(timeout=120), 500)
    assert other.result(timeout=120) == "length"
    assert len(greedy(ops, 3)) == 3
    assert ops.get("/health").status_code == 200
    assert_no_leak(ops)


# ---------------------------------------------------------------------------- keys
ROUTES_USER = [
    ("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 1}),
    ("POST", "/v1/embeddings", {"input": "hi"}),
    ("POST", "/encode", {"text": "hi"}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/x", None),
    ("GET", "/get_model_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/get_load", None),
    ("GET", "/health_generate", None),
    ("GET", "/metrics", None),
    ("POST", "/abort_request", {"rid": "none"}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [10]}),
    ("POST", "/open_session", {"capacity_of_str_len": 100}),
    ("POST", "/close_session", {"session_id": "none"}),
]
ROUTES_ADMIN = [
    ("POST", "/flush_cache", None),
    ("POST", "/update_weights_from_disk", {"model_path": "/no/such/dir"}),
    ("POST", "/get_weights_by_name", {"name": "model.norm.weight"}),
    ("POST", "/release_memory_occupation", {"tags": ["nope"]}),
    ("POST", "/resume_memory_occupation", {"tags": ["nope"]}),
    ("POST", "/start_profile", {"num_steps": 0}),
    ("POST", "/stop_profile", None),
    ("POST", "/set_internal_state", {"server_args": {}}),
    ("POST", "/slow_down", {"forward_sleep_time": None}),
    ("POST", "/freeze_gc", None),
    ("POST", "/pause_generation", {"mode": "nope"}),  # as admin: a 400, nothing paused
    ("POST", "/continue_generation", None),
    ("GET", "/dashboard", None),
    ("GET", "/dashboard/state", None),
]


def call(c: httpx.Client, method: str, path: str, body, headers) -> httpx.Response:
    return c.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize(("method", "path", "body"), ROUTES_USER + ROUTES_ADMIN)
def test_every_route_needs_its_key(ops_server, method, path, body):
    admin = (method, path, body) in ROUTES_ADMIN
    with httpx.Client(base_url=ops_server.base_url, timeout=60) as c:
        assert call(c, method, path, body, {}).status_code == 401
        assert call(c, method, path, body, {"Authorization": "Bearer wrong"}).status_code == 401
        as_user = call(c, method, path, body, USER)
        assert (as_user.status_code == 401) == admin, as_user.text
        assert call(c, method, path, body, ADMIN).status_code != 401


def test_health_is_open_and_reports_a_responsive_scheduler(ops_server):
    with httpx.Client(base_url=ops_server.base_url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/dashboard/state?key=admin-key").status_code == 200
        assert c.get("/dashboard/state?key=user-key").status_code == 401
