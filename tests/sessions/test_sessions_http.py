"""Non-streaming sessions over HTTP: the request tree, its errors, open/close and timeouts.

The server runs with the radix cache (where these sessions get their reuse from) and without
``--enable-streaming-session``, so streaming sessions are refused. Every turn is compared with a
plain ``/generate`` on the ids the session should have assembled (``api.assert_turn``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.server.conftest import paused, start_server
from tests.sessions.conftest import BOS, BUSY_CHECK, new_rid, random_ids, sse_events
from tests.sync import UNTIL_ABORTED, wait_for

N = 6  # new tokens of an ordinary turn


@pytest.fixture(scope="module")
def server(llama_path: Path):
    srv = start_server(llama_path, env=BUSY_CHECK)
    yield srv
    srv.check_clean_stop()


def turn(api, rng, session: str, n_prompt: int = 10, **session_params) -> tuple[dict, list[int]]:
    """A first turn (a root) of ``n_prompt`` random ids; returns its reply and prompt."""
    prompt = random_ids(rng, n_prompt)
    out = api.generate(prompt, N, session, **session_params)
    api.assert_turn(out, prompt, N)
    return out, prompt


def rid_of(out: dict) -> str:
    return out["meta_info"]["id"]


# ---------------------------------------------------------------------- open / close
def test_open_session_answers_the_id_as_a_bare_json_string(api):
    r = api.http.post("/open_session", json={"capacity_of_str_len": 128})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    session_id = json.loads(r.text)
    assert isinstance(session_id, str) and len(session_id) >= 8
    api.opened.append(session_id)


def test_open_session_keeps_a_custom_id_and_refuses_a_duplicate(api, rng):
    assert api.open(session_id="chat-42") == "chat-42"
    r = api.http.post("/open_session", json={"capacity_of_str_len": 128, "session_id": "chat-42"})
    assert r.status_code == 400
    assert "chat-42" in r.json()["error"]["message"]
    assert "already exists" in r.json()["error"]["message"]
    turn(api, rng, "chat-42")  # the original session is untouched


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"streaming": True}, "--enable-streaming-session"),
        ({"capacity_of_str_len": 0}, "capacity_of_str_len"),
        ({"timeout": 0}, "timeout"),
    ],
)
def test_open_session_refuses_what_it_cannot_honour(api, body, message):
    r = api.http.post("/open_session", json={"capacity_of_str_len": 128, **body})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_close_session_answers_200_even_for_an_unknown_id(api):
    r = api.http.post("/close_session", json={"session_id": "never-opened"})
    assert r.status_code == 200


def test_requests_on_a_closed_session_get_400(api, rng):
    session = api.open()
    first, _ = turn(api, rng, session)
    api.close(session)
    message = api.rejected(random_ids(rng, 3), N, session, rid=rid_of(first))
    assert "does not exist or is closed" in message
    api.close(session)  # closing twice is fine


def test_idle_session_is_closed_after_its_timeout(api, rng):
    # No turn between the open and the close: on a loaded machine the second could pass before
    # the turn arrived (a race with the machine's speed).
    session = api.open(timeout=1)
    wait_for(api.state, lambda s: session not in s["session_ids"], "the idle session closed")
    message = api.rejected(random_ids(rng, 3), N, session)
    assert "does not exist or is closed" in message


# ---------------------------------------------------------------------- the request tree
def test_append_with_rid_continues_from_parent_prompt_and_output_dropping_a_leading_bos(api, rng):
    session = api.open()
    first, prompt = turn(api, rng, session, n_prompt=12)
    history = prompt + first["output_ids"]
    new = random_ids(rng, 5)
    second = api.generate([BOS, *new], N, session, rid=rid_of(first))
    api.assert_turn(second, history + new, N)
    # The parent's prompt and all its output but the last token have KV in the radix tree.
    assert second["meta_info"]["cached_tokens"] >= len(history) - 1
    history += new + second["output_ids"]
    new = random_ids(rng, 4)  # no BOS: nothing dropped
    third = api.generate(new, N, session, rid=rid_of(second))
    api.assert_turn(third, history + new, N)
    assert third["meta_info"]["cached_tokens"] >= len(history) - 1


def test_first_turn_keeps_its_bos(api, rng):
    session = api.open()
    prompt = [BOS, *random_ids(rng, 6)]
    out = api.generate(prompt, N, session)
    api.assert_turn(out, prompt, N)


def test_two_children_of_one_rid_branch_from_the_same_context(api, rng):
    session = api.open()
    root, prompt = turn(api, rng, session)
    base = prompt + root["output_ids"]
    new_a, new_b = random_ids(rng, 4), random_ids(rng, 7)
    a = api.generate(new_a, N, session, rid=rid_of(root))
    b = api.generate(new_b, N, session, rid=rid_of(root))
    api.assert_turn(a, base + new_a, N)
    api.assert_turn(b, base + new_b, N)
    assert b["meta_info"]["cached_tokens"] >= len(base) - 1
    # A child of one branch sees that branch only.
    new_c = random_ids(rng, 3)
    c = api.generate(new_c, N, session, rid=rid_of(b))
    api.assert_turn(c, base + new_b + b["output_ids"] + new_c, N)


def test_drop_previous_output_leaves_the_parent_output_out(api, rng):
    session = api.open()
    root, prompt = turn(api, rng, session)
    new = random_ids(rng, 5)
    out = api.generate(new, N, session, rid=rid_of(root), drop_previous_output=True)
    api.assert_turn(out, prompt + new, N)
    assert out["meta_info"]["cached_tokens"] >= len(prompt)


@pytest.mark.parametrize("offset", [7, -1, -4, 0])
def test_offset_cuts_the_inherited_ids_like_a_python_slice(api, rng, offset):
    session = api.open()
    root, prompt = turn(api, rng, session)
    inherited = prompt + root["output_ids"]
    cut = inherited[:offset] if offset else inherited  # 0 means no cut, as in SGLang
    new = random_ids(rng, 5)
    out = api.generate(new, N, session, rid=rid_of(root), offset=offset)
    api.assert_turn(out, cut + new, N)
    assert out["meta_info"]["cached_tokens"] >= min(len(cut), len(inherited) - 1)


def test_offset_with_drop_previous_output_cuts_the_parent_prompt(api, rng):
    session = api.open()
    root, prompt = turn(api, rng, session)
    new = random_ids(rng, 5)
    out = api.generate(new, N, session, rid=rid_of(root), offset=-3, drop_previous_output=True)
    api.assert_turn(out, prompt[:-3] + new, N)


def test_request_without_rid_starts_a_new_root(api, rng):
    session = api.open()
    turn(api, rng, session)
    new = [BOS, *random_ids(rng, 6)]
    out = api.generate(new, N, session)
    api.assert_turn(out, new, N)


def test_replace_with_rid_branches_from_it_and_invalidates_its_descendants(api, rng):
    session = api.open()
    root, prompt = turn(api, rng, session)
    base = prompt + root["output_ids"]
    child = api.generate(random_ids(rng, 3), N, session, rid=rid_of(root))
    grandchild = api.generate(random_ids(rng, 3), N, session, rid=rid_of(child))
    sibling = api.generate(random_ids(rng, 3), N, session, rid=rid_of(root))
    new = random_ids(rng, 4)
    replaced = api.generate(new, N, session, rid=rid_of(root), replace=True)
    api.assert_turn(replaced, base + new, N)
    for stale in (child, grandchild, sibling):
        message = api.rejected(random_ids(rng, 3), N, session, rid=rid_of(stale))
        assert "Invalid request session id" in message and rid_of(stale) in message
    # The rid itself and the new branch stay valid.
    more = random_ids(rng, 3)
    out = api.generate(more, N, session, rid=rid_of(replaced))
    api.assert_turn(out, base + new + replaced["output_ids"] + more, N)
    again = api.generate(more, N, session, rid=rid_of(root))
    api.assert_turn(again, base + more, N)


def test_replace_aborts_a_running_descendant(api, rng):
    session = api.open()
    root, prompt = turn(api, rng, session)
    running = new_rid("running-child")
    with api.stream(random_ids(rng, 4), UNTIL_ABORTED, session, req_rid=running,
                    rid=rid_of(root)) as r:
        events = sse_events(r)
        first = next(events)
        assert first["meta_info"]["finish_reason"] is None
        new = random_ids(rng, 4)
        replaced = api.generate(new, N, session, rid=rid_of(root), replace=True)
        last = [first, *events][-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < UNTIL_ABORTED
    api.assert_turn(replaced, prompt + root["output_ids"] + new, N)
    assert "Invalid request session id" in api.rejected([7], N, session, rid=running)


def test_replace_naming_a_running_request_aborts_it_and_continues_what_it_generated(api, rng):
    session = api.open()
    root, prompt = turn(api, rng, session)
    running = new_rid("running")
    running_new = random_ids(rng, 4)
    with api.stream(running_new, UNTIL_ABORTED, session, req_rid=running,
                    rid=rid_of(root)) as r:
        events = sse_events(r)
        first = next(events)
        assert first["meta_info"]["finish_reason"] is None
        new = random_ids(rng, 4)
        replaced = api.generate(new, N, session, rid=running, replace=True)
        last = [first, *events][-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    generated = last["output_ids"]  # everything the replaced request generated
    assert 0 < len(generated) < UNTIL_ABORTED
    api.assert_turn(replaced, prompt + root["output_ids"] + running_new + generated + new, N)
    # The new request hangs under the aborted one, which stays in the tree.
    more = random_ids(rng, 3)
    out = api.generate(more, N, session, rid=rid_of(replaced))
    api.assert_turn(out, prompt + root["output_ids"] + running_new + generated + new
                    + replaced["output_ids"] + more, N)
    sibling = api.generate(more, N, session, rid=running)
    api.assert_turn(sibling, prompt + root["output_ids"] + running_new + generated + more, N)


def test_replace_without_rid_clears_the_whole_tree(api, rng):
    session = api.open()
    root, _ = turn(api, rng, session)
    child = api.generate(random_ids(rng, 3), N, session, rid=rid_of(root))
    new = [BOS, *random_ids(rng, 5)]
    fresh = api.generate(new, N, session, replace=True)
    api.assert_turn(fresh, new, N)
    for stale in (root, child):
        assert "Invalid request session id" in api.rejected([7, 8], N, session, rid=rid_of(stale))
    more = random_ids(rng, 3)
    out = api.generate(more, N, session, rid=rid_of(fresh))
    api.assert_turn(out, new + fresh["output_ids"] + more, N)


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_session_requests_get_400_and_leave_the_session_usable(api, rng, stream):
    session = api.open()
    root, prompt = turn(api, rng, session)
    ids = random_ids(rng, 3)
    message = api.rejected(ids, N, "no-such-session", stream=stream)
    assert "'no-such-session' does not exist or is closed" in message
    message = api.rejected(ids, N, session, stream=stream, rid="no-such-rid")
    assert "Invalid request session id" in message and "'no-such-rid'" in message
    r = api.http.post("/generate", json={"input_ids": ids, "session_params": {"rid": "x"}})
    assert r.status_code == 400 and "session_params" in r.json()["error"]["message"]
    r = api.http.post("/generate", json={"input_ids": ids, "session_params": {
        "id": session, "rid": rid_of(root), "branch": True}})  # not SGLang's: not ignored
    assert r.status_code == 400 and "`branch`" in r.json()["error"]["message"], r.text
    # Nothing changed: the root is still there and its context is intact.
    out = api.generate(ids, N, session, rid=rid_of(root))
    api.assert_turn(out, prompt + root["output_ids"] + ids, N)


def test_appending_to_an_unfinished_request_gets_400_and_changes_nothing(api, rng):
    session = api.open()
    root, prompt = turn(api, rng, session)
    long_rid = new_rid("long")
    long_new = random_ids(rng, 4)
    with api.stream(long_new, UNTIL_ABORTED, session, req_rid=long_rid,
                    rid=rid_of(root)) as r:
        events = sse_events(r)
        next(events)
        with paused(api.http):  # the request keeps its KV and output until the abort
            assert api.state()["num_running_reqs"] == 1, "finished before the pause"
            message = api.rejected(random_ids(rng, 3), N, session, rid=long_rid)
            assert "Invalid request session id" in message and "has not finished" in message
            api.abort(long_rid)
            last = list(events)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    # The aborted request is finished now: appending continues from its partial output.
    partial = last["output_ids"]
    assert 0 < len(partial) < UNTIL_ABORTED
    new = random_ids(rng, 3)
    out = api.generate(new, N, session, rid=long_rid)
    api.assert_turn(out, prompt + root["output_ids"] + long_new + partial + new, N)
