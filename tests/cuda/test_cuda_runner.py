"""The ModelRunner on the GPU with its defaults there (triton attention, fused ops, CUDA graphs):
greedy fp32 decode at graph-padded batch sizes equal to transformers on the same GPU and to the
eager forward, and bf16 logits as close to the fp32 reference as transformers' own bf16 ones."""

from __future__ import annotations

import random

import pytest
import torch

from tests.cuda.helpers import ON_CUDA, DeviceSlots, make_runner, requires_device

pytestmark = requires_device


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 500) for _ in range(n)] for n in lengths]


def _hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([tokens], device=model.device)
        return model(ids).logits[0].float()


def _decode(runner, prompts: list[list[int]], steps: int, page_size: int = 1):
    """Prefill and greedy-decode ``prompts`` (in two extends: the first half cached first);
    the sequences and each step's logits. Every decode step after the second drops the last
    request, so the batch sizes pass several graph sizes (padded when not captured)."""
    order = list(range(1, runner.max_total_num_tokens // page_size + 1))
    random.Random(0).shuffle(order)
    slots = DeviceSlots(runner, page_order=order)
    seqs = [slots.new_seq() for _ in prompts]
    halves = [p[: len(p) // 2] for p in prompts]
    runner.forward(slots.extend(seqs, halves))
    logits = [runner.forward(slots.extend(seqs, [p[len(h):] for p, h in zip(prompts, halves,
                                                                               strict=True)]))]
    sizes = []
    for step in range(steps):
        live = seqs[: max(1, len(seqs) - max(0, step - 1))]
        sizes.append(len(live))
        logits.append(runner.forward(slots.decode(live, logits[-1][: len(live)]
                                                  .argmax(-1).tolist())))
    return seqs, logits, sizes


@pytest.mark.parametrize("page_size", [1, 16])
def test_graphed_fp32_greedy_equals_transformers(llama64_path, hf_on_device, page_size):
    runner = make_runner(llama64_path, page_size=page_size, max_running_requests=8)
    if ON_CUDA:
        assert runner.attention_backend == "triton"
        assert runner.graph_runner is not None
        assert runner.cuda_graph_batch_sizes == [1, 2, 4, 8]
    prompts = _prompts([37, 5, 70, 12, 2, 23, 44], seed=page_size)
    seqs, step_logits, sizes = _decode(runner, prompts, steps=9, page_size=page_size)
    assert {7, 6, 5, 3} <= set(sizes)  # padded to 8, 8, 8 and 4
    hf = hf_on_device(llama64_path)
    for i, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
        ours = torch.stack([lg[i] for lg in step_logits if lg.shape[0] > i]).float()
        ref = _hf_logits(hf, seq.tokens)[len(prompt) - 1 :]
        torch.testing.assert_close(ours[: ref.shape[0]], ref, atol=2e-4, rtol=0)
        assert seq.tokens[len(prompt):] == ref.argmax(-1).tolist()[: len(seq.tokens)
                                                                   - len(prompt)]


def test_graph_replay_equals_the_eager_forward(llama64_path):
    runner = make_runner(llama64_path, max_running_requests=8)
    prompts = _prompts([9, 30, 4, 17, 2], seed=7)
    slots = DeviceSlots(runner)
    seqs = [slots.new_seq() for _ in prompts]
    logits = runner.forward(slots.extend(seqs, prompts))
    fb = slots.decode(seqs, logits.argmax(-1).tolist())
    graphed = runner.forward(fb).clone()
    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        eager = runner.forward(fb)  # rewrites the same KV slots with the same values
    finally:
        runner.graph_runner = graphs
    torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=0)


def test_bf16_logits_as_close_to_fp32_as_transformers_bf16(llama64_path, hf_on_device):
    runner = make_runner(llama64_path, dtype="bfloat16", max_running_requests=8)
    prompts = _prompts([21, 8, 50], seed=3)
    seqs, step_logits, _ = _decode(runner, prompts, steps=4)
    ref32 = hf_on_device(llama64_path, torch.float32)
    ref16 = hf_on_device(llama64_path, torch.bfloat16)
    for i, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
        ours = torch.stack([lg[i] for lg in step_logits if lg.shape[0] > i]).float()
        n = ours.shape[0]
        # All three read the same tokens (ours): the sequence radixserve generated.
        exact = _hf_logits(ref32, seq.tokens)[len(prompt) - 1 :][:n]
        theirs = _hf_logits(ref16, seq.tokens)[len(prompt) - 1 :][:n]
        our_err = (ours - exact).abs().max().item()
        their_err = (theirs - exact).abs().max().item()
        assert our_err <= 2 * their_err + 1e-2, (our_err, their_err)
