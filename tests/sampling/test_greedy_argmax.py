"""The sampler's greedy argmax (a ``CustomOp``: blocked torch natively, radixserve's kernel for
bf16 and float32 on CPU where it loads) must pick exactly what ``torch.argmax`` picks."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.custom_op import build_context
from radixserve.layers.sampler import GreedyArgmax
from tests.layers.helpers import require_ops


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32-model", "bf16-model"])
def greedy_argmax(request) -> GreedyArgmax:
    with build_context("cpu", request.param):
        return GreedyArgmax()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [512, 8192, 151936, 1001, 7])
def test_greedy_argmax_matches_argmax_with_ties_nan_and_masked_rows(greedy_argmax, vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    logits[1, [3, vocab - 7]] = 100.0  # a tie: the first maximum wins
    logits[2] = float("-inf")  # every token banned
    logits[3, [vocab // 2, vocab - 1]] = float("nan")  # NaN counts as the maximum
    logits[4] = torch.round(logits[4])  # many ties
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_argmax.forward_native(logits), logits.argmax(dim=-1))


def test_greedy_argmax_of_empty_batch_is_empty(greedy_argmax):
    assert greedy_argmax(torch.empty(0, 512)).shape == (0,)
    assert greedy_argmax.forward_native(torch.empty(0, 512)).shape == (0,)


def test_greedy_argmax_kernel_rejects_bad_logits_with_a_clear_error():
    require_ops("argmax")
    with pytest.raises(RuntimeError, match=r"argmax takes \[rows, vocab\] logits, got \[8\]"):
        torch.ops.radixserve_cpu.argmax(torch.zeros(8))
    # an empty vocabulary is torch's error, not a read out of bounds
    with pytest.raises(IndexError):
        torch.ops.radixserve_cpu.argmax(torch.zeros(2, 0, dtype=torch.bfloat16))
