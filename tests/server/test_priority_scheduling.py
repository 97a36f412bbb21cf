"""Priority scheduling (``--enable-priority-scheduling``, docs/priority.md) on a real server.

The server runs one request at a time (``--max-running-requests 1``), so that which request
runs is observable: the one whose stream has produced a chunk. Requests are queued while
generation is paused, so the queue's order is not a race; a preemption shows in
``get_server_info`` (``num_preempted_reqs``) and in outputs equal to undisturbed runs.
"""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path

import httpx
import openai
import pytest

from radixserve.managers.scheduler.priority_scheduling import PriorityScheduling, timed_out
from radixserve.managers.scheduler.schedule_batch import Req
from radixserve.sampling.sampling_params import SamplingParams
from tests.server.conftest import assert_no_leak, internal_state, paused, start_server
from tests.sync import UNTIL_ABORTED, in_background, wait_for

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlap"])
def prio_server(request, llama_path: Path):
    """Both schedules: the overlap one (CUDA's default) plans decode steps ahead, and must
    still stop to let a more important request preempt."""
    overlap = ["--enable-overlap-schedule"] if request.param else []
    srv = start_server(llama_path, "--enable-priority-scheduling", "--max-running-requests", "1",
                       *overlap)
    yield srv
    srv.check_clean_stop()


@pytest.fixture
def prio_client(prio_server):
    with httpx.Client(base_url=prio_server.base_url, timeout=60) as c:
        yield c
        assert internal_state(c)["paused"] is False
        assert_no_leak(c)


def generate(base_url: str, prompt: str, max_new_tokens: int, priority: int | None) -> dict:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, **GREEDY}}
    if priority is not None:
        body["priority"] = priority
    r = httpx.post(f"{base_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_to(events: queue.Queue, base_url: str, rid: str, prompt: str, max_new_tokens: int,
              priority: int) -> dict:
    """A native stream whose chunks are announced on ``events`` as ``(rid, chunk)``; returns
    the last chunk."""
    body = {"text": prompt, "rid": rid, "stream": True, "priority": priority,
            "sampling_params": {"max_new_tokens": max_new_tokens, **GREEDY}}
    last = {}
    with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                events.put((rid, last))
    return last


def next_starter(events: queue.Queue, started: set[str]) -> str:
    """The next request whose first chunk arrives."""
    while True:
        rid, _ = events.get(timeout=120)
        if rid not in started:
            started.add(rid)
            return rid


def test_the_waiting_queue_runs_most_important_first(prio_server, prio_client):
    events: queue.Queue = queue.Queue()
    priorities = {"low": 1, "mid": 5, "high": 9}  # within the threshold (10): no preemption
    futures = {}
    with paused(prio_client):
        for n, (rid, priority) in enumerate(priorities.items(), start=1):
            futures[rid] = in_background(stream_to, events, prio_server.base_url, rid,
                                         f"Request {rid}:", UNTIL_ABORTED, priority)
            wait_for(lambda: internal_state(prio_client), lambda s, n=n: s["num_waiting_reqs"] == n,
                     f"{n} requests waiting")
    started: set[str] = set()
    order = []
    for _ in priorities:
        rid = next_starter(events, started)
        order.append(rid)
        assert internal_state(prio_client)["num_running_reqs"] == 1
        r = prio_client.post("/abort_request", json={"rid": rid})
        assert r.status_code == 200, r.text
        futures[rid].result(timeout=120)
    assert order == ["high", "mid", "low"]
    assert internal_state(prio_client)["num_preempted_reqs"] == 0


def test_an_important_request_preempts_a_running_one_with_undisturbed_outputs(
    prio_server, prio_client
):
    low_prompt, high_prompt, low_tokens, high_tokens = "The low one:", "The high one:", 200, 16
    # Nothing cached: what the preempted request finds when it resumes is its own KV.
    assert prio_client.post("/flush_cache").status_code == 200
    before = internal_state(prio_client)

    events: queue.Queue = queue.Queue()
    low = in_background(stream_to, events, prio_server.base_url, "low", low_prompt, low_tokens, 0)
    while events.get(timeout=120)[1]["meta_info"]["completion_tokens"] < 20:
        pass  # running, with 20 outputs' KV
    with paused(prio_client):
        high = in_background(generate, prio_server.base_url, high_prompt, high_tokens, 100)
        wait_for(lambda: internal_state(prio_client), lambda s: s["num_waiting_reqs"] == 1,
                 "the important request waiting")
    high_out = high.result(timeout=120)
    low_last = low.result(timeout=120)
    after = internal_state(prio_client)
    assert after["num_preempted_reqs"] == before["num_preempted_reqs"] + 1
    # The preempted request resumed from the radix cache: the prefills computed the two prompts
    # and a few tokens more, not the low request's prompt and 20+ outputs again.
    prompts = low_last["meta_info"]["prompt_tokens"] + high_out["meta_info"]["prompt_tokens"]
    assert after["num_prefill_tokens"] - before["num_prefill_tokens"] < prompts + 20
    # The same greedy outputs as undisturbed runs.
    assert high_out["text"] == generate(prio_server.base_url, high_prompt, high_tokens, 100)["text"]
    assert low_last["text"] == generate(prio_server.base_url, low_prompt, low_tokens, 0)["text"]
    assert low_last["meta_info"]["completion_tokens"] == low_tokens


