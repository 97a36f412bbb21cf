"""What a caller creates is theirs (issue 37 items 4 and 5): with ``--api-key`` and
``--admin-api-key``, a plain key may not ``abort_all`` nor abort a rid another key sent, and a
stored ``/v1/responses`` object is read, continued and deleted only with the key that stored it;
issue 36: a Batch API file or batch is seen, read, cancelled and deleted only with the key that
created it (another key gets OpenAI's 404), and the admin key sees them all (openai SDK).

Synchronisation: a request is held running by pausing generation; an abort that would have
reached the scheduler has been handled once a later control request returns (one ordered
socket), so the test reads the scheduler's state after that.
"""

from __future__ import annotations

import io
import json

import httpx
import openai
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


def _sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def _batch_file(sdk: openai.OpenAI, model: str, custom_id: str) -> str:
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                     "max_tokens": 3, "temperature": 0}}
    data = (json.dumps(line) + "\n").encode()
    return sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def _status(sdk: openai.OpenAI, batch_id: str, statuses: set[str]) -> dict:
    return wait_for(lambda: sdk.batches.retrieve(batch_id).model_dump(),
                    lambda b: b["status"] in statuses, f"batch {batch_id} {statuses}")


def test_batch_files_and_batches_belong_to_the_key_that_created_them(server, user, admin):
    as_user, as_admin = _sdk(server, "user-key"), _sdk(server, "admin-key")
    users_file = _batch_file(as_user, server.model, "u")
    admins_file = _batch_file(as_admin, server.model, "a")
    # Another key's file is as absent as one never uploaded; the admin key sees every file.
    for call in (as_user.files.retrieve, as_user.files.content, as_user.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(admins_file)
    with pytest.raises(openai.NotFoundError):
        as_user.batches.create(input_file_id=admins_file, endpoint="/v1/chat/completions",
                               completion_window="24h")
    assert {f.id for f in as_user.files.list()} == {users_file}
    assert {users_file, admins_file} <= {f.id for f in as_admin.files.list()}
    assert as_admin.files.retrieve(users_file).id == users_file
    assert "_owner" not in user.get(f"/v1/files/{users_file}").json()

    pause_generation(admin)  # both batches stay in progress until the cancel below
    try:
        users_batch = as_user.batches.create(
            input_file_id=users_file, endpoint="/v1/chat/completions", completion_window="24h")
        admins_batch = as_admin.batches.create(
            input_file_id=admins_file, endpoint="/v1/chat/completions", completion_window="24h")
        assert "_owner" not in user.get(f"/v1/batches/{users_batch.id}").json()
        _status(as_admin, admins_batch.id, {"in_progress"})
        for call in (as_user.batches.retrieve, as_user.batches.cancel):
            with pytest.raises(openai.NotFoundError):
                call(admins_batch.id)
        assert as_admin.batches.retrieve(admins_batch.id).status == "in_progress"
        assert {b.id for b in as_user.batches.list()} == {users_batch.id}
        assert {users_batch.id, admins_batch.id} <= {b.id for b in as_admin.batches.list()}
        assert as_admin.batches.cancel(admins_batch.id).status in ("cancelling", "cancelled")
    finally:
        continue_generation(admin)
    assert _status(as_admin, admins_batch.id, {"cancelled"})["status"] == "cancelled"
    done = _status(as_user, users_batch.id, {"completed", "failed"})
    assert done["status"] == "completed", done
    output = done["output_file_id"]
    # The batch's output file is its owner's: readable by that key and the admin key only.
    assert json.loads(as_user.files.content(output).text)["custom_id"] == "u"
    assert as_admin.files.retrieve(output).purpose == "batch_output"
    assert as_user.files.delete(users_file).deleted
    assert as_admin.files.delete(admins_file).deleted
    with pytest.raises(openai.NotFoundError):
        as_admin.files.retrieve(users_file)
