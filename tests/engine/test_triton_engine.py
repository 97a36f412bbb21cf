"""The engine served with ``--attention-backend triton`` on CPU (Triton's interpreter, set in the
environment the spawned scheduler inherits) generates greedily what transformers generates,
token for token, with chunked prefill and a radix-cache hit."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from radixserve import Engine
from tests.engine.conftest import ENGINE_KWARGS


def test_triton_engine_greedy_equals_transformers(llama_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned scheduler inherits it
    prompts = [[5, 9, 31, 200, 17, 8, 44, 3, 70, 12, 99, 6, 41], [5, 9, 31, 200, 17, 8, 44, 7]]
    params = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    kwargs = {**ENGINE_KWARGS, "max_total_tokens": 512, "max_running_requests": 4}
    with Engine(model_path=str(llama_path), attention_backend="triton", page_size=4,
                chunked_prefill_size=8, **kwargs) as engine:
        first = engine.generate(input_ids=prompts[0], sampling_params=params)
        # The second prompt shares its first 7 tokens with the first: a radix-cache hit.
        second = engine.generate(input_ids=prompts[1], sampling_params=params)
    assert second["meta_info"]["cached_tokens"] > 0
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, [first, second], strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                              pad_token_id=2)[0, len(prompt):].tolist()
        assert out["output_ids"] == ref
