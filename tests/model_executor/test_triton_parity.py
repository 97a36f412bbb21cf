"""The ModelRunner with the ``triton`` attention backend (Triton's interpreter on CPU) against
transformers in float32: batched prefill, greedy decode and an extend on a cached prefix, over
scattered pages. ``TRITON_INTERPRET=1`` is set before the kernels are first imported."""

from __future__ import annotations

import os

import torch

# Only where no GPU runs the compiled kernels: the variable stays set for the whole test session
# (and the servers it starts), which on a GPU machine would interpret tests/cuda's kernels too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402

from tests.checkpoints import build_checkpoint  # noqa: E402
from tests.model_executor.harness import ManualSlots, hf_logits, make_runner  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)


def test_triton_backend_greedy_decode_matches_transformers(llama_path, hf_model):
    runner = make_runner(llama_path, attention_backend="triton", page_size=4,
                         max_total_tokens=512)
    assert type(runner.attn_backend).__name__ == "TritonAttnBackend"
    order = list(range(1, runner.max_total_num_tokens // 4 + 1))
    random.Random(0).shuffle(order)
    slots = ManualSlots(runner, page_order=order)
    rng = random.Random(0)
    prompts = [[rng.randrange(6, 500) for _ in range(n)] for n in (11, 3, 18)]
    seqs = [slots.new_seq() for _ in prompts]
    # The first prompt's first 5 tokens are cached by an earlier step, so the batch's extend
    # reads a prefix from the pool.
    runner.forward(slots.extend(seqs[:1], [prompts[0][:5]]))
    step_logits = [runner.forward(slots.extend(seqs, [prompts[0][5:], *prompts[1:]]))]
    for _ in range(6):
        next_tokens = step_logits[-1].argmax(-1).tolist()
        step_logits.append(runner.forward(slots.decode(seqs, next_tokens)))
    hf = hf_model(llama_path)
    for i, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
        ref = hf_logits(hf, seq.tokens)[len(prompt) - 1 :]
        ours = torch.stack([logits[i] for logits in step_logits])
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
        generated = seq.tokens[len(prompt) :] + [step_logits[-1][i].argmax().item()]
        assert generated == ref.argmax(-1).tolist()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_triton_sliding_window_and_soft_cap_match_transformers(arch, tmp_path, hf_model):
    """Gemma 2 (window 8, attention and final soft caps) and Gemma 3 (window 6, one KV head):
    a 13-token prefix cached before the window's reach, then prompts longer than the window and
    decode steps past it."""
    extra = {"num_key_value_heads": 1} if arch == "gemma3" else {}
    path = build_checkpoint(tmp_path / arch, arch, **extra)
    runner = make_runner(path, attention_backend="triton", page_size=4, max_total_tokens=512)
    slots = ManualSlots(runner)
    rng = random.Random(1)
    prompts = [[rng.randrange(6, 500) for _ in range(n)] for n in (21, 4, 15)]
    seqs = [slots.new_seq() for _ in prompts]
    runner.forward(slots.extend(seqs[:1], [prompts[0][:13]]))
    step_logits = [runner.forward(slots.extend(seqs, [prompts[0][13:], *prompts[1:]]))]
    for _ in range(10):
        step_logits.append(runner.forward(slots.decode(seqs, step_logits[-1].argmax(-1).tolist())))
    hf = hf_model(path)
    for i, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
        ref = hf_logits(hf, seq.tokens)[len(prompt) - 1 :]
        ours = torch.stack([logits[i] for logits in step_logits])
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
        generated = seq.tokens[len(prompt) :] + [step_logits[-1][i].argmax().item()]
        assert generated == ref.argmax(-1).tolist()
