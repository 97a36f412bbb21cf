"""Faults: a worker process killed under load, and SIGTERM with 50 open streams.

- ``kill -9`` of the scheduler or the detokenizer while requests stream and wait: every open
  request ends with an error (an error event, an error status, or a closed connection: never a
  hang), ``/health`` stops answering 200, and the server exits non-zero leaving no process.
- SIGTERM with 50 streams open (held by a pause, so that none can end by itself): the drain
  aborts every stream properly (``[DONE]``), the server exits 0 and leaves no process.

Each test synchronises on the server's state (a stream's first event, the scheduler's queues);
deadlines only bound a failure.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.server.conftest import internal_state, pause_generation, paused, start_server
from tests.sync import STATE_TIMEOUT_S, UNTIL_ABORTED, in_background, wait_for

# How long an open request may take to end once its server lost a worker: the watcher notices
# a dead child within half a second; the rest is a loaded machine's slack.
END_TIMEOUT_S = 60.0


class Stream:
    """One streaming request on a thread of its own: its events, how it ended, and an event
    set once its first chunk arrived (the request is then running in the scheduler)."""

    def __init__(self, base_url: str, i: int) -> None:
        self.started = threading.Event()
        self.events: list[dict] = []
        self.done = False  # saw data: [DONE]
        self.status: int | None = None
        self.error: BaseException | None = None
        if i % 2:
            path, body = "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"stream {i}"}], "stream": True,
                "max_tokens": UNTIL_ABORTED, "ignore_eos": True}
        else:
            path, body = "/generate", {
                "text": f"stream {i}", "stream": True,
                "sampling_params": {"max_new_tokens": UNTIL_ABORTED, "ignore_eos": True}}
        self.future = in_background(self._run, base_url, path, body)

    def _run(self, base_url: str, path: str, body: dict) -> None:
        try:
            with httpx.Client(base_url=base_url, timeout=STATE_TIMEOUT_S) as c, \
                    c.stream("POST", path, json=body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line.removeprefix("data: ")))
                        self.started.set()
        except httpx.HTTPError as exc:  # the connection closed under it
            self.error = exc
        finally:
            self.started.set()  # also when it failed before its first chunk

    @property
    def ended_with_error(self) -> bool:
        last = self.events[-1] if self.events else {}
        return self.error is not None or (self.status or 0) >= 400 or "error" in last


def _non_stream(base_url: str) -> tuple[int | None, dict | str]:
    body = {"text": "waiting", "sampling_params": {"max_new_tokens": UNTIL_ABORTED,
                                                   "ignore_eos": True}}
    try:
        r = httpx.post(base_url + "/generate", json=body, timeout=END_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return None, repr(exc)
    return r.status_code, r.json()


def _health(base_url: str) -> int | None:
    """``/health``'s status; None once the server no longer accepts connections."""
    try:
        return httpx.get(base_url + "/health", timeout=END_TIMEOUT_S).status_code
    except httpx.TransportError:
        return None


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_kill_9_of_a_worker_ends_every_request_and_the_server(llama_path, victim):
    srv = start_server(llama_path, "--max-total-tokens", str(10 * (UNTIL_ABORTED + 32)))
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            pid = c.get("/get_server_info").json()["processes"][victim]
            children = srv.children()
            assert pid in {p.pid for p in children}
            streams = [Stream(srv.base_url, i) for i in range(8)]
            for s in streams:
                assert s.started.wait(STATE_TIMEOUT_S) and not s.done and s.error is None
            # Two non-streaming requests join them: queued while generation is paused, then
            # generation continues and the worker dies while all ten run.
            with paused(c):
                waiting = [in_background(_non_stream, srv.base_url) for _ in range(2)]
                wait_for(lambda: internal_state(c),
                         lambda s: s["num_waiting_reqs"] == 2 and s["num_running_reqs"] == 8,
                         "two requests queued behind the eight running streams")
                assert _health(srv.base_url) == 200
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for s in streams:
            s.future.result(END_TIMEOUT_S)
            assert s.ended_with_error, (s.status, s.events[-1:], s.done)
        for w in waiting:
            status, body = w.result(END_TIMEOUT_S)
            assert status is None or (status >= 500 and "error" in body), (status, body)
        ended_after = time.monotonic() - killed_at
        # From now on /health never says 200: 503 while the server winds down, then no answer.
        statuses = [_health(srv.base_url) for _ in range(3)]
        assert 200 not in statuses, statuses
        code = srv.proc.wait(END_TIMEOUT_S)
        assert code != 0
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"orphans: {alive}"
        assert f"the radixserve-{victim} process exited unexpectedly" in srv.stderr_tail(400)
        print(f"{victim} killed: every request ended within {ended_after:.2f}s; exit code {code}")
    finally:
        srv.kill()


def test_sigterm_with_50_open_streams_ends_them_all_and_exits_zero(llama_path):
    # Room for every stream's KV: the drain, not retraction, is what this test is about.
    srv = start_server(llama_path, "--max-total-tokens", str(50 * (UNTIL_ABORTED + 32)))
    try:
        children = srv.children()
        streams = [Stream(srv.base_url, i) for i in range(50)]
        for s in streams:
            assert s.started.wait(STATE_TIMEOUT_S) and s.error is None and s.status == 200
        # Held in place, none can finish before the drain's timeout however fast the machine
        # is (a quiet one decodes all 50 to their end within it): the drain must abort them.
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            pause_generation(c)
            state = internal_state(c)
        assert state["num_running_reqs"] + state["num_waiting_reqs"] == 50, state
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(STATE_TIMEOUT_S) == 0, srv.stderr_tail()
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"orphans: {alive}"
        reasons = []
        for s in streams:
            s.future.result(END_TIMEOUT_S)
            assert s.error is None and s.done, (s.error, s.events[-1:])
            last = s.events[-1]
            reason = (last["meta_info"]["finish_reason"]["type"] if "meta_info" in last
                      else last["choices"][0]["finish_reason"])
            reasons.append(reason)
        # The drain waited, then aborted what was still running: each stream says so.
        assert set(reasons) == {"abort"}, reasons
    finally:
        srv.kill()
