"""Session request trees and the controller that owns them (no model, no processes).

``Session.resolve_input_ids`` assembles a new request's prompt from the tree without changing it;
``SessionController`` records admitted requests, streaming histories, deferred closes and
timeouts. Requests are real ``schedule_batch.Req`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from radixserve.finish_reason import FinishAbort, FinishLength
from radixserve.managers.io_struct import (
    OpenSessionReqInput,
    SessionParams,
    TokenizedGenerateReqInput,
)
from radixserve.managers.scheduler.schedule_batch import Req
from radixserve.managers.scheduler.session_controller import SessionController, SessionTurn
from radixserve.mem_cache import (
    RadixCache,
    ReqToTokenPool,
    SessionAwareCache,
    TokenToKVPoolAllocator,
)
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.sessions.session import Session, SessionError

BOS = 0
LENGTH = FinishLength(length=2)
ABORT = FinishAbort(message="aborted by request")


def req(rid: str, prompt: list[int], output: list[int] | None = None, reason=LENGTH) -> Req:
    """A request that ran: ``output`` given means it finished with ``reason``."""
    r = Req(rid, prompt, SamplingParams(max_new_tokens=4))
    if output is not None:
        r.output_ids = list(output)
        r.finished_reason = reason
    return r


def params(session_id: str = "s", **kw) -> SessionParams:
    return SessionParams(id=session_id, **kw)


@pytest.fixture
def tree() -> Session:
    """root [1,2,3]→[4,5]; child a (of root) [6]→[7]; grandchild (of a); child b (of root)."""
    s = Session(capacity_of_str_len=100, session_id="s")
    s.add_req(req("root", [1, 2, 3], [4, 5]), None)
    root = s.req_nodes["root"]
    s.add_req(req("a", [1, 2, 3, 4, 5, 6], [7]), root)
    s.add_req(req("a1", [1, 2, 3, 4, 5, 6, 7, 8], [9]), s.req_nodes["a"])
    s.add_req(req("b", [1, 2, 3, 4, 5, 10], [11]), root)
    return s


def resolve(s: Session, new: list[int], **kw) -> list[int]:
    ids, _, _ = s.resolve_input_ids(params(**kw), new, BOS)
    return ids


# ---------------------------------------------------------------------- prompt assembly
def test_append_inherits_parent_prompt_and_output(tree):
    assert resolve(tree, [20, 21], rid="root") == [1, 2, 3, 4, 5, 20, 21]
    assert resolve(tree, [20], rid="a1") == [1, 2, 3, 4, 5, 6, 7, 8, 9, 20]


def test_only_a_leading_bos_of_the_new_ids_is_dropped(tree):
    assert resolve(tree, [BOS, 20], rid="root") == [1, 2, 3, 4, 5, 20]
    assert resolve(tree, [20, BOS], rid="root") == [1, 2, 3, 4, 5, 20, BOS]
    assert resolve(tree, [BOS], rid="root") == [1, 2, 3, 4, 5]
    ids, _, _ = tree.resolve_input_ids(params(rid="root"), [BOS, 20], None)
    assert ids == [1, 2, 3, 4, 5, BOS, 20], "no BOS id known: nothing is dropped"


def test_a_root_keeps_its_ids_bos_included(tree):
    ids, parent, to_remove = tree.resolve_input_ids(params(), [BOS, 20], BOS)
    assert (ids, parent, to_remove) == ([BOS, 20], None, [])


def test_drop_previous_output_leaves_the_parent_output_out(tree):
    assert resolve(tree, [20], rid="a", drop_previous_output=True) == [1, 2, 3, 4, 5, 6, 20]


@pytest.mark.parametrize(
    ("offset", "inherited"),
    [
        (None, [1, 2, 3, 4, 5]),
        (0, [1, 2, 3, 4, 5]),  # 0 means no cut, as in SGLang
        (2, [1, 2]),
        (-1, [1, 2, 3, 4]),
        (-5, []),
        (99, [1, 2, 3, 4, 5]),
        (-99, []),
    ],
)
def test_offset_cuts_the_inherited_ids_like_a_python_slice(tree, offset, inherited):
    assert resolve(tree, [20], rid="root", offset=offset) == [*inherited, 20]


def test_offset_applies_after_drop_previous_output(tree):
    assert resolve(tree, [20], rid="a", offset=-2, drop_previous_output=True) == [1, 2, 3, 4, 20]


def test_branches_see_their_own_ancestors_only(tree):
    assert resolve(tree, [30], rid="b") == [1, 2, 3, 4, 5, 10, 11, 30]
    assert resolve(tree, [30], rid="a") == [1, 2, 3, 4, 5, 6, 7, 30]


def test_unknown_rid_and_appending_to_an_unfinished_parent_are_session_errors(tree):
    with pytest.raises(SessionError, match="Invalid request session id.*'nope'"):
        resolve(tree, [1], rid="nope")
    tree.add_req(req("running", [1, 2]), tree.req_nodes["b"])
    with pytest.raises(SessionError, match="'running' has not finished"):
        resolve(tree, [1], rid="running")


def test_replace_naming_an_unfinished_request_inherits_what_it_generated_so_far(tree):
    running = req("running", [1, 2, 3, 4, 5, 10, 11, 12])
    running.output_ids = [13, 14]  # generated so far
    tree.add_req(running, tree.req_nodes["b"])
    tree.add_req(req("below", [1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15]), tree.req_nodes["running"])
    ids, parent, to_remove = tree.resolve_input_ids(params(rid="running", replace=True), [BOS, 16],
                                                    BOS)
    assert ids == [1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 16]
    assert parent is tree.req_nodes["running"]
    assert [n.req.rid for n in to_remove] == ["below"]


def test_resolve_changes_nothing(tree):
    before = {rid: [c.req.rid for c in n.children] for rid, n in tree.req_nodes.items()}
    resolve(tree, [1], rid="root", replace=True)
    resolve(tree, [1], replace=True)
    assert {rid: [c.req.rid for c in n.children] for rid, n in tree.req_nodes.items()} == before


def test_replace_with_rid_removes_its_descendants_and_branches_from_it(tree):
    ids, parent, to_remove = tree.resolve_input_ids(params(rid="root", replace=True), [20], BOS)
    assert ids == [1, 2, 3, 4, 5, 20] and parent is tree.req_nodes["root"]
    assert sorted(n.req.rid for n in to_remove) == ["a", "a1", "b"]
    assert tree.remove_nodes(to_remove) == []
    assert set(tree.req_nodes) == {"root"} and tree.req_nodes["root"].children == []


def test_replace_without_rid_clears_the_whole_tree(tree):
    ids, parent, to_remove = tree.resolve_input_ids(params(replace=True), [BOS, 20], BOS)
    assert ids == [BOS, 20] and parent is None
    tree.remove_nodes(to_remove)
    assert tree.req_nodes == {}


def test_remove_nodes_returns_the_unfinished_requests_to_abort(tree):
    running = req("running", [1, 2, 3, 4, 5, 6, 7, 40])
    tree.add_req(running, tree.req_nodes["a"])
    _, _, to_remove = tree.resolve_input_ids(params(rid="root", replace=True), [20], BOS)
    assert tree.remove_nodes(to_remove) == [running]


# ---------------------------------------------------------------------- streaming sessions
def streaming_session(history: list[int]) -> Session:
    return Session(capacity_of_str_len=100, session_id="s", streaming=True, history_ids=history)


def test_streaming_turn_continues_the_history_and_ignores_rid():
    s = streaming_session([1, 2, 3, 4])
    assert resolve(s, [BOS, 5], rid="anything", offset=0) == [1, 2, 3, 4, 5]
    assert resolve(streaming_session([]), [BOS, 5]) == [BOS, 5]


@pytest.mark.parametrize(
    "kw", [{"replace": True}, {"drop_previous_output": True}, {"offset": 2}, {"offset": -1}]
)
def test_streaming_sessions_refuse_tree_operations(kw):
    with pytest.raises(SessionError, match="linear"):
        resolve(streaming_session([1, 2]), [3], **kw)


def test_streaming_session_allows_one_request_in_flight_and_none_while_closing():
    s = streaming_session([1, 2])
    s.inflight_rid = "t1"
    with pytest.raises(SessionError, match="in flight"):
        resolve(s, [3])
    s.inflight_rid, s.close_pending = None, True
    with pytest.raises(SessionError, match="closing"):
        resolve(s, [3])


def test_expiry_needs_a_timeout_and_no_request_in_flight():
    s = Session(capacity_of_str_len=1, timeout=2.0, last_active=10.0)
    assert not s.is_expired(11.0) and s.is_expired(12.5)
    assert not Session(capacity_of_str_len=1, last_active=0.0).is_expired(1e9)
    s.add_req(req("running", [1]), None)
    assert not s.is_expired(100.0), "a session whose request still runs is not idle"
    s.inflight_rid = "t"
    s.req_nodes.clear()
    assert not s.is_expired(100.0)


# ---------------------------------------------------------------------- the controller
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def generate_msg(request_id: str, ids: list[int], /, **kw) -> TokenizedGenerateReqInput:
    """A tokenized request; keywords are its session params (``rid`` names the parent)."""
    return TokenizedGenerateReqInput(
        rid=request_id, input_ids=ids, sampling_params=SamplingParams(max_new_tokens=4),
        session_params=params(**kw),
    )


def open_msg(**kw) -> OpenSessionReqInput:
    return OpenSessionReqInput(capacity_of_str_len=100, **kw)


@dataclass
class Created:
    """A session request as the scheduler holds it between ``plan`` and ``admit``."""

    turn: SessionTurn
    req: Req

    @property
    def error(self) -> str | None:
        return self.turn.error


def create(ctrl: SessionController, msg: TokenizedGenerateReqInput) -> Created:
    """Plan a session request and build its ``Req`` from the plan, as the scheduler does."""
    turn = ctrl.plan(msg)
    built = Req.from_message(msg, turn.input_ids)
    built.streaming_session_id = turn.streaming_session_id
    return Created(turn, built)


def admit(ctrl: SessionController, created: Created) -> list:
    return ctrl.admit(created.turn, created.req)


def run(ctrl: SessionController, msg: TokenizedGenerateReqInput, output, reason=LENGTH) -> Req:
    """Create, admit and finish a session request the way the scheduler does."""
    created = create(ctrl, msg)
    assert created.error is None, created.error
    admit(ctrl, created)
    created.req.output_ids, created.req.finished_reason = list(output), reason
    ctrl.on_req_finished(created.req)
    return created.req


def plain_cache() -> RadixCache:
    """A prefix cache without streaming sessions (real pools, nothing runs on them here)."""
    pool = ReqToTokenPool(4, 64, "cpu")
    return RadixCache(pool, TokenToKVPoolAllocator(64, 1, "cpu"), 1)


def session_cache() -> SessionAwareCache:
    inner = plain_cache()
    return SessionAwareCache(inner, inner.req_to_token_pool, inner.allocator, 1)


def test_open_refuses_duplicates_bad_values_and_streaming_when_disabled():
    ctrl = SessionController(plain_cache(), BOS)
    assert ctrl.open(open_msg(session_id="x")).session_id == "x"
    generated = ctrl.open(open_msg())
    assert generated.success and generated.session_id and generated.session_id != "x"
    for msg, words in [
        (open_msg(session_id="x"), "already exists"),
        (open_msg(streaming=True), "--enable-streaming-session"),
        (OpenSessionReqInput(capacity_of_str_len=0), "capacity_of_str_len"),
        (open_msg(timeout=-1.0), "timeout"),
        (open_msg(timeout=float("nan")), "positive finite"),
        (open_msg(timeout=float("inf")), "positive finite"),
        (open_msg(session_id=""), "1 to 128 visible ASCII characters"),
        (open_msg(session_id="a\nb"), "'a\\nb'"),
        (open_msg(resume=True), "give its session_id"),
        (open_msg(session_id="y", resume=True), '"streaming": true'),
    ]:
        reply = ctrl.open(msg)
        assert not reply.success and reply.session_id is None and words in reply.message
    assert set(ctrl.sessions) == {"x", generated.session_id}


def test_resume_needs_a_session_store():
    ctrl = SessionController(session_cache(), BOS)
    reply = ctrl.open(open_msg(session_id="old", streaming=True, resume=True))
    assert not reply.success and "--session-store" in reply.message
    assert "old" not in ctrl.sessions


def test_plan_changes_nothing_until_admitted():
    ctrl = SessionController(plain_cache(), BOS)
    ctrl.open(open_msg(session_id="s"))
    root = run(ctrl, generate_msg("root", [1, 2]), [3])
    created = create(ctrl, generate_msg("child", [BOS, 4], rid="root", replace=True))
    assert created.req.origin_input_ids == [1, 2, 3, 4]
    assert set(ctrl.sessions["s"].req_nodes) == {"root"}
    assert admit(ctrl, created) == []
    assert set(ctrl.sessions["s"].req_nodes) == {"root", "child"}
    assert ctrl.sessions["s"].req_nodes["child"].parent.req is root


def test_rejections_carry_a_message_and_leave_the_session_alone():
    ctrl = SessionController(plain_cache(), BOS)
    ctrl.open(open_msg(session_id="s"))
    run(ctrl, generate_msg("root", [1, 2]), [3])
    unknown = create(ctrl, generate_msg("r1", [4], session_id="gone"))
    assert unknown.error == "session 'gone' does not exist or is closed"
    bad_rid = create(ctrl, generate_msg("r2", [4], rid="nope"))
    assert "Invalid request session id" in bad_rid.error
    assert set(ctrl.sessions["s"].req_nodes) == {"root"}


def test_admitting_a_replace_of_a_running_request_aborts_it_and_its_descendants():
    ctrl = SessionController(plain_cache(), BOS)
    ctrl.open(open_msg(session_id="s"))
    run(ctrl, generate_msg("root", [1, 2]), [3])
    running = create(ctrl, generate_msg("running", [4], rid="root"))
    admit(ctrl, running)
    below = create(ctrl, generate_msg("below", [5], rid="running"))
    assert "has not finished" in below.error, "appending to a running request is refused"
    msg = generate_msg("new", [6], rid="running", replace=True)
    assert ctrl.running_rid_to_replace(msg) == "running"
    assert ctrl.running_rid_to_replace(generate_msg("x", [6], rid="root", replace=True)) is None
    running.req.output_ids = [7, 8]
    replacing = create(ctrl, msg)
    assert replacing.error is None
    assert replacing.req.origin_input_ids == [1, 2, 3, 4, 7, 8, 6]
    assert admit(ctrl, replacing) == [running.req]
    nodes = ctrl.sessions["s"].req_nodes
    assert set(nodes) == {"root", "running", "new"} and nodes["new"].parent.req is running.req


def test_admitting_a_replace_returns_the_running_requests_to_abort():
    ctrl = SessionController(plain_cache(), BOS)
    ctrl.open(open_msg(session_id="s"))
    run(ctrl, generate_msg("root", [1, 2]), [3])
    running = create(ctrl, generate_msg("running", [4], rid="root"))
    admit(ctrl, running)
    replacing = create(ctrl, generate_msg("new", [5], rid="root", replace=True))
    assert admit(ctrl, replacing) == [running.req]
    assert set(ctrl.sessions["s"].req_nodes) == {"root", "new"}


def test_streaming_history_advances_on_finish_and_rolls_back_on_abort():
    ctrl = SessionController(session_cache(), BOS)
    ctrl.open(open_msg(session_id="s", streaming=True))
    t1 = run(ctrl, generate_msg("t1", [1, 2]), [3, 4])
    assert t1.streaming_session_id == "s"
    session = ctrl.sessions["s"]
    assert session.history_ids == [1, 2, 3, 4] and session.inflight_rid is None
    run(ctrl, generate_msg("t2", [BOS, 5]), [6], reason=ABORT)
    assert session.history_ids == [1, 2, 3, 4] and session.inflight_rid is None
    t3 = run(ctrl, generate_msg("t3", [7]), [8])
    assert t3.origin_input_ids == [1, 2, 3, 4, 7]
    assert session.history_ids == [1, 2, 3, 4, 7, 8]
    assert session.req_nodes == {}, "a streaming session keeps no tree"


def test_a_rejected_request_does_not_clear_the_turn_in_flight():
    ctrl = SessionController(session_cache(), BOS)
    ctrl.open(open_msg(session_id="s", streaming=True))
    running = create(ctrl, generate_msg("t1", [1, 2]))
    admit(ctrl, running)
    second = create(ctrl, generate_msg("t2", [3]))
    assert "in flight" in second.error
    second.req.finished_reason = FinishAbort(message=ABORT.message, status_code=400)
    ctrl.on_req_finished(second.req)
    assert ctrl.sessions["s"].inflight_rid == "t1"


def test_close_of_a_streaming_session_waits_for_its_turn():
    ctrl = SessionController(session_cache(), BOS)
    ctrl.open(open_msg(session_id="s", streaming=True))
    created = create(ctrl, generate_msg("t1", [1, 2]))
    admit(ctrl, created)
    ctrl.close("s")
    assert ctrl.sessions["s"].close_pending
    assert "closing" in create(ctrl, generate_msg("t2", [3])).error
    created.req.output_ids, created.req.finished_reason = [3], LENGTH
    ctrl.on_req_finished(created.req)
    assert "s" not in ctrl.sessions
    ctrl.close("s")  # unknown now: ignored


def close_expired(ctrl: SessionController) -> None:
    """What the scheduler does every step: rank 0 (``RequestReceiver``) turns the expired ids
    into ``CloseSessionReqInput`` messages, which every rank handles."""
    for session_id in ctrl.expired_ids():
        ctrl.close(session_id)


def test_close_expired_drops_idle_sessions_only():
    clock = Clock()
    ctrl = SessionController(session_cache(), BOS, clock=clock)
    ctrl.open(open_msg(session_id="idle", timeout=1.0))
    ctrl.open(open_msg(session_id="busy", streaming=True, timeout=1.0))
    ctrl.open(open_msg(session_id="forever"))
    admit(ctrl, create(ctrl, generate_msg("t1", [1], session_id="busy")))
    clock.now = 0.5
    close_expired(ctrl)
    assert set(ctrl.sessions) == {"idle", "busy", "forever"}
    clock.now = 5.0
    close_expired(ctrl)
    assert set(ctrl.sessions) == {"busy", "forever"}


def test_activity_postpones_expiry_on_the_controller_clock():
    clock = Clock()
    ctrl = SessionController(plain_cache(), BOS, clock=clock)
    ctrl.open(open_msg(session_id="s", timeout=2.0))
    clock.now = 1.5
    run(ctrl, generate_msg("r", [1]), [2])
    clock.now = 3.0
    close_expired(ctrl)
    assert "s" in ctrl.sessions, "used 1.5 s ago: not idle for its 2 s timeout yet"
    clock.now = 4.0
    close_expired(ctrl)
    assert "s" not in ctrl.sessions


def test_open_past_max_sessions_is_refused_as_at_capacity_and_the_default_timeout_applies():
    ctrl = SessionController(plain_cache(), BOS, max_sessions=2, default_timeout=30.0)
    assert ctrl.open(open_msg(session_id="a")).success
    assert ctrl.open(open_msg(session_id="b", timeout=5.0)).success
    reply = ctrl.open(open_msg(session_id="c"))
    assert not reply.success and reply.at_capacity and "--max-sessions" in reply.message
    assert (ctrl.sessions["a"].timeout, ctrl.sessions["b"].timeout) == (30.0, 5.0)
    ctrl.close("a")
    assert ctrl.open(open_msg(session_id="c")).success
