"""A client that goes away aborts its request at once: KV is freed, the server keeps serving."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import assert_no_leak, memory_figures

LONG = 900  # tokens a dropped request would still generate if it were not aborted


def _wait_idle(client: httpx.Client, timeout: float = 60.0) -> None:
    start = time.monotonic()
    while memory_figures(client)["running"] > 0:
        assert time.monotonic() - start < timeout
        time.sleep(0.02)


def test_dropped_stream_is_aborted_at_once(client, server):
    aborted = memory_figures(client)["aborted"]
    body = {"text": "drop me", "stream": True,
            "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(base_url=server.base_url, timeout=60) as c, \
            c.stream("POST", "/generate", json=body) as r:
        for n, _ in enumerate(line for line in r.iter_lines() if line.startswith("data")):
            if n == 4:
                break
    _wait_idle(client)
    # Ended by an abort, not by running out its LONG tokens.
    assert memory_figures(client)["aborted"] == aborted + 1
    assert_no_leak(client)


def test_non_stream_request_of_a_gone_client_is_aborted(client, server):
    aborted = memory_figures(client)["aborted"]
    body = {"text": "wait for me", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    with httpx.Client(base_url=server.base_url, timeout=0.2) as c, \
            pytest.raises(httpx.ReadTimeout):
        c.post("/generate", json=body)
    _wait_idle(client)
    assert memory_figures(client)["aborted"] == aborted + 1
    assert_no_leak(client)


async def _one_stream(client: httpx.AsyncClient, i: int, drop: bool) -> str:
    """Stream request ``i`` (chat or native alternately); drop it after 3 events if asked."""
    max_tokens = 400 if drop else 6
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
