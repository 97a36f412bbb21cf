"""The sampler's blocked greedy argmax must pick exactly what ``torch.argmax`` picks."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.sampler import greedy_argmax


@pytest.mark.parametrize("vocab", [512, 8192, 151936, 1001])
def test_greedy_argmax_matches_argmax_with_ties_nan_and_masked_rows(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    logits[1, [3, vocab - 7]] = 100.0  # a tie: the first maximum wins
    logits[2] = float("-inf")  # every token banned
    logits[3, [17, vocab // 2]] = float("nan")  # NaN counts as the maximum
    logits[4] = torch.round(logits[4])  # many ties
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))


def test_greedy_argmax_of_empty_batch_is_empty():
    assert greedy_argmax(torch.empty(0, 512)).shape == (0,)
