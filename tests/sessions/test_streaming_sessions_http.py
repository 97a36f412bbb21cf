"""Streaming sessions over HTTP: linear turns whose KV stays in a per-session slot.

A turn of a streaming session reuses everything of the last finished turn but its last sampled
token (whose KV the next turn computes):

    cached_tokens(k) == prompt_tokens(k-1) + completion_tokens(k-1) - 1

The first turn goes through the radix tree like any request; its prompt stays there, locked by
the session (``protected``) while the session holds its slot, and the slot holds the rest
(``session_held``).

Every turn is also compared with a plain ``/generate`` on the assembled ids, so a reused slot
holding the wrong KV shows up as different tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.conftest import paused, start_server
from tests.sessions.conftest import BOS, BUSY_CHECK, new_rid, random_ids, sse_events
from tests.sync import in_background, wait_for

N = 6  # new tokens of an ordinary turn
CONTEXT_LEN = 1024  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="module")
def server(llama_path: Path):
    srv = start_server(llama_path, "--enable-streaming-session", env=BUSY_CHECK)
    yield srv
    srv.check_clean_stop()


class Chat:
    """One streaming session and the history the server should hold for it."""

    def __init__(self, api, rng) -> None:
        self.api, self.rng = api, rng
        self.id = api.open(streaming=True)
        self.history: list[int] = []
        self.last_meta: dict | None = None

    def expected_cached(self) -> int:
        assert self.last_meta is not None
        return self.last_meta["prompt_tokens"] + self.last_meta["completion_tokens"] - 1

    def assembled(self, new: list[int]) -> list[int]:
        if self.history and new[:1] == [BOS]:
            new = new[1:]
        return self.history + new

    def until_aborted(self, new: list[int]) -> int:
        """max_new_tokens of a turn the test ends itself: the most the context allows, so that
        it cannot finish first (see ``tests/sync.py``)."""
        return CONTEXT_LEN - len(self.assembled(new))

    def turn(self, n_new: int = 5, max_new_tokens: int = N, bos: bool = False, **params) -> dict:
        """One turn that must succeed, checked against a plain request; the history advances."""
        new = ([BOS] if bos else []) + random_ids(self.rng, n_new)
        assembled = self.assembled(new)
        out = self.api.generate(new, max_new_tokens, self.id, **params)
        self.api.assert_turn(out, assembled, max_new_tokens)
        self.advance(out, assembled)
        return out

    def advance(self, out: dict, assembled: list[int]) -> None:
        self.history = assembled + out["output_ids"]
        self.last_meta = out["meta_info"]


def cached(out: dict) -> int:
    return out["meta_info"]["cached_tokens"]


def finish_type(event: dict) -> str:
    return event["meta_info"]["finish_reason"]["type"]


def test_turns_continue_linearly_reusing_all_but_the_last_token(api, rng):
    chat = Chat(api, rng)
    first = chat.turn(n_new=8, bos=True)
    assert cached(first) == 0
    for _ in range(3):
        expected = chat.expected_cached()
        out = chat.turn(bos=True)  # a leading BOS of a later turn is dropped
        assert cached(out) == expected
    # Streamed over HTTP: the same continuation, the final event carries the whole turn.
    new = random_ids(rng, 4)
    with api.stream(new, N, chat.id) as r:
        events = list(sse_events(r))
    final = events[-1]
    assert finish_type(final) == "length" and cached(final) == chat.expected_cached()
    api.assert_turn(final, chat.assembled(new), N)
    chat.advance(final, chat.assembled(new))
    # The rid of an older turn is ignored: the history stays linear.
    expected = chat.expected_cached()
    out = chat.turn(rid=first["meta_info"]["id"])
    assert cached(out) == expected


def test_held_kv_is_reported_while_a_slot_is_held_and_freed_on_close(api, rng):
    before = api.assert_accounted()
    assert before["session_held_kv_tokens"] == 0
    session = api.open(streaming=True)
    prompt = random_ids(rng, 9)
    out = api.generate(prompt, N, session)
    held = api.assert_accounted()
    # page size 1: the prompt stays in the tree, locked by the session; the slot holds the
    # output tokens but the last.
    assert held["protected_kv_tokens"] == len(prompt)
    assert held["session_held_kv_tokens"] == N - 1
    assert held["available_kv_tokens"] == before["available_kv_tokens"] - (len(prompt) + N - 1)
    assert held["free_req_slots"] == held["total_req_slots"] - 1
    api.close(session)
    after = api.assert_accounted()
    assert after["session_held_kv_tokens"] == after["protected_kv_tokens"] == 0
    # The prompt stays cached in the tree (evictable); the slot's own KV is freed.
    assert after["available_kv_tokens"] == before["available_kv_tokens"] - len(prompt)
    assert after["free_req_slots"] == after["total_req_slots"]
    assert out["meta_info"]["cached_tokens"] == 0


def queue_turn(api, chat: Chat, new: list[int]):
    """Send a turn to the paused server; return its future once the scheduler holds it (the
    session has it in flight from then on)."""
    pending = in_background(api.generate_at, new, N, chat.id)
    wait_for(api.state, lambda s: s["num_waiting_reqs"] == 1, "the turn queued")
    return pending


def test_a_system_prompt_shared_by_sessions_is_computed_once_and_locked_once(api, rng):
    system = random_ids(rng, 24)
    chats = [Chat(api, rng) for _ in range(3)]
    firsts = []
    for chat in chats:
        prompt = system + random_ids(rng, 4)
        out = api.generate(prompt, N, chat.id)
        firsts.append(out)
        api.assert_turn(out, prompt, N)
        chat.advance(out, prompt)
    # The first turn of each later session found the system prompt in the tree.
    assert cached(firsts[0]) == 0
    assert all(cached(out) == 24 for out in firsts[1:])
    # Each session keeps its first prompt locked in the tree; the shared part counts once.
    memory = api.assert_accounted()
    assert memory["protected_kv_tokens"] == 24 + 3 * 4
    assert memory["session_held_kv_tokens"] == 3 * (N - 1)
    for chat in chats:
        expected = chat.expected_cached()
        assert cached(chat.turn()) == expected


def test_second_request_on_a_busy_session_gets_400_and_changes_nothing(api, rng):
    chat = Chat(api, rng)
    chat.turn()
    new = random_ids(rng, 4)
    assembled = chat.assembled(new)
    expected = chat.expected_cached()
    with paused(api.http):
        pending = queue_turn(api, chat, new)
        message = api.rejected(random_ids(rng, 3), N, chat.id)
        assert "in flight" in message
        assert "in flight" in api.rejected(random_ids(rng, 3), N, chat.id, stream=True)
        assert api.state()["num_waiting_reqs"] == 1 and not pending.done()
    final = pending.result(timeout=120)
    assert finish_type(final) == "length" and final["meta_info"]["completion_tokens"] == N
    assert cached(final) == expected
    api.assert_turn(final, assembled, N)
    chat.advance(final, assembled)
    expected = chat.expected_cached()
    assert cached(chat.turn()) == expected


@pytest.mark.parametrize(
    "params", [{"replace": True}, {"drop_previous_output": True}, {"offset": 3}, {"offset": -1}]
)
def test_tree_operations_are_refused_and_leave_the_history_intact(api, rng, params):
    chat = Chat(api, rng)
    chat.turn()
    message = api.rejected(random_ids(rng, 3), N, chat.id, **params)
    assert "streaming sessions are linear" in message
    expected = chat.expected_cached()
    assert cached(chat.turn()) == expected


def test_offset_zero_means_no_cut(api, rng):
    chat = Chat(api, rng)
    chat.turn()
    expected = chat.expected_cached()
    assert cached(chat.turn(offset=0)) == expected


def test_rejected_too_long_turn_keeps_the_slot(api, rng):
    chat = Chat(api, rng)
    chat.turn()
    chat.turn()
    new = random_ids(rng, 20)
    # The new ids alone fit the context; with the session's history they do not.
    max_new = CONTEXT_LEN - len(new)
    message = api.rejected(new, max_new, chat.id)
    assert "context length" in message
    # The scheduler refuses the assembled prompt as the TokenizerManager refuses a plain one.
    assert message == api.rejected(chat.assembled(new), max_new)
    expected = chat.expected_cached()
    assert cached(chat.turn()) == expected


def test_abort_during_the_first_turn_releases_the_slot_and_the_next_turn_starts_fresh(api, rng):
    chat = Chat(api, rng)
    rid = new_rid("first-turn")
    new = random_ids(rng, 8)
    with api.stream(new, chat.until_aborted(new), chat.id, req_rid=rid) as r:
        events = sse_events(r)
        first = next(events)
        api.abort(rid)
        final = [first, *events][-1]
    assert finish_type(final) == "abort"
    assert api.assert_accounted()["session_held_kv_tokens"] == 0
    out = chat.turn(n_new=7)
    assert out["meta_info"]["prompt_tokens"] == 7 and cached(out) == 0
    expected = chat.expected_cached()
    assert cached(chat.turn()) == expected


def test_abort_during_a_later_turn_rolls_back_to_the_last_finished_turn(api, rng):
    chat = Chat(api, rng)
    chat.turn()
    chat.turn()
    memory = api.assert_accounted()
    assert memory["session_held_kv_tokens"] + memory["protected_kv_tokens"] == len(chat.history) - 1
    rid = new_rid("turn-3")
    new = random_ids(rng, 5)
    with api.stream(new, chat.until_aborted(new), chat.id, req_rid=rid) as r:
        events = sse_events(r)
        first = next(events)
        api.abort(rid)
        final = [first, *events][-1]
    assert finish_type(final) == "abort"
    # The slot went with the aborted turn, and the session's lock on the tree with it; the
    # next turn re-prefills the history (through the tree, where the reference requests of
    # this test left it).
    memory = api.assert_accounted()
    assert memory["session_held_kv_tokens"] == memory["protected_kv_tokens"] == 0
    assert memory["free_req_slots"] == memory["total_req_slots"]
    chat.turn()
    expected = chat.expected_cached()
    assert cached(chat.turn()) == expected


def test_a_retracted_turn_keeps_its_slot_and_its_retry_computes_only_what_it_lacks(api, rng):
    chat = Chat(api, rng)
    chat.turn()
    chat.turn()
    new = random_ids(rng, 5)
    assembled = chat.assembled(new)
    rid = new_rid("retracted")
    retracted = api.state()["num_retracted_reqs"]
    with api.stream(new, chat.until_aborted(new), chat.id, req_rid=rid) as r:
        events = sse_events(r)
        first = next(events)
        assert cached(first) == chat.expected_cached()
        with paused(api.http, mode="retract"):
            state = api.state()
            assert state["num_retracted_reqs"] == retracted + 1
            assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 1
            # The slot keeps what the attempt computed: its prompt and its output so far (the
            # session's first prompt stays the tree's, locked by the session).
            memory = state["memory"]
            assert memory["session_held_kv_tokens"] + memory["protected_kv_tokens"] >= len(
                assembled)
            computed = state["num_prefill_tokens"]
        state = wait_for(api.state, lambda s: s["num_running_reqs"] == 1, "the turn resumed")
        # The retry matched the slot: it computed the KV of the attempt's last token only
        # (a re-prefill would have computed the prompt and the output again).
        assert state["num_prefill_tokens"] - computed == 1
        api.abort(rid)
        final = [first, *events][-1]
    assert finish_type(final) == "abort"
    partial = final["output_ids"]
    assert partial == api.reference(assembled, len(partial))["output_ids"]
    # The abort rolled the history back; the session goes on.
    chat.turn()
    expected = chat.expected_cached()
    assert cached(chat.turn()) == expected


def test_a_turn_sent_right_after_a_client_disconnect_succeeds_with_the_history_rolled_back(
    api, rng
):
    chat = Chat(api, rng)
    chat.turn()
    for _ in range(5):
        new = random_ids(rng, 5)
        with api.stream(new, chat.until_aborted(new), chat.id) as r:
            first = next(sse_events(r))
            assert first["meta_info"]["finish_reason"] is None
        # Leaving the block closed the connection: the server aborts the turn, and the next
        # turn is judged only after that abort took effect.
        chat.turn()  # prompt_tokens == len(history + new): the aborted turn left no trace
    expected = chat.expected_cached()
    assert cached(chat.turn()) == expected


def test_close_while_a_turn_runs_is_deferred_until_it_finishes(api, rng):
    chat = Chat(api, rng)
    chat.turn()
    new = random_ids(rng, 4)
    assembled = chat.assembled(new)
    with paused(api.http):
        pending = queue_turn(api, chat, new)
        api.close(chat.id)
        assert "is closing" in api.rejected(random_ids(rng, 3), N, chat.id)
        assert api.state()["memory"]["session_held_kv_tokens"] > 0, "the slot waits for the turn"
    final = pending.result(timeout=120)
    assert finish_type(final) == "length" and final["meta_info"]["completion_tokens"] == N
    assert cached(final) == chat.expected_cached()
    assert "does not exist or is closed" in api.rejected(random_ids(rng, 3), N, chat.id)
    assert api.assert_accounted()["session_held_kv_tokens"] == 0
    api.assert_turn(final, assembled, N)


def test_flush_cache_drops_slots_and_the_next_turn_re_prefills(api, rng):
    chat = Chat(api, rng)
    chat.turn()
    chat.turn()
    assert api.assert_accounted()["session_held_kv_tokens"] > 0
    r = api.http.post("/flush_cache")
    assert r.status_code == 200, r.text
    memory = api.assert_accounted()
    assert memory["session_held_kv_tokens"] == 0
    assert memory["available_kv_tokens"] == memory["total_kv_tokens"]
    out = chat.turn()
    assert cached(out) == 0
    expected = chat.expected_cached()
    assert cached(chat.turn()) == expected


def test_idle_streaming_session_times_out_and_releases_its_slot(api, rng):
    session = api.open(streaming=True, timeout=1)
    api.generate(random_ids(rng, 6), N, session)
    assert api.assert_accounted()["session_held_kv_tokens"] > 0
    # Its slot is released when the scheduler closes the session, a second after its turn.
    wait_for(api.memory, lambda m: m["session_held_kv_tokens"] == 0, "the idle session closed")
    assert "does not exist or is closed" in api.rejected(random_ids(rng, 3), N, session)


def test_non_streaming_sessions_work_beside_streaming_ones(api, rng):
    chat = Chat(api, rng)
    chat.turn()
    tree = api.open()
    prompt = random_ids(rng, 8)
    root = api.generate(prompt, N, tree)
    api.assert_turn(root, prompt, N)
    new = random_ids(rng, 4)
    child = api.generate(new, N, tree, rid=root["meta_info"]["id"])
    api.assert_turn(child, prompt + root["output_ids"] + new, N)
    assert cached(child) >= len(prompt) + N - 1
    expected = chat.expected_cached()
    assert cached(chat.turn()) == expected
