"""No request can stall the others: user-controlled work on the scheduler's thread is bounded.

The stall of issue 37 item 1: ``stop_regex`` ``(a|aa)+$b`` over output that a ``logit_bias``
forces to ``aaaa...`` made Python's backtracking ``re`` take exponential time at every decode
step, on the scheduler's thread, and every other request waited. The test sends it, waits until
the request has produced far more ``a`` than a backtracking search survives, then shows another
request finishing while the first is still running, and the server healthy afterwards. Deadlines
only bound a failure (a stalled scheduler), they are never the synchronisation.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import assert_no_leak, internal_state, start_server
from tests.sync import STATE_TIMEOUT_S, UNTIL_ABORTED, in_background, wait_for

BACKTRACKING = "(a|aa)+$b"  # never matches; exponential in the run of a's for a backtracker
# A backtracking search of BACKTRACKING over 40 a's takes ~1e8 steps: well past a stall.
PAST_THE_STALL = 64
IDLE_S = 1  # --session-idle-timeout


@pytest.fixture(scope="module")
def server(llama_path):
    srv = start_server(llama_path, "--session-idle-timeout", str(IDLE_S))
    yield srv
    srv.check_clean_stop()


@pytest.fixture(scope="module")
def a_token(llama_path) -> int:
    (token,) = AutoTokenizer.from_pretrained(llama_path).encode("a")
    return token


class ForcedStream:
    """A streaming /generate whose every token is ``a`` (a forcing logit_bias), on a thread."""

    def __init__(self, base_url: str, a_token: int, stop_regex: str) -> None:
        self.completion_tokens = 0
        self.text = ""
        self.finish_reason: dict | None = None
        self.finished = threading.Event()
        body = {"text": "say a", "stream": True, "sampling_params": {
            "max_new_tokens": UNTIL_ABORTED, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(a_token): 100}, "stop_regex": stop_regex}}
        self.future = in_background(self._run, base_url, body)

    def _run(self, base_url: str, body: dict) -> None:
        try:
            with httpx.Client(base_url=base_url, timeout=STATE_TIMEOUT_S) as c, \
                    c.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line.removeprefix("data: "))
                        self.text = chunk["text"]
                        self.completion_tokens = chunk["meta_info"]["completion_tokens"]
                        self.finish_reason = chunk["meta_info"]["finish_reason"]
        finally:
            self.finished.set()


def test_a_backtracking_stop_regex_does_not_stall_other_requests(server, a_token):
    forced = ForcedStream(server.base_url, a_token, BACKTRACKING)
    wait_for(lambda: {"tokens": forced.completion_tokens, "finished": forced.finished.is_set()},
             lambda s: s["tokens"] >= PAST_THE_STALL or s["finished"],
             "the forced request runs past the stall")
    assert not forced.finished.is_set(), forced.future.exception()
    assert forced.text.startswith("a" * PAST_THE_STALL)

    # Another user's short request finishes while the forced one still runs.
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S) as c:
        r = c.post("/generate", json={"text": "hello", "sampling_params": {
            "max_new_tokens": 4, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 4
        assert not forced.finished.is_set(), "the forced request ended before the check"

        forced.future.result(STATE_TIMEOUT_S)
        assert forced.finish_reason == {"type": "length", "length": UNTIL_ABORTED}
        assert forced.text == "a" * UNTIL_ABORTED
        assert c.get("/health").status_code == 200
        assert server.proc.poll() is None
        assert_no_leak(c)


def test_a_matching_stop_regex_still_stops_and_is_cut(server, a_token):
    """The same linear matcher finds matches: ``a{5}$`` ends the forced run at five a's (the
    window search sees the output's end), and the detokenizer cuts where the match begins."""
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S) as c:
        r = c.post("/generate", json={"text": "say a", "sampling_params": {
            "max_new_tokens": 64, "temperature": 0, "logit_bias": {str(a_token): 100},
            "stop_regex": "a{5}$"}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": "a{5}$"}
    assert meta["completion_tokens"] == 5
    assert r.json()["text"] == ""


@pytest.mark.parametrize("pattern", [r"(a)\1", "(?=a)a", "(?<!b)a"])
def test_a_pattern_that_needs_backtracking_is_refused_naming_stop_regex(server, pattern):
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S) as c:
        r = c.post("/generate", json={"text": "x", "sampling_params": {"stop_regex": pattern}})
        assert r.status_code == 400, r.text
        assert "stop_regex" in r.json()["error"]["message"]


def test_a_session_opened_without_timeout_gets_the_default_idle_timeout(server):
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S) as c:
        assert c.get("/get_server_info").json()["session_idle_timeout"] == IDLE_S
        r = c.post("/open_session", json={"capacity_of_str_len": 64})
        assert r.status_code == 200, r.text
        session = r.json()
        wait_for(lambda: internal_state(c), lambda s: session not in s["session_ids"],
                 "the idle session timed out")
        r = c.post("/generate", json={"input_ids": [5, 6, 7], "session_params": {"id": session},
                                      "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and "does not exist or is closed" in r.text, r.text


@pytest.mark.parametrize("timeout", [IDLE_S + 0.5, 1e308])
def test_a_session_may_not_outlive_the_servers_idle_timeout(server, timeout):
    """1,024 sessions that never expire would refuse every new one until a restart."""
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S) as c:
        before = internal_state(c)["num_open_sessions"]
        r = c.post("/open_session", json={"capacity_of_str_len": 64, "timeout": timeout})
        assert r.status_code == 400, r.text
        assert "--session-idle-timeout" in r.json()["error"]["message"]
        assert internal_state(c)["num_open_sessions"] <= before  # (earlier ones expire)
        r = c.post("/open_session", json={"capacity_of_str_len": 64, "timeout": IDLE_S / 2})
        assert r.status_code == 200, r.text


def _generate_too_long(base_url: str, text: str) -> str:
    """A prompt far past the context: tokenized (seconds of work for 7 MB), then refused with
    a short 400, so that its answer, once the work is done, is quick to send and read."""
    with httpx.Client(base_url=base_url, timeout=STATE_TIMEOUT_S) as c:
        r = c.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400, r.text[:2000]
        return r.json()["error"]["message"]


def test_a_seven_megabyte_prompt_does_not_hold_other_requests(server):
    """The big prompt is tokenized off the event loop: a short generation sent meanwhile
    finishes while the tokenization still runs. On the loop it could only finish after it."""
    big = in_background(_generate_too_long, server.base_url, "word " * 1_400_000)
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S) as c:
        r = c.post("/generate", json={"text": "hello", "sampling_params": {
            "max_new_tokens": 4, "ignore_eos": True}})
        assert r.status_code == 200, r.text
    assert not big.done(), "the short request waited for the big tokenization"
    assert "context" in big.result(STATE_TIMEOUT_S)


