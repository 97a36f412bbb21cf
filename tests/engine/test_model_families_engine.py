"""Gemma 2, Gemma 3 and Phi-3 (windows 8, 6, 7) served by the Engine (cpu attention backend)
generate greedily what transformers generates, token for token: prompts several windows long,
prefilled in chunks shorter than the window, then a radix hit on a cached prefix longer than
the window."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve import Engine
from tests.checkpoints import build_checkpoint
from tests.engine.conftest import ENGINE_KWARGS


@pytest.mark.parametrize("arch, overrides", [
    ("gemma2", {}), ("gemma3", {}), ("phi3", {"sliding_window": 7}),
])
def test_windowed_families_through_the_engine_equal_transformers(arch, overrides, tmp_path,
                                                                 strict_env):
    path = build_checkpoint(tmp_path / arch, arch, **overrides)
    shared = [7 + (i * 37) % 480 for i in range(30)]  # 30 tokens: beyond every window
    prompts = [shared + [11, 12, 13], shared + [90, 91], [5, 9, 31, 200]]
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    kwargs = {**ENGINE_KWARGS, "max_total_tokens": 1024, "max_running_requests": 4}
    with Engine(model_path=str(path), page_size=4, chunked_prefill_size=5, **kwargs) as engine:
        outs = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
    assert outs[1]["meta_info"]["cached_tokens"] >= 24  # the shared prefix came from the cache
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              pad_token_id=2)[0, len(prompt):].tolist()
        assert out["output_ids"] == ref
