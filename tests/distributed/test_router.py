"""Two radixserve workers behind SGLang's own router (``sglang-router``, its Rust binary).

The router registers each worker through the routes it calls (``/health``, ``/server_info``
then ``/get_server_info``, ``/model_info`` then ``/get_model_info``), re-serialises ``/generate``
bodies with SGLang's defaults of fields radixserve must accept, forwards ``/v1/*``, fans
``/flush_cache`` out and polls ``/get_load`` (its ``/get_loads``). Every OpenAI and native test
that can pass through it runs unchanged through it (17 of 32). The others ask for what the router
does not carry, as sglang-router behaves here: batches of prompts, token-id
completion prompts and form-encoded bodies (it answers them itself, with no JSON body or a 415);
aborts, ``/tokenize``, ``/detokenize``, ``/metrics``, sessions and one worker's own info and
memory (routes it does not forward); the workers' refusal of unknown fields (it drops fields it
does not know first); ``max_model_len`` on ``/v1/models`` (it answers that route itself). Its
own SGLang fields reach the workers at SGLang's defaults, which they accept. ``cache_aware`` keeps
a prefix tree of the text it routed per worker: a prompt that extends one sent before goes to the
worker holding its KV, which shows as ``cached_tokens``.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port, start_server
from tests.server.test_native_api import (  # noqa: F401 - run here through the router
    test_generate_accepts_the_fields_sglang_router_forwards,
    test_generate_logprobs_match_output_ids,
    test_generate_single_returns_text_ids_and_meta,
    test_generate_stream_chunks_are_cumulative_and_end_equal_to_non_stream,
    test_model_info_health_and_health_generate,
)
from tests.server.test_openai_api import (  # noqa: F401
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
    test_repeated_prompt_reports_cached_tokens,
    test_unknown_model_is_404_and_bad_value_is_400,
)

ROUTER_START_TIMEOUT_S = 180.0
ROUTER_STOP_TIMEOUT_S = 30.0
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@dataclass
class Router:
    """The router process, with the attributes the API tests read from a server."""

    proc: subprocess.Popen
    base_url: str
    model: str
    log: Path

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def start_router(worker_urls: list[str], model: str) -> Router:
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log", delete=False) as f:
        log = Path(f.name)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--worker-urls", *worker_urls, "--policy", "cache_aware",
             # Its Prometheus exporter would take a fixed port: two routers would collide.
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--log-level", "warn"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    router = Router(proc, f"http://127.0.0.1:{port}", model, log)
    deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
    while True:
        try:
            ready = httpx.get(router.base_url + "/readiness", timeout=5)
            if ready.status_code == 200 and ready.json()["healthy_workers"] == len(worker_urls):
                return router
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = router.log_tail()
            stop_router(router)
            raise RuntimeError(f"the router did not register both workers:\n{tail}")
        time.sleep(0.2)


def stop_router(router: Router) -> None:
    if router.proc.poll() is None:
        router.proc.send_signal(signal.SIGTERM)
        try:
            router.proc.wait(ROUTER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            router.proc.kill()
            router.proc.wait()
            raise
    router.log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def workers(llama_path: Path) -> Iterator[list]:
    started = []
    try:
        for _ in range(2):
            started.append(start_server(llama_path))
        yield started
    finally:
        for worker in started:
            worker.check_clean_stop()


@pytest.fixture(scope="module")
def server(workers, llama_path: Path) -> Iterator[Router]:
    """The router: the API tests' ``server`` (and, through it, their ``client``)."""
    router = start_router([w.base_url for w in workers], str(llama_path))
    yield router
    stop_router(router)


def received(workers) -> list[int]:
    """Requests each worker's scheduler has received so far."""
    return [httpx.get(w.base_url + "/get_server_info", timeout=30).json()
            ["internal_states"][0]["num_received_reqs"] for w in workers]


def test_router_registered_both_workers_from_their_info_routes(client, workers, llama_path):
    listed = client.get("/workers").json()["workers"]
    assert sorted(w["url"] for w in listed) == sorted(w.base_url for w in workers)
    assert all(w["is_healthy"] for w in listed)
    assert {w["model_id"] for w in listed} == {str(llama_path)}
    info = client.get("/get_model_info").json()  # answered from a worker's /model_info
    assert info["model_path"] == str(llama_path) and info["context_length"] == 1024


