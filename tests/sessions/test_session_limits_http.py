"""Bounds on sessions over HTTP: ``--max-sessions`` (429), the default idle timeout, what a
session id and a timeout may be (400), ids escaped in the log, and the memory a closed session
gives back (counted by the scheduler itself: ``num_session_reqs``, ``num_live_reqs``).

The server allows 3 sessions, each idle for at most an hour (the default idle timeout, and the
cap of a timeout a client asks for: tests/reliability/test_bounded_work.py tests both).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.server.conftest import start_server
from tests.sessions.conftest import BUSY_CHECK, random_ids
from tests.sync import wait_for

MAX_SESSIONS = 3
LONG = 3600  # seconds: a session that must not time out during the test


@pytest.fixture(scope="module")
def server(llama_path: Path):
    srv = start_server(llama_path, "--max-sessions", str(MAX_SESSIONS),
                       "--session-idle-timeout", str(LONG), "--log-level", "info", env=BUSY_CHECK)
    yield srv
    srv.check_clean_stop()


def no_sessions_open(api) -> None:
    """Sessions of earlier tests close when the ``api`` fixture ends; their closes are
    messages the scheduler reads at its next step."""
    wait_for(api.state, lambda s: s["num_open_sessions"] == 0, "no session open")


def test_opening_a_session_past_max_sessions_is_429_until_one_closes(api):
    no_sessions_open(api)
    ids = [api.open(timeout=LONG) for _ in range(MAX_SESSIONS)]
    r = api.http.post("/open_session", json={"capacity_of_str_len": 64, "timeout": LONG})
    assert r.status_code == 429, r.text
    assert int(r.headers["Retry-After"]) >= 1
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and "--max-sessions" in error["message"]
    assert api.state()["num_open_sessions"] == MAX_SESSIONS
    api.close(ids[0])
    wait_for(api.state, lambda s: s["num_open_sessions"] == MAX_SESSIONS - 1, "a session closed")
    api.open(timeout=LONG)


@pytest.mark.parametrize("session_id", [
    "", " ", "a b", "x" * 129, "x" * 1_000_000, "tab\there", "é", "line\nFORGED log line",
], ids=["empty", "space", "inner-space", "129-chars", "1M-chars", "tab", "non-ascii", "newline"])
def test_malformed_session_ids_are_400_on_every_route(api, rng, session_id):
    routes = [
        ("/open_session", {"capacity_of_str_len": 64, "session_id": session_id}),
        ("/close_session", {"session_id": session_id}),
        ("/generate", api.body(random_ids(rng, 3), 2, session_id)),
    ]
    for path, body in routes:
        r = api.http.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        message = r.json()["error"]["message"]
        assert "session_id must be 1 to 128 visible ASCII characters" in message, message
        assert len(message) < 300 and "\n" not in message  # shown escaped and cut short
    assert session_id not in api.state()["session_ids"]


def test_the_longest_id_works_and_ids_are_escaped_in_the_log(api, server, rng):
    """Session ids and request ids are client strings: the log shows them escaped (``%r``),
    so a newline in one cannot start a line of its own (a rid with one is refused outright)."""
    longest = "k" * 128
    assert api.open(session_id=longest, timeout=LONG) == longest
    quoted = "it's-a-\"quoted\"-id"
    assert api.open(session_id=quoted, timeout=LONG) == quoted
    api.generate(random_ids(rng, 4), 2, quoted)
    api.http.post("/open_session", json={"capacity_of_str_len": 64,
                                         "session_id": "x\nFORGED log line"})
    # A request id holding a newline is refused before anything logs it.
    body = {**api.body(random_ids(rng, 3), 2, "never-opened"), "rid": "r\nFORGED rid line"}
    refused = api.http.post("/generate", json=body)
    assert refused.status_code == 400 and "printable" in refused.json()["error"]["message"]
    # One the scheduler rejects (its session was never opened) is logged escaped.
    body = {**body, "rid": "it's-rejected"}
    assert api.http.post("/generate", json=body).status_code == 400
    api.close(quoted)
    wait_for(api.state, lambda s: quoted not in s["session_ids"], "the session closed")
    log = server.stderr_tail(400).splitlines()
    assert not any(line.startswith("FORGED") for line in log)
    assert any(repr(quoted) in line and "opened" in line for line in log), log[-20:]
    assert any(repr("it's-rejected") in line and "rejected:" in line for line in log), log[-20:]


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, -1.0, 0.0],
                         ids=["nan", "inf", "-inf", "negative", "zero"])
def test_a_timeout_that_is_not_positive_and_finite_is_400(api, timeout):
    before = api.state()["num_open_sessions"]
    # NaN and Infinity as written by Python's json module (and read by the server's).
    body = json.dumps({"capacity_of_str_len": 64, "timeout": timeout})
    r = api.http.post("/open_session", content=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]  # NaN and infinities are refused at the HTTP edge
    assert "timeout" in message and ("finite" in message or "positive" in message), message
    assert api.state()["num_open_sessions"] == before


def test_closing_a_session_releases_every_request_of_its_tree(api, rng):
    """3,000 branches of one session used to stay in memory after the close (the tree's
    nodes refer to each other, so only a full garbage collection freed them). The scheduler
    counts its live requests."""
    no_sessions_open(api)
    session = api.open(timeout=LONG)
    root = api.generate(random_ids(rng, 40), 2, session)
    parent = root["meta_info"]["id"]
    branches = 24
    for i in range(branches):
        # half the branches hang under the root, the others under the previous branch
        out = api.generate(random_ids(rng, 3), 2, session, rid=parent)
        if i % 2:
            parent = out["meta_info"]["id"]
    state = api.wait_idle()
    assert state["num_session_reqs"] == branches + 1
    assert state["num_live_reqs"] >= branches + 1
    api.close(session)
    state = wait_for(api.state, lambda s: s["num_open_sessions"] == 0, "the session closed")
    assert state["num_session_reqs"] == 0
    assert state["num_live_reqs"] == 0, "requests of the closed session are still alive"
