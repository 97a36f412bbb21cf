"""Stress: 16 streaming sessions x 8 turns at once, with plain requests, aborts and disconnects,
on a KV pool and a request pool too small for all of them.

The pools force the memory paths that sessions must survive: idle sessions' slots released when
KV or request rows run out (their next turn re-prefills), streaming turns retracted mid-decode,
aborted turns rolled back. Afterwards every session still works, every turn's output equals a
plain ``/generate`` on the ids the session assembled, the memory invariant holds, and no KV is
held once every session is closed. Choices are seeded; the interleaving is whatever the server
makes of them, except at the start: the first turns and a burst of plain requests queue up in the
paused server and start together, so the pools run short however fast the requests arrive.

Turns that get aborted or disconnected ask for more tokens than the KV pool holds: they can only
end by an abort (the client's, or the pool's when such a turn is left alone), never finish, so
what the session holds afterwards does not depend on how far they ran.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import start_server
from tests.sessions.conftest import BOS, BUSY_CHECK, random_ids, sampling
from tests.sync import POLL_S, STATE_TIMEOUT_S

SEED = 20240604
SESSIONS = 16
TURNS = 8
TURN_TOKENS = 4  # new tokens of an ordinary turn
PLAIN_REQUESTS = 20
PLAIN_TOKENS = 48  # long decodes that admission under-reserves for: retraction
KV_TOKENS = 256  # 64 pages of 4, for 16 histories of up to ~100 tokens plus running requests
LONG_TOKENS = KV_TOKENS  # turns that get aborted or disconnected: more than the pool holds
ROWS = 20  # request rows (= max running requests): 16 idle slots leave 4 for running turns
LIMITS = httpx.Limits(max_connections=64, max_keepalive_connections=64)


@pytest.fixture(scope="module")
def server(llama_path: Path):
    srv = start_server(
        llama_path,
        "--enable-streaming-session",
        "--page-size", "4",
        "--max-total-tokens", str(KV_TOKENS),
        "--max-running-requests", str(ROWS),
        "--chunked-prefill-size", "64",
        # Admission counts on little decode growth, so running requests get retracted.
        "--schedule-conservativeness", "0.3",
        env=BUSY_CHECK,
    )
    yield srv
    srv.check_clean_stop()


@dataclass
class Turn:
    """A finished turn: the prompt the session should have assembled and what it produced."""

    assembled: list[int]
    output_ids: list[int]
    cached_tokens: int
    full_reuse: int  # cached_tokens when the session's slot survived since the last turn


@dataclass
class Outcome:
    turns: list[Turn] = field(default_factory=list)
    aborted: int = 0
    disconnected: int = 0


class StressChat:
    """One streaming session driven by a seeded script of turn kinds."""

    def __init__(self, http: httpx.AsyncClient, index: int) -> None:
        self.http = http
        self.rng = random.Random(SEED * 100 + index)
        self.index = index
        self.session_id = ""
        self.history: list[int] = []
        self.last_len = 0  # prompt + completion of the last finished turn
        self.outcome = Outcome()

    async def open(self) -> None:
        r = await self.http.post(
            "/open_session", json={"capacity_of_str_len": 4096, "streaming": True}
        )
        assert r.status_code == 200, r.text
        self.session_id = r.json()

    def body(self, new: list[int], max_new_tokens: int, **extra: Any) -> dict[str, Any]:
        return {
            "input_ids": new,
            "sampling_params": sampling(max_new_tokens),
            "session_params": {"id": self.session_id},
            **extra,
        }

    def assembled(self, new: list[int]) -> list[int]:
        if self.history and new[:1] == [BOS]:
            new = new[1:]
        return self.history + new

    async def run(self, turns: int) -> Outcome:
        for t in range(turns):
            kind = self.rng.choices(["plain", "stream", "abort", "disconnect"], [4, 3, 1, 1])[0]
            new = ([BOS] if self.rng.random() < 0.3 else []) + random_ids(self.rng, 6)
            if kind == "plain":
                await self.turn(new)
            elif kind == "stream":
                await self.streamed_turn(new)
            elif kind == "abort":
                await self.aborted_turn(new, f"stress-{self.index}-{t}")
            else:
                await self.disconnected_turn(new)
        return self.outcome

    async def one_more_turn(self) -> Turn:
        await self.turn(random_ids(self.rng, 5))
        return self.outcome.turns[-1]

    async def turn(self, new: list[int]) -> None:
        # Sent at once, also right after a disconnect: the server orders the abort first.
        r = await self.http.post("/generate", json=self.body(new, TURN_TOKENS))
        assert r.status_code == 200, r.text
        self.record(new, r.json())

    async def streamed_turn(self, new: list[int]) -> None:
        final = await self.stream_until(new, TURN_TOKENS, stop_after=None)
        assert final is not None and final["meta_info"]["finish_reason"]["type"] == "length"
        self.record(new, final)

    async def aborted_turn(self, new: list[int], rid: str) -> None:
        final = await self.stream_until(new, LONG_TOKENS, stop_after=None, abort_rid=rid)
        assert final is not None and final["meta_info"]["finish_reason"]["type"] == "abort"
        self.outcome.aborted += 1
        self.last_len = 0  # the slot went with the turn: nothing to reuse next

    async def disconnected_turn(self, new: list[int]) -> None:
        final = await self.stream_until(new, LONG_TOKENS, stop_after=1)
        assert final is None
        self.outcome.disconnected += 1
        self.last_len = 0

    async def stream_until(
        self, new: list[int], max_new_tokens: int, stop_after: int | None,
        abort_rid: str | None = None,
    ) -> dict[str, Any] | None:
        """Stream a turn; abort it after its first event, or stop reading (disconnect) after
        ``stop_after`` events. Returns the final event, None when disconnected."""
        extra: dict[str, Any] = {"stream": True}
        if abort_rid is not None:
            extra["rid"] = abort_rid
        body = self.body(new, max_new_tokens, **extra)
        async with self.http.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200, (await r.aread()).decode()
            events = 0
            last = None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                last = json.loads(line.removeprefix("data: "))
                events += 1
                if stop_after is not None and events >= stop_after:
                    return None  # leaving the block closes the connection
                if abort_rid is not None and events == 1:
                    await self.http.post("/abort_request", json={"rid": abort_rid})
            return last

    def record(self, new: list[int], out: dict[str, Any]) -> None:
        meta = out["meta_info"]
        assembled = self.assembled(new)
        assert meta["prompt_tokens"] == len(assembled), (
            f"session {self.index}: the server assembled {meta['prompt_tokens']} tokens, "
            f"expected {len(assembled)} (history {len(self.history)})"
        )
        full_reuse = self.last_len - 1 if self.last_len else 0
        self.outcome.turns.append(
            Turn(assembled, out["output_ids"], meta["cached_tokens"], full_reuse)
        )
        self.history = assembled + out["output_ids"]
        self.last_len = len(self.history)


async def plain_traffic(
    http: httpx.AsyncClient, rng: random.Random, started: asyncio.Event
) -> list[Turn]:
    """Plain requests during the chat; some share a prefix (radix cache). A burst is sent at
    once; the rest follow at random moments (spread, not synchronisation) once ``started``."""
    shared = random_ids(rng, 16)

    async def one(prompt: list[int], delay: float | None) -> Turn:
        if delay is not None:
            await started.wait()
            await asyncio.sleep(delay)
        r = await http.post(
            "/generate", json={"input_ids": prompt, "sampling_params": sampling(PLAIN_TOKENS)}
        )
        assert r.status_code == 200, r.text
        return Turn(prompt, r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"], 0)

    jobs = []
    for i in range(PLAIN_REQUESTS):
        prefix = shared if rng.random() < 0.5 else []
        # A burst first: admitted together, their decodes outgrow the pool (retraction).
        delay = None if i < PLAIN_REQUESTS // 2 else rng.uniform(0, 4)
        jobs.append(one(prefix + random_ids(rng, rng.randrange(8, 24)), delay))
    return list(await asyncio.gather(*jobs))


async def check_against_plain(http: httpx.AsyncClient, turns: list[Turn], max_new: int) -> None:
    """Every turn's output equals a plain greedy request on its assembled prompt."""
    gate = asyncio.Semaphore(8)

    async def check(turn: Turn) -> None:
        async with gate:
            body = {"input_ids": turn.assembled, "sampling_params": sampling(max_new)}
            r = await http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == turn.output_ids, (
            f"a session turn of {len(turn.assembled)} prompt tokens differs from plain /generate"
        )

    await asyncio.gather(*(check(t) for t in turns))


