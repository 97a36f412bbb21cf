"""Penalties, logit bias and min_new_tokens against plain reference implementations."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from radixserve.layers.sampler import Sampler
from radixserve.sampling import SamplingParams
from radixserve.sampling.penalties import (
    FrequencyPenalizer,
    MinNewTokensPenalizer,
    PresencePenalizer,
)
from tests.sampling.helpers import EOS_IDS, make_info

VOCAB = 32
sample = Sampler()


def reference_logits(
    row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """Bias, repetition, frequency, presence, min_new_tokens: one token at a time."""
    row = row.clone()
    for token, bias in (p.logit_bias or {}).items():
        row[token] += bias
    for token in set(prompt) | set(output):
        if row[token] > 0:
            row[token] = row[token] / p.repetition_penalty
        else:
            row[token] = row[token] * p.repetition_penalty
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token)
        row[token] -= p.presence_penalty
    if len(output) < p.min_new_tokens:
        for token in [*EOS_IDS, *p.stop_token_ids]:
            row[token] = float("-inf")
    return row


def test_penalties_bias_and_min_new_tokens_match_the_reference():
    params = [
        SamplingParams(),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-1.2),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(repetition_penalty=0.6, temperature=0.0),
        SamplingParams(
            frequency_penalty=-0.4,
            presence_penalty=0.9,
            repetition_penalty=1.3,
            logit_bias={4: 2.5, 11: -3.0},
            min_new_tokens=5,
            stop_token_ids=[6, 9],
        ),
        SamplingParams(min_new_tokens=2, stop_token_ids=[6], frequency_penalty=2.0),
        SamplingParams(logit_bias={0: 1.0}, ignore_eos=True),
    ]
    prompts = [[2, 3], [4, 4, 20], [5], [7, 8, 7, 30], [9, 10], [4, 12, 13], [14], [15]]
    outputs = [[3, 3], [4, 21, 21, 21], [5, 22, 22], [8, 23], [], [11, 24, 24, 12], [6, 6], []]
    logits = torch.randn(len(params), VOCAB) * 3
    info = make_info(params, VOCAB, outputs, prompts)

    processed = info.process_logits(logits)

    expected = torch.stack(
        [reference_logits(logits[i], p, prompts[i], outputs[i]) for i, p in enumerate(params)]
    )
    torch.testing.assert_close(processed, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(processed[0], logits[0]), "a request without penalties is untouched"


def test_repetition_penalty_matches_transformers():
    penalties = [1.0, 1.2, 1.9, 0.5]
    prompts = [[1, 2, 3], [4, 5, 5, 6], [0, 31, VOCAB + 3], [7, 8]]  # VOCAB + 3: not emittable
    outputs = [[3], [6, 9, 9], [10], []]
    logits = torch.randn(4, VOCAB) * 4
    info = make_info(
        [SamplingParams(repetition_penalty=r) for r in penalties], VOCAB, outputs, prompts
    )

    processed = info.process_logits(logits)

    for i, penalty in enumerate(penalties):
        processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
        ids = torch.tensor([prompts[i] + outputs[i]])
        expected = processor(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(processed[i], expected, atol=1e-6, rtol=1e-6)


def test_frequency_and_presence_count_output_tokens_only():
    params = [SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)]
    logits = torch.zeros(1, VOCAB)
    processed = make_info(params, VOCAB, [[3, 3, 3]], [[7, 7]]).process_logits(logits)
    assert processed[0, 3] == -3.5
    assert processed[0, 7] == 0.0


def test_only_the_penalizers_some_request_uses_are_built():
    params = [SamplingParams(presence_penalty=0.5), SamplingParams(min_new_tokens=1)]
    info = make_info(params, VOCAB, [[1], []])
    assert [type(p) for p in info.penalties.penalizers] == [
        PresencePenalizer,
        MinNewTokensPenalizer,
    ]
    info = make_info([SamplingParams(frequency_penalty=1.0)], VOCAB)
    assert [type(p) for p in info.penalties.penalizers] == [FrequencyPenalizer]


def test_positive_logit_bias_forces_a_token_and_negative_bans_it():
    logits = torch.randn(1, VOCAB).expand(500, VOCAB).contiguous()
    favourite = int(logits[0].argmax())
    forced = [SamplingParams(temperature=1.0, logit_bias={17: 100.0})] * 500
    assert (sample(logits, make_info(forced, VOCAB)).next_token_ids == 17).all()
    banned = [SamplingParams(temperature=1.0, logit_bias={favourite: -100.0})] * 500
    assert (sample(logits, make_info(banned, VOCAB)).next_token_ids != favourite).all()
    greedy = [SamplingParams(temperature=0.0, logit_bias={favourite: -100.0})]
    assert sample(logits[:1], make_info(greedy, VOCAB)).next_token_ids[0] != favourite


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached():
    (eos,) = EOS_IDS
    params = SamplingParams(temperature=1.0, min_new_tokens=3, stop_token_ids=[5])
    logits = torch.zeros(1, VOCAB)
    logits[0, eos], logits[0, 5] = 10.0, 9.0
    batch = logits.expand(300, VOCAB).contiguous()
    for produced in range(3):
        info = make_info([params] * 300, VOCAB, [[2] * produced] * 300)
        processed = info.process_logits(batch)
        assert torch.isneginf(processed[:, [eos, 5]]).all()
        tokens = sample(batch, info).next_token_ids
        assert not ((tokens == eos) | (tokens == 5)).any()
    info = make_info([params] * 300, VOCAB, [[2] * 3] * 300)
    assert info.penalties is None
    assert (sample(batch, info).next_token_ids == eos).any()


def test_ignore_eos_does_not_mask_eos():
    (eos,) = EOS_IDS
    logits = torch.zeros(1, VOCAB)
    logits[0, eos] = 5.0
    info = make_info([SamplingParams(temperature=0.0, ignore_eos=True)], VOCAB)
    assert info.penalties is None
    assert sample(logits, info).next_token_ids[0] == eos
