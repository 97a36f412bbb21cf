"""OpenAI's Batch API (docs/batch.md) through the openai SDK, on a real server with a
``--batch-dir`` and priority scheduling: uploads, a batch run to completion with its output and
error files, validation failures, cancel, list, the upload limits, and a restart in the middle
of a batch that loses nothing.

Batches are followed through ``batches.retrieve`` (the server's own account of them); requests
are held where a test needs them held by pausing generation.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

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
from tests.sync import in_background, wait_for

FLAGS = ("--enable-priority-scheduling", "--max-running-requests", "2",
         "--batch-max-concurrency", "2")


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batches")


@pytest.fixture(scope="module")
def servers(llama_path: Path, batch_dir: Path):
    """The module's server; the restart test replaces it with one on the same folder."""
    holder = {"srv": start_server(llama_path, *FLAGS, "--batch-dir", str(batch_dir))}
    yield holder
    holder["srv"].check_clean_stop()


@pytest.fixture
def srv(servers):
    return servers["srv"]


@pytest.fixture
def oai(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)


def chat_line(custom_id: str, content: str, model: str, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}],
                     "max_tokens": 6, "temperature": 0, **extra}}


def upload(oai: openai.OpenAI, lines: list[dict]) -> str:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return oai.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch").id


def wait_status(oai: openai.OpenAI, batch_id: str, statuses: set[str]):
    return wait_for(lambda: oai.batches.retrieve(batch_id).model_dump(),
                    lambda b: b["status"] in statuses, f"batch {batch_id} {statuses}")


def read_lines(oai: openai.OpenAI, file_id: str) -> dict[str, dict]:
    text = oai.files.content(file_id).text
    return {d["custom_id"]: d for d in map(json.loads, text.splitlines())}


def test_a_batch_runs_to_completion_with_output_and_error_files(srv, oai):
    prompts = {"a": "Hello", "b": "The sky is", "c": "One two three"}
    lines = [chat_line(cid, text, srv.model) for cid, text in prompts.items()]
    lines.append(chat_line("bad", "Hi", srv.model, max_tokens=-1))
    file_id = upload(oai, lines)
    meta = oai.files.retrieve(file_id)
    assert meta.purpose == "batch" and meta.filename == "requests.jsonl" and meta.bytes > 0

    batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                               completion_window="24h", metadata={"job": "t1"})
    assert batch.status == "validating" and batch.metadata == {"job": "t1"}
    done = wait_status(oai, batch.id, {"completed", "failed"})
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert all(done[k] for k in ("in_progress_at", "finalizing_at", "completed_at"))

    outputs = read_lines(oai, done["output_file_id"])
    assert set(outputs) == set(prompts)
    for cid, text in prompts.items():
        line = outputs[cid]
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
        direct = oai.chat.completions.create(
            model=srv.model, messages=[{"role": "user", "content": text}], max_tokens=6,
            temperature=0)
        body = line["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
    errors = read_lines(oai, done["error_file_id"])
    assert list(errors) == ["bad"]
    assert errors["bad"]["response"]["status_code"] == 400
    assert errors["bad"]["response"]["body"]["error"]["param"]

    listed = oai.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]
    assert oai.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(file_id)
    assert_no_leak(httpx.Client(base_url=srv.base_url, timeout=60))


def test_an_invalid_input_file_fails_the_batch_naming_the_line(srv, oai):
    good = chat_line("a", "Hi", srv.model)
    wrong_url = {**chat_line("b", "Hi", srv.model), "url": "/v1/completions"}
    file_id = upload(oai, [good, wrong_url, good])  # line 3 repeats custom_id "a"
    batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    failed = wait_status(oai, batch.id, {"failed", "completed"})
    assert failed["status"] == "failed" and failed["failed_at"]
    errors = {(e["line"], e["code"]) for e in failed["errors"]["data"]}
    assert errors == {(2, "mismatched_url"), (3, "duplicate_custom_id")}