async def wait_state(http: httpx.AsyncClient, predicate: Callable[[dict], bool]) -> None:
    """Poll the scheduler's internal state until ``predicate`` holds (the deadline bounds a
    failure only)."""
    deadline = time.monotonic() + STATE_TIMEOUT_S
    while True:
        state = (await http.get("/get_server_info")).json()["internal_states"][0]
        if predicate(state):
            return
        assert time.monotonic() < deadline, f"not reached: {state}"
        await asyncio.sleep(POLL_S)


async def stress(base_url: str) -> tuple[list[StressChat], list[Outcome]]:
    """The concurrent chat with plain traffic; then every finished turn checked."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=LIMITS) as http:
        chats = [StressChat(http, i) for i in range(SESSIONS)]
        await asyncio.gather(*(c.open() for c in chats))
        # The first turns and the plain burst queue in the paused scheduler, then start at once.
        r = await http.post("/pause_generation", json={"mode": "in_place"})
        assert r.status_code == 200, r.text
        started = asyncio.Event()
        traffic = asyncio.gather(
            *(c.run(TURNS) for c in chats), plain_traffic(http, random.Random(SEED), started)
        )
        try:
            queued = SESSIONS + PLAIN_REQUESTS // 2
            await wait_state(http, lambda s: s["num_waiting_reqs"] == queued)
        finally:
            r = await http.post("/continue_generation")
            assert r.status_code == 200, r.text
            started.set()
        results = await traffic
        outcomes, plain = list(results[:-1]), results[-1]
        session_turns = [t for o in outcomes for t in o.turns if len(t.output_ids) == TURN_TOKENS]
        await check_against_plain(http, session_turns, TURN_TOKENS)
        await check_against_plain(http, plain[:6], PLAIN_TOKENS)
    return chats, outcomes


async def one_more_turn_each(base_url: str, chats: list[StressChat]) -> list[Turn]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=LIMITS) as http:
        for chat in chats:
            chat.http = http
        return list(await asyncio.gather(*(c.one_more_turn() for c in chats)))


async def check_turns(base_url: str, turns: list[Turn]) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=LIMITS) as http:
        await check_against_plain(http, turns, TURN_TOKENS)


def test_many_streaming_sessions_survive_aborts_disconnects_and_memory_pressure(server, api):
    chats, outcomes = asyncio.run(stress(server.base_url))
    turns = [t for o in outcomes for t in o.turns]
    assert sum(o.aborted for o in outcomes) > 0 and sum(o.disconnected for o in outcomes) > 0
    assert len(turns) >= SESSIONS * TURNS // 2
    # Memory ran short: idle sessions lost their slots, running decodes were retracted.
    assert any(t.cached_tokens < t.full_reuse for t in turns), "no slot was ever released"
    assert api.wait_idle()["num_retracted_reqs"] > 0, "no request was retracted"
    api.assert_accounted()
    # Every session still works; alone, a session reuses its slot again.
    extra = asyncio.run(one_more_turn_each(server.base_url, chats))
    for _ in range(2):
        extra += asyncio.run(one_more_turn_each(server.base_url, chats[:1]))
    assert extra[-1].cached_tokens == extra[-1].full_reuse > 0
    assert api.assert_accounted()["session_held_kv_tokens"] > 0
    asyncio.run(check_turns(server.base_url, extra))
    for chat in chats:
        api.close(chat.session_id)
    memory = api.assert_accounted()
    assert memory["session_held_kv_tokens"] == 0
    assert memory["free_req_slots"] == memory["total_req_slots"] == ROWS
