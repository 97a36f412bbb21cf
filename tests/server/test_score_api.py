"""SGLang's ``/v1/score`` on the shared tiny-Llama server, against ``transformers``: each item's
label probabilities are the next-token softmax of query + item (fp32, within 1e-5)."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.server.conftest import assert_no_leak

QUERY = "The open() function returns a"
ITEMS = [" file object", " list", " dict of keys and values"]
LABELS = [17, 42, 300]


@pytest.fixture(scope="module")
def hf(llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_path, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(llama_path)


def hf_next_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(logits.double(), dim=-1)


def score(client: httpx.Client, **body) -> dict:
    r = client.post("/v1/score", json={"label_token_ids": LABELS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_scores_are_the_next_token_probabilities_of_transformers(client, server, hf):
    model, tok = hf
    r = score(client, query=QUERY, items=ITEMS, model=server.model)
    assert r["object"] == "scoring" and r["model"] == server.model
    prompts = [tok.encode(QUERY + item) for item in ITEMS]
    assert r["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    for got, ids in zip(r["scores"], prompts, strict=True):
        probs = hf_next_probs(model, ids)[LABELS]
        assert got == pytest.approx(probs.tolist(), abs=1e-5)
        assert sum(got) < 1  # whole-vocabulary probabilities of three of 512 tokens
    soft = score(client, query=QUERY, items=ITEMS, apply_softmax=True)
    for got, ids in zip(soft["scores"], prompts, strict=True):
        probs = hf_next_probs(model, ids)[LABELS]
        assert got == pytest.approx((probs / probs.sum()).tolist(), abs=1e-5)
        assert sum(got) == pytest.approx(1.0, abs=1e-9)


def test_item_first_and_token_ids(client, hf):
    model, tok = hf
    first = score(client, query=QUERY, items=ITEMS[:2], item_first=True)
    for got, item in zip(first["scores"], ITEMS[:2], strict=True):
        probs = hf_next_probs(model, tok.encode(item + QUERY))[LABELS]
        assert got == pytest.approx(probs.tolist(), abs=1e-5)
    q = tok.encode(QUERY)
    items = [tok.encode(i, add_special_tokens=False) for i in ITEMS]
    by_ids = score(client, query=q, items=items)
    for got, item in zip(by_ids["scores"], items, strict=True):
        probs = hf_next_probs(model, q + item)[LABELS]
        assert got == pytest.approx(probs.tolist(), abs=1e-5)
    one = score(client, query=QUERY, items=ITEMS[0])  # one item as a string
    assert len(one["scores"]) == 1


@pytest.mark.parametrize(("body", "needle"), [
    ({"query": QUERY, "items": ITEMS}, "label_token_ids"),
    ({"query": QUERY, "items": ITEMS, "label_token_ids": []}, "label_token_ids"),
    ({"query": QUERY, "label_token_ids": LABELS}, "items"),
    ({"items": ITEMS, "label_token_ids": LABELS}, "query"),
    ({"query": QUERY, "items": [], "label_token_ids": LABELS}, "items"),
    ({"query": [1, 2], "items": ["a"], "label_token_ids": LABELS}, "both text or both"),
    ({"query": QUERY, "items": ITEMS, "label_token_ids": [10**6]}, "vocabulary"),
    ({"query": QUERY, "items": ITEMS, "label_token_ids": LABELS, "top_n": 2}, "top_n"),
    ({"query": "", "items": [""], "label_token_ids": LABELS}, "empty"),
])
def test_bad_scoring_requests_are_400_naming_the_field(client, body, needle):
    r = client.post("/v1/score", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_unknown_model_is_404_and_nothing_leaks(client):
    r = client.post("/v1/score", json={"query": QUERY, "items": ITEMS, "label_token_ids": LABELS,
                                       "model": "other"})
    assert r.status_code == 404, r.text
    assert_no_leak(client)