def test_bad_requests_to_the_routes(srv, oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert err.value.body["param"] == "purpose"
    with pytest.raises(openai.NotFoundError):
        oai.batches.create(input_file_id="file-nothere", endpoint="/v1/chat/completions",
                           completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        oai.batches.retrieve("batch_nothere")
    with pytest.raises(openai.NotFoundError):
        oai.files.content("../../etc/passwd")
    too_big = b"x" * (8 * 1024 * 1024 + 1)
    with pytest.raises(openai.APIStatusError) as err:
        oai.files.create(file=("big.jsonl", io.BytesIO(too_big)), purpose="batch")
    assert err.value.status_code == 413
    r = httpx.post(f"{srv.base_url}/v1/batches", timeout=60, json={
        "input_file_id": "file-x", "endpoint": "/v1/chat/completions",
        "completion_window": "1h"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "completion_window"


def test_cancel_stops_a_running_batch(srv, oai):
    client = httpx.Client(base_url=srv.base_url, timeout=60)
    file_id = upload(oai, [chat_line(f"r{i}", f"Count {i}", srv.model) for i in range(4)])
    pause_generation(client)
    try:
        batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
        wait_status(oai, batch.id, {"in_progress"})
        wait_for(lambda: internal_state(client), lambda s: s["num_waiting_reqs"] >= 2,
                 "batch requests queued")
        # --batch-max-concurrency 2: the batch's other two requests are held back, so an
        # interactive request sent now is the third to wait, not the fifth.
        interactive = in_background(client.post, "/generate", json={
            "text": "Hi", "sampling_params": {"max_new_tokens": 2}})
        state = wait_for(lambda: internal_state(client), lambda s: s["num_waiting_reqs"] >= 3,
                         "the interactive request queued")
        assert state["num_waiting_reqs"] == 3
        assert oai.batches.cancel(batch.id).status == "cancelling"
        cancelled = wait_status(oai, batch.id, {"cancelled"})
    finally:
        continue_generation(client)
    assert interactive.result(60).status_code == 200
    assert cancelled["cancelled_at"] and cancelled["request_counts"]["completed"] == 0
    with pytest.raises(openai.APIStatusError) as err:
        oai.batches.cancel(batch.id)
    assert err.value.status_code == 409
    assert_no_leak(client)


def test_a_restart_in_the_middle_of_a_batch_loses_nothing(servers, llama_path, batch_dir):
    old = servers["srv"]
    oai = openai.OpenAI(base_url=f"{old.base_url}/v1", api_key="x", max_retries=0)
    prompts = {f"r{i}": f"Story number {i}:" for i in range(3)}
    file_id = upload(oai, [chat_line(cid, text, old.model) for cid, text in prompts.items()])
    client = httpx.Client(base_url=old.base_url, timeout=60)
    pause_generation(client)  # nothing finishes before the restart
    batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    late = oai.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    wait_status(oai, batch.id, {"in_progress"})
    wait_status(oai, late.id, {"in_progress"})
    wait_for(lambda: internal_state(client), lambda s: s["num_waiting_reqs"] >= 1,
             "batch requests queued")
    client.close()
    old.check_clean_stop()  # SIGTERM: drains, exits 0
    # While the server is down, the second batch's 24 hours pass (its object on disk says so).
    stored = batch_dir / "batches" / f"{late.id}.json"
    doc = json.loads(stored.read_text())
    assert doc["status"] == "in_progress"
    stored.write_text(json.dumps({**doc, "expires_at": doc["created_at"] - 1}))

    new = start_server(llama_path, *FLAGS, "--batch-dir", str(batch_dir))
    servers["srv"] = new
    oai = openai.OpenAI(base_url=f"{new.base_url}/v1", api_key="x", max_retries=0)
    assert oai.files.retrieve(file_id).id == file_id
    done = wait_status(oai, batch.id, {"completed", "failed"})
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    outputs = read_lines(oai, done["output_file_id"])
    assert set(outputs) == set(prompts)
    for cid, text in prompts.items():
        direct = oai.chat.completions.create(
            model=new.model, messages=[{"role": "user", "content": text}], max_tokens=6,
            temperature=0)
        got = outputs[cid]["response"]["body"]["choices"][0]["message"]["content"]
        assert got == direct.choices[0].message.content
    expired = wait_status(oai, late.id, {"expired"})
    assert expired["expired_at"] and expired["output_file_id"] is None
    errors = read_lines(oai, expired["error_file_id"])
    assert set(errors) == set(prompts)
    assert all(e["response"] is None and e["error"]["code"] == "batch_expired"
               for e in errors.values())
    assert_no_leak(httpx.Client(base_url=new.base_url, timeout=60))


def test_batches_without_a_batch_dir_or_priority_scheduling(server):
    """The shared server: no --batch-dir (a temporary folder), no priority scheduling (batch
    requests carry no priority, which such a server would refuse)."""
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
            "body": {"model": server.model, "prompt": "Hello", "max_tokens": 4,
                     "temperature": 0}}
    batch = oai.batches.create(input_file_id=upload(oai, [line]), endpoint="/v1/completions",
                               completion_window="24h")
    done = wait_status(oai, batch.id, {"completed", "failed"})
    assert done["request_counts"] == {"total": 1, "completed": 1, "failed": 0}, done
    body = read_lines(oai, done["output_file_id"])["c"]["response"]["body"]
    direct = oai.completions.create(model=server.model, prompt="Hello", max_tokens=4,
                                    temperature=0)
    assert body["choices"][0]["text"] == direct.choices[0].text
    # An embeddings batch on a generation model: each request gets the route's 400.
    line = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": server.model, "input": "Hello"}}
    batch = oai.batches.create(input_file_id=upload(oai, [line]), endpoint="/v1/embeddings",
                               completion_window="24h")
    done = wait_status(oai, batch.id, {"completed", "failed"})
    assert done["request_counts"] == {"total": 1, "completed": 0, "failed": 1}, done
    assert done["output_file_id"] is None
    error = read_lines(oai, done["error_file_id"])["e"]
    assert error["response"]["status_code"] == 400
