"""Schemathesis against ``/openapi.json``: every operation the server declares, 200 positive and
negative examples each in CI (``RADIXSERVE_FUZZ_EXAMPLES``: ``make fuzz`` sends 1,000 with a
fresh random seed). No 5xx, every 4xx the OpenAI error object, and afterwards the server is
healthy and holds nothing: no KV, no request state, no session.

The server runs with ``--max-completion-tokens 16`` (larger requests are refused, requests
without a bound get 16), so that no fuzzed request generates for long.
"""

from __future__ import annotations

import os

import httpx
import pytest
import requests

from tests.reliability.fuzz import (
    ServerKeeper,
    examples_per_operation,
    fuzz_operation,
    load_schema,
    operations,
)
from tests.server.conftest import assert_no_leak, internal_state, start_server

pytestmark = pytest.mark.timeout(1800)

# 5xx answers the fuzz finds that are known and being fixed: a response text marker → the bug.
# Anything else fails the test; these alone make it an expected failure that names them.
KNOWN_BUGS = {
    "internal server error: OverflowError": "an integer past 64 bits in a body is a 500 "
                                            "(issue #18, hostile-input fixes)",
}


@pytest.fixture(scope="module")
def fuzz_server(llama_path):
    srv = start_server(llama_path, "--max-completion-tokens", "16", "--enable-metrics")
    yield srv
    srv.check_clean_stop()


def test_every_operation_keeps_the_error_contract(fuzz_server, tmp_path):
    examples = examples_per_operation()
    derandomize = os.environ.get("RADIXSERVE_FUZZ_RANDOM") != "1"  # CI: the same run each time
    schema = load_schema(fuzz_server.base_url)
    ops = operations(schema)
    with requests.Session() as session:
        keeper = ServerKeeper(fuzz_server.base_url, session, str(tmp_path))
        reports = [fuzz_operation(op, keeper, examples, derandomize) for op in ops]
    summary = "\n".join(f"{r.label}: {r.calls} calls {r.statuses}" for r in reports)
    print(summary)
    # Every route: the schema holds all of them, and each with inputs got its examples (one
    # without inputs has a single request to send).
    labels = {r.label for r in reports}
    assert {"POST /generate", "POST /v1/chat/completions", "POST /v1/completions",
            "POST /open_session", "POST /tokenize", "GET /health"} <= labels
    for op, report in zip(ops, reports, strict=True):
        has_inputs = any(True for _ in op.iter_parameters()) or op.body
        assert report.calls >= (examples if has_inputs else 1), report.label
    # Generation was reached, not only validation.
    for label in ("POST /generate", "POST /v1/chat/completions", "POST /v1/completions"):
        assert next(r for r in reports if r.label == label).statuses.get(200, 0) > 0, label
    failures = [f"{r.label} [{kind}]: {detail}"
                for r in reports for kind, detail in r.failures.items()]
    unknown = [f for f in failures if not any(k in f for k in KNOWN_BUGS)]
    assert not unknown, "\n".join(unknown)
    if failures:
        pytest.xfail(f"known bugs only ({', '.join(KNOWN_BUGS.values())}):\n" + "\n".join(failures))


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
