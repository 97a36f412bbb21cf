"""Soak: mixed traffic against one server for a while, a leak check after every step.

``make soak`` runs it for 15 minutes on the shipped demo model (``DURATION=`` seconds to
change that); ``tests/reliability/test_soak.py`` runs it for 20 seconds on a tiny checkpoint.
Each step sends a burst of mixed requests concurrently: native and OpenAI generations, streams
read to the end, streams dropped mid-way (a disconnect), requests aborted by rid, and a session
with two turns then closed. Then it waits until the scheduler is idle and checks that nothing is
held: the KV invariant, no request state in the server process, no open session, and the
scheduler's own idle leak check. The server runs with ``RADIXSERVE_TEST_STRICT=1`` and
``RADIXSERVE_STRICT_MEM_CHECK=busy`` (the memory invariant checked after every scheduler step,
busy or not), so a leak the scheduler notices itself crashes it (the soak reports the dead
server).

Prints one JSON line per step, then a summary (requests of each kind, failures with samples,
resident memory of the server's processes after the first step and at the end: the growth);
exits 1 on any failure or leak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from radixserve.server.default_model import default_model_path
from tests.server.conftest import ServerProcess, assert_no_leak, start_server
from tests.sync import UNTIL_ABORTED

BURST = 12  # requests of one step, sent together
TOKENS = 24  # output tokens of a request that runs to its end


class Soak:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.sent: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.samples: list[str] = []

    def fail(self, kind: str, detail: str) -> None:
        self.failures[kind] += 1
        if len(self.samples) < 20:
            self.samples.append(f"{kind}: {detail[:300]}")

    def expect(self, kind: str, r: httpx.Response, *ok: int) -> None:
        if r.status_code not in (ok or (200,)):
            self.fail(kind, f"{r.status_code} {r.text}")

    # ------------------------------------------------------------------ traffic
    async def generate(self, c: httpx.AsyncClient, i: int) -> None:
        r = await c.post("/generate", json={
            "text": f"soak {i}", "sampling_params": {"max_new_tokens": TOKENS,
                                                     "sampling_seed": i}})
        self.expect("generate", r)

    async def chat_stream(self, c: httpx.AsyncClient, i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"tell me {i}"}], "stream": True,
                "max_tokens": TOKENS, "n": 1 + i % 2}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        if r.status_code != 200 or not lines or lines[-1] != "data: [DONE]":
            self.fail("chat_stream", f"{r.status_code} {lines[-2:]}")

    async def dropped_stream(self, c: httpx.AsyncClient, i: int) -> None:
        body = {"text": f"drop {i}", "stream": True,
                "sampling_params": {"max_new_tokens": UNTIL_ABORTED, "ignore_eos": True}}
        async with c.stream("POST", "/generate", json=body) as r:
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    return  # leaving the block closes the connection mid-stream
        self.fail("dropped_stream", f"{r.status_code}: ended before it was dropped")

    async def aborted(self, c: httpx.AsyncClient, i: int) -> None:
        rid = f"soak-abort-{uuid.uuid4().hex}"
        body = {"text": f"abort {i}", "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": UNTIL_ABORTED, "ignore_eos": True}}
        async with c.stream("POST", "/generate", json=body) as r:
            lines = r.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):  # running: abort it by its rid
                    self.expect("abort", await c.post("/abort_request", json={"rid": rid}))
                    break
            rest = [line async for line in lines if line.startswith("data: ")]
        final = json.loads(rest[-2].removeprefix("data: ")) if len(rest) >= 2 else {}
        reason = final.get("meta_info", {}).get("finish_reason") or {}
        if rest[-1:] != ["data: [DONE]"] or reason.get("type") != "abort":
            self.fail("aborted", f"{r.status_code} {rest[-2:]}")

    async def session(self, c: httpx.AsyncClient, i: int) -> None:
        r = await c.post("/open_session", json={"capacity_of_str_len": 4096})
        self.expect("session", r)
        if r.status_code != 200:
            return
        session_id = r.json()
        try:
            rid = None
            for turn in range(2):
                r = await c.post("/generate", json={
                    "text": f" turn {turn} of {i}",
                    "session_params": {"id": session_id, "rid": rid},
                    "sampling_params": {"max_new_tokens": 8}})
                self.expect("session", r)
                if r.status_code != 200:
                    return
                rid = r.json()["meta_info"]["id"]
        finally:
            self.expect("session", await c.post("/close_session",
                                                json={"session_id": session_id}))

    async def step(self, index: int) -> None:
        kinds = [self.generate, self.chat_stream, self.dropped_stream, self.aborted,
                 self.session]
        limits = httpx.Limits(max_connections=BURST)
        async with httpx.AsyncClient(base_url=self.server.base_url, timeout=300,
                                     limits=limits) as c:

            async def one(i: int) -> None:
                kind = kinds[(index + i) % len(kinds)]
                self.sent[kind.__name__] += 1
                try:
                    await kind(c, index * BURST + i)
                except httpx.HTTPError as exc:
                    self.fail(kind.__name__, repr(exc))

            await asyncio.gather(*(one(i) for i in range(BURST)))

    # ------------------------------------------------------------------ checks
    def check_idle(self) -> None:
        """Nothing held once idle; ``AssertionError`` names what is."""
        with httpx.Client(base_url=self.server.base_url, timeout=60) as c:
            memory = assert_no_leak(c)
            assert memory["session_held_kv_tokens"] == 0, memory
            info = c.get("/get_server_info").json()
            state = info["internal_states"][0]
            assert info["num_inflight_requests"] == 0, info["num_inflight_requests"]
            assert state["num_open_sessions"] == 0, state["session_ids"]
            assert state["last_leak_check"]["ok"], state["last_leak_check"]

    def rss_mib(self) -> float:
        procs = [psutil.Process(self.server.proc.pid), *self.server.children()]
        return sum(p.memory_info().rss for p in procs) / 2**20


def run(model_path: Path, duration: float) -> dict[str, Any]:
    server = start_server(model_path, env={"RADIXSERVE_STRICT_MEM_CHECK": "busy"})
    soak = Soak(server)
    steps, rss, started = 0, [], time.monotonic()
    try:
        while steps == 0 or time.monotonic() - started < duration:
            asyncio.run(soak.step(steps))
            steps += 1
            try:
                soak.check_idle()
            except AssertionError as exc:
                soak.fail("leak", str(exc))
                break
            rss.append(soak.rss_mib())
            print(json.dumps({"step": steps, "elapsed_s": round(time.monotonic() - started, 1),
                              "rss_mib": round(rss[-1], 1),
                              "failures": sum(soak.failures.values())}), flush=True)
    except httpx.TransportError as exc:  # the server is gone
        soak.fail("server", f"{exc!r}\n{server.stderr_tail()}")
    finally:
        code = server.stop()
    if code != 0:
        soak.fail("exit", f"exit code {code}: {server.stderr_tail()}")
    elapsed = time.monotonic() - started
    return {
        "duration_s": round(elapsed, 1), "steps": steps, "requests": dict(soak.sent),
        "leak_checks_passed": len(rss), "failures": dict(soak.failures),
        "failure_samples": soak.samples,
        "rss_mib_after_first_step": round(rss[0], 1) if rss else None,
        "rss_mib_at_end": round(rss[-1], 1) if rss else None,
        "rss_growth_mib": round(rss[-1] - rss[0], 1) if rss else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, default=None,
                        help="checkpoint to serve (default: the shipped demo model)")
    parser.add_argument("--duration", type=float, default=900.0,
                        help="seconds of traffic (the step under way finishes)")
    args = parser.parse_args(argv)
    summary = run(args.model_path or default_model_path(), args.duration)
    print(json.dumps(summary), flush=True)
    return 0 if not summary["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
