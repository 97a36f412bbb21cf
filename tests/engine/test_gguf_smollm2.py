"""The real SmolLM2-135M-Instruct GGUF (Q4_1) through the Engine: greedy fp32 output equals
``transformers``' own GGUF loader token for token on 20 prompts x 64 tokens."""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine
from radixserve.tokenizer_loader import load_tokenizer
from tests.engine.conftest import ENGINE_KWARGS
from tests.smollm2 import smollm2_path

NEW_TOKENS = 64
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "Explain what a hash table is in one paragraph.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a haiku about the sea.",
    "Why is the sky blue?",
    "Suggest a name for a pet goldfish.",
]
TEXTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "Paris is the capital of",
    "import numpy as np\n\n",
    "In 1969, the first humans",
    "A recipe for pancakes: first,",
    "The mitochondria is",
    "Dear hiring manager,",
]


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_path()


@pytest.fixture(scope="module")
def prompts(gguf_path) -> list[list[int]]:
    """10 chat-templated questions (the file's own template) and 10 plain texts, as ids."""
    tok = load_tokenizer(gguf_path)
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                tokenize=False)
        for q in QUESTIONS
    ]
    return [tok.encode(text, add_special_tokens=False) for text in chats + TEXTS]


def _hf_greedy_choices(model, prompt: list[int], continuation: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and after each token of ``continuation``:
    one forward over the whole sequence. It equals ``continuation`` exactly when
    ``continuation`` is transformers' greedy output (each choice is made on the same prefix),
    at a twentieth of the cost of decoding token by token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation[:-1]])).logits[0]
    return logits[len(prompt) - 1 :].argmax(dim=-1).tolist()


# A real 135M model: the Engine's 20 x 64 tokens and 20 transformers forwards take about a
# minute on an idle 2-core machine, several times that on a loaded one.
@pytest.mark.timeout(1800)
def test_smollm2_gguf_greedy_matches_transformers(gguf_path, prompts):
    assert len(prompts) == 20
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Engine(model_path=str(gguf_path), dtype="float32", **ENGINE_KWARGS) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    ours = [o["output_ids"] for o in outs]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    for i, prompt in enumerate(prompts):
        assert len(ours[i]) == NEW_TOKENS
        expected = _hf_greedy_choices(model, prompt, ours[i])
        assert ours[i] == expected, f"prompt {i}: first difference at token " + str(
            next(j for j, (a, b) in enumerate(zip(ours[i], expected, strict=True)) if a != b)
        )
