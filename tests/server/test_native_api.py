"""SGLang's native API: /generate (single, batch, stream), abort, cache, info and tokenizer."""

from __future__ import annotations

import threading
import uuid

import httpx

from tests.server.conftest import KV_TOKENS, assert_no_leak, parse_sse
from tests.sync import UNTIL_ABORTED

GREEDY = {"temperature": 0.0, "ignore_eos": True}
MEMORY_KEYS = {
    "available_kv_tokens", "evictable_kv_tokens", "protected_kv_tokens",
    "session_held_kv_tokens", "session_offloaded_tokens", "total_kv_tokens", "free_req_slots",
    "total_req_slots",
}


def _generate(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/generate", json=body)


def test_generate_single_returns_text_ids_and_meta(client):
    r = _generate(client, text="Hello", rid="single-1",
                  sampling_params={"max_new_tokens": 5, **GREEDY})
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "single-1" and meta["completion_tokens"] == 5
    assert len(out["output_ids"]) == 5 and meta["prompt_tokens"] > 0
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert isinstance(out["text"], str) and meta["cached_tokens"] >= 0


def test_generate_batch_keeps_input_order(client):
    params = {"max_new_tokens": 4, **GREEDY}
    singles = [_generate(client, text=t, sampling_params=params).json() for t in ("a b", "c d")]
    batch = _generate(client, text=["a b", "c d"], sampling_params=params).json()
    assert [o["output_ids"] for o in batch] == [o["output_ids"] for o in singles]
    ids = client.post("/tokenize", json={"prompt": ["a b", "c d"]}).json()["tokens"]
    by_ids = _generate(client, input_ids=ids, sampling_params=params).json()
    assert [o["text"] for o in by_ids] == [o["text"] for o in singles]


def test_generate_stream_chunks_are_cumulative_and_end_equal_to_non_stream(client):
    params = {"max_new_tokens": 8, **GREEDY}
    full = _generate(client, text="Stream me", sampling_params=params).json()
    with client.stream("POST", "/generate",
                       json={"text": "Stream me", "sampling_params": params, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = parse_sse(list(r.iter_lines()))
    for prev, nxt in zip(chunks, chunks[1:], strict=False):
        assert nxt["text"].startswith(prev["text"])
        assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_batch_stream_tags_chunks_with_index(client):
    body = {"text": ["x", "y"], "stream": True, "sampling_params": {"max_new_tokens": 3, **GREEDY}}
    with client.stream("POST", "/generate", json=body) as r:
        chunks = parse_sse(list(r.iter_lines()))
    finished = [c["index"] for c in chunks if c["meta_info"]["finish_reason"] is not None]
    assert sorted(finished) == [0, 1]


def test_generate_logprobs_match_output_ids(client):
    out = _generate(client, text="Hello", return_logprob=True, top_logprobs_num=3,
                    sampling_params={"max_new_tokens": 4, **GREEDY}).json()
    meta = out["meta_info"]
    assert [tid for _, tid, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(tops) == 3 for tops in meta["output_top_logprobs"])
    # Greedy: each chosen token is the top alternative.
    assert [tops[0][1] for tops in meta["output_top_logprobs"]] == out["output_ids"]


def test_abort_request_ends_a_running_stream_with_abort(client, server):
    rid = f"to-abort-{uuid.uuid4().hex}"
    body = {"text": "Go on", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": UNTIL_ABORTED, **GREEDY}}
    with httpx.Client(base_url=server.base_url, timeout=60) as stream_client, \
            stream_client.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert first
        assert client.post("/abort_request", json={"rid": rid}).status_code == 200
        chunks = parse_sse([first, *lines])
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "abort"
    assert last["completion_tokens"] < UNTIL_ABORTED
    assert_no_leak(client)


def test_abort_all_ends_every_request(client, server):
    results: list[dict] = []
    started = threading.Barrier(3)

    def run(i: int) -> None:
        body = {"text": f"req {i}", "stream": True,
                "sampling_params": {"max_new_tokens": UNTIL_ABORTED, **GREEDY}}
        with httpx.Client(base_url=server.base_url, timeout=60) as c, \
                c.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            started.wait(timeout=60)
            results.append(parse_sse([first, *lines])[-1]["meta_info"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
    for t in threads:
        t.join(60)
    assert [m["finish_reason"]["type"] for m in results] == ["abort", "abort"]
    assert_no_leak(client)


def test_flush_cache_empties_the_prefix_cache(client):
    _generate(client, text="cache me " * 10, sampling_params={"max_new_tokens": 2, **GREEDY})
    before = assert_no_leak(client)
    assert before["evictable_kv_tokens"] > 0
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    after = assert_no_leak(client)
    assert after["evictable_kv_tokens"] == 0
    assert after["available_kv_tokens"] == after["total_kv_tokens"] == KV_TOKENS


def test_flush_cache_answers_get_as_sglang_does(client):
    r = client.get("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True


def test_openapi_has_one_operation_id_per_operation(client):
    """Generated clients name their methods by operation id: two equal ids clash (FastAPI
    warned of ``flush_cache`` and ``get_weights_by_name``, each served for GET and POST)."""
    paths = client.get("/openapi.json").json()["paths"]
    ids = [op["operationId"] for path in paths.values() for op in path.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert {"get", "post"} <= set(paths["/flush_cache"])


def test_server_info_reports_args_sizes_and_memory(client, server):
    info = client.get("/get_server_info").json()
    assert info["model_path"] == server.model and info["port"] == server.port
    assert info["context_length"] == 1024 and info["max_total_num_tokens"] == KV_TOKENS
    assert "api_key" not in info
    memory = info["internal_states"][0]["memory"]
    assert set(memory) == MEMORY_KEYS and memory["total_kv_tokens"] == KV_TOKENS


def test_model_info_health_and_health_generate(client, server):
    info = client.get("/get_model_info").json()
    assert info["model_path"] == server.model and info["is_generation"] is True
    assert info["context_length"] == 1024
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200


def test_newer_sglang_info_routes_answer_like_the_get_routes(client):
    assert client.get("/model_info").json() == client.get("/get_model_info").json()
    info, old = client.get("/server_info").json(), client.get("/get_server_info").json()
    assert info.keys() == old.keys() and info["model_path"] == old["model_path"]


def test_generate_accepts_the_fields_sglang_router_forwards(client, server):
    """sglang-router re-serialises /generate bodies with its defaults of SGLang's fields."""
    params = {"max_new_tokens": 4, **GREEDY}
    plain = _generate(client, text="Routed", sampling_params=params).json()
    for model in (None, server.model):
        routed = _generate(client, text="Routed", sampling_params=params, model=model,
                           return_text_in_logprobs=False, log_metrics=True,
                           return_hidden_states=False, background=False, no_logs=False,
                           return_bytes=False, return_entropy=False)
        assert routed.status_code == 200, routed.text
        assert routed.json()["output_ids"] == plain["output_ids"]


def test_tokenize_detokenize_round_trip(client):
    tok = client.post("/tokenize", json={"prompt": "round trip text"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
    text = client.post("/detokenize", json={"tokens": tok["tokens"]}).json()["text"]
    assert text == "round trip text"


def test_metrics_are_404_without_the_flag(client):
    r = client.get("/metrics")
    assert r.status_code == 404 and "--enable-metrics" in r.json()["error"]["message"]


def test_form_encoded_body_is_read_as_json(client):
    # curl -d sends application/x-www-form-urlencoded; the API only speaks JSON.
    body = b'{"text": "hi", "sampling_params": {"max_new_tokens": 1}}'
    r = client.post("/generate", content=body,
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1


def test_session_routes_open_continue_and_close(client):
    sid = client.post("/open_session", json={"capacity_of_str_len": 1024}).json()
    assert isinstance(sid, str) and sid
    dup = client.post("/open_session", json={"capacity_of_str_len": 1024, "session_id": sid})
    assert dup.status_code == 400 and dup.json()["error"]["type"] == "invalid_request_error"
    params = {"max_new_tokens": 3, **GREEDY}
    first = _generate(client, text="Hello", session_params={"id": sid},
                      sampling_params=params).json()["meta_info"]
    second = _generate(client, text=" more", sampling_params=params,
                       session_params={"id": sid, "rid": first["id"]}).json()["meta_info"]
    # The second turn's prompt is the first turn's prompt and output plus the new text.
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
    assert client.post("/close_session", json={"session_id": sid}).status_code == 200
    gone = _generate(client, text="x", session_params={"id": sid}, sampling_params=params)
    assert gone.status_code == 400
    assert_no_leak(client)
