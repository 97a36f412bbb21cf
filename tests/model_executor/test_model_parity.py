"""ModelRunner against transformers on the same checkpoint, in float32: batched prefill, greedy
decode, prefill on top of a cached prefix, paged KV layouts and RoPE scaling."""

from __future__ import annotations

import random

import pytest
import torch

from tests.checkpoints import build_checkpoint
from tests.model_executor.harness import ManualSlots, hf_logits, make_runner

ATOL = 1e-4


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 500) for _ in range(n)] for n in lengths]


def _generate_and_compare(runner, hf, slots: ManualSlots, prompts, steps: int) -> None:
    """Prefill ``prompts`` as one batch, decode ``steps`` greedy tokens, and check every step's
    logits and argmax against transformers' full-sequence forward."""
    seqs = [slots.new_seq() for _ in prompts]
    step_logits = [runner.forward(slots.extend(seqs, prompts))]
    for _ in range(steps):
        next_tokens = step_logits[-1].argmax(-1).tolist()
        step_logits.append(runner.forward(slots.decode(seqs, next_tokens)))
    final_tokens = step_logits[-1].argmax(-1).tolist()

    for i, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
        ref = hf_logits(hf, seq.tokens)[len(prompt) - 1 :]  # logits predicting each new token
        ours = torch.stack([logits[i] for logits in step_logits])
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
        generated = seq.tokens[len(prompt) :] + [final_tokens[i]]
        assert generated == ref.argmax(-1).tolist()


def test_batched_prefill_and_greedy_decode_match_transformers(arch_path, hf_model):
    runner = make_runner(arch_path)
    prompts = _prompts([13, 3, 24, 1])
    _generate_and_compare(runner, hf_model(arch_path), ManualSlots(runner), prompts, steps=8)


def test_extend_on_cached_prefix_equals_full_prefill(arch_path, hf_model):
    runner = make_runner(arch_path)
    slots = ManualSlots(runner)
    prompts = _prompts([17, 9, 30], seed=1)
    split = [10, 4, 1]

    full = runner.forward(slots.extend([slots.new_seq() for _ in prompts], prompts))

    cached = [slots.new_seq() for _ in prompts]
    runner.forward(slots.extend(cached, [p[:s] for p, s in zip(prompts, split, strict=True)]))
    # The second step also carries a request with no cached prefix.
    fresh_prompt = _prompts([6], seed=2)[0]
    seqs = [*cached, slots.new_seq()]
    rest = [p[s:] for p, s in zip(prompts, split, strict=True)] + [fresh_prompt]
    extended = runner.forward(slots.extend(seqs, rest))

    torch.testing.assert_close(extended[:3], full, atol=1e-5, rtol=0)
    hf = hf_model(arch_path)
    for i, prompt in enumerate([*prompts, fresh_prompt]):
        torch.testing.assert_close(extended[i], hf_logits(hf, prompt)[-1], atol=ATOL, rtol=0)


def test_page_size_16_with_scattered_pages_matches_transformers(checkpoint_factory, hf_model):
    path = checkpoint_factory("qwen3")
    runner = make_runner(path, page_size=16, max_total_tokens=1024)
    num_pages = runner.max_total_num_tokens // 16
    order = list(range(1, num_pages + 1))
    random.Random(0).shuffle(order)
    slots = ManualSlots(runner, page_order=order)
    # 30 + 9 decode steps crosses a page boundary; 16 fills a page exactly.
    prompts = _prompts([30, 16, 5], seed=3)
    _generate_and_compare(runner, hf_model(path), slots, prompts, steps=9)


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_rope_scaling_matches_transformers(kind, rope_checkpoint, hf_model):
    path = rope_checkpoint(kind)
    runner = make_runner(path)
    assert runner.model_config.rope_scaling["rope_type"] == kind
    prompts = _prompts([70, 9], seed=4)
    _generate_and_compare(runner, hf_model(path), ManualSlots(runner), prompts, steps=8)


@pytest.mark.parametrize("arch, shape", [
    # the CPU decode kernel's head sizes (64, 128) with 7 and 2 query heads per KV head
    ("llama", dict(hidden_size=112, num_attention_heads=14, num_key_value_heads=2, head_dim=64)),
    ("qwen2", dict(head_dim=128)),
])
def test_head_dims_64_and_128_decode_like_transformers(arch, shape, tmp_path, hf_model):
    path = build_checkpoint(tmp_path / arch, arch, **shape)
    runner = make_runner(path)
    assert runner.model_config.head_dim == shape["head_dim"]
    prompts = _prompts([21, 4, 40], seed=5)
    _generate_and_compare(runner, hf_model(path), ManualSlots(runner), prompts, steps=8)
