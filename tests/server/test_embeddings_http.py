"""``/v1/embeddings`` and ``/encode`` through real HTTP, on a decoder served with --is-embedding
(one server for the module), and their refusal on the shared generation server."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest

from tests.server.conftest import assert_no_leak, start_server

HIDDEN = 64  # the tiny test checkpoints' hidden size


@pytest.fixture(scope="module")
def emb_server(llama_path):
    srv = start_server(llama_path, "--is-embedding")
    yield srv
    srv.check_clean_stop()


@pytest.fixture
def emb(emb_server):
    with httpx.Client(base_url=emb_server.base_url, timeout=60) as c:
        yield c


def test_openai_sdk_embeddings_equal_native_encode(emb_server, emb):
    client = openai.OpenAI(base_url=f"{emb_server.base_url}/v1", api_key="none")
    texts = ["The open() function", "a dict maps keys to values", "x"]
    resp = client.embeddings.create(model=emb_server.model, input=texts)  # base64 on the wire
    native = emb.post("/encode", json={"text": texts}).json()
    assert [d.index for d in resp.data] == [0, 1, 2]
    for d, n in zip(resp.data, native, strict=True):
        assert len(d.embedding) == HIDDEN
        assert d.embedding == pytest.approx(n["embedding"], abs=1e-6)
    assert resp.usage.prompt_tokens == sum(n["meta_info"]["prompt_tokens"] for n in native)
    assert resp.model == emb_server.model
    assert_no_leak(emb)


def test_embeddings_float_base64_token_ids_and_dimensions(emb):
    body = {"input": [[10, 20, 30], [40, 50]], "encoding_format": "float", "dimensions": HIDDEN}
    floats = emb.post("/v1/embeddings", json=body).json()
    assert floats["object"] == "list" and floats["usage"]["prompt_tokens"] == 5
    b64 = emb.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], b64["data"], strict=True):
        decoded = struct.unpack(f"<{HIDDEN}f", base64.b64decode(b["embedding"]))
        assert list(decoded) == pytest.approx(f["embedding"], abs=1e-6)
    single = emb.post("/encode", json={"input_ids": [10, 20, 30]}).json()
    assert single["embedding"] == pytest.approx(floats["data"][0]["embedding"], abs=1e-6)
    assert single["meta_info"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    ("route", "body", "needle"),
    [
        ("/v1/embeddings", {"input": []}, "empty"),
        ("/v1/embeddings", {}, "input"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 8}, "dimensions"),
        ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": "hi", "truncate": True}, "unknown parameter"),
        ("/v1/embeddings", {"input": [[1, 2], [10**7]]}, "vocabulary"),
        ("/v1/embeddings", {"input": [7] * 1500}, "context length"),
        ("/encode", {"text": "hi", "sampling_params": {}}, "sampling_params"),
        ("/encode", {"text": ""}, "empty"),
        ("/encode", {"text": "a", "input_ids": [1]}, "exactly one"),
        ("/generate", {"text": "hi"}, "embedding model"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "embedding model"),
    ],
)
def test_bad_embedding_requests_get_400(emb, route, body, needle):
    r = emb.post(route, json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_embedding_server_reports_itself_and_stays_healthy(emb):
    assert emb.post("/v1/embeddings", json={"input": "hi", "model": "other"}).status_code == 404
    assert emb.get("/get_model_info").json()["is_generation"] is False
    assert emb.get("/health_generate").status_code == 200
    assert_no_leak(emb)


def test_generation_server_refuses_embeddings(client):
    for route, body in [("/v1/embeddings", {"input": "hi"}), ("/encode", {"text": "hi"})]:
        r = client.post(route, json=body)
        assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"]
