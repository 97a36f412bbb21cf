"""Sampler behaviour: greedy, filtering, temperature statistics, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from radixserve.layers.sampler import SampleOutput, Sampler
from radixserve.sampling import SamplingParams
from tests.sampling.helpers import make_info

sample = Sampler()


def draw(params: SamplingParams, logits_row: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` independent draws for one request, as one batch of ``n`` identical rows."""
    vocab = logits_row.shape[-1]
    info = make_info([params] * n, vocab)
    return sample(logits_row.expand(n, vocab).contiguous(), info).next_token_ids


def transformers_probs(params: SamplingParams, logits_row: torch.Tensor) -> torch.Tensor:
    """The distribution transformers' warpers sample from for ``params`` (the reference)."""
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k != -1:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(params.min_p))
    scores = logits_row.unsqueeze(0).clone()
    no_ids = torch.zeros(1, 0, dtype=torch.int64)
    for warper in warpers:
        scores = warper(no_ids, scores)
    return scores.softmax(dim=-1)[0]


def chi_square(tokens: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over bins expecting at least 5 draws, and its degrees of freedom."""
    observed = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * tokens.numel()
    bins = expected >= 5
    stat = (((observed - expected) ** 2)[bins] / expected[bins]).sum().item()
    return stat, int(bins.sum()) - 1


def test_all_greedy_batch_equals_argmax():
    logits = torch.randn(8, 100)
    info = make_info([SamplingParams(temperature=0.0)] * 8, 100)
    assert info.is_all_greedy
    out = sample(logits, info)
    assert out.next_token_ids.dtype == torch.int64
    assert torch.equal(out.next_token_ids, logits.argmax(dim=-1))


def test_bfloat16_logits_sample_as_their_float32_upcast():
    logits = (torch.randn(6, 300) * 4).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max()  # a tie: the first index wins either way
    upcast = logits.float()
    greedy = make_info([SamplingParams(temperature=0.0)] * 6, 300)
    assert torch.equal(sample(logits, greedy).next_token_ids, upcast.argmax(dim=-1))
    assert sample(logits, greedy).next_token_ids[0] == 7
    # Logprobs, penalties and seeded sampling run on the float32 upcast.
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5),
              *(SamplingParams(temperature=0.8, sampling_seed=i) for i in range(5))]
    info = make_info(params, 300, output_ids=[[3]] * 6)
    ours = sample(logits, info, return_logprob=True)
    ref = sample(upcast, make_info(params, 300, output_ids=[[3]] * 6), return_logprob=True)
    assert ours.logprobs is not None and ours.logprobs.dtype == torch.float32
    assert torch.equal(ours.next_token_ids, ref.next_token_ids)
    assert torch.equal(ours.logprobs, ref.logprobs)


def test_top_k_one_equals_greedy_even_with_temperature_one_in_a_sampled_batch():
    logits = torch.randn(6, 100) * 0.1  # flat: plain sampling would rarely hit the argmax
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0)] * 3
    for _ in range(20):
        out = sample(logits, make_info(params, 100)).next_token_ids
        assert torch.equal(out[0::2], logits[0::2].argmax(dim=-1))


def test_greedy_rows_of_a_mixed_batch_take_the_argmax():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)] * 2
    info = make_info(params, 50)
    assert not info.is_all_greedy
    out = sample(logits, info).next_token_ids
    assert torch.equal(out[0::2], logits[0::2].argmax(dim=-1))


PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.6), {0, 1}),
        (SamplingParams(top_p=0.3), {0}),
        (SamplingParams(min_p=0.6), {0, 1}),
        (SamplingParams(min_p=0.3), {0, 1, 2}),
        # top_p applies to what top_k kept, renormalised: 0.4 / 0.7 > 0.5 already.
        (SamplingParams(top_k=2, top_p=0.5), {0}),
        (SamplingParams(top_k=3, top_p=0.5), {0, 1}),
    ],
)
def test_filters_never_sample_a_filtered_token(params, allowed):
    tokens = draw(params, PROBS.log(), 4000)
    assert set(tokens.tolist()) == allowed


def test_a_top_p_that_rounds_to_zero_in_float32_keeps_the_most_likely_token():
    """1e-300 is in (0, 1] but 0 in float32: the nucleus is the top token, not nothing (which
    drew token 0, whatever its probability)."""
    tokens = draw(SamplingParams(top_p=1e-300), PROBS.flip(0).log(), 200)
    assert set(tokens.tolist()) == {3}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.5, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=0.8, min_p=0.15),
        SamplingParams(temperature=1.2, top_k=6, top_p=0.8, min_p=0.05),
    ],
)
def test_sampling_matches_the_transformers_distribution(params):
    logits_row = torch.randn(12, generator=torch.Generator().manual_seed(7)) * 1.5
    expected = transformers_probs(params, logits_row)
    tokens = draw(params, logits_row, 20000)
    assert not set(tokens.tolist()) - set(expected.nonzero().flatten().tolist())
    stat, dof = chi_square(tokens, expected)
    assert stat < dof + 6 * math.sqrt(2 * dof), (stat, dof)


def _random_params(gen: torch.Generator) -> SamplingParams:
    """Some other request: random temperature and filters, sometimes greedy or seeded."""
    kind = int(torch.randint(4, (1,), generator=gen))
    if kind == 0:
        return SamplingParams(temperature=0.0)
    return SamplingParams(
        temperature=0.5 + float(torch.rand(1, generator=gen)),
        top_k=[-1, 5, 20][kind - 1],
        top_p=[1.0, 0.9, 0.5][kind - 1],
        min_p=[0.0, 0.05, 0.0][kind - 1],
        sampling_seed=[None, None, 99][kind - 1],
    )


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=1.0, sampling_seed=42),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, sampling_seed=2**70 + 3),
    ],
)
def test_seeded_request_samples_the_same_alone_or_anywhere_in_a_batch(target):
    vocab = 64
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(vocab, generator=gen)
    tokens_per_step = []
    for step in range(8):
        output = [5] * step
        alone = sample(row.unsqueeze(0), make_info([target], vocab, [output])).next_token_ids[0]
        tokens_per_step.append(int(alone))
        for position in (0, 3, 5):
            torch.manual_seed(1000 * step + position)  # a different global RNG state each time
            others = [_random_params(gen) for _ in range(5)]
            params = others[:position] + [target] + others[position:]
            outputs = [[2] * int(torch.randint(4, (1,), generator=gen)) for _ in others]
            outputs.insert(position, output)
            logits = torch.randn(6, vocab, generator=gen) * 2
            logits[position] = row
            batched = sample(logits, make_info(params, vocab, outputs)).next_token_ids
            assert batched[position] == alone, (step, position)
    assert len(set(tokens_per_step)) > 1, "the noise must change from one step to the next"


def test_seeded_sampling_follows_the_softmax_distribution_across_seeds():
    vocab, n = 8, 4000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.7, sampling_seed=seed) for seed in range(n)]
    info = make_info(params, vocab, [[4, 4, 4]] * n)
    tokens = sample(row.expand(n, vocab).contiguous(), info).next_token_ids
    stat, dof = chi_square(tokens, torch.softmax(row / 0.7, dim=-1))
    assert stat < dof + 6 * math.sqrt(2 * dof), (stat, dof)


def test_logprobs_and_top_logprobs_come_from_the_raw_logits():
    vocab = 50
    logits = torch.randn(4, vocab) * 3
    raw = logits.clone()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.8),
        SamplingParams(temperature=0.5, logit_bias={3: 4.0}),
        SamplingParams(temperature=1.3, top_k=5, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, min_new_tokens=3, stop_token_ids=[7]),
    ]
    info = make_info(params, vocab, output_ids=[[3, 3], [], [9, 9, 9], [2]])
    out = sample(logits, info, return_logprob=True, top_logprobs_nums=[0, 3, 50, 80])

    assert torch.equal(logits, raw), "the caller's logits must not be modified"
    reference = torch.log_softmax(raw, dim=-1)
    chosen = reference.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, chosen, atol=1e-6, rtol=0)
    assert [len(t) for t in out.top_logprobs] == [0, 3, 50, 50]
    for i, top in enumerate(out.top_logprobs):
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        for token, value in top:
            assert abs(value - reference[i, token].item()) <= 1e-6
        if top:
            assert top[0][0] == int(reference[i].argmax())


def test_no_logprobs_unless_asked():
    info = make_info([SamplingParams()] * 2, 10)
    out = sample(torch.randn(2, 10), info)
    assert isinstance(out, SampleOutput)
    assert out.logprobs is None and out.top_logprobs is None
    out = sample(torch.randn(2, 10), info, return_logprob=True)
    assert out.logprobs is not None and out.logprobs.shape == (2,)
    assert out.top_logprobs is None


def test_row_with_every_token_banned_falls_back_to_its_raw_logits():
    vocab = 3
    params = [
        SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[2]),
        SamplingParams(temperature=1.0, min_new_tokens=2, stop_token_ids=[2]),
    ]
    info = make_info(params, vocab, eos_token_ids=[0, 1])
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 0.0]])
    for _ in range(20):
        out = sample(logits, info, return_logprob=True).next_token_ids
        assert out[0] == 1
        assert 0 <= int(out[1]) < vocab


def test_all_minus_inf_logits_and_empty_batches_do_not_crash():
    vocab = 5
    logits = torch.full((2, vocab), float("-inf"))
    info = make_info([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)], vocab)
    out = sample(logits, info).next_token_ids
    assert ((out >= 0) & (out < vocab)).all()

    empty = sample(torch.empty(0, vocab), make_info([], vocab), True, [])
    assert empty.next_token_ids.shape == (0,) and empty.top_logprobs == []


def test_sample_output_reaches_the_host_in_one_piece():
    """``to_host`` gives the ids and the chosen logprobs exactly as ``tolist`` of each would
    (float64 carries both), with and without logprobs; on CPU there is nothing to copy ahead."""
    from radixserve.layers.sampler import SampleOutput

    ids = torch.tensor([0, 5, 151935, 2**31 + 7])
    logprobs = torch.tensor([-0.0, -1e-8, -3.4028235e38, -12.345678], dtype=torch.float32)
    out = SampleOutput(ids, logprobs)
    out.start_host_copy()
    got_ids, got_logprobs = out.to_host()
    assert got_ids == ids.tolist() and all(type(t) is int for t in got_ids)
    assert got_logprobs == logprobs.tolist()
    assert SampleOutput(ids).to_host() == (ids.tolist(), None)
