"""The data-parallel controller's routing: policies, load accounting and session affinity."""

from __future__ import annotations

import pytest

from radixserve.managers.data_parallel_controller import DataParallelController
from radixserve.managers.io_struct import (
    AbortReq,
    CloseSessionReqInput,
    FlushCacheReq,
    GetInternalStateReq,
    LoadReport,
    OpenSessionReqInput,
    SessionParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from radixserve.sampling.sampling_params import SamplingParams


def generate(
    rid: str, session: str | None = None, rank: int | None = None
) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid, input_ids=[6, 7], sampling_params=SamplingParams(max_new_tokens=1),
        session_params=SessionParams(id=session) if session is not None else None,
        data_parallel_rank=rank,
    )


def report(dp_rank: int, num_reqs: int, num_received: int) -> LoadReport:
    return LoadReport(dp_rank=dp_rank, num_reqs=num_reqs, num_waiting_reqs=0, num_tokens=0,
                      num_received=num_received)


def controller(dp_size: int, method: str) -> tuple[DataParallelController, list]:
    sent: list[tuple[int, object]] = []
    return DataParallelController(dp_size, method, lambda r, m: sent.append((r, m))), sent


def replicas(sent: list) -> list[int]:
    return [r for r, _ in sent]


def test_round_robin_cycles_over_the_replicas():
    ctrl, sent = controller(3, "round_robin")
    for i in range(7):
        ctrl.handle(generate(f"r{i}"))
    assert replicas(sent) == [0, 1, 2, 0, 1, 2, 0]


def test_an_embedding_request_goes_to_one_replica_and_counts_as_load():
    ctrl, sent = controller(2, "shortest_queue")
    ctrl.handle(TokenizedEmbeddingReqInput(rid="e", input_ids=[6, 7]))
    ctrl.handle(generate("g"))
    assert replicas(sent) == [0, 1] and ctrl.sent == [1, 1]


def test_shortest_queue_counts_the_requests_sent_since_each_report():
    ctrl, sent = controller(2, "shortest_queue")
    for i in range(4):  # no report yet: the requests sent are the whole load
        ctrl.handle(generate(f"a{i}"))
    assert replicas(sent) == [0, 1, 0, 1]
    # Replica 0 finished both of its requests; replica 1 has received one of its two so far.
    ctrl.handle(report(0, num_reqs=0, num_received=2))
    ctrl.handle(report(1, num_reqs=1, num_received=1))
    assert (ctrl.load(0), ctrl.load(1)) == (0, 2)
    sent.clear()
    for i in range(3):
        ctrl.handle(generate(f"b{i}"))
    assert replicas(sent) == [0, 0, 1]  # 0 → (1, 2), 0 → (2, 2), tie → the next in turn


def test_a_session_stays_on_the_replica_that_opened_it():
    ctrl, sent = controller(2, "round_robin")
    ctrl.handle(OpenSessionReqInput(capacity_of_str_len=10, session_id="s1"))
    ctrl.handle(OpenSessionReqInput(capacity_of_str_len=10, session_id="s2", streaming=True))
    home = {"s1": sent[0][0], "s2": sent[1][0]}
    assert set(home.values()) == {0, 1}
    sent.clear()
    for i in range(5):
        ctrl.handle(generate(f"x{i}", session="s1"))
        ctrl.handle(generate(f"y{i}", session="s2"))
        ctrl.handle(generate(f"z{i}"))  # unrelated traffic goes round as usual
    for replica, msg in sent:
        if msg.session_params is not None:
            assert replica == home[msg.session_params.id]
    # A duplicate open goes to the replica holding the id (which refuses it).
    sent.clear()
    ctrl.handle(OpenSessionReqInput(capacity_of_str_len=10, session_id="s1"))
    assert replicas(sent) == [home["s1"]]
    # Close goes there too, and the controller forgets the session.
    sent.clear()
    ctrl.handle(CloseSessionReqInput(session_id="s1"))
    assert replicas(sent) == [home["s1"]] and "s1" not in ctrl.session_replica


def test_session_requests_do_not_move_the_round_robin_turn():
    ctrl, sent = controller(2, "round_robin")
    ctrl.handle(OpenSessionReqInput(capacity_of_str_len=10, session_id="s"))  # → 0
    for i in range(3):
        ctrl.handle(generate(f"s{i}", session="s"))
    ctrl.handle(generate("other"))
    assert replicas(sent) == [0, 0, 0, 0, 1]


@pytest.mark.parametrize("msg", [
    AbortReq(rid="r"), AbortReq(abort_all=True), FlushCacheReq(), GetInternalStateReq(),
    CloseSessionReqInput(session_id="never-opened"),
])
def test_control_messages_go_to_every_replica(msg):
    ctrl, sent = controller(3, "shortest_queue")
    ctrl.handle(msg)
    assert sent == [(0, msg), (1, msg), (2, msg)]


def test_an_unknown_session_is_routed_by_the_policy_and_refused_by_its_replica():
    ctrl, sent = controller(2, "round_robin")
    ctrl.handle(generate("r", session="nobody"))
    assert replicas(sent) == [0]


def test_a_named_replica_takes_the_request_unless_its_session_lives_elsewhere():
    ctrl, sent = controller(3, "round_robin")
    ctrl.handle(generate("a", rank=2))
    ctrl.handle(generate("b"))  # the policy goes on from where it was
    ctrl.handle(OpenSessionReqInput(capacity_of_str_len=64, session_id="s"))
    ctrl.handle(generate("c", session="s", rank=0))  # the session's replica holds its state
    assert replicas(sent) == [2, 0, 1, 1] and ctrl.sent == [1, 1, 1]
