"""radixserve's greedy output on the shipped demo model equals transformers', token for token.

The demo checkpoint stores bf16 weights; both sides run them in float32, so the comparison is
exact up to the numerical ties that ``assert_matches_reference`` tolerates and checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.managers.conftest import assert_matches_reference, hf_reference, new_driver

DEMO_DIR = Path(__file__).resolve().parents[2] / "models" / "radixserve-demo"
MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(DEMO_DIR, local_files_only=True)
    # As the chat endpoint does: render the template, which carries its own special tokens.
    chats = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for q in ("How do I open a file?", "What is a list?", "What does len() do?")
    ]
    texts = [tok(t).input_ids for t in ("The open() function", "A dictionary maps keys to")]
    return [list(ids) for ids in chats + texts]


def test_greedy_output_on_demo_model_equals_transformers(prompts):
    driver = new_driver(DEMO_DIR, dtype="float32")
    results = driver.generate(
        {f"p{i}": ids for i, ids in enumerate(prompts)}, max_new_tokens=MAX_NEW
    )
    refs = hf_reference(DEMO_DIR, prompts, max_new_tokens=MAX_NEW)
    # Both sides stop at the same EOS ids (<|eos|> and <|end|>, from generation_config.json).
    for i, ref in enumerate(refs):
        assert results[f"p{i}"].tokens, "every prompt generates something"
        assert_matches_reference(results[f"p{i}"], ref)
