"""Gemma 2 and Gemma 3 (text) against transformers in float32, on the cpu and torch_native
attention backends: prompts longer than the sliding window, greedy decode past it, and an extend
on a cached prefix longer than the window (a chunked prefill or a radix hit reads it from the
pool), over several shapes (GQA ratios, head_dims, windows, layer patterns)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.checkpoints import build_checkpoint
from tests.layers.helpers import needs_kernels
from tests.model_executor.harness import ManualSlots, hf_logits, make_runner

ATOL = 1e-4

SHAPES = {
    # 2 query heads per KV head, head_dim 16, window 8, both soft caps
    "gemma2": ("gemma2", {}),
    # 4 query heads per KV head, head_dim 64, window 5, three layers (sliding, full, sliding)
    "gemma2-gqa4": ("gemma2", dict(hidden_size=96, num_attention_heads=8, num_key_value_heads=2,
                                   head_dim=64, sliding_window=5, num_hidden_layers=3,
                                   layer_types=["sliding_attention", "full_attention",
                                                "sliding_attention"])),
    # q/k norms, local RoPE base, one KV head, head_dim 32, window 6
    "gemma3": ("gemma3", dict(num_key_value_heads=1)),
    # head_dim 128, window 17 (not a multiple of any block), five sliding layers to one global
    "gemma3-hd128": ("gemma3", dict(head_dim=128, sliding_window=17, num_hidden_layers=6,
                                    layer_types=["sliding_attention"] * 5 + ["full_attention"])),
}


# every shape on the cpu backend; the torch_native reference on the two smallest
CASES = [pytest.param(shape, "cpu", marks=needs_kernels) for shape in SHAPES] + [
    ("gemma2", "torch_native"), ("gemma3", "torch_native")]


@pytest.fixture(scope="module")
def gemma_checkpoint(tmp_path_factory):
    cache = {}

    def get(shape: str):
        if shape not in cache:
            arch, overrides = SHAPES[shape]
            cache[shape] = build_checkpoint(tmp_path_factory.mktemp(shape), arch, **overrides)
        return cache[shape]

    return get


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 500) for _ in range(n)] for n in lengths]


def _check(hf, seqs, prompts, step_logits) -> None:
    final = step_logits[-1].argmax(-1).tolist()
    for i, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
        ref = hf_logits(hf, seq.tokens)[len(prompt) - 1 :]
        ours = torch.stack([logits[i] for logits in step_logits])
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
        assert seq.tokens[len(prompt) :] + [final[i]] == ref.argmax(-1).tolist()


@pytest.mark.parametrize("shape, backend", CASES)
def test_gemma_prefill_and_decode_past_the_window_match_transformers(
    shape, backend, gemma_checkpoint, hf_model
):
    gemma_path = gemma_checkpoint(shape)
    runner = make_runner(gemma_path, attention_backend=backend, page_size=4)
    hf = hf_model(gemma_path)
    # window 5..17: these prompts are longer than it, except the short ones, and 12 decode
    # steps slide it further
    prompts = _prompts([40, 3, 23, 9], seed=0)
    slots = ManualSlots(runner)
    seqs = [slots.new_seq() for _ in prompts]
    step_logits = [runner.forward(slots.extend(seqs, prompts))]
    for _ in range(12):
        step_logits.append(runner.forward(slots.decode(seqs, step_logits[-1].argmax(-1).tolist())))
    _check(hf, seqs, prompts, step_logits)


@pytest.mark.parametrize("shape, backend", CASES)
def test_gemma_extend_on_cached_prefix_longer_than_window(shape, backend, gemma_checkpoint,
                                                          hf_model):
    gemma_path = gemma_checkpoint(shape)
    runner = make_runner(gemma_path, attention_backend=backend)
    hf = hf_model(gemma_path)
    prompts = _prompts([45, 30, 7], seed=1)
    split = [37, 20, 0]  # cached prefixes longer than every window, and none
    slots = ManualSlots(runner)
    seqs = [slots.new_seq() for _ in prompts]
    # the prefixes in chunks of 9 (a chunked prefill), then the rest together
    for start in range(0, max(split), 9):
        chunk = [(i, p[start : min(start + 9, s)]) for i, (p, s) in
                 enumerate(zip(prompts, split, strict=True)) if start < s]
        runner.forward(slots.extend([seqs[i] for i, _ in chunk], [c for _, c in chunk]))
    rest = [p[s:] for p, s in zip(prompts, split, strict=True)]
    step_logits = [runner.forward(slots.extend(seqs, rest))]
    for _ in range(4):
        step_logits.append(runner.forward(slots.decode(seqs, step_logits[-1].argmax(-1).tolist())))
    _check(hf, seqs, prompts, step_logits)


@pytest.mark.parametrize("shape", ["gemma2-gqa4", "gemma3-hd128"])
def test_gemma_layers_alternate_windows_and_scale_queries(shape, gemma_checkpoint):
    runner = make_runner(gemma_checkpoint(shape))
    model = runner.model
    hf = runner.model_config.hf_config
    layers = model.model.layers
    windows = [layer.self_attn.attn.sliding_window for layer in layers]
    assert windows == [hf["sliding_window"] if t == "sliding_attention" else None
                       for t in hf["layer_types"]]
    assert layers[0].self_attn.attn.scaling == hf["query_pre_attn_scalar"] ** -0.5
