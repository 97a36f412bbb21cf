"""Phi-3 (q/k/v and gate/up fused in the checkpoint) and Mistral with a sliding window against
transformers in float32: batched prefill, greedy decode past the window, and an extend on a
cached prefix longer than it; rope scalings Phi-3's long-context variants use are refused."""

from __future__ import annotations

import json
import random

import pytest
import torch

from radixserve.model_config import ModelConfig
from tests.checkpoints import build_checkpoint
from tests.model_executor.harness import ManualSlots, hf_logits, make_runner

SHAPES = {
    "phi3": ("phi3", {}),  # 2 query heads per KV head, head_dim 16, no window
    "phi3-window": ("phi3", dict(sliding_window=7, hidden_size=128, num_attention_heads=8,
                                 num_key_value_heads=2, head_dim=64)),
    "phi3-mha": ("phi3", dict(num_key_value_heads=4, sliding_window=11)),
    "mistral-window": ("mistral", dict(sliding_window=6)),
}


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 500) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_cached_prefix_and_decode_match_transformers(shape, tmp_path, hf_model):
    arch, overrides = SHAPES[shape]
    path = build_checkpoint(tmp_path / shape, arch, **overrides)
    runner = make_runner(path, page_size=4)
    assert runner.model.model.layers[0].self_attn.attn.sliding_window == overrides.get(
        "sliding_window"
    )
    slots = ManualSlots(runner)
    prompts = _prompts([33, 5, 19], seed=0)
    seqs = [slots.new_seq() for _ in prompts]
    runner.forward(slots.extend(seqs[:1], [prompts[0][:20]]))  # a cached prefix of 20
    step_logits = [runner.forward(slots.extend(seqs, [prompts[0][20:], *prompts[1:]]))]
    for _ in range(10):
        step_logits.append(runner.forward(slots.decode(seqs, step_logits[-1].argmax(-1).tolist())))
    hf = hf_model(path)
    final = step_logits[-1].argmax(-1).tolist()
    for i, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
        ref = hf_logits(hf, seq.tokens)[len(prompt) - 1 :]
        ours = torch.stack([logits[i] for logits in step_logits])
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
        assert seq.tokens[len(prompt) :] + [final[i]] == ref.argmax(-1).tolist()


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
      "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}, "'longrope'"),
    ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
     "partial_rotary_factor"),
])
def test_phi3_unsupported_rope_is_refused_by_name(rope, message, tmp_path):
    path = build_checkpoint(tmp_path / "phi3", "phi3")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = rope
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_path(path)
        make_runner(path)
