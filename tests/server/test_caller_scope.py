"""What a caller creates is theirs (issue 37 items 4 and 5): with ``--api-key`` and
``--admin-api-key``, a plain key may not ``abort_all`` nor abort a rid another key sent, and a
stored ``/v1/responses`` object is read, continued and deleted only with the key that stored it.

Synchronisation: a request is held running by pausing generation; an abort that would have
reached the scheduler has been handled once a later control request returns (one ordered
socket), so the test reads the scheduler's state after that.
"""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import (
    assert_no_leak,
    continue_generation,
    internal_state,
    pause_generation,
    start_server,
)
from tests.sync import STATE_TIMEOUT_S, UNTIL_ABORTED, in_background, wait_for

ADMIN = {"Authorization": "Bearer admin-key"}
USER = {"Authorization": "Bearer user-key"}


@pytest.fixture(scope="module")
def server(llama_path):
    srv = start_server(llama_path, "--api-key", "user-key", "--admin-api-key", "admin-key")
    yield srv
    srv.check_clean_stop()


@pytest.fixture
def admin(server):
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S, headers=ADMIN) as c:
        yield c
        assert_no_leak(c)


@pytest.fixture
def user(server):
    with httpx.Client(base_url=server.base_url, timeout=STATE_TIMEOUT_S, headers=USER) as c:
        yield c


def _generate(base_url: str, headers: dict, rid: str) -> str:
    with httpx.Client(base_url=base_url, timeout=STATE_TIMEOUT_S, headers=headers) as c:
        r = c.post("/generate", json={"text": "held", "rid": rid, "sampling_params": {
            "max_new_tokens": UNTIL_ABORTED, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["finish_reason"]["type"]


def test_a_plain_key_may_not_abort_all(user, admin):
    r = user.post("/abort_request", json={"abort_all": True})
    assert r.status_code == 403, r.text
    assert r.json()["error"]["param"] == "abort_all"
    assert admin.post("/abort_request", json={"abort_all": True}).status_code == 200


def test_a_plain_key_aborts_only_the_rids_it_sent(server, user, admin):
    theirs = in_background(_generate, server.base_url, ADMIN, "admins-request")
    mine = in_background(_generate, server.base_url, USER, "users-request")
    wait_for(lambda: internal_state(admin), lambda s: s["num_running_reqs"] == 2,
             "both requests running")
    pause_generation(admin)  # both keep running, with their KV, until aborted
    try:
        assert user.post("/abort_request", json={"rid": "admins-request"}).status_code == 200
        assert user.post("/abort_request", json={"rid": "users-request"}).status_code == 200
        assert mine.result(STATE_TIMEOUT_S) == "abort"
        # The first abort would have reached the scheduler before the second one.
        assert internal_state(admin)["num_running_reqs"] == 1
        assert not theirs.done()
        assert admin.post("/abort_request", json={"rid": "admins-request"}).status_code == 200
    finally:
        continue_generation(admin)
    assert theirs.result(STATE_TIMEOUT_S) == "abort"


def test_a_stored_response_belongs_to_the_key_that_stored_it(server, user, admin):
    r = user.post("/v1/responses", json={"model": server.model, "input": "Hi",
                                         "max_output_tokens": 4, "store": True})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    assert user.get(f"/v1/responses/{rid}").status_code == 200
    assert admin.get(f"/v1/responses/{rid}").status_code == 404
    r = admin.post("/v1/responses", json={"model": server.model, "input": "more",
                                          "max_output_tokens": 4, "previous_response_id": rid})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text
    assert admin.delete(f"/v1/responses/{rid}").status_code == 404
    r = user.post("/v1/responses", json={"model": server.model, "input": "more",
                                         "max_output_tokens": 4, "previous_response_id": rid})
    assert r.status_code == 200, r.text
    assert user.delete(f"/v1/responses/{rid}").status_code == 200
    assert user.get(f"/v1/responses/{rid}").status_code == 404
