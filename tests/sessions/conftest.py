"""HTTP helpers for the session tests: a client for the session routes of a real server.

Each HTTP test module starts its own ``radixserve serve`` (module-scoped ``server`` fixture, built
with ``start_server`` from the server tests); ``api`` wraps it. Every session turn a test runs is
compared with a plain ``/generate`` on the ids the session should have assembled (greedy,
``ignore_eos``), so a wrong prompt assembly or a corrupt reused KV shows up as different tokens.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.conftest import ServerProcess, memory_figures
from tests.sync import STATE_TIMEOUT_S

BOS = 0  # the tiny tokenizer's <|bos|>
GREEDY = {"temperature": 0.0, "ignore_eos": True}
# Session servers check the memory invariant after every scheduler step (a leak crashes them).
BUSY_CHECK = {"RADIXSERVE_STRICT_MEM_CHECK": "busy"}


def sampling(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, **GREEDY}


def random_ids(rng: random.Random, n: int) -> list[int]:
    """Ordinary (non-special) token ids of the tiny vocabulary."""
    return [rng.randrange(10, 500) for _ in range(n)]


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a native ``/generate`` stream, up to ``data: [DONE]``."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("the stream ended without data: [DONE]")


class SessionAPI:
    """The session routes over HTTP; every helper checks the status code it expects.

    Sessions opened through it are closed when the test ends, so tests that look at
    ``session_held_kv_tokens`` see only their own sessions.
    """

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.opened: list[str] = []

    # ------------------------------------------------------------------ sessions
    def open(self, streaming: bool = False, **body: Any) -> str:
        r = self.http.post(
            "/open_session", json={"capacity_of_str_len": 4096, "streaming": streaming, **body}
        )
        assert r.status_code == 200, r.text
        session_id = r.json()
        assert isinstance(session_id, str) and session_id
        self.opened.append(session_id)
        return session_id

    def close(self, session_id: str) -> None:
        r = self.http.post("/close_session", json={"session_id": session_id})
        assert r.status_code == 200, r.text

    # ------------------------------------------------------------------ generation
    def body(
        self, ids: list[int], max_new_tokens: int, session: str | None, **session_params: Any
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": sampling(max_new_tokens)}
        if session is not None:
            body["session_params"] = {"id": session, **session_params}
        return body

    def generate(
        self, ids: list[int], max_new_tokens: int = 6, session: str | None = None,
        **session_params: Any,
    ) -> dict[str, Any]:
        r = self.http.post("/generate", json=self.body(ids, max_new_tokens, session,
                                                      **session_params))
        assert r.status_code == 200, r.text
        return r.json()

    def generate_at(
        self, ids: list[int], max_new_tokens: int = 6, session: str | None = None,
        **session_params: Any,
    ) -> dict[str, Any]:
        """``generate`` on a connection of its own, for a thread beside the test's."""
        with httpx.Client(base_url=self.http.base_url, timeout=self.http.timeout) as http:
            r = http.post("/generate", json=self.body(ids, max_new_tokens, session,
                                                     **session_params))
        assert r.status_code == 200, r.text
        return r.json()

    def rejected(
        self, ids: list[int], max_new_tokens: int = 6, session: str | None = None,
        stream: bool = False, **session_params: Any,
    ) -> str:
        """Send a request that must get 400; return the error message."""
        body = self.body(ids, max_new_tokens, session, **session_params)
        r = self.http.post("/generate", json={**body, "stream": stream})
        assert r.status_code == 400, f"expected 400, got {r.status_code}: {r.text}"
        return r.json()["error"]["message"]

    @contextlib.contextmanager
    def stream(
        self, ids: list[int], max_new_tokens: int, session: str | None = None,
        req_rid: str | None = None, **session_params: Any,
    ) -> Iterator[httpx.Response]:
        """``with api.stream(...) as r: events = sse_events(r)``; asserts the 200.

        ``req_rid`` names the request itself (for ``abort``); a ``rid`` keyword is the session's.
        """
        body = {**self.body(ids, max_new_tokens, session, **session_params), "stream": True}
        if req_rid is not None:
            body["rid"] = req_rid
        with self.http.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise AssertionError(f"stream refused with {r.status_code}: {r.text}")
            yield r

    def reference(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        return self.generate(ids, max_new_tokens)

    def assert_turn(self, out: dict[str, Any], assembled: list[int], max_new_tokens: int) -> None:
        """A session turn ran on exactly ``assembled`` and produced what a plain request does."""
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(assembled)
        assert meta["completion_tokens"] == max_new_tokens
        assert out["output_ids"] == self.reference(assembled, max_new_tokens)["output_ids"]

    def abort(self, rid: str) -> None:
        r = self.http.post("/abort_request", json={"rid": rid})
        assert r.status_code == 200, r.text

    # ------------------------------------------------------------------ memory
    def state(self) -> dict[str, Any]:
        return self.http.get("/get_server_info").json()["internal_states"][0]

    def memory(self) -> dict[str, int]:
        return memory_figures(self.http)

    def wait_idle(self, timeout: float = STATE_TIMEOUT_S) -> dict[str, Any]:
        """Wait until nothing runs or waits; return the internal state then."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
                return state
            assert time.monotonic() < deadline, f"not idle after {timeout}s: {state}"
            time.sleep(0.05)

    def assert_accounted(self) -> dict[str, int]:
        """Idle: every KV slot is free, evictable, held by a session or locked by one (a
        session's first prompt stays locked in the tree); with no session holding a slot,
        nothing is locked."""
        state = self.wait_idle()
        m = state["memory"]
        held = (m["available_kv_tokens"] + m["evictable_kv_tokens"]
                + m["protected_kv_tokens"] + m["session_held_kv_tokens"])
        assert held == m["total_kv_tokens"], m
        assert state["last_leak_check"]["ok"], state["last_leak_check"]
        if m["free_req_slots"] == m["total_req_slots"]:
            assert m["protected_kv_tokens"] == m["session_held_kv_tokens"] == 0, m
        return m


def new_rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def api(server: ServerProcess) -> Iterator[SessionAPI]:
    """A ``SessionAPI`` on the module's ``server``; afterwards closes the sessions it opened and
    checks that the KV memory is accounted for."""
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        client = SessionAPI(http)
        yield client
        for session_id in client.opened:
            client.close(session_id)
        client.assert_accounted()


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """Prompts differ between tests (no accidental prefix sharing) but not between runs."""
    return random.Random(request.node.name)
