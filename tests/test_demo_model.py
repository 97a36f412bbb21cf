"""Checks on the shipped demo checkpoint (``models/radixserve-demo``) using transformers only.

These do not need the engine: they make sure the checkpoint that ``make serve`` and the parity
tests rely on is a complete, loadable Hugging Face directory of the advertised size, with a chat
template whose assistant turns end in a token that generation treats as EOS.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / "radixserve-demo"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


@pytest.fixture(scope="module")
def offline() -> Iterator[None]:
    """Make sure nothing below reaches for the Hugging Face hub."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def tokenizer(offline: None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_DIR)


@pytest.fixture(scope="module")
def model(offline: None) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_DIR).eval()


def test_files_exist_and_size() -> None:
    for name in REQUIRED_FILES:
        assert (DEMO_DIR / name).is_file(), f"missing {name}"
    total = sum(f.stat().st_size for f in DEMO_DIR.rglob("*") if f.is_file())
    assert total < 50 * 1024 * 1024, f"checkpoint is {total / 2**20:.1f} MiB"


def test_config_is_small_llama() -> None:
    config = json.loads((DEMO_DIR / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] >= 1024


def test_tokenizer_and_chat_template(tokenizer: Any) -> None:
    assert tokenizer.bos_token == "<|bos|>"
    assert tokenizer.eos_token == "<|eos|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.chat_template
    vocab = tokenizer.get_vocab()
    for token in ROLE_TOKENS:
        assert token in vocab

    messages = [{"role": "user", "content": "How do I open a file?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|bos|>")
    assert text.endswith("<|assistant|>")
    assert "<|user|>How do I open a file?<|end|>" in text

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    ids = ids["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")

    full = messages + [{"role": "assistant", "content": "Use open()."}]
    rendered = tokenizer.apply_chat_template(full, tokenize=False)
    assert rendered.endswith("<|assistant|>Use open().<|end|>")

    # Plain text encoding starts with <|bos|>, like every training document.
    assert tokenizer("The open() function")["input_ids"][0] == tokenizer.bos_token_id


def test_generation_config_has_both_eos_ids(tokenizer: Any) -> None:
    generation = json.loads((DEMO_DIR / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    assert tokenizer.convert_tokens_to_ids("<|eos|>") in eos
    assert tokenizer.convert_tokens_to_ids("<|end|>") in eos
    assert generation["bos_token_id"] == tokenizer.bos_token_id


def test_model_loads_with_expected_size(model: Any, tokenizer: Any) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    assert 5_000_000 <= n_params <= 20_000_000, n_params
    assert model.config.vocab_size == len(tokenizer)

    ids = tokenizer("The open() function", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits.float()).all()