def _off_loop_total(c: httpx.Client, kind: str = "inputs") -> int:
    """``inputs_off_loop_total`` (tokenizing, templates) or ``bodies_off_loop_total``."""
    r = c.get("/get_server_info")
    assert r.status_code == 200, r.text
    return r.json()[f"{kind}_off_loop_total"]


# Every route that tokenizes or renders user input, with an input past OFF_LOOP_BYTES (64 KiB):
# each runs that work off the event loop (``server/off_loop.py``) exactly once.
LARGE = "word " * 14_000  # 70,000 characters, about 14,000 tokens: past the 1,024 context
OFF_LOOP_ROUTES = {
    "generate": ("/generate", {"text": LARGE, "sampling_params": {"max_new_tokens": 1}}),
    "tokenize": ("/tokenize", {"prompt": LARGE}),
    "completions": ("/v1/completions", {"prompt": LARGE, "max_tokens": 1}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": LARGE}],
                                      "max_tokens": 1}),
    "responses": ("/v1/responses", {"input": LARGE, "max_output_tokens": 16}),
    "responses_auto_truncation": ("/v1/responses", {
        "input": [{"role": "user", "content": LARGE}, {"role": "user", "content": "hi"}],
        "truncation": "auto", "max_output_tokens": 16}),
    "score": ("/v1/score", {"query": LARGE, "items": ["a", "b"], "label_token_ids": [1]}),
    "embeddings": ("/v1/embeddings", {"input": LARGE}),
    "encode": ("/encode", {"text": LARGE}),
    "ollama_chat": ("/api/chat", {"model": "{model}", "stream": False,
                                  "messages": [{"role": "user", "content": LARGE}]}),
    "ollama_generate": ("/api/generate", {"model": "{model}", "stream": False,
                                          "prompt": LARGE}),
    "ollama_generate_raw": ("/api/generate", {"model": "{model}", "stream": False,
                                              "prompt": LARGE, "raw": True}),
    "ollama_embed": ("/api/embed", {"model": "{model}", "input": LARGE}),
}


@pytest.mark.parametrize("route", OFF_LOOP_ROUTES)
def test_every_route_prepares_a_large_input_off_the_event_loop(server, route):
    """The server counts the inputs it prepared off the loop: a large input to any route that
    tokenizes or renders one adds exactly one (inline on the loop, it would add none), and the
    answer is never a 5xx (most are a 400: the prompt is past the context). Its body was
    parsed and checked, then validated against the route's model, off the loop: two more."""
    path, body = OFF_LOOP_ROUTES[route]
    if body.get("model") == "{model}":
        body = {**body, "model": server.model}
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S) as c:
        before, bodies_before = _off_loop_total(c), _off_loop_total(c, "bodies")
        r = c.post(path, json=body)
        assert r.status_code < 500, r.text[:2000]
        assert _off_loop_total(c) == before + 1
        assert _off_loop_total(c, "bodies") == bodies_before + 2
        if route == "score":  # refused before the query is joined to every item
            assert r.status_code == 400 and r.json()["error"]["param"] == "query", r.text


