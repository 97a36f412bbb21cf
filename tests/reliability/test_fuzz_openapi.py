"""Schemathesis against ``/openapi.json``: every operation the server declares, 30 positive and
negative examples each in CI (``RADIXSERVE_FUZZ_EXAMPLES``: ``make fuzz`` sends 1,000 with a
fresh random seed). No 5xx, every 4xx the OpenAI error object (Ollama's on ``/api/``), and
afterwards the server is healthy and holds nothing: no KV, no request state, no session.

The server runs with ``--max-completion-tokens 16`` (larger requests are refused, requests
without a bound get 16), so that no fuzzed request generates for long.
"""

from __future__ import annotations

import json
import time

import httpx
import psutil
import pytest
import requests

from tests.reliability.fuzz import (
    ServerKeeper,
    examples_per_operation,
    fuzz_operation,
    fuzz_seed,
    is_subset,
    load_schema,
    operations,
    stream_server_errors,
)
from tests.server.conftest import assert_no_leak, internal_state, start_server

# A failure bound only: 9 s per example per route (4.5 minutes for CI's 30; make fuzz's 1,000
# took more than 30 minutes on a two-core guest at load 20).
pytestmark = pytest.mark.timeout(9 * examples_per_operation())


@pytest.fixture(scope="module")
def fuzz_server(llama_path):
    srv = start_server(llama_path, "--max-completion-tokens", "16", "--enable-metrics")
    yield srv
    srv.check_clean_stop()


def test_every_operation_keeps_the_error_contract(fuzz_server, tmp_path):
    examples = examples_per_operation()
    seed = fuzz_seed()
    schema = load_schema(fuzz_server.base_url)
    ops = operations(schema)
    server = psutil.Process(fuzz_server.proc.pid)
    procs = [server, *server.children(recursive=True)]
    cpu_before = [sum(p.cpu_times()[:2]) for p in procs]
    started, test_cpu = time.monotonic(), time.process_time()
    with requests.Session() as session:
        keeper = ServerKeeper(fuzz_server.base_url, session, str(tmp_path))
        reports = []
        for op in ops:  # each printed as it ends: a run stopped half-way says how far it got
            reports.append(fuzz_operation(op, keeper, examples, seed))
            r = reports[-1]
            print(f"{r.label}: {r.calls} calls {r.statuses} {r.failures or ''} "
                  f"({time.monotonic() - started:.0f}s)", flush=True)
    server_cpu = sum(sum(p.cpu_times()[:2]) - b for p, b in zip(procs, cpu_before, strict=True))
    # Where the time goes (generating examples, or serving them) on a machine of any speed.
    print(f"fuzz seed {seed}: {sum(r.calls for r in reports)} calls in "
          f"{time.monotonic() - started:.0f}s; CPU {time.process_time() - test_cpu:.0f}s "
          f"in the test (schemathesis), {server_cpu:.0f}s in the server")
    # Every route: the schema holds all of them, and each with inputs got its examples (one
    # without inputs has a single request to send).
    assert reports, "no operation selected"
    # Generation must be reached, not only validation (unless a subset was asked for:
    # RADIXSERVE_FUZZ_OPERATIONS / RADIXSERVE_FUZZ_AFTER, then only its operations count).
    generating = set() if is_subset() else {
        "POST /generate", "POST /v1/chat/completions", "POST /v1/completions",
        "POST /api/chat", "POST /api/generate"}
    if not is_subset():
        assert {*generating, "POST /open_session", "POST /tokenize", "GET /health"} <= {
            r.label for r in reports}
    for op, report in zip(ops, reports, strict=True):
        has_inputs = any(True for _ in op.iter_parameters()) or op.body
        assert report.calls >= (examples if has_inputs else 1), report.label
    for label in sorted(generating):
        assert next(r for r in reports if r.label == label).statuses.get(200, 0) > 0, label
    failures = [f"{r.label} [{kind}]: {detail}"
                for r in reports for kind, detail in r.failures.items()]
    assert not failures, "\n".join(failures)


def test_the_fuzzed_server_is_healthy_and_holds_nothing(fuzz_server):
    """Runs after the fuzz (same module, same server)."""
    with httpx.Client(base_url=fuzz_server.base_url, timeout=60) as c:
        for session_id in internal_state(c)["session_ids"]:  # the sessions the fuzz opened
            assert c.post("/close_session", json={"session_id": session_id}).status_code == 200
        memory = assert_no_leak(c)
        assert memory["session_held_kv_tokens"] == 0
        info = c.get("/get_server_info").json()
        assert info["num_inflight_requests"] == 0
        state = info["internal_states"][0]
        assert state["num_open_sessions"] == 0 and not state["paused"]
        assert c.get("/health").status_code == 200
        r = c.post("/generate", json={"text": "still serving",
                                      "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4


def test_the_judge_sees_a_server_error_in_every_stream_format():
    """A stream fails after its 200: chat/completions/native streams send an error object with
    its status, a Responses stream an ``error`` event (named by type) then
    ``response.failed``. Only server errors break the contract."""
    def sse(*events):
        return "\n\n".join(f"data: {json.dumps(e)}" for e in events)

    native_500 = sse({"error": {"message": "boom", "type": "server_error", "code": 500}})
    native_400 = sse({"error": {"message": "bad", "type": "invalid_request_error", "code": 400}})
    failed = {"type": "response.failed", "response": {"status": "failed"}}
    responses_500 = sse({"type": "error", "code": "server_error", "message": "boom"}, failed)
    responses_400 = sse({"type": "error", "code": "invalid_request_error", "message": "x"},
                        failed)
    assert [e["message"] for e in stream_server_errors(native_500)] == ["boom"]
    assert [e["message"] for e in stream_server_errors(responses_500)] == ["boom"]
    assert stream_server_errors(native_400) == stream_server_errors(responses_400) == []
    assert stream_server_errors(sse({"text": "fine"}) + "\n\ndata: [DONE]") == []