def test_equal_priorities_do_not_preempt(prio_server, prio_client):
    before = internal_state(prio_client)["num_preempted_reqs"]
    events: queue.Queue = queue.Queue()
    first = in_background(stream_to, events, prio_server.base_url, "first", "One:", 40, 50)
    assert events.get(timeout=120)[0] == "first"
    second = in_background(generate, prio_server.base_url, "Two:", 4, 60)  # within the threshold
    first.result(timeout=120)
    second.result(timeout=120)
    assert internal_state(prio_client)["num_preempted_reqs"] == before


def test_the_openai_routes_take_priority_as_an_extra_field(prio_server):
    oai = openai.OpenAI(base_url=f"{prio_server.base_url}/v1", api_key="x")
    out = oai.completions.create(model=prio_server.model, prompt="Hi", max_tokens=3,
                                 temperature=0, extra_body={"priority": 7})
    assert out.usage.completion_tokens == 3
    chat = oai.chat.completions.create(model=prio_server.model, max_tokens=3, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"priority": 7})
    assert chat.usage.completion_tokens == 3


def test_priority_is_refused_without_the_flag(server):
    """The shared server runs without --enable-priority-scheduling."""
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=server.model, max_tokens=2,
                                    messages=[{"role": "user", "content": "Hi"}],
                                    extra_body={"priority": 1})
    assert err.value.body["param"] == "priority"
    assert "--enable-priority-scheduling" in err.value.body["message"]
    r = httpx.post(f"{server.base_url}/generate", timeout=60, json={
        "text": "Hi", "priority": 1, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_a_request_past_the_waiting_timeout_gets_503(llama_path: Path):
    srv = start_server(llama_path, "--max-running-requests", "1",
                       env={"RADIXSERVE_REQ_WAITING_TIMEOUT": "0.2"})
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            assert generate(srv.base_url, "Hi", 2, None)["meta_info"]["completion_tokens"] == 2
            with paused(c):
                late = in_background(httpx.post, f"{srv.base_url}/generate", timeout=60, json={
                    "text": "Hi", "sampling_params": {"max_new_tokens": 2}})
                wait_for(lambda: internal_state(c), lambda s: s["num_waiting_reqs"] == 1,
                         "a request waiting")
                # Longer than the timeout; the scheduler ends it at its next step.
                threading.Event().wait(0.4)
            r = late.result(timeout=60)
            assert r.status_code == 503 and "waiting timeout" in r.text
            assert_no_leak(c)
    finally:
        srv.check_clean_stop()


def _req(rid: str, priority: int | None, policy: PriorityScheduling) -> Req:
    req = Req(rid, [5, 6], SamplingParams(max_new_tokens=4))
    policy.assign(req, priority)
    return req


@pytest.mark.parametrize("low_first", [False, True])
def test_order_and_victims_follow_the_convention(low_first):
    policy = PriorityScheduling(low_values_first=low_first, threshold=10)
    reqs = [_req("a", 0, policy), _req("b", 50, policy), _req("c", None, policy),
            _req("d", 50, policy)]
    waiting = list(reqs)
    policy.order(waiting)
    expected = ["b", "d", "a", "c"] if not low_first else ["a", "b", "d", "c"]
    assert [r.rid for r in waiting] == expected  # stable: b before d
    top = waiting[0]
    victim = policy.victim(top, [r for r in reqs if r is not top])
    assert victim is not None and victim.rid == "c"  # unnamed: the least important
    equal = [r for r in reqs if r is not top and r.priority == top.priority]
    assert policy.victim(top, equal) is None
    assert PriorityScheduling(preemption=False).victim(top, reqs[1:]) is None


def test_timed_out_skips_started_requests():
    policy = PriorityScheduling()
    fresh, old, retracted = (_req(n, None, policy) for n in ("fresh", "old", "retracted"))
    old.queued_at -= 10
    retracted.queued_at -= 10
    retracted.is_retracted = True
    now = fresh.queued_at + 1
    assert timed_out([fresh, old, retracted], 5.0, now) == [old]
    assert timed_out([fresh, old, retracted], 0.0, now) == []