def _responses_too_long(base_url: str, text: str) -> httpx.Response:
    with httpx.Client(base_url=base_url, timeout=STATE_TIMEOUT_S) as c:
        return c.post("/v1/responses", json={"input": text, "max_output_tokens": 16})


def test_a_seven_megabyte_responses_input_does_not_hold_the_event_loop(server):
    """The 7 MB conversation of a /v1/responses request is rendered and tokenized (seconds of
    work) off the loop: the server answers /get_server_info meanwhile, saying that the input
    is being prepared. On the loop, no answer could come before that work ended."""
    big = in_background(_responses_too_long, server.base_url, "word " * 1_400_000)
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S) as c:
        info = wait_for(lambda: c.get("/get_server_info").json(),
                        lambda i: i["inputs_off_loop"] > 0 or big.done(),
                        "the big input being prepared")
        assert info["inputs_off_loop"] == 1, "the 7 MB input was prepared on the event loop"
    r = big.result(STATE_TIMEOUT_S)
    assert r.status_code == 400 and "context" in r.text, r.text[:2000]


def _generate_with_bulk(base_url: str, bulk: list[int]) -> httpx.Response:
    with httpx.Client(base_url=base_url, timeout=STATE_TIMEOUT_S) as c:
        return c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1},
                                         "bulk": bulk})


def test_a_large_body_is_parsed_off_the_event_loop(server):
    """A 4 MB body of two million small numbers takes seconds to parse and check (every value
    is looked at: ``request_guard._check_values``); that runs off the loop. The server answers
    /get_server_info meanwhile, saying that a body is being parsed (on the loop, no answer
    could come before the parse ended), and a short generation sent then finishes before the
    big body's answer: its unknown field ``bulk``, found by validating it off the loop too."""
    big = in_background(_generate_with_bulk, server.base_url, [0] * 2_000_000)
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S) as c:
        info = wait_for(lambda: c.get("/get_server_info").json(),
                        lambda i: i.get("bodies_off_loop", 0) > 0 or big.done(),
                        "the big body being parsed")
        assert info.get("bodies_off_loop") == 1, "the 4 MB body was parsed on the event loop"
        r = c.post("/generate", json={"text": "hello", "sampling_params": {
            "max_new_tokens": 4, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 4
    assert not big.done(), "the short request waited for the big body"
    r = big.result(STATE_TIMEOUT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bulk", r.text[:2000]


class RunningStream:
    """A streaming /generate of ``UNTIL_ABORTED`` tokens on a thread; ``first`` is set by its
    first chunk: from then on it runs, one step after the other, so that a ``slow_down`` that
    returns has its next step sleeping. (The scheduler's internal state is not asked for while
    a step sleeps: that control request would wait behind the sleep.)"""

    def __init__(self, base_url: str) -> None:
        self.first = threading.Event()
        self.tokens = 0
        self.future = in_background(self._run, base_url)

    def _run(self, base_url: str) -> None:
        body = {"text": "slow", "stream": True,
                "sampling_params": {"max_new_tokens": UNTIL_ABORTED, "ignore_eos": True}}
        with httpx.Client(base_url=base_url, timeout=STATE_TIMEOUT_S) as c, \
                c.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.tokens = json.loads(line[6:])["meta_info"]["completion_tokens"]
                    self.first.set()


def test_slow_down_is_bounded_and_a_reset_ends_the_sleep_at_once(server):
    """``forward_sleep_time`` past ``--watchdog-timeout`` (300 s here) is refused; one at the
    bound sleeps after every step until a reset arrives, which ends the sleep instead of
    waiting (and timing out) behind it."""
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S) as c:
        r = c.post("/slow_down", json={"forward_sleep_time": 1e9})
        assert r.status_code == 400, r.text
        assert "--watchdog-timeout" in r.json()["error"]["message"]
        running = RunningStream(server.base_url)
        assert running.first.wait(STATE_TIMEOUT_S), "the request never started"
        try:
            assert c.post("/slow_down", json={"forward_sleep_time": 300}).status_code == 200
        finally:  # the next step sleeps 300 s: the reset must come back well before it ends
            r = c.post("/slow_down", json={"forward_sleep_time": None})
        assert r.status_code == 200 and r.json()["forward_sleep_time"] is None, r.text
        running.future.result(STATE_TIMEOUT_S)
        assert running.tokens == UNTIL_ABORTED


def test_sigterm_stops_a_slowed_down_server(server):
    """The last test of the module: SIGTERM while a step sleeps for 300 s exits 0
    (``check_clean_stop`` allows 60 s)."""
    running = RunningStream(server.base_url)
    assert running.first.wait(STATE_TIMEOUT_S), "the request never started"
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S) as c:
        assert c.post("/slow_down", json={"forward_sleep_time": 300}).status_code == 200
    server.check_clean_stop()
