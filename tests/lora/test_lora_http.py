"""LoRA through a real server process: the openai SDK (``model`` = ``BASE:ADAPTER`` or the
adapter's name), native ``/generate`` with ``lora_path``, ``/v1/models``, and the admin routes
``/load_lora_adapter`` and ``/unload_lora_adapter`` with SGLang's bodies."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.lora.adapters import make_adapter, peft_greedy
from tests.server.conftest import start_server

PROMPT_IDS = [5, 17, 33, 90, 120, 7]


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("http_adapters")
    return {
        "qv": make_adapter(llama_path, root / "qv", 4, ["q_proj", "v_proj"], seed=21),
        "all": make_adapter(llama_path, root / "all", 8, ["q_proj", "k_proj", "v_proj",
                                                          "o_proj", "gate_proj", "up_proj",
                                                          "down_proj"], seed=22),
    }


@pytest.fixture(scope="module")
def server(llama_path, adapters):
    srv = start_server(llama_path, "--dtype", "float32", "--max-total-tokens", "4096",
                       "--lora-paths", f"qv={adapters['qv']}", "--max-lora-rank", "8",
                       "--max-loras-per-batch", "2", "--lora-target-modules", "all")
    yield srv
    srv.check_clean_stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture
def sdk(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def test_openai_model_names_the_adapter(server, sdk, adapters, llama_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_path, local_files_only=True)
    expected = peft_greedy(llama_path, adapters["qv"], PROMPT_IDS, 6)
    for model in (f"{server.model}:qv", "qv"):
        out = sdk.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == tokenizer.decode(expected)
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model=f"{server.model}:nope", prompt="hi", max_tokens=2)


def test_models_lists_adapters(server, sdk):
    cards = {m.id: m for m in sdk.models.list().data}
    assert set(cards) == {server.model, "qv"}
    assert cards["qv"].model_extra["parent"] == server.model


def test_load_generate_unload_over_http(http, adapters, llama_path):
    body = {"lora_name": "all", "lora_path": str(adapters["all"])}
    r = http.post("/load_lora_adapter", json=body)
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"qv", "all"}, r.text
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = http.post("/generate", json={"input_ids": [PROMPT_IDS, PROMPT_IDS],
                                     "lora_path": ["all", None], "sampling_params": params})
    assert r.status_code == 200, r.text
    got = [o["output_ids"] for o in r.json()]
    assert got == [peft_greedy(llama_path, adapters["all"], PROMPT_IDS, 6),
                   peft_greedy(llama_path, None, PROMPT_IDS, 6)]
    r = http.post("/load_lora_adapter", json={"lora_name": "third", "lora_path": "/nowhere"})
    assert r.status_code == 400 and "adapters are loaded" in r.json()["error"]["message"], r.text
    r = http.post("/unload_lora_adapter", json={"lora_name": "all"})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"qv"}, r.text
    r = http.post("/generate", json={"text": "hi", "lora_path": "all"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    r = http.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nowhere"})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"], r.text
