"""The real Gemma-3-270M (Q4_K_M GGUF: Q5_0/Q8_0/Q4_K/Q6_K tensors) through the Engine: greedy
fp32 output equals transformers' own GGUF loader token for token. Its 18 layers are five
sliding-window (512) layers to one global, with q/k norms and two RoPE bases; the prompts here
are short of the window, and one long prompt (chunked) goes past it. Skips unless the chunk
packages are installed (``tests/gemma3_gguf.py``)."""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine
from radixserve.tokenizer_loader import load_tokenizer
from tests.engine.conftest import ENGINE_KWARGS
from tests.gemma3_gguf import gemma3_270m_path

NEW_TOKENS = 32
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n",
    "Why is the sky blue? Because",
]


def _hf_greedy_choices(model, prompt: list[int], continuation: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and after each token of ``continuation``
    (one forward): equal to ``continuation`` exactly when it is transformers' greedy output."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation[:-1]])).logits[0]
    return logits[len(prompt) - 1 :].argmax(dim=-1).tolist()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gemma3_270m_gguf_greedy_matches_transformers():
    path = gemma3_270m_path()
    tok = load_tokenizer(path)
    prompts = [tok.encode(text) for text in TEXTS]
    # past the 512-token window: a numbered list, prefilled in chunks of 256
    long_text = " ".join(f"{i}. item number {i};" for i in range(1, 150))
    prompts.append(tok.encode(long_text))
    assert len(prompts[-1]) > 700
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Engine(model_path=str(path), dtype="float32", chunked_prefill_size=256,
                **ENGINE_KWARGS) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    ours = [o["output_ids"] for o in outs]
    # a base model: it continues the text ("The capital of France is the capital of the
    # country of France. It is the largest city in France ...")
    assert "France" in tok.decode(ours[0])

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    for i, prompt in enumerate(prompts):
        assert len(ours[i]) == NEW_TOKENS
        expected = _hf_greedy_choices(model, prompt, ours[i])
        assert ours[i] == expected, f"prompt {i}: first difference at token " + str(
            next(j for j, (a, b) in enumerate(zip(ours[i], expected, strict=True)) if a != b)
        )
