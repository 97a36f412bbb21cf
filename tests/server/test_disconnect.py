"""A client that goes away aborts its request at once: KV is freed, the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from tests.server.conftest import (
    assert_no_leak,
    continue_generation,
    internal_state,
    memory_figures,
    pause_generation,
    paused,
)
from tests.sync import UNTIL_ABORTED, wait_for


def _aborted(client: httpx.Client, count: int) -> None:
    """Wait until the scheduler has aborted ``count`` requests in all and runs nothing."""
    wait_for(lambda: internal_state(client),
             lambda s: s["num_aborted_reqs"] == count and s["num_running_reqs"] == 0
             and s["num_waiting_reqs"] == 0, f"{count} aborted requests in all")


def test_dropped_stream_is_aborted_at_once(client, server):
    aborted = memory_figures(client)["aborted"]
    body = {"text": "drop me", "stream": True,
            "sampling_params": {"max_new_tokens": UNTIL_ABORTED, "temperature": 0,
                                "ignore_eos": True}}
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as c, \
                c.stream("POST", "/generate", json=body) as r:
            events = (line for line in r.iter_lines() if line.startswith("data"))
            for _ in range(5):  # (kept referenced: closing the iterator closes the connection)
                next(events)
            # Paused, the request cannot finish: only the disconnect can end it.
            pause_generation(client)
            assert internal_state(client)["num_running_reqs"] == 1, "finished before the pause"
        _aborted(client, aborted + 1)
    finally:
        continue_generation(client)
    assert_no_leak(client)


def _queued_then_gone(client: httpx.Client, server, path: str, body: dict) -> None:
    """Send ``body`` over a raw connection while the scheduler is paused, wait until it is
    queued, and close the connection: the server must abort it, paused or not."""
    aborted = memory_figures(client)["aborted"]
    data = json.dumps(body).encode()
    request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    with paused(client):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(request + data)
            wait_for(lambda: internal_state(client), lambda s: s["num_waiting_reqs"] == 1,
                     "the request queued in the paused scheduler")
        _aborted(client, aborted + 1)
    assert_no_leak(client)


def test_non_stream_request_of_a_gone_client_is_aborted(client, server):
    body = {"text": "wait for me", "sampling_params": {"max_new_tokens": 8}}
    _queued_then_gone(client, server, "/generate", body)


STREAMS = {
    "/generate": {"text": "gone early", "stream": True, "sampling_params": {"max_new_tokens": 8}},
    "/v1/completions": {"prompt": "gone early", "stream": True, "max_tokens": 8},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "gone early"}],
                             "stream": True, "max_tokens": 8},
    "/v1/responses": {"input": "gone early", "stream": True, "max_output_tokens": 8},
}


@pytest.mark.parametrize("path", list(STREAMS))
def test_stream_of_a_client_gone_before_its_first_output_is_aborted(client, server, path):
    """The stream has not started (its first output is waited for before the 200 goes out):
    the disconnect is watched then too, so a request held in the queue does not outlive its
    client."""
    _queued_then_gone(client, server, path, STREAMS[path])


async def _one_stream(client: httpx.AsyncClient, i: int, drop: bool) -> str:
    """Stream request ``i`` (chat or native alternately); drop it after 3 events if asked."""
    max_tokens = UNTIL_ABORTED if drop else 6
    if i % 2:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": f"tell me {i}"}], "stream": True,
                "max_tokens": max_tokens, "ignore_eos": True, "seed": i}
    else:
        path = "/generate"
        body = {"text": f"story {i}", "stream": True,
                "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True,
                                    "sampling_seed": i}}
    events = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line)
                if drop and len(events) == 3:
                    return "dropped"  # leaving the block closes the connection mid-stream
    assert events[-1] == "data: [DONE]"
    return "done"


def test_hundred_streams_with_a_third_dropped_leave_no_leak(client, server):
    async def storm() -> list[str]:
        gate = asyncio.Semaphore(8)
        limits = httpx.Limits(max_connections=8)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                     limits=limits) as ac:

            async def run(i: int) -> str:
                async with gate:
                    return await _one_stream(ac, i, drop=i % 3 == 0)

            return await asyncio.gather(*(run(i) for i in range(100)))

    aborted = memory_figures(client)["aborted"]
    results = asyncio.run(storm())
    assert results.count("dropped") == 34 and results.count("done") == 66
    assert_no_leak(client)  # waits until idle: every abort has been handled
    assert memory_figures(client)["aborted"] == aborted + 34
    r = client.post("/generate", json={"text": "still alive",
                                       "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
    assert client.get("/health").status_code == 200
