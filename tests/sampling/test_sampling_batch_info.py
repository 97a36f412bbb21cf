"""SamplingBatchInfo: batched fields, flags, and staying cheap for plain batches."""

from __future__ import annotations

import torch

from radixserve.sampling import SamplingParams
from radixserve.sampling.sampling_batch_info import SeededRow
from tests.sampling.helpers import make_info

VOCAB = 100


def test_plain_batch_builds_no_vocab_sized_tensors():
    params = [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.0, sampling_seed=5),
        SamplingParams(top_k=10, min_p=0.1, sampling_seed=3, ignore_eos=True),
        SamplingParams(min_new_tokens=2, stop=["\n"], stop_token_ids=[4]),
    ]
    info = make_info(params, VOCAB, output_ids=[[], [1], [1, 2], [7, 7, 7]])
    assert info.logit_bias is None
    assert info.penalties is None
    assert info.temperatures.shape == (4, 1)
    for field in (info.top_ps, info.top_ks, info.min_ps):
        assert field.shape == (4,)


def test_fields_and_flags():
    params = [
        SamplingParams(temperature=0.0, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.5, top_k=1000, sampling_seed=11),
        SamplingParams(temperature=2.0, sampling_seed=12),
    ]
    info = make_info(params, VOCAB, output_ids=[[], [], [3, 4], [5]])
    assert torch.equal(info.temperatures.flatten(), torch.tensor([1.0, 1.0, 0.5, 2.0]))
    assert info.top_ks.tolist() == [1, 1, VOCAB, VOCAB]
    assert not info.is_all_greedy
    assert not info.need_top_p_top_k, "greedy rows' filters and an oversized top_k filter nothing"
    assert not info.need_min_p
    assert info.seeded_rows == (SeededRow(2, 11, 2), SeededRow(3, 12, 1))

    info = make_info([SamplingParams(top_p=0.95), SamplingParams(min_p=0.2)], VOCAB)
    assert info.need_top_p_top_k and info.need_min_p
    assert make_info([SamplingParams(temperature=0.0)] * 3, VOCAB).is_all_greedy


def test_logit_bias_is_dense_only_when_requested():
    params = [SamplingParams(), SamplingParams(logit_bias={3: 1.5, 99: -2.0})]
    info = make_info(params, VOCAB)
    expected = torch.zeros(2, VOCAB)
    expected[1, 3], expected[1, 99] = 1.5, -2.0
    assert torch.equal(info.logit_bias, expected)
