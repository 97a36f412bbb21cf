"""``radixserve serve --model-path SmolLM2-135M-Instruct.Q4_1.gguf``: the real model answers
through the OpenAI chat API with the chat template and tokenizer read from the GGUF file."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import ServerProcess
from tests.smollm2 import smollm2_path


@pytest.fixture(scope="module")
def smollm2_server():
    srv = ServerProcess(smollm2_path(), [])
    # Three processes each build the tokenizer from the file's metadata and the scheduler
    # dequantises the weights: on a loaded machine that takes longer than a tiny checkpoint.
    srv.wait_ready(timeout=600)
    yield srv
    srv.check_clean_stop()


def test_chat_answers_the_capital_of_france(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.base_url}/v1", api_key="none",
                           max_retries=0)
    reply = client.chat.completions.create(
        model=smollm2_server.model, temperature=0, max_tokens=40,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    choice = reply.choices[0]
    # The file's template puts SmolLM's default system prompt first and ends each turn with
    # <|im_end|>, the file's EOS: greedy decoding answers and stops there.
    assert choice.message.content == "The capital of France is Paris."
    assert choice.finish_reason == "stop"
    assert reply.usage.completion_tokens == 8  # 7 tokens of text and <|im_end|>
    assert reply.usage.prompt_tokens == 37


def test_models_route_lists_the_gguf_file(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.base_url}/v1", api_key="none",
                           max_retries=0)
    assert [m.id for m in client.models.list().data] == [smollm2_server.model]
