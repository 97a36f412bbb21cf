"""LoRA with speculative decoding (NGRAM and STANDALONE): a verify step scores a request's
drafts under the request's own adapter, so greedy output with speculation is ``peft``'s with the
adapter applied, token for token, as without speculation. (The draft model of STANDALONE runs
without adapters: its drafts are only proposals, which the target under the adapter judges.)"""

from __future__ import annotations

import pytest

from radixserve import Engine
from tests.engine.conftest import ENGINE_KWARGS
from tests.lora.adapters import make_adapter, peft_greedy

MAX_NEW = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
# A repeated phrase: the n-gram proposer finds drafts in the prompt from the first step.
PHRASE = [41, 97, 13, 250, 66, 8, 129]
PROMPTS = [PHRASE * 6, [5, 17, 33, 90] * 5 + PHRASE * 3]


@pytest.mark.parametrize("flags", [
    {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
    {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3},
], ids=["ngram", "standalone"])
def test_speculative_verify_steps_apply_each_requests_adapter(flags, llama_path,
                                                             tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-adapters")
    adapters = {
        "attn": make_adapter(llama_path, root / "attn", 4, ["q_proj", "v_proj", "o_proj"], 31),
        "mlp": make_adapter(llama_path, root / "mlp", 8, ["gate_proj", "up_proj", "down_proj"],
                            32),
    }
    if flags["speculative_algorithm"] == "STANDALONE":
        flags = {**flags, "speculative_draft_model_path": str(llama_path)}
    paths = [f"{name}={path}" for name, path in adapters.items()]
    with Engine(model_path=str(llama_path), dtype="float32", lora_paths=paths,
                max_loras_per_batch=2, max_lora_rank=8, **flags, **ENGINE_KWARGS) as engine:
        for names in (["attn", "mlp"], ["mlp", None]):
            out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=names)
            expected = [peft_greedy(llama_path, adapters[n] if n else None, p, MAX_NEW)
                        for n, p in zip(names, PROMPTS, strict=True)]
            assert [o["output_ids"] for o in out] == expected, names
        state = engine.get_server_info()["internal_states"][0]
    assert state["spec_num_verify_steps"] > 0  # the outputs went through verify steps