@pytest.fixture
def fresh_client(workers, llama_path: Path) -> Iterator[httpx.Client]:
    """A new router on the same workers: its prefix trees start empty."""
    for worker in workers:
        assert httpx.post(worker.base_url + "/flush_cache", timeout=30).status_code == 200
    router = start_router([w.base_url for w in workers], str(llama_path))
    try:
        with httpx.Client(base_url=router.base_url, timeout=60) as c:
            yield c
    finally:
        stop_router(router)


def generate_one(client: httpx.Client, text: str, **fields) -> dict:
    r = client.post("/generate", json={"text": text, **fields,
                                       "sampling_params": {"max_new_tokens": 1, **GREEDY}})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


@contextlib.contextmanager
def held_request(client: httpx.Client, workers, text: str) -> Iterator[None]:
    """A streamed request through the router that keeps running until the block ends: every
    worker sleeps 0.5 s per step (``/slow_down``) and it asks for 500 tokens; it is aborted on
    leaving, and its stream read to the end."""
    rid = f"held-{uuid.uuid4().hex}"
    for worker in workers:
        assert httpx.post(worker.base_url + "/slow_down", json={"forward_sleep_time": 0.5},
                          timeout=30).status_code == 200
    try:
        with client.stream("POST", "/generate", json={
            "text": text, "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 500, **GREEDY},
        }) as held:
            lines = held.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it runs
            try:
                yield
            finally:
                for worker in workers:
                    httpx.post(worker.base_url + "/abort_request", json={"rid": rid}, timeout=30)
            assert [line for line in lines if line][-1] == "data: [DONE]"
    finally:
        for worker in workers:
            httpx.post(worker.base_url + "/slow_down", json={"forward_sleep_time": 0}, timeout=30)


def test_cache_aware_sends_a_repeated_prefix_to_the_worker_that_has_it(fresh_client, workers):
    """Prefix A goes to some worker; while a request extending A runs there, a new prefix B goes
    to the idle worker (for text it has not seen the router picks the least loaded worker).
    Then each prefix, extended, returns to the worker that holds its KV."""
    client = fresh_client
    before = received(workers)
    prefix_a, prefix_b = (f"{uuid.uuid4().hex} " * 6 for _ in range(2))
    first_a = generate_one(client, prefix_a)
    home_a = [a - b for a, b in zip(received(workers), before, strict=True)].index(1)
    with held_request(client, workers, prefix_a + "held"):
        first_b = generate_one(client, prefix_b)
    spread = [a - b for a, b in zip(received(workers), before, strict=True)]
    assert spread[home_a] == 2 and spread[1 - home_a] == 1, spread
    for prefix, first in ((prefix_a, first_a), (prefix_b, first_b)):
        # Only the worker that served the prefix holds it (each prefix is new text).
        extended = generate_one(client, prefix + "and a new ending")
        assert extended["cached_tokens"] >= first["prompt_tokens"] - 2, (first, extended)
    spread = [a - b for a, b in zip(received(workers), before, strict=True)]
    assert spread[home_a] == 3 and spread[1 - home_a] == 2, spread


def test_router_reads_each_workers_load(client, workers):
    """The router's ``/get_loads`` is what it polls from each worker's ``/get_load``."""
    idle = {w["worker"]: w["load"] for w in client.get("/get_loads").json()["workers"]}
    assert idle == {w.base_url: 0 for w in workers}
    with held_request(client, workers, f"{uuid.uuid4().hex} is running"):
        loads = {w["worker"]: w["load"] for w in client.get("/get_loads").json()["workers"]}
        tokens = {w.base_url: httpx.get(w.base_url + "/get_load", timeout=30).json()[0]
                  ["num_tokens"] for w in workers}
    busy = max(tokens, key=tokens.get)
    assert tokens[busy] > 0 and loads[busy] > 0, (loads, tokens)
    assert [loads[u] for u in tokens if u != busy] == [0], loads


def test_flush_cache_through_the_router_empties_both_workers(client, workers):
    for i in range(4):
        client.post("/generate", json={"text": f"{uuid.uuid4().hex} flush me {i}",
                                       "sampling_params": {"max_new_tokens": 2, **GREEDY}})
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.json()["workers_flushed"] == 2, r.text
    for worker in workers:
        state = httpx.get(worker.base_url + "/get_server_info", timeout=30).json()
        assert state["internal_states"][0]["memory"]["evictable_kv_tokens"] == 0
